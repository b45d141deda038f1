"""Noise floor: the baseline gated against itself on a second numeric path, once per baseline and shadow set.

    floor = noise_floor(baseline_runner_factory, baseline, shadow, ref, ShadowConfig(), cache_dir)
    check_thresholds(ShadowConfig(kl_p99_max=1e-9), floor)     # ConfigError: tighter than the floor supports

The reference comes from generation (one left-padded prefill per batch of prompts, then KV-cached decode steps); the
second path is the gate's own: the baseline scored teacher-forced on the same tokens exactly as a candidate is
(length-sorted batches, full sequences). What differs is other GEMM shapes, padding, cache reuse and reduction order.
Its time is the baseline's teacher-forced scoring time, which the perf check compares candidates with. What differs
between the two is numerical noise, not quantization: a threshold the baseline itself cannot meet against this floor
would fail every candidate.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from qgate.artifact import Artifact, sha256_json
from qgate.cache import read_cached, write_cached
from qgate.errors import ConfigError
from qgate.execute import releases
from qgate.gates import answer_ends
from qgate.gates.kl_checks import kl_top1_checks
from qgate.gates.positions import scoring_summary
from qgate.gates.scoring import SCORING_LIBRARIES
from qgate.gates.shadow import REFERENCE_VERSION, ShadowConfig, candidate_metrics


def noise_floor(
    runner_factory,
    baseline: Artifact,
    shadow: Artifact,
    ref: dict,
    cfg: ShadowConfig,
    cache_dir: Path,
    timed_on: str | None = None,
    passes: int = 1,
) -> dict:
    """{"kl_mean", "kl_p99", "top1_agreement": {"observed", "ci"}, the decision guards' shares (answer_ends.floor),
    "path", "baseline_score_seconds", "baseline_score_passes", "timed_on", "warm_up", "cached"}, cached by content hash.
    timed_on (device.timing_host), given when the perf check gates on the time: it must have been measured there, after
    a warm-up batch, in at least `passes` timed passes (shadow.candidate_metrics; 1 where the check does not gate); a
    cached floor timed elsewhere (another card or CPU, or an unrecorded one), cold or in fewer passes is measured again
    and replaces it, as is one that lacks a decision guard's shares `ref` calls for (measured before the guard was)."""
    key = sha256_json(
        {
            "baseline": baseline.sha256,
            "shadow": shadow.sha256,
            "cfg": cfg.reference_key(),
            "positions": cfg.positions,
            "path": "gate-scoring",
            "v": 3,
            "reference": REFERENCE_VERSION,
            "libs": releases(SCORING_LIBRARIES),
        }
    )
    path = Path(cache_dir) / f"noise-floor-{key[:24]}.json"
    if (data := read_cached(path)) is not None:
        cached = json.loads(data)
        timed = cached.get("timed_on") == timed_on and cached.get("warm_up")
        shares = all(d.refrains in cached for d in answer_ends.DECISIONS.values() if len(ref.get(d.ids, ())))
        if shares and (timed_on is None or (timed and len(cached.get("baseline_score_passes", ())) >= passes)):
            return cached | {"cached": True}
    from qgate.device import timing_host

    runner = runner_factory()
    gated = timed_on is not None
    m = candidate_metrics(runner, ref, desc="noise floor: baseline vs itself", warm_up=gated, passes=passes)
    masks, _ = scoring_summary(ref, cfg.positions)
    checks = kl_top1_checks(m, ref["prompt_of"], masks["gated"], None)
    floor = {r.metric: {"observed": r.observed, "ci": list(r.ci) if r.ci else None} for r in checks}
    floor["path"] = (
        f"reference (prefill + KV-cached decode) vs the gate's teacher-forced scoring, {int(masks['gated'].sum())} "
        f"{cfg.positions} positions"
    )
    floor |= answer_ends.floor(ref, m)
    floor["baseline_score_seconds"] = m["score_seconds"]
    floor["baseline_score_passes"] = m["score_passes"]
    floor["timed_on"] = timing_host(getattr(runner, "device", None))
    floor["warm_up"] = gated
    write_cached(path, json.dumps(floor).encode())
    return floor | {"cached": False}


def check_thresholds(cfg: ShadowConfig, floor: dict) -> None:
    """ConfigError when the baseline itself, on its noise floor, could not pass a threshold, or when an answer-end
    guard would fail it: such a check would fail or stay inconclusive for every candidate."""
    limits = (
        ("kl_mean_max", "kl_mean", False),
        ("kl_p99_max", "kl_p99", False),
        ("top1_agreement_min", "top1_agreement", True),
    )
    for key, metric, higher in limits:
        thr, f = getattr(cfg, key), floor.get(metric)
        if thr is None or not f:
            continue
        lo, hi = f["ci"] or (f["observed"], f["observed"])
        bound = lo if higher else (hi if np.isfinite(hi) else f["observed"])  # the end the baseline itself must clear
        if (higher and thr > bound) or (not higher and thr < bound):
            raise ConfigError(
                f"gates.shadow.{key}: {thr:g} is tighter than the measured noise floor: the baseline against itself "
                f"({floor['path']}) gives {metric} {f['observed']:.3g}, 95% CI [{lo:.3g}, {hi:.3g}]",
                hint=f"set gates.shadow.{key} {'below' if higher else 'above'} {bound:.3g}",
            )
    thr = cfg.top1_agreement_min
    guarded = (("stop", "end_guards", "answer-end"), ("tool", "tool_guards", "tool-call"))
    for kind, flag, what in guarded if thr is not None else ():
        d = answer_ends.DECISIONS[kind]
        for name in (d.agrees, d.refrains) if getattr(cfg, flag) else ():
            if (f := floor.get(name)) and f["ci"][1] < thr:  # the guard would fail the baseline itself
                raise ConfigError(
                    f"gates.shadow.top1_agreement_min: {thr:g} is tighter than the measured noise floor of the {what} "
                    f"guards: the baseline against itself ({floor['path']}) gives {name} {f['agree']} of "
                    f"{f['answers']} answers, 95% CI [{f['ci'][0]:.3g}, {f['ci'][1]:.3g}], so that guard would fail "
                    "every candidate",
                    hint=f"set gates.shadow.top1_agreement_min below {f['ci'][1]:.3g}, or gates.shadow.{flag}: false",
                )
