"""`qgate search --spec SPEC --variant NAME`: the smallest per-layer mix of a variant that passes the shadow gate.

Exit 0 when a passing point was found, 2 when none passed within the step and size budgets (the point closest to
passing is kept and shown), 1 on error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qgate.cli.options import Device, quiet_libraries, seconds


def search_cmd(
    spec: Annotated[Path, typer.Option("--spec", help="Pipeline YAML, e.g. pipelines/promote.yaml.")],
    variant: Annotated[
        str,
        typer.Option(
            "--variant",
            help="The variant to search from (its scheme, options and `search:` settings; defaults when it has none).",
        ),
    ],
    wait: Annotated[
        float, typer.Option(callback=seconds, help="Seconds to wait for another job on the same workdir.")
    ] = 0.0,
    device: Device = None,
) -> None:
    """Rank per-layer moves by sensitivity, then quantize and gate points until the smallest passing one is found."""
    quiet_libraries()
    from qgate.errors import GateFailed
    from qgate.pipeline.jobs import run_search, search_preflight
    from qgate.pipeline.spec import load_spec
    from qgate.progress import console_err, interactive, quiet_console

    s = load_spec(spec).on_device(device)
    search_preflight(s, variant)  # a search that cannot start writes nothing, not even its log
    workdir = s.path(s.workdir)
    log_file = None if interactive() else quiet_console(workdir / "logs" / "qgate-search.log")
    typer.echo(
        f"search {s.name}/{variant}: workdir {workdir}" + (f"; library logs: {log_file}" if log_file else ""),
        file=console_err(),
    )
    art = run_search(s, variant, echo=lambda m: typer.echo(m, file=console_err()), wait=wait)
    res = art.meta["search"]
    from qgate.gates.report import search_layout

    typer.echo(f"{'k':>4s} {'shadow':12s} {'bits/weight':>11s} {'weights bytes':>14s} {'KL p99':>9s} {'top-1':>7s}")
    for p in sorted(res["points"], key=lambda p: p["k"]):
        mark = "  <- chosen" if p["k"] == res["chosen_k"] else ""
        typer.echo(
            f"{p['k']:>4d} {p['verdict'].upper():12s} {p['bits_per_weight']:11.3f} {p['weights_bytes']:14,d} "
            f"{p['kl_p99']:9.4f} {p['top1']:7.4f}{mark}"
        )
    typer.echo(
        f"chosen: {search_layout(res)}: "
        + (", ".join(f"{f['layer']} ({f.get('to', 'fallback')})" for f in res["fallback"]) or "none")
    )
    typer.echo(
        f"{res['points_tried']} points, {res['gate_runs']} gated in this run, {res['seconds']}s; checkpoint "
        f"{art.path}; plot {art.path / 'qgate-search.png'}"
    )
    if not res["found"]:
        raise GateFailed(
            f"{variant}: {res['note']}",
            hint="raise search.max_steps or search.max_bits_per_weight, or use search.fallback_bits: 16",
        )
