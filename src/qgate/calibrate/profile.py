"""Traffic profile: what the traffic looked like, so drift can be measured later.

    prof = TrafficProfiler(); prof.add(request, text); profile = prof.result()
    (drift between two profiles: calibrate/drift.py)

Tokens here are model-independent words (lowercased \\w+ runs and punctuation), so
profiles taken before and after a model change still compare.
"""
from __future__ import annotations

import hashlib
import math
import re
from collections import Counter

import numpy as np

LENGTH_EDGES = (0, 16, 64, 256, 1024)   # words; the last bucket is open-ended
TOP_UNIGRAMS = 2000
_WORD = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def length_bucket(n_words: int) -> str:
    for lo, hi in zip(LENGTH_EDGES, LENGTH_EDGES[1:]):
        if n_words < hi:
            return f"{lo}-{hi}"
    return f"{LENGTH_EDGES[-1]}+"


BUCKETS = tuple(length_bucket(e) for e in LENGTH_EDGES)


class TrafficProfiler:
    """Accumulates a profile over a stream in bounded memory (unigram counts are pruned)."""

    def __init__(self) -> None:
        self.n = 0
        self.lengths: Counter = Counter()
        self.routes: Counter = Counter()
        self.tenants: Counter = Counter()
        self.unigrams: Counter = Counter()
        self.total_words = 0
        # the vocabulary again, split in two halves of the requests: how far two samples of this same traffic differ,
        # with words of one request co-varying as they do (calibrate/drift.py scales it to the sizes compared)
        self.split: list[Counter] = [Counter(), Counter()]
        self.split_n = [0, 0]
        self.events: list[tuple[float, float | None]] = []   # (ts, latency_ms); capped below
        self._max_events = 200_000

    def add(self, route: str, tenant: str, tokens: list[str], ts: float | None, latency_ms: float | None) -> None:
        self.n += 1
        self.lengths[length_bucket(len(tokens))] += 1
        self.routes[route] += 1
        self.tenants[tenant] += 1
        self.unigrams.update(tokens)
        self.total_words += len(tokens)
        half = hashlib.blake2b(" ".join(tokens).encode(), digest_size=1).digest()[0] & 1   # by content: order-independent
        self.split[half].update(tokens)
        self.split_n[half] += 1
        if len(self.unigrams) > 20 * TOP_UNIGRAMS:  # keep memory bounded on huge logs
            self.unigrams = Counter(dict(self.unigrams.most_common(5 * TOP_UNIGRAMS)))
            self.split = [Counter(dict(c.most_common(5 * TOP_UNIGRAMS))) for c in self.split]
        if ts is not None and len(self.events) < self._max_events:
            self.events.append((ts, latency_ms))

    def result(self) -> dict:
        return {
            "version": 1,
            "requests": self.n,
            "length_words": {b: self.lengths.get(b, 0) for b in BUCKETS},
            "routes": dict(self.routes.most_common()),
            "tenants": dict(self.tenants.most_common(50)),
            "unigrams": {"total": self.total_words, "top": dict(self.unigrams.most_common(TOP_UNIGRAMS)),
                         "split_halves": [{"requests": n, "total": sum(c.values()), "top": dict(c.most_common(TOP_UNIGRAMS))}
                                          for n, c in zip(self.split_n, self.split, strict=True)]},
            "concurrency": concurrency(self.events),
        }


def concurrency(events: list[tuple[float, float | None]]) -> dict:
    """In-flight requests over time.

    With latencies, concurrency is exact: requests whose [ts, ts+latency) covers each arrival.
    Without, it is the peak-arrivals-per-second proxy, and says so in `method`.
    """
    if not events:
        return {"method": "none", "p50": 1, "p90": 1, "p99": 1, "max": 1, "samples": 0}
    ts = np.array(sorted(e[0] for e in events))
    if all(e[1] is not None for e in events):
        spans = sorted((e[0], e[0] + e[1] / 1000.0) for e in events)
        starts = np.array([s for s, _ in spans])
        ends = np.sort(np.array([e for _, e in spans]))
        in_flight = np.arange(1, len(starts) + 1) - np.searchsorted(ends, starts, side="right")
        method = "in-flight from ts+latency_ms"
    else:
        seconds = np.floor(ts - ts[0]).astype(np.int64)
        in_flight = np.bincount(seconds)
        in_flight = in_flight[in_flight > 0]
        method = "arrivals per second (no latency_ms in log)"
    q = lambda p: int(max(1, math.ceil(float(np.percentile(in_flight, p)))))  # noqa: E731
    return {"method": method, "p50": q(50), "p90": q(90), "p99": q(99), "max": int(in_flight.max()), "samples": int(len(in_flight))}


def _js(a: dict, b: dict) -> float:
    keys = sorted(set(a) | set(b))
    p = np.array([a.get(k, 0) for k in keys], dtype=float)
    q = np.array([b.get(k, 0) for k in keys], dtype=float)
    if p.sum() == 0 or q.sum() == 0:
        return float("nan")
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2
    return 0.5 * _kl2(p, m) + 0.5 * _kl2(q, m)


def _kl2(x: np.ndarray, y: np.ndarray) -> float:
    """KL in bits over the support of x (y > 0 there because y is a mixture containing x)."""
    s = x > 0
    return float(np.sum(x[s] * np.log2(x[s] / y[s])))
