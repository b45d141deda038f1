"""Traffic profile: what the traffic looked like, so drift can be measured later.

    prof = TrafficProfiler(); prof.add(route, tenant, words(text), ts, latency_ms); prof.merge(other); prof.result()
    (drift between two profiles: calibrate/traffic_drift.py)

Tokens here are model-independent words (lowercased \\w+ runs and punctuation), so profiles taken before and
after a model change still compare. Every request the model would serve is profiled, repeats included.
Memory is bounded whatever the log's size, and profiles of partitions merge:
- length buckets and routes are exact counters (routes are strata: a handful of labels);
- tenants and word counts are heavy-hitter sketches (calibrate/sketches.py), exact up to 12,288 distinct items and
  within `max_error` counts beyond; `result()["estimates"]` says which;
- concurrency is an exact histogram of in-flight counts (bounded by the peak concurrency, not by the log), computed
  per partition in time order (a 10,000-request reorder window absorbs late writes; requests further out of order
  are counted in `out_of_order`). An in-flight count is an integer, so a histogram is exact where a quantile sketch
  (KLL) would be approximate and, with its random compactions, not reproducible run to run.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections import Counter

import numpy as np

from qgate.calibrate.sketches import HeavyHitters
from qgate.calibrate.words import word_table, words  # noqa: F401  (profile.words: the definition the profile counts)

LENGTH_EDGES = (0, 16, 64, 256, 1024)  # words; the last bucket is open-ended
TOP_UNIGRAMS = 2000
TOP_TENANTS = 50
REORDER_WINDOW = 10_000


def length_bucket(n_words: int) -> str:
    for lo, hi in zip(LENGTH_EDGES, LENGTH_EDGES[1:]):
        if n_words < hi:
            return f"{lo}-{hi}"
    return f"{LENGTH_EDGES[-1]}+"


BUCKETS = tuple(length_bucket(e) for e in LENGTH_EDGES)


class Concurrency:
    """In-flight requests over time, streamed in timestamp order: a histogram of the in-flight count at each arrival
    (from ts + latency_ms), and of arrivals per second (the proxy when a log has no latencies).

    Requests enter a reorder buffer of `window` requests; once it is full, the earliest (by timestamp, then log
    order) leaves it and arrives. Requests that come in timestamp order (a production log, nearly always) are
    vectorized; the others go one by one through a heap (the tests hold both equal to a one-request-at-a-time
    reference on shuffled, tied and latency-less timestamps)."""

    def __init__(self, window: int = REORDER_WINDOW) -> None:
        self.size = window
        self.win_ts = np.zeros(0)  # reorder buffer, in arrival order (timestamp, then log order)
        self.win_lat = np.zeros(0)  # latency_ms, NaN where absent
        self.ends: list[float] = []  # end times of requests still in flight (a heap)
        self.last_ts = -math.inf
        self.second: int | None = None  # the second being counted, and its arrivals
        self.in_second = 0
        self.in_flight: Counter = Counter()  # in-flight count at an arrival -> arrivals
        self.per_second: Counter = Counter()  # arrivals in a second -> seconds
        self.timed = 0  # requests with a timestamp
        self.no_latency = 0
        self.out_of_order = 0

    def add_batch(self, ts: np.ndarray, latency_ms: np.ndarray) -> None:
        """Requests in log order (float64 arrays, NaN where absent), as if they came one at a time."""
        timed = ~np.isnan(ts)
        ts, lat = ts[timed], latency_ms[timed]
        if not len(ts):
            return
        self.timed += len(ts)
        self.no_latency += int(np.isnan(lat).sum())
        if np.all(ts[1:] >= ts[:-1]) and (not len(self.win_ts) or self.win_ts[-1] <= ts[0]):
            # every request ranks after the whole buffer: it leaves in order, first in first out
            all_ts, all_lat = np.concatenate((self.win_ts, ts)), np.concatenate((self.win_lat, lat))
            cut = max(0, len(all_ts) - self.size)
            self.win_ts, self.win_lat = all_ts[cut:], all_lat[cut:]
            return self._arrive_run(all_ts[:cut], all_lat[:cut])
        window = [(t, k, la) for k, (t, la) in enumerate(zip(self.win_ts.tolist(), self.win_lat.tolist(), strict=True))]
        seq, gone = len(window), []
        for t, la in zip(ts.tolist(), lat.tolist(), strict=True):
            heapq.heappush(window, (t, seq, la))
            seq += 1
            if len(window) > self.size:
                gone.append(heapq.heappop(window))
        self._set_window(window)
        self._arrive_run(np.array([g[0] for g in gone]), np.array([g[2] for g in gone]))

    def _set_window(self, window: list[tuple]) -> None:
        window.sort()
        self.win_ts = np.array([w[0] for w in window], dtype=np.float64)
        self.win_lat = np.array([w[2] for w in window], dtype=np.float64)

    def _arrive_run(self, ts: np.ndarray, lat: np.ndarray) -> None:
        """Arrivals in this order: `_arrive` of each, vectorized when they come in timestamp order, none before the
        last arrival. Then at arrival i every end <= ts[i] has left (the earlier ones too: the times only grow), so
        in flight are the ends > ts[i] of the requests before it, and itself."""
        if not len(ts):
            return
        if ts[0] < self.last_ts or np.any(ts[1:] < ts[:-1]):
            for t, la in zip(ts.tolist(), lat.tolist(), strict=True):
                self._arrive(t, la)
            return
        has = ~np.isnan(lat)
        end = ts + lat / 1000.0  # NaN where no latency: in no comparison
        prior = np.sort(np.array(self.ends, dtype=np.float64))
        before = np.cumsum(has) - has  # requests with a latency before i
        ends_sorted = np.sort(end[has])
        le_all = np.searchsorted(ends_sorted, ts, side="right")  # ends <= ts[i], over the whole run
        # those at or after i: end_j >= ts_j >= ts[i], so only end_j == ts_j == ts[i], within i's tie group
        zero = has & (end == ts)
        upto = np.cumsum(zero)
        group_end = np.searchsorted(ts, ts, side="right") - 1
        le_later = upto[group_end] - upto + zero  # zero-length ones from i to its group's end
        in_flight = (len(prior) - np.searchsorted(prior, ts, side="right")) + before - (le_all - le_later) + 1
        counts = np.unique(in_flight[has], return_counts=True)
        self.in_flight.update(dict(zip(counts[0].tolist(), counts[1].tolist(), strict=True)))
        last = ts[-1]
        earlier = has.copy()
        earlier[-1] = False  # the last one's own end stays, whatever it is
        others = end[earlier]
        keep = np.concatenate((prior[prior > last], others[others > last], end[-1:][has[-1:]]))
        self.ends = np.sort(keep).tolist()  # sorted: a heap
        self.last_ts = float(last)
        secs, k = np.unique(np.floor(ts).astype(np.int64), return_counts=True)
        k = k.tolist()
        if secs[0] == self.second:
            k[0] += self.in_second
        else:
            self._close_second()
        for c in k[:-1]:
            self.per_second[c] += 1
        self.second, self.in_second = int(secs[-1]), k[-1]

    def _arrive(self, ts: float, latency_ms: float) -> None:
        if ts < self.last_ts:
            self.out_of_order += 1
        self.last_ts = max(self.last_ts, ts)
        while self.ends and self.ends[0] <= ts:
            heapq.heappop(self.ends)
        if latency_ms == latency_ms:  # not NaN
            heapq.heappush(self.ends, ts + latency_ms / 1000.0)
            self.in_flight[len(self.ends)] += 1
        sec = math.floor(ts)
        if sec != self.second:
            self._close_second()
            self.second = sec
        self.in_second += 1

    def _close_second(self) -> None:
        if self.in_second:
            self.per_second[self.in_second] += 1
        self.in_second = 0

    def finish(self) -> None:
        """End of a partition: drain the window; in-flight state does not carry over to the next partition."""
        self._arrive_run(self.win_ts, self.win_lat)
        self.win_ts, self.win_lat = np.zeros(0), np.zeros(0)
        self._close_second()
        self.ends, self.second, self.last_ts = [], None, -math.inf

    def merge(self, other: Concurrency) -> None:
        for o in (self, other):
            o.finish()
        self.in_flight.update(other.in_flight)
        self.per_second.update(other.per_second)
        self.timed += other.timed
        self.no_latency += other.no_latency
        self.out_of_order += other.out_of_order

    def result(self) -> dict:
        self.finish()
        if not self.timed:
            return {"method": "none", "p50": 1, "p90": 1, "p99": 1, "max": 1, "samples": 0}
        if self.no_latency == 0:
            hist, method = self.in_flight, "in-flight from ts+latency_ms"
        else:
            hist, method = self.per_second, "arrivals per second (no latency_ms in log)"
        values = np.array(sorted(hist), dtype=np.int64)
        cum = np.cumsum([hist[v] for v in values])
        q = lambda p: int(max(1, values[np.searchsorted(cum, math.ceil(p / 100 * cum[-1]))]))  # noqa: E731  nearest rank
        return {
            "method": method,
            "p50": q(50),
            "p90": q(90),
            "p99": q(99),
            "max": int(values[-1]),
            "samples": int(cum[-1]),
            "out_of_order": self.out_of_order,
            "histogram": {str(int(v)): int(hist[v]) for v in values},
        }


class TrafficProfiler:
    """Accumulates a profile over a stream in bounded memory; profiles of partitions merge."""

    def __init__(self) -> None:
        self.n = 0
        self.lengths: Counter = Counter()
        self.routes: Counter = Counter()
        self.tenants = HeavyHitters()
        self.total_words = 0
        # the vocabulary again, split in two halves of the requests: how far two samples of this same traffic differ,
        # with words of one request co-varying as they do (calibrate/traffic_drift.py scales it to the sizes compared)
        self.split = [HeavyHitters(), HeavyHitters()]
        self.split_n = [0, 0]
        self.split_words = [0, 0]
        self.concurrency = Concurrency()

    def add(self, route: str, tenant: str, tokens: list[str], ts: float | None, latency_ms: float | None) -> None:
        """One request (the sampler adds whole batches: `add_batch`)."""
        half = hashlib.blake2b(" ".join(tokens).encode(), digest_size=1).digest()[0] & 1  # by content, not order
        self.add_batch(
            [route],
            [tenant],
            np.array([len(tokens)]),
            np.array([half]),
            (word_table(Counter(tokens)),) * 2,
            np.array([np.nan if ts is None else ts]),
            np.array([np.nan if latency_ms is None else latency_ms]),
        )

    def add_batch(
        self,
        routes: list[str],
        tenants: list[str],
        n_words: np.ndarray,
        halves: np.ndarray,
        bags: tuple,
        ts: np.ndarray,
        latency_ms: np.ndarray,
    ) -> None:
        """Requests in arrival order: their labels, word counts, split half (0 or 1, by content) and the words of
        each half (bags[h]: a `words.word_table`), and their ts and latency_ms (NaN where absent)."""
        self.n += len(routes)
        buckets, k = np.unique(np.searchsorted(LENGTH_EDGES, n_words, side="right") - 1, return_counts=True)
        self.lengths.update({BUCKETS[b]: int(c) for b, c in zip(buckets.tolist(), k.tolist(), strict=True)})
        self.routes.update(routes)
        self.tenants.add(tenants)
        self.total_words += int(n_words.sum())
        for h in (0, 1):
            sel = halves == h
            if sel.any():
                self.split[h].add_table(bags[h])
                self.split_n[h] += int(sel.sum())
                self.split_words[h] += int(n_words[sel].sum())
        self.concurrency.add_batch(ts, latency_ms)

    def finish_partition(self) -> None:
        self.concurrency.finish()
        for sk in (self.tenants, *self.split):
            sk.flush()

    def merge(self, other: TrafficProfiler) -> None:
        self.n += other.n
        self.lengths.update(other.lengths)
        self.routes.update(other.routes)
        self.tenants.merge(other.tenants)
        self.total_words += other.total_words
        for i in (0, 1):
            self.split[i].merge(other.split[i])
            self.split_n[i] += other.split_n[i]
            self.split_words[i] += other.split_words[i]
        self.concurrency.merge(other.concurrency)

    def result(self) -> dict:
        unigrams = HeavyHitters()  # the vocabulary is the two halves merged: each word is counted once
        for half in self.split:
            unigrams.merge(half)
        sketches = {
            "tenants": self.tenants,
            "unigrams": unigrams,
            "unigrams_half_0": self.split[0],
            "unigrams_half_1": self.split[1],
        }
        return {
            "version": 3,  # 3: a request's split half comes from its content digest (2: from its words)
            "requests": self.n,
            "length_words": {b: self.lengths.get(b, 0) for b in BUCKETS},
            "routes": dict(sorted(self.routes.items(), key=lambda kv: (-kv[1], kv[0]))),
            "tenants": dict(self.tenants.top(TOP_TENANTS)),
            "unigrams": {
                "total": self.total_words,
                "top": dict(unigrams.top(TOP_UNIGRAMS)),
                "split_halves": [
                    {"requests": n, "total": w, "top": dict(c.top(TOP_UNIGRAMS))}
                    for n, w, c in zip(self.split_n, self.split_words, self.split, strict=True)
                ],
            },
            "concurrency": self.concurrency.result(),
            "estimates": {
                name: {
                    "exact": sk.max_error() == 0,
                    "max_count_error": sk.max_error(),
                    "method": "frequent-items sketch (Apache DataSketches), counts within +-max_count_error",
                }
                for name, sk in sketches.items()
            },
        }


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
