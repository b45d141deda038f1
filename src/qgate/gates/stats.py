"""Paired statistics for gates: cluster bootstrap-t, ratios of sums over few clusters, clustered quantile intervals,
exact McNemar, paired accuracy differences and ratios, speed-ups from repeated timings.

mean, lo, hi, ev = cluster_bootstrap_t(values, clusters)             # a mean over many clusters (prompts)
ratio, lo, hi, ev = ratio_of_sums_ci(cand_nll, base_nll, documents)  # sum / sum over few clusters (documents)
lo, hi, ev = quantile_ci(values, clusters, 0.99)                     # hi is inf when the sample cannot bound it
min_effective_n(0.99)                                                # 368: fewer values never bound p99 above
ratio, lo, hi = time_ratio_ci([2.0, 2.1, 1.9], [1.0, 1.02, 0.98])    # a speed-up from timed passes of each side
m = passes_to_decide([2.0, 2.1, 1.9], [1.0, 1.02, 0.98], 2.1)        # passes of each that would decide it against 2.1
recovery, lo, hi = paired_ratio_ci(base_correct, cand_correct)       # candidate / baseline accuracy, paired items
"""

from __future__ import annotations

import numpy as np

N_BOOT = 1000
BOOT_MIN_CLUSTERS = 8  # fewer: too few distinct resamples to studentize (with 2, every one gives t = 0 or none)
SEED = 0
_HUGE = np.finfo(float).max


def quantile(values, q: float) -> float:
    """np.quantile's linear interpolation, with +inf values allowed (the KL of a position whose candidate logits
    define no distribution): interpolating toward one gives +inf, not NaN; on one exactly, the lower neighbour."""
    x = np.asarray(values, float)
    if not np.isposinf(x).any():
        return float(np.quantile(x, q))
    v = float(np.quantile(np.where(np.isposinf(x), _HUGE, x), q))
    return float("inf") if v > 1e300 else v


def _cluster_var(c: np.ndarray, d: np.ndarray, ratio) -> np.ndarray:
    """Cluster-robust variance of sum(c) / sum(d) over the last axis (clusters' sums c of values and d of weights):
    the clusters' linearized residuals c - ratio * d, with the k / (k - 1) small-sample factor."""
    k = c.shape[-1]
    return (k / max(k - 1, 1)) * np.sum((c - ratio * d) ** 2, -1) / np.sum(d, -1) ** 2


