"""How often a recovery check decides wrongly for a candidate whose true recovery sits exactly on the margin.

    .venv/bin/python benchmarks/bench_recovery_ci.py                 # the table; ~1 minute on one core
    .venv/bin/python benchmarks/bench_recovery_ci.py --fine          # worst rates over 1,440 scenarios; ~15 minutes

The eval gate passes a multiple-choice task when the 95% interval of recovery (candidate accuracy / baseline
accuracy) lies wholly above `min_recovery`, and fails it when the interval lies wholly below. A candidate whose true
recovery equals the margin should therefore pass at most 2.5% of the time, and fail at most 2.5%. Each scenario
(items, baseline accuracy, margin, and the share of items the candidate gains: it loses that share plus what the
margin costs) draws paired right/wrong items from its true 2x2 table and counts how often an interval

  passes    with its lower end above the margin: a regression of exactly the margin let through;
  fails     with its upper end below the margin.

The intervals, on the same draws:
  diff/base  the Agresti-Min interval of the accuracy difference divided by the observed baseline accuracy, as if
             that accuracy were known (`stats.paired_binary_ci`): the eval gate's rule before;
  score      Tang's asymptotic score, both ends (`stats.paired_ratio_score` at the margin);
  skewed     the same with the skewness correction, both ends;
  gate       `stats.paired_ratio_ci`, what the gate decides on now: Tang's lower end, the skewness-corrected upper.
Each distinct table is scored once and weighted by how often it was drawn. Pure numpy/scipy; no model is loaded.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import numpy as np

from qgate.gates.stats import paired_binary_ci, paired_ratio_ci, paired_ratio_score

Z = 1.959964
RULES = ("diff/base", "score", "skewed", "gate")
COARSE = dict(items=(50, 200, 1600), base_acc=(0.5, 0.9), margins=(0.9, 0.95, 0.98), gains=(0.0, 0.01, 0.05))
FINE = dict(
    items=(30, 50, 100, 200, 400, 1600),
    base_acc=(0.3, 0.6, 0.9, 0.95),
    margins=tuple(round(0.85 + 0.01 * i, 2) for i in range(15)),
    gains=(0.0, 0.005, 0.02, 0.08),
)


def cells(base_acc: float, margin: float, gains: float) -> np.ndarray | None:
    """Cell probabilities (both right, only the candidate right, only the baseline right, neither): candidate
    accuracy = margin x base_acc."""
    lost = base_acc * (1 - margin) + gains
    p = np.array([base_acc - lost, gains, lost, 1 - base_acc - gains])
    return p if p.min() >= -1e-12 else None


def decisions(both: int, gained: int, lost: int, n: int, margin: float) -> dict[str, tuple[bool, bool]]:
    """(passes, fails) of each rule on one table."""
    base = np.repeat([True, False, True, False], [both, gained, lost, n - both - gained - lost])
    cand = np.repeat([True, True, False, False], [both, gained, lost, n - both - gained - lost])
    acc = base.mean()
    _, dlo, dhi = paired_binary_ci(base, cand)
    _, lo, hi = paired_ratio_ci(base, cand)
    t, ts = paired_ratio_score(base, cand, margin), paired_ratio_score(base, cand, margin, skew=True)
    return {
        "diff/base": ((acc + dlo) / acc > margin, (acc + dhi) / acc < margin),
        "score": (t > Z, t < -Z),
        "skewed": (ts > Z, ts < -Z),
        "gate": (lo > margin, hi < margin),
    }


def rates(n: int, p: np.ndarray, margin: float, draws: int, rng) -> dict[str, np.ndarray]:
    tables, weight = np.unique(
        rng.multinomial(n, np.clip(p, 0, None) / np.clip(p, 0, None).sum(), draws), axis=0, return_counts=True
    )
    out = {r: np.zeros(2) for r in RULES}
    for (both, gained, lost, _), w in zip(tables, weight, strict=True):
        if both + lost == 0:  # the baseline got nothing right: no recovery to decide
            continue
        for r, (passes, fails) in decisions(int(both), int(gained), int(lost), n, margin).items():
            out[r] += w * np.array([passes, fails])
    return {r: v / draws for r, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draws", type=int, default=10000, help="draws per scenario (Monte Carlo error ~0.16%% at 10k)")
    ap.add_argument("--fine", action="store_true", help="the fine grid; print only each rule's worst rates")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    grid = FINE if args.fine else COARSE
    rng = np.random.default_rng(args.seed)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, numpy {np.__version__}; {args.draws} draws each")
    print("a candidate on the margin: each rate should be at most 0.025")
    if not args.fine:
        print(f"{'items':>5} {'base':>5} {'margin':>6} {'gains':>5} | " + " | ".join(f"{r:>15}" for r in RULES))
        print(f"{'':>5} {'acc':>5} {'':>6} {'':>5} | " + " | ".join(f"{'passes':>7} {'fails':>7}" for _ in RULES))
    worst = {r: [(0.0, None), (0.0, None)] for r in RULES}
    t0 = time.perf_counter()
    for n, acc, margin, gains in itertools.product(grid["items"], grid["base_acc"], grid["margins"], grid["gains"]):
        p = cells(acc, margin, gains)
        if p is None:
            continue
        r = rates(n, p, margin, args.draws, rng)
        for rule, v in r.items():
            for side in (0, 1):
                if v[side] > worst[rule][side][0]:
                    worst[rule][side] = (float(v[side]), (n, acc, margin, gains))
        if not args.fine:
            print(
                f"{n:5d} {acc:5.2f} {margin:6.2f} {gains:5.3f} | "
                + " | ".join(f"{v[0]:7.4f} {v[1]:7.4f}" for v in r.values())
            )
    for rule, ((p, at_p), (f, at_f)) in worst.items():
        print(
            f"worst {rule:9s}: passes {p:.4f} ({p / 0.025:.2f}x nominal) at {at_p}, "
            f"fails {f:.4f} ({f / 0.025:.2f}x) at {at_f}   (items, base acc, margin, gains)"
        )
    print(f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
