"""Noise floor: the baseline gated against itself on a second numeric path, once per baseline and shadow set.

    floor = noise_floor(baseline_runner_factory, baseline, shadow, ref, ShadowConfig(), cache_dir)
    check_thresholds(ShadowConfig(kl_p99_max=1e-9), floor)     # ConfigError: tighter than the floor supports

The reference scores one sequence at a time; the second path scores the same tokens in left-padded batches
of 8 (other GEMM shapes, masking, reduction order). What differs between the two is numerical noise, not
quantization: a threshold the baseline itself cannot meet against this floor would fail every candidate.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from qgate.artifact import Artifact, sha256_json
from qgate.cache import read_cached, write_cached
from qgate.errors import ConfigError
from qgate.gates.shadow import ShadowConfig, candidate_metrics, kl_top1_checks, scoring_summary

BATCH = 8


class BatchedPath:
    """A runner view whose logits(seq) come from logits_batch over the reference's upcoming sequences."""

    def __init__(self, runner, ref: dict):
        self.runner, self.tokenizer = runner, runner.tokenizer
        bounds = np.concatenate([[0], np.cumsum(ref["seq_lens"])])
        self.seqs = [ref["tokens"][a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        self.next, self.ready = 0, []

    def logits(self, ids) -> np.ndarray:
        if not self.ready:
            chunk = self.seqs[self.next:self.next + BATCH]
            self.ready = list(self.runner.logits_batch(chunk))
            self.next += len(chunk)
        out = self.ready.pop(0)
        if out.shape[0] != len(ids):
            raise RuntimeError("noise floor: sequences requested out of order")
        return out


def noise_floor(runner_factory, baseline: Artifact, shadow: Artifact, ref: dict, cfg: ShadowConfig, cache_dir: Path) -> dict:
    """{"kl_mean", "kl_p99", "top1_agreement": {"observed", "ci"}, "path", "cached"}, cached by content hash."""
    key = sha256_json({"baseline": baseline.sha256, "shadow": shadow.sha256, "cfg": cfg.reference_key(),
                       "positions": cfg.positions, "batch": BATCH, "v": 1})
    path = Path(cache_dir) / f"noise-floor-{key[:24]}.json"
    if (data := read_cached(path)) is not None:
        return json.loads(data) | {"cached": True}
    m = candidate_metrics(BatchedPath(runner_factory(), ref), ref, desc="noise floor: baseline vs itself")
    masks, _ = scoring_summary(ref, cfg)
    checks = kl_top1_checks(m, ref["prompt_of"], masks["gated"], None)
    floor = {r.metric: {"observed": r.observed, "ci": list(r.ci) if r.ci else None} for r in checks}
    floor["path"] = f"unbatched vs left-padded batches of {BATCH}, {int(masks['gated'].sum())} {cfg.positions} positions"
    write_cached(path, json.dumps(floor).encode())
    return floor | {"cached": False}


def check_thresholds(cfg: ShadowConfig, floor: dict) -> None:
    """ConfigError when the baseline itself, on its noise floor, could not pass a threshold: such a check would
    fail or stay inconclusive for every candidate."""
    limits = (("kl_mean_max", "kl_mean", False), ("kl_p99_max", "kl_p99", False), ("top1_agreement_min", "top1_agreement", True))
    for key, metric, higher in limits:
        thr, f = getattr(cfg, key), floor.get(metric)
        if thr is None or not f:
            continue
        lo, hi = f["ci"] or (f["observed"], f["observed"])
        bound = lo if higher else (hi if np.isfinite(hi) else f["observed"])   # the end the baseline itself must clear
        if (higher and thr > bound) or (not higher and thr < bound):
            raise ConfigError(
                f"gates.shadow.{key}: {thr:g} is tighter than the measured noise floor: the baseline against itself "
                f"({floor['path']}) gives {metric} {f['observed']:.3g}, 95% CI [{lo:.3g}, {hi:.3g}]",
                hint=f"set gates.shadow.{key} {'below' if higher else 'above'} {bound:.3g}")
