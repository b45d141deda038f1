"""`qgate run SPEC`: every stage from one pipeline spec; exit 2 when no variant passes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from qgate.cli.options import Device, Json, Junit, quiet_libraries, seconds
from qgate.cli.output import Output


def run_cmd(
    spec: Annotated[Path, typer.Argument(help="Pipeline YAML, e.g. pipelines/promote.yaml.")],
    json_out: Json = False,
    junit: Junit = None,
    wait: Annotated[
        float,
        typer.Option(
            callback=seconds,
            help="Seconds to wait for another job on the same workdir to finish "
            "(default: exit 1 at once, naming the job that holds it).",
        ),
    ] = 0.0,
    executor: Annotated[
        str,
        typer.Option(
            "--executor",
            "--parallel",  # the flag's earlier name, still accepted
            help="serial, or ray: traffic partitions and variants (each with its "
            "spec `resources`) run as Ray tasks; the same artifacts either way.",
        ),
    ] = "serial",
    device: Device = None,
) -> None:
    """Calibrate, quantize each variant, build engines, gate, register, and promote the best passing variant."""
    quiet_libraries()
    from qgate.errors import LockHeld, PromotionRefused
    from qgate.pipeline.jobs import run_pipeline, run_preflight
    from qgate.pipeline.spec import load_spec
    from qgate.progress import console_err, interactive, quiet_console

    o = Output(json_out)
    s = load_spec(spec).on_device(device)
    run_preflight(s, executor)  # a run that cannot start writes nothing, not even its log
    workdir = s.path(s.workdir)
    log_file = None if interactive() else quiet_console(workdir / "logs" / "qgate-run.log")
    o.say(f"pipeline {s.name}: workdir {workdir}" + (f"; library logs: {log_file}" if log_file else ""))
    summary, refused = None, None
    earlier = _written(s)
    try:
        summary = run_pipeline(s, echo=lambda m: typer.echo(m, file=console_err()), wait=wait, executor=executor)
    except PromotionRefused as e:
        refused = e
    finally:
        # this run's table only: not an earlier run's summary (a run that failed before writing one), nor another job's
        if not isinstance(sys.exc_info()[1], LockHeld) and _written(s) != earlier:
            _print_table(s, o)
    summary = _load_summary(s)
    if summary is not None:
        _ci_outputs(s, summary, o, junit, log_file, 2 if refused else 0)
    if refused is not None:
        raise refused
    p = summary["promoted"]
    o.say(
        f"promoted {p['variant']} as {summary['model_name']} v{p['version']} @{p['alias']}"
        + (f" (previous-production: v{p['previous']})" if p.get("previous") and p["previous"] != p["version"] else "")
    )
    ui = Path(sys.executable).parent / "mlflow"  # the venv's own mlflow: works without an activated venv
    o.say(
        f"MLflow store: {summary['tracking_uri']}   (view: {ui if ui.exists() else 'mlflow'} ui --backend-store-uri "
        f"{summary['tracking_uri']})"
    )


def _summary_path(spec) -> Path:
    return spec.path(spec.workdir) / "summary.json"


def _written(spec) -> int | None:
    """When the workdir's summary.json was last written (ns), None while there is none."""
    path = _summary_path(spec)
    return path.stat().st_mtime_ns if path.exists() else None


def _load_summary(spec) -> dict | None:
    import json

    path = _summary_path(spec)
    return json.loads(path.read_text()) if path.exists() else None


def _ci_outputs(spec, summary: dict, o: Output, junit, log_file, exit_code: int) -> None:
    import json

    from qgate.cli.gate import ci_outputs
    from qgate.cli.output import RunDoc, VariantDoc, checks, step_summary
    from qgate.cli.registry import promote_doc
    from qgate.gates.markdown import run_summary

    reports = {
        v["variant"]: json.loads(Path(v["report"]).with_name("report.json").read_text()) for v in summary["variants"]
    }
    step_summary(run_summary(summary | {"pipeline": spec.name}))
    ci_outputs(o, reports, junit)
    variants = [
        VariantDoc(
            variant=v["variant"],
            verdict=v["verdict"],
            passed=v["passed"],
            version=v["version"],
            backend=v["backend"],
            weights_bytes=v["weights_bytes"],
            served_bytes=v.get("served_bytes"),
            report=v["report"],
            checks=checks(reports[v["variant"]]["results"]),
        )
        for v in summary["variants"]
    ]
    p = summary.get("promoted")
    o.emit(
        RunDoc(
            exit_code=exit_code,
            pipeline=spec.name,
            workdir=summary["workdir"],
            model=summary["model_name"],
            tracking_uri=summary["tracking_uri"],
            variants=variants,
            promoted=promote_doc(p) if p else None,
            log_file=None if log_file is None else str(log_file),
        )
    )


