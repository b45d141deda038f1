"""`qgate drift check` and `qgate drift run`: the scheduled job that keeps production fit for today's traffic.

Exit codes (beside 0/1/2): check: 0 no drift, 3 drift found, 1 error.
run: 0 no drift, or drift handled (a recalibrated variant promoted); 3 drift found and a passing recalibrated version
registered but not promoted (drift.auto_promote: false); 2 drift found and no recalibrated variant passed (production
left alone); 1 error (including another drift run holding the lock).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qgate.cli.options import Device, Executor, quiet_libraries, seconds
from qgate.errors import EXIT_DRIFT

app = typer.Typer(
    no_args_is_help=True, help="Drift: has the traffic moved since production was calibrated? Recalibrate if so."
)
Spec = Annotated[
    Path, typer.Option("--spec", help="Pipeline YAML: model, variants, gates, registry and its `drift:` policy.")
]
Recent = Annotated[
    str,
    typer.Option(
        "--traffic",
        help="Recent traffic: a JSONL/Parquet file, a quoted glob, a directory of partitions, or a URI such as s3://bucket/logs/.",
    ),
]


def _out(text: str) -> None:
    from qgate.progress import console_out

    typer.echo(text, file=console_out())


def _err(text: str) -> None:
    from qgate.progress import console_err

    typer.echo(text, file=console_err())


def _verdict(report: dict) -> str:
    """The check's verdict, with the traffic facets that could not tell (neither drift nor shown ok)."""
    unsure = report.get("inconclusive")
    return report["verdict"].upper() + (f" (inconclusive: {', '.join(unsure)})" if unsure else "")


def _load(spec: Path, device: str | None, traffic: str, executor: str):
    quiet_libraries()
    from qgate.pipeline.drift_jobs import drift_preflight
    from qgate.pipeline.spec import load_spec
    from qgate.progress import interactive, quiet_console

    s = load_spec(spec).on_device(device)
    drift_preflight(s, traffic, executor)  # a job that cannot start writes nothing, not even its log
    if not interactive():  # cron, CI: a few plain lines here, library logs in a file
        log = quiet_console(s.path(s.workdir) / "logs" / "qgate-drift.log")
        _err(f"library logs: {log}")
    return s


@app.command("check")
def check_cmd(
    spec: Spec,
    traffic: Recent,
    record: Annotated[
        bool, typer.Option("--record/--no-record", help="Tag the production version and log the report in MLflow.")
    ] = True,
    wait: Annotated[
        float, typer.Option(callback=seconds, help="Seconds to wait for a running drift job on this model.")
    ] = 0.0,
    executor: Executor = "serial",
    device: Device = None,
) -> None:
    """Compare recent traffic with production's calibration profile and re-gate production on it. Exit 3 on drift."""
    from qgate.pipeline.drift_jobs import drift_check

    s = _load(spec, device, traffic, executor)
    report = drift_check(s, traffic, echo=_err, record=record, wait=wait, executor=executor)
    _out(f"drift check: {_verdict(report)}  report {report['report']}")
    if report["drift"]:
        raise typer.Exit(EXIT_DRIFT)


@app.command("run")
def run_cmd(
    spec: Spec,
    traffic: Recent,
    wait: Annotated[
        float, typer.Option(callback=seconds, help="Seconds to wait for another drift run on this model to finish.")
    ] = 0.0,
    executor: Executor = "serial",
    device: Device = None,
) -> None:
    """The scheduled job: check; on drift recalibrate, gate and register every variant, then promote per
    drift.auto_promote."""
    from qgate.pipeline.drift_jobs import drift_run

    s = _load(spec, device, traffic, executor)
    result = drift_run(s, traffic, echo=_err, wait=wait, executor=executor)
    check = result["check"]
    _out(f"drift check: {_verdict(check)}  report {check['report']}")
    for v in result["variants"]:
        _out(
            f"  {v['variant']:22s} {v['verdict'].upper():12s} KL p99 {v['kl_p99']:.4f}  v{v['version']}  {v['report']}"
        )
    if result["action"] == "promoted":
        p = result["promoted"]
        _out(
            f"promoted {p['variant']} as {p['model']} v{p['version']} @{p['alias']} (previous-production: "
            f"v{p['previous']})"
        )
    elif result["action"] == "registered":
        c = result["candidate"]
        _out(f"drift found; {c['variant']} v{c['version']} passed and awaits promotion (drift.auto_promote: false)")
        raise typer.Exit(EXIT_DRIFT)
