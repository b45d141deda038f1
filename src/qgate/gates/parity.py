"""Engine parity: an engine against its own checkpoint, and that checkpoint against the baseline.

    side = checkpoint_side(ckpt, ref, ShadowConfig().top_k)   # before the engine loads, which then has the device
    results = parity_checks(engine_runner, ckpt, side, ref, gated, ParityConfig())

The engine-vs-checkpoint figures are runtime error alone (kernels, packing, graphs); checkpoint-vs-baseline is the
quantization loss. Both are scored on the baseline's shadow tokens at the positions the shadow gate gated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qgate.artifact import Artifact
from qgate.gates.kl_checks import KL_THRESHOLDS, kl_top1_checks, unmeasured
from qgate.gates.numerics import LazyRunner
from qgate.gates.passes import rescore_reference
from qgate.gates.result import GateResult, check_threshold_values
from qgate.gates.shadow import candidate_metrics


@dataclass(frozen=True)
class ParityConfig:
    """Engine candidates: the engine vs its own checkpoint on the reference path, on the gated shadow positions.
    Tells a kernel or runtime bug from quantization loss. Report-only unless a threshold is set."""

    enabled: bool = True  # score an engine against its own checkpoint
    kl_mean_max: float | None = None  # as gates.shadow's, engine vs checkpoint; None: reported only
    kl_p99_max: float | None = None  # as gates.shadow's, engine vs checkpoint
    kl_p999_max: float | None = None  # as gates.shadow's, engine vs checkpoint
    top1_agreement_min: float | None = None  # as gates.shadow's, engine vs checkpoint
    VERSION = 1

    def __post_init__(self):
        check_threshold_values("gates.parity", self, KL_THRESHOLDS)


def checkpoint_side(
    ckpt: Artifact | None, ref: dict, top_k: int, device: str = "auto", dtype: str = "auto"
) -> tuple[dict, dict] | None:
    """An engine's own checkpoint on the reference path, scored against the baseline's reference and rescored as a
    reference for the engine: (checkpoint metrics, checkpoint reference), or None when the checkpoint is gone. The
    checkpoint is freed before this returns, so the engine loads into a device holding no other model."""
    if ckpt is None:
        return None
    runner = LazyRunner(ckpt, device, dtype)
    m_ckpt = candidate_metrics(runner(), ref, desc="parity: checkpoint vs baseline")
    ckpt_ref = rescore_reference(runner(), ref, top_k, desc="parity: checkpoint reference")
    runner.release()
    return m_ckpt, ckpt_ref | {"numerics": runner.tag()}


def parity_checks(
    cand_runner, ckpt: Artifact | None, side: tuple[dict, dict] | None, ref: dict, gated, cfg: ParityConfig
) -> list[GateResult]:
    """Checkpoint vs baseline and engine vs checkpoint, on the baseline's shadow tokens and the gated positions.
    Where the checkpoint's own logits define no distribution (NaN or +inf: a float16 checkpoint whose activations
    overflow, which an engine computing wider still serves), there is nothing to compare the engine with: engine vs
    checkpoint is scored on the other gated positions and says how many it left out. With no checkpoint, or no position
    left, engine vs checkpoint is not measured: NaN rows, each an error where parity sets its threshold."""
    if side is None:
        why = "the engine's checkpoint is not on disk or changed since the build"
        return unmeasured(cfg, {"error": why}, "engine_vs_checkpoint.", "parity") + [
            GateResult.check(
                "parity", "checkpoint_vs_baseline.kl_p99", float("nan"), None, False, 0, evidence={"error": why}
            )
        ]
    m_ckpt, ckpt_ref = side
    undefined = int((gated & m_ckpt["undefined"]).sum())
    checkpoint_rows = kl_top1_checks(
        m_ckpt,
        ref["prompt_of"],
        gated,
        None,
        prefix="checkpoint_vs_baseline.",
        evidence={"undefined_positions": undefined} if undefined else None,
        gate="parity",
    )
    m_eng = candidate_metrics(cand_runner, ckpt_ref, desc="parity: engine vs checkpoint")
    ev = {"checkpoint": ckpt.sha256, "checkpoint_path": str(ckpt.path)}
    lost = gated & np.isnan(ckpt_ref["top_lp"]).any(-1)
    if n_lost := int(lost.sum()):
        ev["checkpoint_undefined_positions"] = n_lost
        why = (
            f"the checkpoint's own logits define no distribution at {n_lost} of {int(gated.sum())} gated positions, "
            f"scored in {ckpt_ref['numerics']} (NaN or +inf: an activation past the format's range, or a broken weight)"
        )
        if n_lost == gated.sum():
            return unmeasured(cfg, ev | {"error": why}, "engine_vs_checkpoint.", "parity") + checkpoint_rows
        ev["note"] = f"{why}; the engine is compared with it at the others"
    return (
        kl_top1_checks(
            m_eng, ref["prompt_of"], gated & ~lost, cfg, prefix="engine_vs_checkpoint.", evidence=ev, gate="parity"
        )
        + checkpoint_rows
    )
