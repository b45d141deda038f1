"""Which shadow prompts a candidate is gated on: only traffic it was not made with.

    held = held_out(candidate, shadow, rows)   # held.mask: bool per shadow row; held.notes: what the report says

A candidate fitted to some prompts scores better on them than on new traffic, so evidence from them would flatter it.
Two rules keep the shadow evidence held out:
- the split: a gate on the split the candidate was calibrated on, one of its parents, or the split a search chose its
  layout on is refused (InputError, no verdict);
- the requests: a shadow request the candidate was made with is left out of the checks. Two samples of the same
  traffic share requests (a drift job's fresh sample of recent logs and the older sample production was calibrated
  on, say), and the split rule cannot see that. A checkpoint records its calibration requests as
  `calibration_prompts` (chat.prompt_digest of each, written by quantize) and a searched one the requests of the split
  its search chose on as `search_prompts`; an engine's manifest carries its checkpoint's. When every shadow request is
  one of them the gate is refused as on the calibration split.
A candidate that says it was calibrated (`calibration_sha256`) but records no requests is gated on every row, and
its report says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qgate.artifact import Artifact, engine_checkpoint
from qgate.chat import row_digest
from qgate.errors import InputError

HINT = (
    "gate on a split of the same `qgate calibrate sample` that the candidate was not made with: the shadow split, "
    "with calibration on the calib split and a search on the search split"
)


@dataclass(frozen=True)
class HeldOut:
    mask: np.ndarray  # bool per shadow row: True where the row counts as held-out evidence
    notes: tuple[str, ...]  # for the report: rows left out, and what could not be checked

    @property
    def left_out(self) -> int:
        return int((~self.mask).sum())


def made_with(art: Artifact) -> set[str]:
    """The requests (chat.prompt_digest keys) an artifact's manifest says it was made with: its calibration set's
    (`calibration_prompts`) and, for a searched checkpoint, the split its search chose on (`search_prompts`)."""
    return set(art.meta.get("calibration_prompts", ())) | set(art.meta.get("search_prompts", ()))


def unrecorded(*arts: Artifact) -> bool:
    """Whether these manifests (a candidate and the checkpoint it was built from) say the model was calibrated
    (`calibration_sha256`) but none records the requests (`calibration_prompts`): quantized before the record."""
    calibrated = any(a.meta.get("calibration_sha256") for a in arts)
    return calibrated and not any("calibration_prompts" in a.meta for a in arts)


def held_out(candidate: Artifact, shadow: Artifact, rows: list[dict], checkpoint: Artifact | None = None) -> HeldOut:
    """The split rule (InputError), then the request rule over `rows` (the shadow rows the gate scores, in order).
    checkpoint: an engine candidate's checkpoint (default: its manifest's record)."""
    source = checkpoint or (engine_checkpoint(candidate) if candidate.kind == "engine" else None)
    made = [art for art in (candidate, source) if art is not None]
    for art in made:
        _check_split(candidate, shadow, art)
    seen = set().union(*(made_with(art) for art in made))
    mask = np.array([row_digest(row) not in seen for row in rows], bool)
    if len(rows) and not mask.any():
        raise InputError(
            f"{shadow.path}: every one of its {len(rows)} requests is one {candidate.path} was made with (its "
            "calibration set, or the split its search chose on), so a gate on it would score the prompts the "
            "candidate was fitted to, not held-out traffic",
            hint=f"sample the traffic again with `qgate calibrate sample --held-from {candidate.path}`: its shadow "
            "split passes over the requests the candidate was made with",
        )
    notes = ()
    if left := int((~mask).sum()):
        notes += (
            f"{left} of {len(rows)} shadow requests are ones the candidate was made with (its calibration set, or the "
            "split its search chose on; two samples of the same traffic share requests): the shadow checks leave "
            "them out.",
        )
    if unrecorded(*made):
        notes += (
            "The candidate's manifest records no calibration requests (it was quantized before qgate recorded them), "
            "so shadow requests that were also in its calibration set could not be left out.",
        )
    return HeldOut(mask, notes)


def _check_split(candidate: Artifact, shadow: Artifact, art: Artifact) -> None:
    chosen_on = (art.meta.get("search") or {}).get("chosen_on", {}).get("sha256")
    if shadow.sha256 == art.meta.get("calibration_sha256"):
        how = "was calibrated on this split"
    elif shadow.sha256 in (*art.parents, chosen_on):
        how = "was made with this split (a search chose its layout on it)"
    else:
        return
    raise InputError(
        f"{shadow.path}: {candidate.path} {how}, so a gate on it would score the prompts the candidate was fitted "
        "to, not held-out traffic",
        hint=HINT,
    )
