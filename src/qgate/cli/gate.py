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
    name: Annotated[str | None, typer.Option("--name", help="Variant name for the report and the registry run "
                                                         "(default: the candidate's scheme).")] = None,
) -> None:
    """Shadow disagreement + eval + perf gates, report.json and report.html."""
    quiet_libraries()
    from qgate.artifact import Artifact
    from qgate.gates.run import GateConfig, run_gates
    from qgate.pipeline.spec import load_spec

    cfg = load_spec(spec).gate_config() if spec else GateConfig()
    cand = Artifact.load(candidate)
    art = run_gates(cand, Artifact.load(baseline, "checkpoint"), Artifact.load(shadow, "calibration-set"),
                    cfg, out, cache, name=name or cand.meta.get("scheme"))
    print_verdict(art)
    raise_unless_passed(art, str(candidate))


def raise_unless_passed(art, what: str) -> None:
    """GateFailed (exit 2) for a failed gate, or an inconclusive one under on_inconclusive: block."""
    meta = art.meta
    evidence = f"evidence: {art.path / 'report.html'}"
    if meta["verdict"] == "fail":
        raise GateFailed(f"gate failed for {what}: {', '.join(meta['failed'])}", hint=evidence)
    if not meta["passed"]:
        raise GateFailed(f"gate inconclusive for {what}: {', '.join(meta['inconclusive'])} (gates.on_inconclusive: block)",
                         hint=f"{evidence}; more shadow prompts or eval items would decide it, or set on_inconclusive: warn")


def print_verdict(art) -> None:
    import json

    from qgate.gates.contract import describe
    from qgate.gates.result import GateResult

    report = json.loads((art.path / "report.json").read_text())
    for r in report["results"]:
        typer.echo("  " + GateResult.from_dict(r).line())
        for d in r["evidence"].get("differences", []):
            typer.echo("      " + describe(d))
        for d in r["evidence"].get("accepted", []):
            typer.echo("      accepted (gates.contract.allow): " + describe(d))
    verdict = report["verdict"].upper()
    if report["verdict"] == "inconclusive" and report["passed"]:
        typer.echo(f"warning: inconclusive checks passed under on_inconclusive: warn: {', '.join(art.meta['inconclusive'])}",
                   err=True)
        verdict += " (warn: passed)"
    typer.echo(f"gate {verdict}: {art.path / 'report.html'}")
