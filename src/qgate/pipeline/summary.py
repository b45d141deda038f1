"""What a pipeline run reports about its gated variants, and which one it promotes.

chosen = best_passing(spec, chains)          # None when no variant passed
rows = [variant_summary(c) for c in chains]  # summary.json's "variants", the CLI's table
"""

from __future__ import annotations

from pathlib import Path

from qgate.artifact import Artifact
from qgate.gates.result import GateReport
from qgate.pipeline.spec import PipelineSpec
from qgate.pipeline.stages import Chain


def best_passing(spec: PipelineSpec, chains: list[Chain]) -> Chain | None:
    """The variant `promote.choose` picks among the passing ones: best (lowest shadow KL p99), smallest (fewest
    weights bytes, then KL) or first (spec order)."""
    passing = [c for c in chains if GateReport.of(c.report).passed]
    kl = lambda c: GateReport.of(c.report).summary.get("shadow.kl_p99", float("inf"))  # noqa: E731
    if spec.promote.choose == "best":
        passing.sort(key=kl)
    elif spec.promote.choose == "smallest":
        passing.sort(key=lambda c: (c.candidate.meta.get("weights_bytes") or float("inf"), kl(c)))
    return passing[0] if passing else None


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
        "weights_bytes": c.candidate.meta.get("weights_bytes"),
        "bits_per_weight": _bits_per_weight(c.candidate),
        "search": _search_summary(c.candidate.meta.get("search")),
        "backend": c.candidate.meta.get("backend", "torch-reference"),
    }


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
        "smoothing_seconds": search.get("smoothing_seconds"),
        "sensitivity_seconds": (search.get("sensitivity") or {}).get("seconds"),
        "point_seconds": [p.get("seconds") for p in search.get("points", [])],
    }
