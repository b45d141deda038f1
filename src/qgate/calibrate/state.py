"""Sampling state of one traffic partition, mergeable with any other, in memory bounded by the sample size.

    st, rejects = scan_partition(Partition("logs/part-0.jsonl"), SampleConfig())   # one pass over one file
    total = SampleState.empty(cfg); total.merge(st)                                  # in partition order

Per stratum (route x prompt-length bucket) the state keeps the `calib_size + shadow_size` distinct prompts with the
smallest seeded priority (a bottom-k sample keyed by content digest: it deduplicates what it keeps), and an HLL
distinct-count sketch of every prompt. Bottom-k of a union is the bottom-k of the parts' bottom-k's, and a digest
seen more than once keeps its first occurrence by (file name, line), so merging partitions in any grouping gives
exactly the sets one pass gives. Memory: strata x sample size rows, plus 4 KiB per stratum and the profile sketches.
"""
from __future__ import annotations

import hashlib
import heapq
import json
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from qgate.calibrate.profile import TrafficProfiler, length_bucket, words
from qgate.calibrate.reader import Reject, Request, read_traffic
from qgate.calibrate.scrub import scrub
from qgate.calibrate.sketches import DistinctCount
from qgate.calibrate.sources import Partition


TOTAL_LG_K = 16   # the log's distinct prompts: 64 KiB, relative standard error 0.4%, exact-ish below ~16k prompts
CACHED_SCRUB_CHARS = 2048   # message contents up to this long are scrubbed once per process (system prompts repeat)


def priority(seed: int, digest: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(digest, digest_size=8, key=seed.to_bytes(8, "little")).digest(), "big")


class BottomK:
    """The k distinct digests with the smallest (priority, digest), each with its smallest (file, line) occurrence."""

    def __init__(self, k: int):
        self.k = k
        self.rows: dict[bytes, tuple[int, tuple, dict]] = {}   # digest -> (priority, (file, line), row)
        self.heap: list[tuple[int, int, bytes]] = []            # max-heap of (-priority, -digest as int, digest)
        self.dropped = False     # a distinct digest was left out: the stratum has more than k (a set property)

    def offer(self, prio: int, digest: bytes, where: tuple, row: dict) -> None:
        cur = self.rows.get(digest)
        if cur is not None:
            if where < cur[1]:
                self.rows[digest] = (prio, where, row)
            return
        entry = (-prio, -int.from_bytes(digest, "big"), digest)
        if len(self.rows) < self.k:
            heapq.heappush(self.heap, entry)
        elif entry > self.heap[0]:     # smaller (priority, digest) than the largest kept
            del self.rows[heapq.heapreplace(self.heap, entry)[2]]
            self.dropped = True
        else:
            self.dropped = True
            return
        self.rows[digest] = (prio, where, row)

    def exact(self) -> bool:
        """Every distinct digest offered is kept: len(rows) is the stratum's exact distinct count."""
        return not self.dropped

    def ranked(self) -> list[tuple[bytes, tuple, dict]]:
        """(digest, where, row), smallest priority first."""
        return [(d, w, r) for d, (_, w, r) in sorted(self.rows.items(), key=lambda kv: (kv[1][0], kv[0]))]


@dataclass
class SampleState:
    need: int
    seed: int
    strata: dict[str, BottomK] = field(default_factory=dict)
    distinct: dict[str, DistinctCount] = field(default_factory=dict)   # stratum -> prompts seen (HLL)
    kept: DistinctCount = field(default_factory=lambda: DistinctCount(TOTAL_LG_K))   # every distinct usable prompt
    stats: Counter = field(default_factory=Counter)   # records, rejected, too_short, usable (exact, additive)
    pii: Counter = field(default_factory=Counter)
    profiler: TrafficProfiler = field(default_factory=TrafficProfiler)
    partitions: list[dict] = field(default_factory=list)   # [{"name", "records"}] in merge order

    @classmethod
    def empty(cls, config) -> SampleState:
        return cls(need=config.calib_size + config.shadow_size, seed=config.seed)

    def add(self, part_name: str, item: Request, tag_file: bool, min_words: int) -> None:
        msgs, found = _scrub_messages(item)
        self.pii.update(found)
        text = "\n".join(c for _, c in msgs)
        toks = words(text)
        if len(toks) < min_words:
            self.stats["too_short"] += 1
            return
        self.stats["usable"] += 1
        self.profiler.add(item.route, item.tenant, toks, item.ts, item.latency_ms)
        digest = hashlib.blake2b(" ".join(text.split()).encode(), digest_size=16).digest()
        stratum = f"{item.route}|{length_bucket(len(toks))}"
        self.kept.add(digest)
        if stratum not in self.strata:
            self.strata[stratum], self.distinct[stratum] = BottomK(self.need), DistinctCount()
        self.distinct[stratum].add(digest)
        row = {"messages": [{"role": r, "content": c} for r, c in msgs], "route": item.route, "stratum": stratum,
               "line": item.line} | ({"file": part_name} if tag_file else {})
        self.strata[stratum].offer(priority(self.seed, digest), digest, (part_name, item.line), row)

    def merge(self, other: SampleState) -> None:
        for stratum, bk in other.strata.items():
            mine = self.strata.setdefault(stratum, BottomK(self.need))
            for digest, (prio, where, row) in bk.rows.items():
                mine.offer(prio, digest, where, row)
            mine.dropped |= bk.dropped
        for stratum, d in other.distinct.items():
            self.distinct.setdefault(stratum, DistinctCount()).merge(d)
        self.kept.merge(other.kept)
        self.stats.update(other.stats)
        self.pii.update(other.pii)
        self.profiler.merge(other.profiler)
        self.partitions += other.partitions


def scan_partition(part: Partition, config, tag_file: bool, show_progress: bool = False) -> tuple[SampleState, bytes]:
    """One pass over one file: its sampling state, and its rejects as JSONL bytes (scrubbed: a rejected record is
    still production traffic), each with the file, its line number and the reason."""
    from qgate.progress import progress

    st = SampleState.empty(config)
    rejects: list[bytes] = []
    items = read_traffic(part, config.max_line_bytes)
    if show_progress:
        items = progress(items, f"calibrate: reading {part.name}", unit="record")
    for item in items:
        st.stats["records"] += 1
        if isinstance(item, Reject):
            st.stats["rejected"] += 1
            excerpt, _ = scrub(item.excerpt)
            rejects.append(json.dumps({"file": part.location, "line": item.line, "reason": item.reason, "excerpt": excerpt}).encode() + b"\n")
            continue
        st.add(part.name, item, tag_file, config.min_words)
    st.profiler.finish_partition()
    st.partitions.append({"name": part.name, "records": st.stats["records"]})
    return st, b"".join(rejects)


def _scrub_messages(item: Request) -> tuple[list[tuple[str, str]], Counter]:
    found: Counter = Counter()
    msgs = []
    for role, content in item.messages:
        if len(content) <= CACHED_SCRUB_CHARS:
            clean, c = _scrub_short(content)
        else:
            clean, c = scrub(content)
        if c:
            found.update(c)
        msgs.append((role, clean))
    return msgs, found


@lru_cache(maxsize=4096)
def _scrub_short(content: str) -> tuple[str, Counter]:
    return scrub(content)     # callers only read the Counter
