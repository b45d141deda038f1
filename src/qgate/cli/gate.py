"""`qgate gate`: run the gates for one candidate; exit 2 when it fails."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from qgate.cli.options import Device, Json, Junit, OutDir, quiet_libraries
from qgate.cli.output import Output
from qgate.errors import GateFailed
from qgate.gates.result import GateReport


def gate_cmd(
    candidate: Annotated[Path, typer.Option("--candidate", help="Quantized checkpoint or engine artifact.")],
    baseline: Annotated[Path, typer.Option("--baseline", help="Baseline checkpoint artifact.")],
    shadow: Annotated[Path, typer.Option("--shadow", help="Shadow split from `qgate calibrate sample`.")],
    out: OutDir,
    spec: Annotated[
        Path | None, typer.Option("--spec", help="Pipeline YAML whose `gates:` section sets thresholds.")
    ] = None,
    cache: Annotated[Path, typer.Option("--cache", help="Baseline cache directory.")] = Path(".qgate/cache"),
    name: Annotated[
        str | None,
        typer.Option(
            "--name", help="Variant name for the report and the registry run (default: the candidate's scheme)."
        ),
    ] = None,
    json_out: Json = False,
    junit: Junit = None,
    score_anyway: Annotated[
        bool,
        typer.Option(
            "--score-anyway",
            help="Score a candidate whose serving contract failed "
            "(its verdict is FAIL regardless; by default the gate stops there).",
        ),
    ] = False,
    device: Device = None,
) -> None:
    """Contract, shadow, parity, eval and perf gates; report.json and report.html. Exit 2 unless it passed.
    A candidate that fails the serving contract is not scored unless --score-anyway."""
    quiet_libraries()
    from qgate.artifact import Artifact, build_atomically
    from qgate.gates.gating import GateConfig, run_gates
    from qgate.pipeline.spec import load_spec

    o = Output(json_out)
    cfg = load_spec(spec).gate_config() if spec else GateConfig()
    if score_anyway:
        cfg = replace(cfg, score_anyway=True)
    if device is not None:
        from qgate.device import check_device

        cfg = replace(cfg, device=check_device(device, "--device"))
    cand = Artifact.load(candidate, ("checkpoint", "engine"))
    label = name or cand.meta.get("scheme") or cand.path.name
    base, shadow_set = Artifact.load(baseline, "checkpoint"), Artifact.load(shadow, "calibration-set")
    art = build_atomically(out, lambda tmp: run_gates(cand, base, shadow_set, cfg, tmp, cache, name=label))
    report = print_verdict(art, o)
    ci_outputs(o, {label: report}, junit)
    o.emit(gate_doc(art, report, str(candidate)))
    raise_unless_passed(art, str(candidate))


def gate_doc(art, report: dict, candidate: str):
    from qgate.cli.output import GateDoc, checks

    decided = GateReport.from_json(report)
    return GateDoc(
        exit_code=0 if decided.passed else 2,
        verdict=decided.verdict,
        passed=decided.passed,
        candidate=candidate,
        candidate_sha256=art.meta["candidate"],
        report_json=str(art.path / "report.json"),
        report_html=str(art.path / "report.html"),
        checks=checks(report["results"]),
    )


def ci_outputs(o: Output, reports: dict[str, dict], junit: Path | None) -> None:
    """JUnit file and GitHub job summary for these gate reports (name -> report.json content)."""
    from qgate.cli.output import step_summary, write_junit
    from qgate.gates.markdown import ICON, checks_table, undecided

    if junit is not None:
        o.say(f"junit: {write_junit(junit, {k: GateReport.from_json(r) for k, r in reports.items()})}")
    sections = []
    for name, r in reports.items():
        sections += [f"### qgate gate {name}: {ICON.get(r['verdict'], r['verdict'])}", checks_table(r["results"])]
        if open_checks := undecided(r["results"]):
            sections.append(open_checks)
    step_summary("\n\n".join(sections))


def raise_unless_passed(art, what: str) -> None:
    """GateFailed (exit 2) for a failed gate, or an inconclusive one under on_inconclusive: block."""
    report = GateReport.of(art)
    evidence = f"evidence: {art.path / 'report.html'}"
    if report.verdict == "fail":
        unscored = "" if report.scored else " (the serving contract; not scored: --score-anyway scores it)"
        raise GateFailed(f"gate failed for {what}: {', '.join(report.failed)}{unscored}", hint=evidence)
    if not report.passed:
        from qgate.gates.result import what_would_decide

        decides = "; ".join(f"{check}: {said}" for check, said in what_would_decide(list(report.results)).items())
        raise GateFailed(
            f"gate inconclusive for {what}: {', '.join(report.inconclusive)} (gates.on_inconclusive: block)",
            hint=f"{evidence}; what would decide it: {decides}; or set gates.on_inconclusive: warn",
        )


def print_verdict(art, o: Output | None = None) -> dict:
    import json

    from qgate.gates.contract import describe
    from qgate.gates.result import GateResult

    o = o or Output(False)
    report = json.loads((art.path / "report.json").read_text())
    said: set[str] = set()
    for r in report["results"]:
        o.say("  " + GateResult.from_dict(r).line())
        for d in r["evidence"].get("differences", []):
            o.say("      " + describe(d))
        for d in r["evidence"].get("accepted", []):
            o.say("      accepted (gates.contract.allow): " + describe(d))
        if (caveat := r["evidence"].get("caveat")) and caveat not in said:  # once, under the first check it weakens
            said.add(caveat)
            o.say("      caveat: " + caveat)
    for note in report.get("notes", []):
        o.say("  note: " + note)
    decided = GateReport.from_json(report)
    verdict = decided.verdict.upper()
    if decided.warned:
        typer.echo(
            f"warning: inconclusive checks passed under on_inconclusive: warn: {', '.join(decided.inconclusive)}",
            err=True,
        )
        verdict += " (warn: passed)"
    o.say(f"gate {verdict}: {art.path / 'report.html'}")
    return report
