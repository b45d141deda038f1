"""`qgate gate`: run the gates for one candidate; exit 2 when it fails."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qgate.cli.options import OutDir, quiet_libraries
from qgate.errors import GateFailed


def gate_cmd(
    candidate: Annotated[Path, typer.Option("--candidate", help="Quantized checkpoint or engine artifact.")],
    baseline: Annotated[Path, typer.Option("--baseline", help="Baseline checkpoint artifact.")],
    shadow: Annotated[Path, typer.Option("--shadow", help="Shadow split from `qgate calibrate sample`.")],
    out: OutDir,
    spec: Annotated[Path | None, typer.Option("--spec", help="Pipeline YAML whose `gates:` section sets thresholds.")] = None,
    cache: Annotated[Path, typer.Option("--cache", help="Baseline cache directory.")] = Path(".qgate/cache"),
) -> None:
    """Shadow disagreement + eval + perf gates, report.json and report.html."""
    quiet_libraries()
    from qgate.artifact import Artifact
    from qgate.gates.run import GateConfig, run_gates
    from qgate.pipeline.spec import load_spec

    cfg = load_spec(spec).gate_config() if spec else GateConfig()
    art = run_gates(Artifact.load(candidate), Artifact.load(baseline, "checkpoint"), Artifact.load(shadow, "calibration-set"),
                    cfg, out, cache)
    print_verdict(art)
    if not art.meta["passed"]:
        raise GateFailed(f"gate failed for {candidate}: {', '.join(art.meta['failed'])}", hint=f"evidence: {art.path / 'report.html'}")


def print_verdict(art) -> None:
    import json

    report = json.loads((art.path / "report.json").read_text())
    from qgate.gates.result import GateResult

    for r in report["results"]:
        typer.echo("  " + GateResult(**{**r, "ci": tuple(r["ci"]) if r["ci"] else None}).line())
    typer.echo(f"gate {'PASSED' if report['passed'] else 'FAILED'}: {art.path / 'report.html'}")
