"""The KL and top-1 checks over scored positions, shared by the shadow gate, engine parity and the noise floor.

    results = kl_top1_checks(m, ref["prompt_of"], mask, cfg)   # m: per-position "kl" and "agree" (candidate_metrics)

Each check has one estimator (`estimators`): the mean KL and top-1 agreement a bootstrap-t over prompts
(stats.cluster_bootstrap_t), the KL quantiles a clustered order-statistic interval (stats.quantile_ci). The pooled
checks take it at 95% on the gated positions; the route guards (gates/routes.py) at their Holm-adjusted levels on
each route's positions.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from qgate.gates.result import POSITIVE, SHARE, GateResult
from qgate.gates.routes import Interval, RouteCheck
from qgate.gates.stats import cluster_bootstrap_t, quantile, quantile_ci

KL_THRESHOLDS = {"kl_mean_max": POSITIVE, "kl_p99_max": POSITIVE, "kl_p999_max": POSITIVE, "top1_agreement_min": SHARE}
QUANTILES = {"kl_p99": 0.99, "kl_p999": 0.999}  # the KL quantile checks and their q; thresholds: <name>_max


def kl_top1_checks(
    m: dict,
    clusters: np.ndarray,
    mask: np.ndarray,
    cfg,
    prefix: str = "",
    evidence: dict | None = None,
    gate: str = "shadow",
) -> list[GateResult]:
    """kl_mean, kl_p99, kl_p999 and top1_agreement over the masked positions, on their 95% intervals (estimators).
    Thresholds are read from cfg's kl_mean_max, kl_p99_max, kl_p999_max and top1_agreement_min; report-only when cfg
    is None. `evidence` goes on kl_mean's row. With no position masked: `unmeasured`'s rows (kl_mean's with
    `evidence` too), none when cfg is None."""
    n = int(mask.sum())
    if n == 0:
        if cfg is None:
            return []
        first, *rest = unmeasured(cfg, {"error": "no positions of this kind were scored"}, prefix, gate)
        return [replace(first, evidence=(evidence or {}) | first.evidence), *rest]
    out = []
    for name, (higher, interval) in estimators(m, clusters).items():
        observed, lo, hi, ev = interval(mask, 0.95)
        if name == "kl_mean":
            ev = evidence
        elif name == "top1_agreement":
            ev = {"flip_rate": 1 - observed}
        threshold = getattr(cfg, THRESHOLD_OF[name]) if cfg else None
        out.append(GateResult.check(gate, f"{prefix}{name}", observed, threshold, higher, n, (lo, hi), evidence=ev))
    return out


THRESHOLD_OF = {name.rsplit("_", 1)[0]: name for name in KL_THRESHOLDS}  # "kl_p99" -> "kl_p99_max"
HIGHER = {"top1_agreement"}  # the checks whose higher values are better; the KL checks' lower


def unmeasured(cfg, evidence: dict, prefix: str = "", gate: str = "shadow") -> list[GateResult]:
    """Each check with nothing to compare: a NaN row, an error where cfg sets its threshold (the gate asked for a
    figure it does not have) and report-only where it does not. evidence["error"] says why."""
    return [
        GateResult.check(gate, prefix + x, float("nan"), getattr(cfg, t), x in HIGHER, 0, evidence=evidence)
        for x, t in THRESHOLD_OF.items()
    ]


def estimators(m: dict, clusters: np.ndarray) -> dict[str, tuple[bool, Interval]]:
    """Each KL and top-1 check's estimator: whether higher is better, and interval(mask, level) -> (observed, lo, hi,
    evidence) over the masked positions at that two-sided level. Means (KL, agreement) get the bootstrap-t over
    prompts (stats.cluster_bootstrap_t) within the range the quantity can take; quantiles the clustered
    order-statistic interval (stats.quantile_ci)."""
    kl, agree = m["kl"], m["agree"].astype(float)

    def mean_of(x: np.ndarray, low: float, high: float) -> Interval:
        def interval(mask: np.ndarray, level: float):
            _, lo, hi, ev = cluster_bootstrap_t(x[mask], clusters[mask], level=level)
            return float(x[mask].mean()), float(np.clip(lo, low, high)), float(np.clip(hi, low, high)), ev

        return interval

    def quantile_of(q: float) -> Interval:
        def interval(mask: np.ndarray, level: float):
            lo, hi, ev = quantile_ci(kl[mask], clusters[mask], q, level=level, cluster_name="prompts")
            return quantile(kl[mask], q), lo, hi, ev

        return interval

    intervals = (
        {"kl_mean": mean_of(kl, 0.0, np.inf)}
        | {name: quantile_of(q) for name, q in QUANTILES.items()}
        | {"top1_agreement": mean_of(agree, 0.0, 1.0)}
    )
    return {name: (name in HIGHER, interval) for name, interval in intervals.items()}


def route_checks(m: dict, clusters: np.ndarray, cfg) -> list[RouteCheck]:
    """The checks cfg gates (a threshold set), for route_guards: the same estimators as kl_top1_checks."""
    return [
        RouteCheck(name, getattr(cfg, THRESHOLD_OF[name]), higher, interval)
        for name, (higher, interval) in estimators(m, clusters).items()
        if getattr(cfg, THRESHOLD_OF[name]) is not None
    ]


def defined_check(m: dict, ref: dict, gate: str = "shadow") -> GateResult:
    """Every scored position, template and repeats included, must have logits that define a distribution: a NaN or
    +inf logit anywhere is a broken candidate whatever the KL thresholds allow (a p99 over the rest could pass it)."""
    bad = np.flatnonzero(m["undefined"])
    n = len(m["undefined"])
    ev = {"undefined_positions": int(len(bad))}
    if len(bad):
        i = int(ref["prompt_of"][bad[0]])
        ev["first"] = {"prompt": i, "position": int(bad[0] - np.flatnonzero(ref["prompt_of"] == i)[0])}
        ev["why"] = (
            f"{len(bad)} of {n} positions have NaN or +inf logits; the first: shadow prompt {i}, "
            f"position {ev['first']['position']}"
        )
    return GateResult.check(gate, "defined_logits", 1 - len(bad) / n if n else float("nan"), 1.0, True, n, evidence=ev)
