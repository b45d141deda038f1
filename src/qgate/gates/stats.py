"""Paired statistics for gates: cluster bootstrap, exact McNemar, paired mean differences.

    lo, hi = cluster_bootstrap(values, clusters, lambda v: np.percentile(v, 99))
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

N_BOOT = 1000
SEED = 0


def cluster_bootstrap(values: np.ndarray, clusters: np.ndarray, stat: Callable[[np.ndarray], float],
                      n_boot: int = N_BOOT, level: float = 0.95, seed: int = SEED) -> tuple[float, float]:
    """Percentile CI resampling whole clusters (prompts): tokens of one prompt are not independent."""
    values = np.asarray(values)
    ids, inverse = np.unique(clusters, return_inverse=True)
    if len(ids) < 2:
        v = float(stat(values))
        return v, v
    order = np.argsort(inverse, kind="stable")
    bounds = np.searchsorted(inverse[order], np.arange(len(ids) + 1))
    groups = [values[order[bounds[i]:bounds[i + 1]]] for i in range(len(ids))]
    rng = np.random.default_rng(seed)
    stats = np.empty(n_boot)
    for b in range(n_boot):
        pick = rng.integers(0, len(groups), len(groups))
        stats[b] = stat(np.concatenate([groups[i] for i in pick]))
    a = (1 - level) / 2
    return float(np.quantile(stats, a)), float(np.quantile(stats, 1 - a))


def mcnemar_exact(base_correct: np.ndarray, cand_correct: np.ndarray) -> dict:
    """Exact two-sided McNemar test on discordant pairs, with the flip counts."""
    from scipy.stats import binomtest

    base_correct = np.asarray(base_correct, bool)
    cand_correct = np.asarray(cand_correct, bool)
    lost = int(np.sum(base_correct & ~cand_correct))    # baseline right, candidate wrong
    gained = int(np.sum(~base_correct & cand_correct))  # baseline wrong, candidate right
    p = 1.0 if lost + gained == 0 else float(binomtest(lost, lost + gained, 0.5).pvalue)
    n = len(base_correct)
    return {"lost": lost, "gained": gained, "n": n, "flip_rate": (lost + gained) / n if n else float("nan"), "p_value": p}


def paired_mean_ci(diff: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """Mean of paired differences with a t-interval."""
    from scipy.stats import t

    diff = np.asarray(diff, float)
    n = len(diff)
    m = float(diff.mean()) if n else float("nan")
    if n < 2:
        return m, m, m
    half = float(t.ppf(0.5 + level / 2, n - 1) * diff.std(ddof=1) / np.sqrt(n))
    return m, m - half, m + half


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    den = 1 + z * z / n
    c = (p + z * z / (2 * n)) / den
    h = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return float(c - h), float(c + h)
