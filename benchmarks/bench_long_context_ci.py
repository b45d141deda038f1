"""How often the long-context check's interval decides wrongly for a candidate whose true NLL increase sits exactly
on `max_nll_increase`, with as few documents as a window gets.

    .venv/bin/python benchmarks/bench_long_context_ci.py             # ~2 minutes on one core
    .venv/bin/python benchmarks/bench_long_context_ci.py --draws 4000

A window's check is the candidate's NLL summed over the window's tokens over the baseline's, minus one; the tokens
come in documents (8 by default, fewer for the far windows of a short set), and the documents differ in length, in
the baseline's NLL and in how much the candidate loses on them. PASS needs the 95% interval wholly below the limit,
FAIL wholly above: a candidate on the limit should pass at most 2.5% of the time and fail at most 2.5%. Each
scenario draws k documents and prints how often each interval

  passes    with its upper end below the true increase (a regression of exactly the limit let through);
  fails     with its lower end above it.

The intervals, on the same draws:
  bootstrap  the percentile bootstrap resampling whole documents (1,000 resamples): the rule before;
  t (CR2)    `stats.ratio_of_sums_ci`: a t interval on the bias-reduced cluster-robust variance with Bell-McCaffrey
             degrees of freedom, what the check uses now.
Scenarios: documents' increases spread normally (sd 0.02 around 0.05) or with heavy tails (t, 3 df), an increase
that grows with a document's length, and lengths from 50 to 4,096 tokens. Pure numpy/scipy; no model is loaded.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import numpy as np

from qgate.gates.stats import ratio_of_sums_ci

TRUE = 0.05
SCENARIOS = ("normal", "heavy tails", "grows with length", "lengths 50-4096")


def draw(rng, k: int, scenario: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """(candidate NLL, baseline NLL, document) per token of k documents, and the true increase they are drawn at."""
    low = 50 if scenario == "lengths 50-4096" else 500
    m = rng.integers(low, 4096, k)
    per_token = rng.normal(2.0, 0.4, k).clip(0.5)
    truth = TRUE
    if scenario == "heavy tails":
        inc = TRUE + 0.02 * rng.standard_t(3, k) / np.sqrt(3)
    elif scenario == "grows with length":  # the token-weighted increase is then above the documents' mean
        sd_m = (4096 - low) / np.sqrt(12)
        slope = 0.014 / sd_m
        inc = TRUE + slope * (m - (low + 4096) / 2) + 0.014 * rng.normal(size=k)
        truth = TRUE + slope * sd_m**2 / ((low + 4096) / 2)
    else:
        inc = rng.normal(TRUE, 0.02, k)
    doc = np.repeat(np.arange(k), m)
    base = rng.gamma(4.0, per_token[doc] / 4.0)
    cand = base * (1 + inc[doc]) + rng.normal(0, 0.3, doc.size)
    return cand, base, doc, truth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draws", type=int, default=1000, help="draws per scenario (Monte Carlo error ~0.5%% at 1000)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, numpy {np.__version__}; {args.draws} draws each")
    print("a candidate on the limit: each rate should be at most 0.025")
    print(f"{'docs':>4} {'scenario':18s} | {'bootstrap':>15} | {'t (CR2)':>15} | {'t df':>5}")
    print(f"{'':>4} {'':18s} | {'passes':>7} {'fails':>7} | {'passes':>7} {'fails':>7} |")
    t0 = time.perf_counter()
    worst = {"bootstrap": [0.0, 0.0], "t (CR2)": [0.0, 0.0]}
    for k, scenario in itertools.product((2, 3, 4, 6, 8, 13), SCENARIOS):
        counts = {name: np.zeros(2) for name in worst}
        dfs = []
        for _ in range(args.draws):
            cand, base, doc, truth = draw(rng, k, scenario)
            pick = rng.integers(0, k, (1000, k))  # resampling documents is resampling their sums
            resampled = np.bincount(doc, cand)[pick].sum(1) / np.bincount(doc, base)[pick].sum(1) - 1
            lo, hi = np.quantile(resampled, [0.025, 0.975])
            counts["bootstrap"] += [hi < truth, lo > truth]
            _, tlo, thi, ev = ratio_of_sums_ci(cand, base, doc)
            counts["t (CR2)"] += [thi - 1 < truth, tlo - 1 > truth]
            dfs.append(ev["df"])
        rates = {name: c / args.draws for name, c in counts.items()}
        for name, r in rates.items():
            worst[name] = [max(worst[name][0], r[0]), max(worst[name][1], r[1])]
        (bp, bf), (tp, tf) = rates.values()
        print(f"{k:4d} {scenario:18s} | {bp:7.3f} {bf:7.3f} | {tp:7.3f} {tf:7.3f} | {np.median(dfs):5.1f}")
    for name, (p, f) in worst.items():
        print(f"worst {name:9s}: passes {p:.3f} ({p / 0.025:.1f}x nominal), fails {f:.3f} ({f / 0.025:.1f}x)")
    print(f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