def cluster_sums(values: np.ndarray, clusters: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per cluster (in sorted cluster order): the sum of its values and its count of them, as floats."""
    ids, inv = np.unique(np.asarray(clusters), return_inverse=True)
    k = len(ids)
    return np.bincount(inv, np.asarray(values, float), k), np.bincount(inv, minlength=k).astype(float)


def cluster_resamples(c: np.ndarray, d: np.ndarray, n_boot: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n_boot resamples of whole clusters (cluster_sums' c and d), drawn with replacement: each one's mean and its
    cluster-robust standard error."""
    pick = np.random.default_rng(seed).integers(0, len(c), (n_boot, len(c)))
    cs, ds = c[pick], d[pick]
    means = cs.sum(1) / ds.sum(1)
    return means, np.sqrt(_cluster_var(cs, ds, means[:, None]))


def cluster_bootstrap_t(
    values: np.ndarray, clusters: np.ndarray, n_boot: int = N_BOOT, level: float = 0.95, seed: int = SEED
) -> tuple[float, float, float, dict]:
    """The mean of values grouped in clusters (positions in prompts), with a studentized bootstrap (bootstrap-t)
    interval that resamples whole clusters: each resample's mean less the sample's, over that resample's own
    cluster-robust standard error, and the sample's standard error times those t quantiles. Per-prompt KL and
    disagreement are skewed (a few prompts hold most of them), so an interval symmetric about the mean, or the
    percentile bootstrap, sits too close on the side where the rare heavy prompts are missing: the side that passes
    a candidate (benchmarks/bench_shadow_ci.py). A resample whose clusters all have the same mean has no spread to
    studentize by: where its mean is the sample's it is left out, and where it differs its t is infinite that way.
    Leaving those out would drop a tail: when a few prompts hold all the disagreement, the resamples that miss them
    are the ones above the mean. Where more than a tail's share of resamples has an infinite t, the bootstrap cannot
    place that end, and it is ratio_of_sums_ci's (evidence: `no_spread_share`, `ends_from`). Below BOOT_MIN_CLUSTERS
    clusters the whole interval is ratio_of_sums_ci's (a t interval on few clusters' degrees of freedom). Clusters
    whose means agree while the values vary give no interval (-inf, inf); values that never vary give [mean, mean].
    (mean, lo, hi, evidence with the percentile interval of the same resamples); lo, hi = -inf, inf with fewer than
    two clusters."""
    x = np.asarray(values, float)
    c, d = cluster_sums(x, clusters)
    k = len(c)
    mean = float(c.sum() / d.sum())
    ev: dict = {"clusters": int(k), "method": "cluster bootstrap-t"}
    if k < 2:
        return mean, float("-inf"), float("inf"), ev
    if not np.isfinite(mean):
        return mean, float("nan"), float("nan"), ev
    varies = bool(x.min() != x.max())
    if k < BOOT_MIN_CLUSTERS:
        _, lo, hi, cr2 = ratio_of_sums_ci(x, np.ones_like(x), clusters, level)
        ev |= {"method": "cluster-robust t (CR2): too few clusters to bootstrap"} | {
            key: cr2[key] for key in ("df", "se") if key in cr2
        }
        if varies and not lo < hi:  # clusters whose means agree by chance (0/1 values): no spread to read
            lo, hi = float("-inf"), float("inf")
        return mean, float(lo), float(hi), ev

    se = float(np.sqrt(_cluster_var(c, d, mean)))
    means, ses = cluster_resamples(c, d, n_boot, seed)
    a = (1 - level) / 2
    ev |= {"se": se, "percentile": [quantile(means, a), quantile(means, 1 - a)]}
    dev = means - mean
    flat = np.where(dev > 0, np.inf, np.where(dev < 0, -np.inf, np.nan))  # a resample without spread: its t
    t = np.divide(dev, ses, out=flat, where=ses > 0)
    if se == 0 or np.isnan(t).all():  # every cluster has the same mean: by chance, or nothing varies
        return (mean, float("-inf"), float("inf"), ev) if varies else (mean, mean, mean, ev)
    ev["no_spread_share"] = float(np.mean(ses <= 0))
    if np.isinf(t).any():  # order statistics, each on its outer side: no interpolation toward an infinite t
        t_lo, t_hi = np.nanquantile(t, a, method="lower"), np.nanquantile(t, 1 - a, method="higher")
    else:
        t_lo, t_hi = np.nanquantile(t, [a, 1 - a])
    lo, hi = float(mean - t_hi * se), float(mean - t_lo * se)
    if not (np.isfinite(lo) and np.isfinite(hi)):  # that end's tail is resamples without spread
        _, cr2_lo, cr2_hi, cr2 = ratio_of_sums_ci(x, np.ones_like(x), clusters, level)
        ev["ends_from"] = f"cluster-robust t (CR2, df {cr2.get('df')}): the bootstrap cannot place " + " and ".join(
            side for side, end in (("the lower end", lo), ("the upper end", hi)) if not np.isfinite(end)
        )
        lo, hi = (lo if np.isfinite(lo) else float(cr2_lo)), (hi if np.isfinite(hi) else float(cr2_hi))
    return mean, lo, hi, ev


def ratio_of_sums_ci(
    num: np.ndarray, den: np.ndarray, clusters: np.ndarray, level: float = 0.95
) -> tuple[float, float, float, dict]:
    """sum(num) / sum(den) over values grouped in clusters (tokens in documents), with an interval that holds its
    level with few clusters. Per cluster, the ratio's linearized residual (its own ratio less the whole one, weighted
    by its share of den); their bias-reduced cluster-robust variance (CR2) and Bell & McCaffrey's Satterthwaite
    degrees of freedom for it (Bell & McCaffrey, 2002, Survey Methodology 28:169; Imbens & Kolesar, 2016, REStat
    98:701), then a t interval. A percentile bootstrap over k clusters is far too narrow for small k: with 2 clusters
    its "95%" interval is the two clusters' own ratios, which miss the truth half the time. (ratio, lo, hi,
    evidence); lo and hi are NaN with fewer than two clusters, or when one cluster holds all of den."""
    from scipy.stats import t as student_t

    ids, inv = np.unique(np.asarray(clusters), return_inverse=True)
    k = len(ids)
    c, d = np.bincount(inv, np.asarray(num, float), k), np.bincount(inv, np.asarray(den, float), k)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = float(c.sum() / d.sum())
        w = d / d.sum()  # each cluster's share of the denominator
        r = np.where(w > 0, c / np.where(d != 0, d, 1) - ratio, 0.0)
    ev = {"clusters": int(k), "method": "cluster-robust-t (CR2, Bell-McCaffrey df)"}
    if k < 2 or not np.isfinite(ratio) or not np.isfinite(r).all() or w.max() >= 1 - 1e-12:
        return ratio, float("nan"), float("nan"), ev
    a2 = w**2 / (1 - w)  # CR2: each residual over its leverage's complement, the leverage of a weighted mean being w
    se = float(np.sqrt(np.sum(a2 * r**2)))
    # Satterthwaite: the variance estimate is x' Q x in the clusters' ratios x, with Q = M' diag(a2) M and residuals
    # M x = x - w'x. Q = diag(a2) + B C B' for B = [w, a2], C = cm = [[sum(a2), -1], [-1, 0]]: traces in O(k).
    b, cm = np.stack([w, a2], 1), np.array([[a2.sum(), -1.0], [-1.0, 0.0]])
    cg = cm @ (b.T @ b)
    tr_q = a2.sum() - 2 * np.sum(w * a2) + a2.sum() * np.sum(w * w)
    tr_q2 = np.sum(a2 * a2) + 2 * np.trace(cm @ (b.T @ (a2[:, None] * b))) + np.trace(cg @ cg)
    df = float(tr_q**2 / tr_q2)
    half = float(student_t.ppf((1 + level) / 2, df)) * se
    return ratio, ratio - half, ratio + half, ev | {"df": round(df, 2), "se": se}


def min_effective_n(q: float, level: float = 0.95) -> int:
    """The effective sample size below which quantile_ci cannot bound the q-quantile from above: the sample maximum
    is a (1+level)/2 upper bound only from there (368 for p99, 3,688 for p99.9 at 95%)."""
    return int(np.ceil(np.log((1 - level) / 2) / np.log(q)))


def quantile_ci(
    values: np.ndarray,
    clusters: np.ndarray,
    q: float,
    level: float = 0.95,
    cluster_name: str = "clusters",
    design_df: float | None = None,
) -> tuple[float, float, dict]:
    """Distribution-free interval for the q-quantile of clustered samples (tokens within prompts).

    Order-statistic (binomial, Clopper-Pearson) ranks on an effective sample size m, mapped back through the
    empirical quantile function: the upper rank r at r / m, the lower at r / (m + 1), where the r-th of m draws
    sits on average (at r / m a small m's lower end would be the sample maximum). The effective size is Korn &
    Graubard's (1998, Survey Methodology 24:193): n / deff, where the design effect deff (at least 1) comes from
    the per-cluster counts above the estimate (a ratio estimator), not from n independent tokens, times (z / t)^2
    for the t quantile on the variance's degrees of freedom, `design_df` (the clusters less one unless given; inf:
    no adjustment), since that variance is estimated from the clusters. A percentile bootstrap of an extreme
    quantile collapses onto a few repeated tail values; this does not. When even the sample maximum is not a
    (1+level)/2 upper bound (n_eff < log((1-level)/2) / log(q): 368 for p99, 3,688 for p99.9 at 95%), the upper
    end is +inf: such a check can fail, never pass. The evidence then says how many values (`n_to_bound`) and
    clusters (`clusters_to_bound`) would reach that effective n at this design effect. One cluster has no degrees
    of freedom and bounds nothing, on either side.
    """
    from scipy.stats import binom, norm
    from scipy.stats import t as student_t

    x = np.asarray(values, float)
    n = len(x)
    if n == 0:
        return float("nan"), float("nan"), {"n": 0}
    est = quantile(x, q)
    above = (x > est).astype(float)
    ids, inv = np.unique(np.asarray(clusters), return_inverse=True)
    k = len(ids)
    tot, size = np.bincount(inv, above, k), np.bincount(inv, minlength=k).astype(float)
    p_hat = float(above.mean())
    var_cluster = _cluster_var(tot, size, p_hat)
    var_iid = p_hat * (1 - p_hat) / n
    deff = float(max(var_cluster / var_iid, 1.0)) if var_iid > 0 else 1.0
    a = (1 - level) / 2
    df = float(k - 1 if design_df is None else design_df)
    if df == np.inf:
        t_over_z = 1.0
    elif df > 0:
        t_over_z = float(student_t.ppf(1 - a, df) / norm.ppf(1 - a))
    else:
        t_over_z = np.inf
    m = max(int(n / (deff * t_over_z**2)), 1)  # effective n
    need = min_effective_n(q, level)
    lo_rank, hi_rank = int(binom.ppf(a, m, q)), int(binom.ppf(1 - a, m, q)) + 1  # 1-based ranks among m
    lo = quantile(x, lo_rank / (m + 1)) if lo_rank >= 1 else float(x.min())
    hi = quantile(x, hi_rank / m) if hi_rank <= m else float("inf")
    if not np.isfinite(t_over_z):  # one cluster: nothing about the others, below as above
        lo = float("-inf")
    ev = {
        "n": n,
        "clusters": int(k),
        "tail_count": int(above.sum()),
        "tail_clusters": int(np.sum(tot > 0)),
        "design_effect": round(deff, 3),
        "design_df": df,
        "n_effective": m,
        "min_n_effective": need,
        "method": "order-statistic-clustered (Korn-Graubard)",
    }
    if hi_rank > m:  # the sample's size, not its values (an infinite KL is a bound reached), leaves it open
        ev["n_to_bound"], ev["clusters_to_bound"] = int(np.ceil(n * need / m)), int(np.ceil(k * need / m))
        ev["unbounded_because"] = (
            f"effective n {m} < {need}: the sample cannot bound p{100 * q:g} from above; at this design effect about "
            f"{ev['clusters_to_bound']} {cluster_name} ({ev['n_to_bound']} values) would bound it"
        )
    return lo, hi, ev


def mcnemar_exact(base_correct: np.ndarray, cand_correct: np.ndarray) -> dict:
    """Exact McNemar tests on the discordant pairs, with the flip counts: `p_value` two-sided, `p_loss` one-sided
    (the chance of at least `lost` losses among the flipped items if losing and gaining were equally likely)."""
    from scipy.stats import binomtest

    base_correct = np.asarray(base_correct, bool)
    cand_correct = np.asarray(cand_correct, bool)
    lost = int(np.sum(base_correct & ~cand_correct))  # baseline right, candidate wrong
    gained = int(np.sum(~base_correct & cand_correct))  # baseline wrong, candidate right
    flipped = lost + gained
    p = 1.0 if flipped == 0 else float(binomtest(lost, flipped, 0.5).pvalue)
    p_loss = 1.0 if flipped == 0 else float(binomtest(lost, flipped, 0.5, alternative="greater").pvalue)
    n = len(base_correct)
    return {
        "lost": lost,
        "gained": gained,
        "n": n,
        "flip_rate": flipped / n if n else float("nan"),
        "p_value": p,
        "p_loss": p_loss,
    }


def agresti_min(base_correct: np.ndarray, cand_correct: np.ndarray) -> tuple[float, float]:
    """The Agresti-Min estimate of the paired accuracy difference (candidate - baseline) and its standard error:
    0.5 added to each cell of the paired 2x2 table (Agresti & Min, 2005, Biometrics 61:515)."""
    b, c = np.asarray(base_correct, bool), np.asarray(cand_correct, bool)
    gained, lost = float(np.sum(~b & c)) + 0.5, float(np.sum(b & ~c)) + 0.5
    m = len(b) + 2.0
    return (gained - lost) / m, float(np.sqrt(max((gained + lost) - (gained - lost) ** 2 / m, 0.0)) / m)


def paired_binary_ci(
    base_correct: np.ndarray, cand_correct: np.ndarray, z: float = 1.959964
) -> tuple[float, float, float]:
    """Observed difference in accuracy (candidate - baseline) of paired right/wrong items, with the Agresti-Min
    interval (`agresti_min` +- z standard errors). Unlike a t-interval on the differences, it never has zero width:
    with no discordant item among n it still spans about +-2/(n+2), since n agreements cannot rule out a loss
    smaller than that."""
    b, c = np.asarray(base_correct, bool), np.asarray(cand_correct, bool)
    if len(b) == 0:
        return float("nan"), float("nan"), float("nan")
    d, se = agresti_min(b, c)
    base = float(b.mean())  # the candidate's accuracy lies in [0, 1], so the difference in [-base, 1 - base]
    return float(c.mean()) - base, float(max(d - z * se, -base)), float(min(d + z * se, 1.0 - base))


def _paired_table(base_correct: np.ndarray, cand_correct: np.ndarray) -> tuple[int, int, int, int]:
    """(both right, gained: only the candidate right, lost: only the baseline right, n)."""
    b, c = np.asarray(base_correct, bool), np.asarray(cand_correct, bool)
    return int(np.sum(b & c)), int(np.sum(~b & c)), int(np.sum(b & ~c)), len(b)


def paired_ratio_score(base_correct: np.ndarray, cand_correct: np.ndarray, ratio: float, skew: bool = False) -> float:
    """The score statistic for "candidate accuracy / baseline accuracy = ratio" on paired right/wrong items: about
    N(0, 1) at the true ratio, positive when the observed ratio is above `ratio`. Tang's asymptotic score (Tang,
    Tang & Chan, 2003, Stat Med 22:1217): the candidate's right count less ratio x the baseline's, over its standard
    error at the table's maximum-likelihood cells under that null. skew: with the skewness correction of Gart & Nam,
    as Laud generalised it (2017, Pharm Stat 16:334), for a ratio below 1 where the items flip mostly one way."""
    return _ratio_score(*_paired_table(base_correct, cand_correct), ratio, skew)


def _ratio_score(both: int, gained: int, lost: int, n: int, ratio: float, skew: bool) -> float:
    a = n * (1 + ratio)
    b = (both + lost) * ratio**2 - (both + gained + 2 * lost)
    c = lost * (1 - ratio) * (both + gained + lost) / n
    q_lost = (-b + np.sqrt(max(b * b - 4 * a * c, 0.0))) / (2 * a)  # the cells' maximum likelihood under the null
    some = (both + gained + lost) / n
    q_both, q_gained = (some - (1 + ratio) * q_lost) / ratio, (q_lost + (ratio - 1) * some) / ratio
    # an item adds (candidate right) - ratio x (baseline right): 1 - ratio, 1, -ratio or 0
    var = n * (q_both * (1 - ratio) ** 2 + q_gained + q_lost * ratio**2)
    num = (both + gained) - ratio * (both + lost)
    if var <= 0:  # no spread left under this null: only the sign of the difference counts
        return float(np.sign(num) * np.inf) if num else 0.0
    t = num / np.sqrt(var)
    if not skew:
        return float(t)
    g6 = n * (q_both * (1 - ratio) ** 3 + q_gained - q_lost * ratio**3) / var**1.5 / 6  # skewness / 6
    # the corrected z solves z = t - g6 (z^2 - 1): its root near t, in a form that stays exact as g6 -> 0
    return float(2 * (t + g6) / (1 + np.sqrt(max(1 + 4 * g6 * (t + g6), 0.0))))


def paired_ratio_ci(
    base_correct: np.ndarray, cand_correct: np.ndarray, z: float = 1.959964
) -> tuple[float, float, float]:
    """Candidate accuracy / baseline accuracy on paired right/wrong items, with an interval whose each end is a
    one-sided bound at (1 - level) / 2: the lower end the smallest ratio that Tang's score (`paired_ratio_score`)
    does not reject, the upper end the largest that its skewness-corrected form does not. Where the true ratio sits
    on a threshold, each end crosses it by mistake about as often as nominal, whether the items flip both ways or
    one way, few or many; the uncorrected score's upper end, the corrected score's lower end, and an accuracy
    difference's interval divided by the baseline's accuracy (as if that accuracy were known) cross it more often
    (benchmarks/bench_recovery_ci.py). Never of zero width: with no discordant item it still spans the ratios that
    as many agreements cannot rule out. (ratio, lo, hi); NaN when the baseline gets no item right."""
    table = _paired_table(base_correct, cand_correct)
    both, gained, lost, _ = table
    if both + lost == 0:
        return float("nan"), float("nan"), float("nan")
    est = (both + gained) / (both + lost)
    lo = 0.0 if both + gained == 0 else _score_root(table, z, est, False, 0.5)
    return float(est), lo, _score_root(table, -z, max(est, 1e-6), True, 2.0)


def _score_root(table: tuple[int, int, int, int], target: float, start: float, skew: bool, step: float) -> float:
    """The ratio at which the score crosses `target`, searched outward from `start` by factors of `step` (0.5: the
    lower end, where the score falls to `target` from above; 2: the upper end, from below)."""
    from scipy.optimize import brentq

    def f(ratio: float) -> float:
        return _ratio_score(*table, ratio, skew) - target

    def near(ratio: float) -> bool:  # on the estimate's side of the root
        return f(ratio) < 0 if step < 1 else f(ratio) > 0

    inside = start
    while not near(inside) and 1e-9 < inside < 1e9:  # a table so skewed that its estimate is rejected
        inside /= step
    outside = inside * step
    while near(outside) and 1e-9 < outside < 1e9:
        inside, outside = outside, outside * step
    if not 1e-9 < outside < 1e9:
        return 0.0 if step < 1 else float("inf")
    return float(brentq(f, min(inside, outside), max(inside, outside), xtol=1e-14))


def _log_ratio(base_seconds, cand_seconds, paired: bool) -> tuple[float, float | None, float | None]:
    """(mean log ratio, its standard error, its degrees of freedom) of timed passes (time_ratio_ci); the standard
    error and df are None when a side has fewer than two passes."""
    lb, lc = np.log(np.asarray(base_seconds, float)), np.log(np.asarray(cand_seconds, float))
    d = float(lb.mean() - lc.mean())
    if min(len(lb), len(lc)) < 2:
        return d, None, None
    if paired:
        diff = lb - lc
        return d, float(diff.std(ddof=1) / np.sqrt(len(diff))), len(diff) - 1
    vb, vc = lb.var(ddof=1) / len(lb), lc.var(ddof=1) / len(lc)
    se = float(np.sqrt(vb + vc))
    df = se**4 / (vb**2 / (len(lb) - 1) + vc**2 / (len(lc) - 1)) if se > 0 else 1  # Welch-Satterthwaite
    return d, se, float(df)


def time_ratio_ci(base_seconds, cand_seconds, paired: bool = False, level: float = 0.95) -> tuple[float, float, float]:
    """A speed-up (baseline time / candidate time) from repeated timed passes of each: the ratio of their geometric
    means, with a t interval on the log times (a time's jitter is multiplicative). paired: pass k of each side was
    timed in turn with the other's, so a drift of the host over the passes cancels in their ratio (a paired t on the
    log ratios); otherwise Welch's. (ratio, lo, hi); lo and hi are NaN when a side has fewer than two passes, whose
    spread could not be read."""
    from scipy.stats import t as student_t

    d, se, df = _log_ratio(base_seconds, cand_seconds, paired)
    if se is None:
        return float(np.exp(d)), float("nan"), float("nan")
    if se == 0:
        return float(np.exp(d)), float(np.exp(d)), float(np.exp(d))
    half = float(student_t.ppf((1 + level) / 2, df)) * se
    return float(np.exp(d)), float(np.exp(d - half)), float(np.exp(d + half))


def passes_to_decide(
    base_seconds, cand_seconds, threshold: float, paired: bool = False, level: float = 0.95, most: int = 100_000
) -> int | None:
    """Roughly how many timed passes of each model would put time_ratio_ci's interval wholly on one side of the
    speed-up `threshold`: the fewest m at which the t interval's half width on the log times, its standard error
    shrinking as 1/sqrt(m) and its degrees of freedom growing with m (paired: m - 1; Welch: the df at hand scaled
    as the passes are), is at most the log ratio's distance to the log threshold. With few passes the t quantile
    falls as passes are added (4.30 at 2 df, 2.04 at 30), so the standard error alone would name too many. None
    where the spread cannot be read, or the ratio is the threshold; `most` when not even that many would do."""
    from scipy.stats import t as student_t

    d, se, df = _log_ratio(base_seconds, cand_seconds, paired)
    if se is None or se <= 0 or not threshold > 0:
        return None
    gap, n = abs(d - float(np.log(threshold))), min(len(base_seconds), len(cand_seconds))
    if gap == 0:
        return None
    q = (1 + level) / 2

    def decides(m: int) -> bool:
        dfm = m - 1 if paired else df * (m - 1) / (n - 1)
        return float(student_t.ppf(q, dfm)) * se * np.sqrt(n / m) <= gap

    lo, hi = n, n
    while not decides(hi):  # the first power-of-two multiple that decides, then bisect below it
        if hi >= most:
            return most
        lo, hi = hi, min(hi * 2, most)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if not decides(mid) else (lo, mid)
    return hi


def holm(p_values: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (step-down; family-wise error at most alpha when each is compared to
    alpha), in the order given."""
    m = len(p_values)
    adjusted, running = [1.0] * m, 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    den = 1 + z * z / n
    c = (p + z * z / (2 * n)) / den
    h = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return float(c - h), float(c + h)
