"""Per-route guards under the shadow gate's pooled checks: a regression that pooling over the traffic would hide.

    rows = route_guards(routes, gated, checks)   # routes [positions] str, gated [positions] bool

The shadow gate decides on all gated positions together, so a candidate that breaks a minority route (code
assistance at a tenth of the traffic, say) can pass on the pooled figures. Each gated check is then also
computed on each route's positions alone, as a guard (GateResult.guard): it fails the candidate when its
interval, adjusted for the other routes tested beside it, lies wholly on the bad side of the same threshold,
and it never passes one. A route the split holds too few prompts of gets a wide interval and stays INFO.

The adjustment is Holm's step-down, done with intervals: with m routes left untested, each gets its interval
at one-sided error GUARD_ERROR / m; those wholly on the bad side fail and leave, and the rest are tested again
at the smaller m, until a round fails none. That rejects exactly the routes Holm's procedure on the intervals'
p-values would, at family-wise error GUARD_ERROR per check, the bad side of the pooled check's 95% interval
(benchmarks/bench_route_guards.py measures it). The checks and their estimators come from gates/kl_checks.py
(route_checks).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from qgate.gates.result import GUARD_ERROR, GateResult

LABEL_CHARS = 48  # a route's label in a metric name, at most
# interval(mask, level) -> (observed, lo, hi, evidence) over the positions in `mask`, at two-sided `level`
Interval = Callable[[np.ndarray, float], tuple[float, float, float, dict]]


@dataclass(frozen=True)
class RouteCheck:
    name: str  # the pooled check's metric: "kl_p99"
    threshold: float
    higher_is_better: bool
    interval: Interval


def route_guards(
    routes: np.ndarray, gated: np.ndarray, checks: list[RouteCheck], gate: str = "shadow"
) -> list[GateResult]:
    """One guard per check and route with gated positions, named `route.<route>.<check>`, in check then route
    order; [] when the gated positions come from fewer than two routes (the pooled checks are then that route's)."""
    names = sorted(set(routes[gated].tolist()))
    if len(names) < 2:
        return []
    masks = {r: gated & (routes == r) for r in names}
    labels = route_labels(names)
    total = int(gated.sum())
    out: list[GateResult] = []
    for check in checks:
        out += _holm(check, masks, labels, total, gate)
    return out


def route_labels(names: list[str]) -> dict[str, str]:
    """A metric-name label per route: letters, digits, "_" and "-" kept, anything else "_", at most LABEL_CHARS
    characters, with "_2", "_3", ... where two routes would share one (a route is any string of up to 200
    characters; metric names also key MLflow tags). The evidence keeps each route as written."""
    out: dict[str, str] = {}
    for r in names:
        base = re.sub(r"[^A-Za-z0-9_-]", "_", r)[:LABEL_CHARS] or "_"
        label, i = base, 1
        while label in out.values():
            i += 1
            label = f"{base}_{i}"
        out[r] = label
    return out


def holm_rounds(intervals: dict[str, Callable[[float], tuple]], higher_is_better: bool, threshold: float) -> dict:
    """Holm's step-down with intervals, for a family of guards at GUARD_ERROR: with m guards left untested, each
    gets interval(level) at two-sided level 1 - 2 GUARD_ERROR / m; those wholly on the bad side of `threshold` leave,
    and the rest are tested again at the smaller m, until a round fails none. intervals: name -> interval(level) ->
    (observed, lo, hi, evidence). Per name: (observed, lo, hi, evidence, level, round, m) of its last round."""
    sign = 1.0 if higher_is_better else -1.0
    left, rows, step = list(intervals), {}, 0
    while left:
        step += 1
        level = 1 - 2 * GUARD_ERROR / len(left)
        tested = {r: intervals[r](level) for r in left}
        failed = [r for r, (_, lo, hi, _) in tested.items() if _bad(sign, lo, hi, threshold)]
        for r, (obs, lo, hi, ev) in tested.items():
            rows[r] = (obs, lo, hi, ev, level, step, len(left))
        if not failed:
            break
        left = [r for r in left if r not in failed]
    return rows


def _holm(
    check: RouteCheck, masks: dict[str, np.ndarray], labels: dict[str, str], total: int, gate: str
) -> list[GateResult]:
    sign = 1.0 if check.higher_is_better else -1.0
    intervals = {r: (lambda level, mask=mask: check.interval(mask, level)) for r, mask in masks.items()}
    rows = holm_rounds(intervals, check.higher_is_better, check.threshold)
    out = []
    for r, mask in masks.items():
        obs, lo, hi, ev, level, step, m = rows[r]
        lo95, hi95 = (lo, hi) if m == 1 else check.interval(mask, 0.95)[1:3]  # a round of one is at 95% already
        ev = ev | {
            "route": r,
            "positions": int(mask.sum()),
            "share_of_gated": round(int(mask.sum()) / total, 4),
            "ci_95_unadjusted": [lo95, hi95],
            "holm_round": step,
            "holm_routes": m,
            "adjusted_level": level,
            "rule": "holm-guard over the routes, at the pooled check's threshold",
        }
        if _bad(sign, lo, hi, check.threshold):
            side = "below" if check.higher_is_better else "above"
            ev["why"] = (
                f"route {r} ({ev['share_of_gated']:.1%} of the gated positions): {check.name} {obs:.4g}, its "
                f"Holm-adjusted {level:.2%} interval lies wholly {side} {check.threshold:g}: this route's traffic "
                "regressed, whatever the pooled figure says"
            )
        metric = f"route.{labels[r]}.{check.name}"
        out.append(
            GateResult.guard(gate, metric, obs, check.threshold, check.higher_is_better, ev["positions"], (lo, hi),
                             evidence=ev)
        )  # fmt: skip
    return out


def _bad(sign: float, lo: float, hi: float, threshold: float) -> bool:
    best = hi if sign > 0 else lo  # the end nearest passing: the route is shown bad when even it is bad
    return bool(np.isfinite(best) and sign * (best - threshold) < 0)