def _print_table(spec, o: Output) -> None:
    summary = _load_summary(spec)
    if summary is None:
        return
    typer_echo = o.say
    typer_echo(
        f"{'variant':22s} {'verdict':12s} {'KL p99':>9s} {'top-1':>7s} {'served MB':>10s} {'bits/w':>6s} "
        f"{'version':>8s}  report"
    )
    for v in summary["variants"]:
        kl, top1 = v.get("kl_p99"), v.get("top1_agreement")
        verdict = v["verdict"].upper() + ("*" if v["warned"] else "")
        mb = f"{v['served_bytes'] / 1e6:10.1f}" if v.get("served_bytes") else f"{'-':>10s}"
        bits = f"{v['bits_per_weight']:6.2f}" if v.get("bits_per_weight") else f"{'-':>6s}"
        kl_s, top1_s = (
            (f"{kl:9.4f}" if kl is not None else f"{'-':>9s}"),
            (f"{top1:7.3f}" if top1 is not None else f"{'-':>7s}"),
        )
        typer_echo(
            f"{v['variant']:22s} {verdict:12s} {kl_s} {top1_s} {mb} {bits} {str(v['version']):>8s}  {v['report']}"
        )
        if s := v.get("search"):
            from qgate.gates.report import search_layout

            typer_echo(
                f"{'':22s} search: {search_layout(s)}"
                f"{'' if s['found'] else ' (no point passed; closest kept)'}; {s['points_tried']} points, "
                f"{s['gate_runs']} gate runs in this run, {s['seconds']:g}s"
            )
        for what in ("failed", "inconclusive"):
            if v[f"{what}_checks"]:
                typer_echo(f"{'':22s} {what}: {', '.join(v[f'{what}_checks'])}")
        if stop := v.get("stopped"):
            typer_echo(f"{'':22s} not run: {' and '.join(stop['skipped'])} (decided FAIL first; gates.stop_on_fail)")
        said: set[str] = set()
        for c in v.get("checks", []):
            if (
                c["gate"] in ("eval", "long_context") and c["verdict"] != "info"
            ):  # a guard that did not fail: in the report
                # significant digits: bpb rises are ~0.002
                ci = f" [{c['ci'][0]:.4g}, {c['ci'][1]:.4g}]" if c["ci"] else ""
                mde = f"  mde {c['mde']:.3g}" if c["mde"] is not None else ""
                typer_echo(
                    f"{'':22s} {c['verdict'].upper():12s} {c['metric']} {c['observed']:.4g}{ci}  n={c['n']}{mde}"
                )
            if c.get("caveat") and c["verdict"] != "info" and c["caveat"] not in said:
                said.add(c["caveat"])  # an eval check's under it; the shadow checks' (cut prompts) once
                typer_echo(
                    f"{'':35s} caveat: {c['caveat']}"
                    if c["gate"] in ("eval", "long_context")
                    else f"{'':22s} caveat: {c['caveat']}"
                )
    if summary.get("frontier"):
        typer_echo(f"size against shadow KL p99, every variant and search point: {summary['frontier']}")
    if any(v["warned"] for v in summary["variants"]):
        typer_echo("* inconclusive, passed under gates.on_inconclusive: warn")
    secs = summary.get("stage_seconds") or {}
    if secs:
        skipped = set(summary.get("stages_skipped", []))
        typer_echo(
            "stage seconds: "
            + ", ".join(f"{k} {v:g}{' (earlier run)' if k in skipped else ''}" for k, v in secs.items())
        )
