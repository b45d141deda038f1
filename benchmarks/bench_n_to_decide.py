"""How often an INCONCLUSIVE shadow check is decided once the split grows to the size its row names (`n_to_decide`,
"~N items would decide it"), for two ways of naming it from the interval at hand:

  half width   n x (half the interval's width / the observed value's distance to the threshold)^2;
  facing side  n x (the observed value's distance to the interval's end that faces the threshold / its distance to
               the threshold)^2: only that end crosses, and the intervals of skewed statistics are not symmetric.
               This is what gates/result.py computes.

Per-prompt KL is drawn skewed (lognormal prompt levels, exponential positions around them), 48 prompts of 40
positions, with the threshold above the truth (a good candidate, which the upper end must clear) or below it (a bad
one). For each inconclusive draw, a new split of the named size is drawn and gated; the share decided is printed per
estimate, with the median size named as a multiple of 48 prompts. A size named as the median of what decides it
decides about half the time.

The perf check's speed-up, from 3 timed passes of each model (5% log-normal jitter; in turn, a host drift of 10%
shared by a round's two passes), is named two ways too: `se only`, its log interval's half width scaled as
1/sqrt(n), and `t-aware` (stats.passes_to_decide, what gates/perf.py names), where the t quantile also falls as
passes are added.

    .venv/bin/python benchmarks/bench_n_to_decide.py              # every row, 100 draws each; ~30 s
    .venv/bin/python benchmarks/bench_n_to_decide.py --draws 300 --seed 1
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from qgate.gates.result import GateResult
from qgate.gates.stats import cluster_bootstrap_t, passes_to_decide, quantile_ci, time_ratio_ci

PROMPTS, PER, CAP = 48, 40, 4000  # the split, positions per prompt, the largest split drawn


def draw(rng, prompts: int) -> tuple[np.ndarray, np.ndarray]:
    level = rng.lognormal(-4.0, 1.2, prompts)
    return rng.exponential(np.repeat(level, PER)), np.repeat(np.arange(prompts), PER)


def gate(metric: str, x: np.ndarray, c: np.ndarray, threshold: float) -> GateResult:
    if metric == "kl_mean":
        m, lo, hi, _ = cluster_bootstrap_t(x, c)
    else:
        m = float(np.quantile(x, 0.99))
        lo, hi, _ = quantile_ci(x, c, 0.99)
    return GateResult.check("shadow", metric, m, threshold, False, len(np.unique(c)), (lo, hi))


def named(r: GateResult, how: str) -> int | None:
    """The size `how` names for the row r: the facing side's is the row's own count (gates/result.py)."""
    if how == "facing side":
        return r.n_to_decide
    half, gap = (r.ci[1] - r.ci[0]) / 2, abs(r.threshold - r.observed)
    return math.ceil(r.n * (half / gap) ** 2) if math.isfinite(half) and half > 0 and gap > 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draws", type=int, default=100, help="inconclusive draws per row")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    hows = ("half width", "facing side")
    print(f"{'check':8s} {'candidate':9s} {'estimate':12s} {'median n / 48':>13s} {'decided':>9s}")
    for metric in ("kl_mean", "kl_p99"):
        big, _ = draw(np.random.default_rng(99), 200_000)
        truth = float(big.mean()) if metric == "kl_mean" else float(np.quantile(big, 0.99))
        for mult, who in ((1.35, "good"), (0.75, "bad")):
            threshold, tried = truth * mult, 0
            sizes: dict[str, list[int]] = {h: [] for h in hows}
            decided = dict.fromkeys(hows, 0)
            while tried < args.draws:
                x, c = draw(rng, PROMPTS)
                r = gate(metric, x, c, threshold)
                ns = {h: named(r, h) for h in hows}
                if r.verdict != "inconclusive" or None in ns.values():
                    continue
                tried += 1
                for h, n in ns.items():
                    sizes[h].append(n)
                    y, cy = draw(rng, min(n, CAP))
                    decided[h] += gate(metric, y, cy, threshold).verdict != "inconclusive"
            for h in hows:
                print(f"{metric:8s} {who:9s} {h:12s} {np.median(sizes[h]) / PROMPTS:13.2f} {decided[h] / tried:9.2f}")
    perf_rows(rng, args.draws)


def perf_rows(rng, draws: int) -> None:
    """The speed-up rows: true speed-ups just above and below a threshold of 1.2, apart (Welch) and in turn."""

    def passes(k: int, true: float, paired: bool) -> tuple[np.ndarray, np.ndarray]:
        drift = np.exp(rng.normal(0, 0.1, k)) if paired else 1.0
        return 13.0 * np.exp(rng.normal(0, 0.05, k)) * drift, 13.0 / true * np.exp(rng.normal(0, 0.05, k)) * drift

    threshold = 1.2
    print(f"{'perf':8s} {'timing':9s} {'true':>5s} {'estimate':12s} {'median passes':>13s} {'decided':>9s}")
    for paired in (False, True):
        for true in (1.25, 1.15):
            tried, sizes, decided = 0, {"se only": [], "t-aware": []}, {"se only": 0, "t-aware": 0}
            while tried < draws:
                b, c = passes(3, true, paired)
                ratio, lo, hi = time_ratio_ci(b, c, paired)
                if not lo < threshold < hi:
                    continue
                tried += 1
                half, gap = math.log(hi / lo) / 2, abs(math.log(ratio / threshold))
                ns = {"se only": math.ceil(3 * (half / gap) ** 2), "t-aware": passes_to_decide(b, c, threshold, paired)}
                for how, m in ns.items():
                    sizes[how].append(m)
                    _, lo2, hi2 = time_ratio_ci(*passes(min(m, CAP), true, paired), paired)
                    decided[how] += not lo2 < threshold < hi2
            for how in sizes:
                print(
                    f"{'perf':8s} {'in turn' if paired else 'apart':9s} {true:5.2f} {how:12s} "
                    f"{np.median(sizes[how]):13.0f} {decided[how] / tried:9.2f}"
                )


if __name__ == "__main__":
    main()
