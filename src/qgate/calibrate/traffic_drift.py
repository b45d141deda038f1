"""Traffic drift: has the traffic moved since the model was calibrated? Facet by facet, with the sampling noise.

    rows = traffic_drift(old_profile, new_profile, DriftConfig())   # one row per facet
    [r["verdict"] for r in rows]                                     # "ok" | "drift" | "inconclusive"

Each facet (prompt length, route, tenant, vocabulary, the share of records the sampler rejected, and the share of
requests that use tools) is a distribution; the distance is the Jensen-Shannon divergence in bits (0 = same mix, 1 =
disjoint). Two samples of the same traffic are never at distance 0, so each row also carries the divergence that
sampling alone produces at these sizes (the 99th percentile of a parametric
bootstrap from the pooled counts). A facet drifts when its divergence is above the spec's threshold and above
that noise; above the threshold but within the noise it is inconclusive (too little traffic to tell).
Words of one request co-vary, so for vocabulary a multinomial bootstrap understates the noise (on the demo traffic,
two halves of one log differ by JS 0.09 where it predicts 0.024); the noise there is measured instead, from each
profile's two content-hashed halves, scaled to the sizes compared.
The rejected share counts records the gates never see (malformed, or a kind of request qgate does not read, such as
a legacy function call): when it grows, production's evidence covers less of the traffic, though every other facet,
read from the records kept, stays where it was.
The tool-use share counts requests that offer tools or carry tool calls or results: traffic that turns to tool use
is traffic the calibration set holds little of. A profile written before the sampler read tool use counts none, and
its calibration set held no request with its tools.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qgate.calibrate.profile import _js
from qgate.errors import ConfigError

FACETS = ("length", "route", "tenant", "vocabulary", "rejected", "tool_use")
OTHER = "(other words)"


@dataclass(frozen=True)
class DriftConfig:
    """`drift:` in the pipeline spec."""

    max_js_length: float = 0.05  # bits; per facet: above this (and above sampling noise) is drift
    max_js_route: float = 0.05  # bits, for the route mix
    max_js_tenant: float = 0.05  # bits, for the tenant mix
    max_js_vocabulary: float = 0.1  # word mixes of two samples differ more: thousands of categories
    max_js_rejected: float = 0.05  # bits, for the share of records rejected (0% -> 10% is 0.052)
    max_js_tool_use: float = 0.05  # bits, for the share of requests read that use tools
    quality: bool = True  # re-gate production on a fresh shadow sample of the recent traffic
    auto_promote: bool = False  # drift run: promote the best passing recalibrated variant
    alias: str = "production"  # the version the job watches
    noise_draws: int = 200  # resamples that estimate each facet's sampling noise
    seed: int = 0  # of those resamples
    VERSION = 3

    def __post_init__(self):
        for f in FACETS:
            v = getattr(self, f"max_js_{f}")
            if not 0 < v <= 1:
                raise ConfigError(f"max_js_{f} must be in (0, 1] bits, got {v}")
        if self.noise_draws < 20:
            raise ConfigError(f"noise_draws must be >= 20, got {self.noise_draws}")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")


def facets(profile: dict) -> dict[str, tuple[dict, int]]:
    """Facet -> (counts, sample size in the facet's unit: requests, or words for vocabulary)."""
    n = int(profile["requests"])
    top = _with_tail(profile["unigrams"])  # the tail beyond the profile's top words keeps its mass
    stats = profile.get("stats") or {}  # a profile written before it kept the sampler's counts has none
    records, rejected = int(stats.get("records", 0)), int(stats.get("rejected", 0))
    read, tools = records - rejected, int(stats.get("tool_use", 0))
    return {
        "length": (profile["length_words"], n),
        "route": (profile["routes"], n),
        "tenant": (profile["tenants"], n),
        "vocabulary": (top, int(profile["unigrams"]["total"])),
        "rejected": ({"read": read, "rejected": rejected} if records else {}, records),
        "tool_use": ({"no tools": read - tools, "tools": tools} if read else {}, read),
    }


def sampling_noise(a: dict, b: dict, n_a: int, n_b: int, draws: int, seed: int) -> float:
    """99th percentile of the JS divergence between two samples of sizes n_a, n_b from the pooled distribution."""
    keys = sorted(set(a) | set(b))
    pooled = np.array([a.get(k, 0) + b.get(k, 0) for k in keys], dtype=float)
    if pooled.sum() == 0 or n_a == 0 or n_b == 0:
        return float("nan")
    p = pooled / pooled.sum()
    rng = np.random.default_rng(seed)
    xa, xb = rng.multinomial(n_a, p, size=draws), rng.multinomial(n_b, p, size=draws)  # [draws, K]
    js = [_js(dict(enumerate(x)), dict(enumerate(y))) for x, y in zip(xa, xb, strict=True)]
    return float(np.percentile(js, 99))


def _with_tail(u: dict) -> dict:
    top = dict(u["top"])
    top[OTHER] = max(int(u["total"]) - sum(top.values()), 0)
    return top


def split_half_noise(old: dict, new: dict) -> float | None:
    """Vocabulary noise measured, not modelled: the JS divergence between the two content-hashed halves of each
    profile's requests, scaled from half-vs-half sizes to old-vs-new sizes (the divergence of two samples grows as
    1/n1 + 1/n2), the larger of the two, times 1.5 for the spread around that expectation. None when a profile has
    no split."""
    n_old, n_new = int(old["requests"]), int(new["requests"])
    est = []
    for prof in (old, new):
        halves = prof["unigrams"].get("split_halves")
        if not halves or min(h["requests"] for h in halves) == 0:
            return None
        js = _js(_with_tail(halves[0]), _with_tail(halves[1]))
        scale = (1 / n_old + 1 / n_new) / (1 / halves[0]["requests"] + 1 / halves[1]["requests"])
        est.append(js * scale)
    return 1.5 * max(est)


def traffic_drift(old: dict, new: dict, cfg: DriftConfig) -> list[dict]:
    fo, fn = facets(old), facets(new)
    rows = []
    for f in FACETS:
        (a, n_a), (b, n_b) = fo[f], fn[f]
        js = _js(a, b)
        noise = sampling_noise(a, b, n_a, n_b, cfg.noise_draws, cfg.seed)
        unmeasured = False
        if f == "vocabulary":  # words of one request co-vary: the multinomial model understates the noise
            measured = split_half_noise(old, new)
            unmeasured = measured is None
            noise = noise if measured is None else max(noise, measured)
        limit = getattr(cfg, f"max_js_{f}")
        if js != js:
            verdict = "inconclusive"  # an empty facet: nothing to compare
            note = "nothing to compare: a profile holds no counts for this facet (written before profiles kept them)"
        elif js <= limit:
            verdict, note = "ok", ""
        elif js > noise and not unmeasured:  # above the limit and above the noise, which was measured
            verdict, note = "drift", ""
        else:
            verdict, note = "inconclusive", "above the limit but within the sampling noise: too little traffic to tell"
        if unmeasured:
            note = "noise not measured: a profile predates split halves (multinomial lower bound shown)"
        shift = _top_shifts(a, b)
        rows.append(
            {
                "facet": f,
                "js": js,
                "threshold": limit,
                "noise_p99": noise,
                "n_old": n_a,
                "n_new": n_b,
                "verdict": verdict,
                "top_shifts": shift,
                "note": note,
            }
        )
    return rows


def _top_shifts(a: dict, b: dict, k: int = 5) -> list[dict]:
    """The categories whose share moved most: what an on-call engineer reads first."""
    sa, sb = sum(a.values()) or 1, sum(b.values()) or 1
    keys = set(a) | set(b)
    moves = sorted(((b.get(c, 0) / sb - a.get(c, 0) / sa, c) for c in keys), key=lambda t: (-abs(t[0]), str(t[1])))[:k]
    return [{"category": str(c), "old": a.get(c, 0) / sa, "new": b.get(c, 0) / sb} for _, c in moves]
