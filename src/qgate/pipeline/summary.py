"""What a pipeline run reports about its gated variants, and which one it promotes.

chosen = best_passing(spec, chains)          # None when no variant passed
rows = [variant_summary(c) for c in chains]  # summary.json's "variants", the CLI's table
frontier(spec, rows, chains, workdir, chosen)  # workdir/frontier.json and .png: size against shadow KL p99
"""

from __future__ import annotations

from pathlib import Path

from qgate.artifact import Artifact, served_bytes
from qgate.gates.result import GateReport
from qgate.pipeline.spec import PipelineSpec
from qgate.pipeline.stages import Chain


def best_passing(spec: PipelineSpec, chains: list[Chain]) -> Chain | None:
    """The variant `promote.choose` picks among the passing ones: best (lowest shadow KL p99), smallest (the fewest
    bytes of weights in what is served, `artifact.served_bytes`: an engine's own files, not the checkpoint it was
    built from; then KL) or first (spec order)."""
    reports = [(c, GateReport.of(c.report)) for c in chains]  # each report.json read once
    passing = [(c, r) for c, r in reports if r.passed]
    kl = lambda cr: cr[1].summary.get("shadow.kl_p99", float("inf"))  # noqa: E731
    if spec.promote.choose == "best":
        passing.sort(key=kl)
    elif spec.promote.choose == "smallest":
        passing.sort(key=lambda cr: (served_bytes(cr[0].candidate.meta) or float("inf"), kl(cr)))
    return passing[0][0] if passing else None


def variant_summary(c: Chain) -> dict:
    report = GateReport.of(c.report)
    s = report.summary
    return {
        "variant": c.variant.name,
        "version": c.version,
        "passed": report.passed,
        "verdict": report.verdict,
        "warned": report.warned,  # inconclusive, passed under gates.on_inconclusive: warn
        "failed_checks": report.failed,
        "inconclusive_checks": report.inconclusive,
        "stopped": report.stopped,  # gates.stop_on_fail: what was not run, after which failures
        "checks": report.checks(),
        "report": str(c.report.path / "report.html"),
        "kl_p99": s.get("shadow.kl_p99"),
        "top1_agreement": s.get("shadow.top1_agreement"),
        "metrics": s,
        "weights_bytes": c.candidate.meta.get("weights_bytes"),  # the checkpoint's safetensors
        "served_bytes": served_bytes(c.candidate.meta),  # what promote.choose: smallest ranks
        "bits_per_weight": _bits_per_weight(c.candidate),
        "search": _search_summary(c.candidate.meta.get("search")),
        "backend": c.candidate.meta.get("backend", "torch-reference"),
    }


def frontier(
    spec: PipelineSpec, rows: list[dict], chains: list[Chain], out: Path, promoted: Chain | None = None
) -> str:
    """The run's size/quality frontier (search/frontier.py) from its variant summaries and the points its searched
    checkpoints tried, with the variant promoted (best_passing's choice; None: none passed). Returns the picture's
    path."""
    from qgate.search.frontier import write_frontier

    keys = ("k", "bits_per_weight", "weights_bytes", "kl_p99", "kl_p99_ci", "verdict")
    variants = [
        {
            "name": r["variant"],
            "bits_per_weight": r["bits_per_weight"],
            "weights_bytes": r["weights_bytes"],
            "served_bytes": r["served_bytes"],
            "kl_p99": r["kl_p99"],
            "kl_p99_ci": next((c["ci"] for c in r["checks"] if (c["gate"], c["metric"]) == ("shadow", "kl_p99")), None),
            "verdict": r["verdict"],
        }
        for r in rows
        if r["kl_p99"] is not None  # not scored: its serving contract failed
    ]
    points = [
        {"name": f"{c.variant.name} k={p['k']}", "variant": c.variant.name} | {k: p.get(k) for k in keys}
        for c in chains
        for p in ((c.checkpoint or c.candidate).meta.get("search") or {}).get("points", [])
    ]
    chosen = (promoted.variant.name, spec.promote.choose) if promoted else None
    return write_frontier(variants, points, spec.gate_config().shadow.kl_p99_max, out, chosen)["picture"]


def _bits_per_weight(candidate: Artifact) -> float | None:
    """From the manifest; for checkpoints made before it recorded the figure, measured from the checkpoint's files."""
    from qgate.quantize.compress import linear_size

    if candidate.meta.get("bits_per_weight") is not None:
        return candidate.meta["bits_per_weight"]
    ckpt = Path(candidate.meta.get("checkpoint_path") or candidate.path)
    return linear_size(ckpt)["bits_per_weight"] if ckpt.is_dir() and candidate.meta.get("scheme") else None


_SEARCH_KEYS = (
    "found",
    "chosen_k",
    "layers_total",
    "points_tried",
    "gate_runs",
    "seconds",
    "bits_per_weight",
    "fallback_bits",
)


def _search_summary(search: dict | None) -> dict | None:
    if not search:
        return None
    return {k: search[k] for k in _SEARCH_KEYS} | {
        "layout": search.get("layout"),
        "smoothing_seconds": search.get("smoothing_seconds"),
        "sensitivity_seconds": (search.get("sensitivity") or {}).get("seconds"),
        "point_seconds": [p.get("seconds") for p in search.get("points", [])],
    }
