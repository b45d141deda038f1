"""`qgate run SPEC`: every stage from one pipeline spec; exit 2 when no variant passes."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from qgate.cli.options import quiet_libraries


def run_cmd(spec: Annotated[Path, typer.Argument(help="Pipeline YAML, e.g. pipelines/promote.yaml.")]) -> None:
    """Calibrate, quantize each variant, build engines, gate, register, and promote the best passing variant."""
    quiet_libraries()
    from qgate.pipeline.runner import run_pipeline
    from qgate.pipeline.spec import load_spec

    s = load_spec(spec)
    typer.echo(f"pipeline {s.name}: workdir {s.path(s.workdir)}")
    try:
        summary = run_pipeline(s, echo=lambda m: typer.echo(m, err=True))
    finally:
        _print_table(s)
    p = summary["promoted"]
    typer.echo(f"promoted {p['variant']} as {summary['model_name']} v{p['version']} @{p['alias']}"
               + (f" (previous-production: v{p['previous']})" if p.get("previous") and p["previous"] != p["version"] else ""))
    ui = Path(sys.executable).parent / "mlflow"    # the venv's own mlflow: works without an activated venv
    typer.echo(f"MLflow store: {summary['tracking_uri']}   (view: {ui if ui.exists() else 'mlflow'} ui --backend-store-uri "
               f"{summary['tracking_uri']})")


def _print_table(spec) -> None:
    import json

    path = spec.path(spec.workdir) / "summary.json"
    if not path.exists():
        return
    summary = json.loads(path.read_text())
    typer.echo(f"{'variant':22s} {'verdict':12s} {'KL p99':>9s} {'top-1':>7s} {'version':>8s}  report")
    for v in summary["variants"]:
        kl, top1 = v.get("kl_p99"), v.get("top1_agreement")
        verdict = v["verdict"].upper() + ("*" if v["verdict"] == "inconclusive" and v["passed"] else "")
        typer.echo(f"{v['variant']:22s} {verdict:12s} {kl:9.4f} {top1:7.3f} {str(v['version']):>8s}  {v['report']}")
        for what in ("failed", "inconclusive"):
            if v[f"{what}_checks"]:
                typer.echo(f"{'':22s} {what}: {', '.join(v[f'{what}_checks'])}")
        for c in v.get("checks", []):
            if c["gate"] == "eval":
                ci = f" [{c['ci'][0]:.3f}, {c['ci'][1]:.3f}]" if c["ci"] else ""
                mde = f"  mde {c['mde']:.3f}" if c["mde"] is not None else ""
                typer.echo(f"{'':22s} {c['verdict'].upper():12s} {c['metric']} {c['observed']:.3f}{ci}  n={c['n']}{mde}")
    if any(v["verdict"] == "inconclusive" and v["passed"] for v in summary["variants"]):
        typer.echo("* inconclusive, passed under gates.on_inconclusive: warn")
    secs = summary.get("stage_seconds") or {}
    if secs:
        skipped = set(summary.get("stages_skipped", []))
        typer.echo("stage seconds: " + ", ".join(f"{k} {v:g}{' (earlier run)' if k in skipped else ''}" for k, v in secs.items()))
