"""What a registered version carries for the MLflow UI: its tags (verdict, lineage, recipe, each gated figure) and
the registered model's description.

    tags = version_tags(gate, candidate, report, verdict, run_id, model_id, profile, recipe)
"""

from __future__ import annotations

import json

from qgate.artifact import Artifact, served_bytes

MODEL_DESCRIPTION = """Quantized variants gated by **qgate** against the baseline on held-out production traffic and
offline evals.

- Every version's description holds its gate verdict, each check (observed, 95% CI, threshold, decision) and its
  lineage; the full report is the gate run's `gate-report/report.html` artifact.
- `@production` is moved only by `qgate promote` / `qgate drift run` / `qgate rollback`, which refuse a version whose
  gate did not pass or whose stored files no longer match their gated sha256; `@previous-production` is the rollback
  target.
- Filter versions by the tags `qgate.gate_verdict`, `qgate.scheme`, `qgate.backend`, `qgate.kv_cache_dtype`,
  `qgate.base_model_sha256`, `qgate.calibration_sha256`; `qgate.drift.verdict` holds the last drift check.
"""


def names_tag(names: list[str], what: str = "layers") -> str:
    """Layer names for a tag: comma-joined, '-' for none, their count when too long for MLflow's tag value."""
    joined = ",".join(names) or "-"
    return joined if len(joined) < 4000 else f"{len(names)} {what} (see the report)"


def version_tags(
    gate: Artifact,
    candidate: Artifact,
    report: dict,
    verdict: str,
    run_id: str,
    model_id: str,
    profile: Artifact | None,
    recipe: dict | None,
) -> dict[str, str]:
    tags = {
        "qgate.gate_passed": str(bool(gate.meta["passed"])).lower(),
        "qgate.gate_verdict": verdict,
        "qgate.gate_failed_checks": ",".join(gate.meta.get("failed", [])) or "-",
        "qgate.gate_inconclusive_checks": ",".join(gate.meta.get("inconclusive", [])) or "-",
        "qgate.scheme": str(candidate.meta.get("scheme")),
        "qgate.backend": str(candidate.meta.get("backend", "torch-reference")),
        "qgate.kv_cache_dtype": str(candidate.meta.get("kv_cache_dtype") or "model-default"),
        "qgate.calibration_sha256": candidate.meta.get("calibration_sha256") or "-",  # none: no data, or not known
        "qgate.base_model_sha256": candidate.meta.get("base_model") or "-",  # none: quantized elsewhere (imported)
        "qgate.artifact_sha256": candidate.sha256,
        "qgate.gate_report_sha256": gate.sha256,
        "qgate.gate_report_artifact": f"runs:/{run_id}/gate-report/report.html",
        "qgate.model_id": model_id,
        "qgate.variant": str(report["candidate"]["name"]),
    }
    if profile is not None:
        tags |= {"qgate.profile_sha256": profile.sha256, "qgate.profile_artifact": f"runs:/{run_id}/traffic-profile"}
    if recipe is not None:
        tags["qgate.recipe"] = json.dumps(recipe, sort_keys=True)
    if (nbytes := served_bytes(candidate.meta)) is not None:  # what promote.choose: smallest ranks
        tags["qgate.served_bytes"] = str(nbytes)
    if candidate.meta.get("bits_per_weight") is not None:
        tags["qgate.bits_per_weight"] = f"{candidate.meta['bits_per_weight']:.3f}"
    if candidate.meta.get("lm_head"):  # a quantized output head (search.lm_head); absent: the head is not quantized
        tags["qgate.lm_head"] = candidate.meta["lm_head"]
    if search := candidate.meta.get("search"):  # what a search traded: which layers fell back, at what size
        fallback = candidate.meta.get("fallback_layers", [])
        tags |= {
            "qgate.search.fallback_layers": names_tag(fallback),
            "qgate.search.fine_group_layers": names_tag(
                candidate.meta.get("fine_group_layers", []),
                f"layers at group size {candidate.meta.get('fine_group_size')}",
            ),
            "qgate.search.fallback_count": str(len(fallback)),
            "qgate.search.moves": str(search["chosen_k"]),
            "qgate.search.found": str(search["found"]).lower(),
            "qgate.search.points_tried": str(search["points_tried"]),
        }
    tags |= {
        f"qgate.{r['gate']}.{r['metric']}": f"{r['observed']:.6g}"
        for r in report["results"]
        if r["threshold"] is not None
    }
    return tags
