"""Sampling state of one traffic partition, mergeable with any other, in memory bounded by the sample size.

    st, rejects = scan_partition(Partition("logs/part-0.jsonl"), SampleConfig())   # one pass over one file
    total = SampleState.empty(cfg); total.merge(st)                                  # in partition order

Per stratum (route x prompt-length bucket) the state keeps the `calib_size + shadow_size` distinct prompts with the
smallest seeded priority (a bottom-k sample keyed by content digest: it deduplicates what it keeps), and an HLL
distinct-count sketch of every prompt. Bottom-k of a union is the bottom-k of the parts' bottom-k's, and a digest
seen more than once keeps its first occurrence by (file name, line), so merging partitions in any grouping gives
exactly the sets one pass gives. Memory: strata x sample size rows, plus 4 KiB per stratum and the profile sketches,
plus one block of lines. A partition is read as column batches (calibrate/batches.py): scrubbing, word counts and the
profile run over whole columns, and only hashing is per request (`benchmarks/bench_sampler.py` measures the rate).
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from qgate.calibrate.batch import Batch
from qgate.calibrate.batches import prefetched, read_batches
from qgate.calibrate.columns import PY_SPACE
from qgate.calibrate.profile import BUCKETS, LENGTH_EDGES, TrafficProfiler
from qgate.calibrate.scrub import HINT, rule_hints, scrub
from qgate.calibrate.sketches import DistinctCount
from qgate.calibrate.sources import Partition
from qgate.calibrate.words import batch_words, text_words, word_table, words
from qgate.chat import FIELDS_TURN, TOOLS_TURN, request_from_turns

_OTHER_SPACE = PY_SPACE.replace(r"\x1c-\x20", r"\x1c-\x1f")  # Python's whitespace but " "
# a text that " ".join(t.split()) changes: whitespace other than one " " between two other characters
UNSQUEEZED = f"[{PY_SPACE}][{PY_SPACE}]|^[{PY_SPACE}]|[{PY_SPACE}]$|[{_OTHER_SPACE}]"
TOTAL_LG_K = 16  # the log's distinct prompts: 64 KiB, relative standard error 0.4%, exact-ish below ~16k prompts


def priorities(seed: int, digests: list[bytes]) -> np.ndarray:
    """Each digest's seeded priority (uint64): blake2b-64 keyed by the seed, big-endian. Each hash runs on a copy of
    one keyed state, so the key block is compressed once, not per digest."""
    keyed = hashlib.blake2b(digest_size=8, key=seed.to_bytes(8, "little"))
    out = []
    for d in digests:
        h = keyed.copy()
        h.update(d)
        out.append(h.digest())
    return np.frombuffer(b"".join(out), dtype=">u8").astype(np.uint64)


class BottomK:
    """The k distinct digests with the smallest (priority, digest), each with its smallest (file, line) occurrence."""

    def __init__(self, k: int):
        self.k = k
        self.rows: dict[bytes, tuple[int, tuple, dict]] = {}  # digest -> (priority, (file, line), row)
        self.heap: list[tuple[int, int, bytes]] = []  # max-heap of (-priority, -digest as int, digest)
        self.dropped = False  # a distinct digest was left out: the stratum has more than k (a set property)

    def offer(self, prio: int, digest: bytes, where: tuple, row: dict) -> None:
        cur = self.rows.get(digest)
        if cur is not None:
            if where < cur[1]:
                self.rows[digest] = (prio, where, row)
            return
        entry = (-prio, -int.from_bytes(digest, "big"), digest)
        if len(self.rows) < self.k:
            heapq.heappush(self.heap, entry)
        elif entry > self.heap[0]:  # smaller (priority, digest) than the largest kept
            del self.rows[heapq.heapreplace(self.heap, entry)[2]]
            self.dropped = True
        else:
            self.dropped = True
            return
        self.rows[digest] = (prio, where, row)

    def limit(self) -> int | None:
        """The largest priority a digest not kept yet could still enter with (ties broken by digest), once the sample
        is full; None while it is not. It never grows: a full sample only swaps in smaller priorities."""
        return -self.heap[0][0] if len(self.rows) >= self.k else None

    def cut(self, limit: int) -> None:
        """Leave out every digest whose priority is above `limit`, a full sample's `limit()` that these rows are
        later merged into: none of them could enter it, each is a distinct digest it does not keep."""
        gone = [d for d, (prio, _, _) in self.rows.items() if prio > limit]
        if gone:
            for d in gone:
                del self.rows[d]
            self.heap = [e for e in self.heap if e[2] in self.rows]
            heapq.heapify(self.heap)
            self.dropped = True

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
    distinct: dict[str, DistinctCount] = field(default_factory=dict)  # stratum -> prompts seen (HLL)
    kept: DistinctCount = field(default_factory=lambda: DistinctCount(TOTAL_LG_K))  # every distinct usable prompt
    stats: Counter = field(default_factory=Counter)  # records, rejected, too_short, usable (exact, additive)
    pii: Counter = field(default_factory=Counter)
    profiler: TrafficProfiler = field(default_factory=TrafficProfiler)
    partitions: list[dict] = field(default_factory=list)  # [{"name", "records", "rejected", "sha256"}] in merge order

    @classmethod
    def empty(cls, config) -> SampleState:
        return cls(need=config.sample_size, seed=config.seed)

    def add_batch(self, part_name: str, batch: Batch, tag_file: bool, min_words: int, profiler=None) -> None:
        """A batch of requests in line order (calibrate/batches.py): scrubbed, profiled, sketched and offered to the
        bottom-k samples. Hashing is per request; scrubbing is per turn that a PII hint matches; the rest runs over
        the batch's columns. profiler: what the profile's inputs go to (`TrafficProfiler.add_batch`'s arguments),
        this state's own profiler unless given (a block scanned elsewhere hands them back: calibrate/split_scan.py)."""
        n = len(batch.lines)
        if n == 0:
            return
        import pyarrow as pa
        import pyarrow.compute as pc

        # each distinct turn once (a system prompt repeats in every request of its app): its id per turn
        enc = pc.dictionary_encode(batch.contents)
        turn_ids, distinct = enc.indices.to_numpy(zero_copy_only=False), enc.dictionary
        repeats = np.bincount(turn_ids, minlength=len(distinct))
        clean, scrubbed, found = _scrub_batch(distinct, repeats)
        self.pii.update(found)
        ids = turn_ids.tolist()
        starts = batch.starts.tolist()
        digests, halves = _digests(
            _patched(distinct, {i: clean[i] for i in np.flatnonzero(scrubbed).tolist()}), turn_ids, batch.starts
        )
        n_words, bags = _words(batch, turn_ids, distinct, clean, scrubbed, halves)
        usable = n_words >= min_words
        rows = np.flatnonzero(usable)
        self.stats["usable"] += len(rows)
        self.stats["too_short"] += n - len(rows)
        if len(rows) < n:  # a too-short request is not profiled: take its words back out of its half
            short: tuple[Counter, Counter] = (Counter(), Counter())
            for i in np.flatnonzero(~usable).tolist():
                short[halves[i]].update(w for t in ids[starts[i] : starts[i + 1]] for w in words(clean[t]))
            bags = tuple(
                pa.concat_tables([bag, word_table({w: -c for w, c in sub.items()})])
                for bag, sub in zip(bags, short, strict=True)
            )
        (self.profiler if profiler is None else profiler).add_batch(
            [batch.routes[i] for i in rows.tolist()],
            [batch.tenants[i] for i in rows.tolist()],
            n_words[rows],
            halves[rows],
            bags,
            batch.ts[rows],
            batch.latency[rows],
        )
        self._sample(part_name, batch, rows, n_words, digests, clean, ids, tag_file)

    def finish_partition(self, part: Partition, sha256: str) -> None:
        """The end of a one-partition state: its profile's sketches flushed and concurrency drained, and the file
        named with its record and reject counts and the sha256 of the bytes the scan read."""
        self.profiler.finish_partition()
        self.partitions.append(
            {"name": part.name, "records": self.stats["records"], "rejected": self.stats["rejected"], "sha256": sha256}
        )

    def take_batch(self, part: Partition, batch: Batch, tag_file: bool, min_words: int, profiler=None) -> bytes:
        """A partition's next batch, its records and rejects counted: `add_batch`, and its `reject_lines`."""
        self.stats["records"] += batch.records
        self.stats["rejected"] += len(batch.rejects)
        self.stats["tool_use"] += tool_requests(batch)
        self.add_batch(part.name, batch, tag_file, min_words, profiler)
        return reject_lines(part, batch)

    def _sample(
        self,
        part_name: str,
        batch: Batch,
        rows: np.ndarray,
        n_words: np.ndarray,
        digests: list[bytes],
        clean: list[str],
        ids: list[int],
        tag_file: bool,
    ) -> None:
        """The usable requests (`rows`) into the distinct-count sketches, and per stratum the few that can be in its
        bottom-k (the batch's k smallest distinct priorities) offered to it. Turn t's scrubbed text is clean[ids[t]]."""
        starts = batch.starts.tolist()
        prio = priorities(self.seed, [digests[i] for i in rows.tolist()])
        buckets = np.searchsorted(LENGTH_EDGES, n_words[rows], side="right") - 1
        routes = [batch.routes[i] for i in rows.tolist()]
        route_id = {r: k for k, r in enumerate(dict.fromkeys(routes))}
        code = np.array([route_id[r] for r in routes], dtype=np.int64) * len(BUCKETS) + buckets
        keys = np.frombuffer(b"".join(digests[i] for i in rows.tolist()), "<i8")[
            ::2
        ].tolist()  # DistinctCount.add's key
        self.kept.add_keys(keys)
        order = np.argsort(code, kind="stable")
        cuts = np.flatnonzero(np.diff(code[order])) + 1
        for js in np.split(order, cuts) if len(order) else []:
            st = f"{routes[js[0]]}|{BUCKETS[buckets[js[0]]]}"
            if st not in self.strata:
                self.strata[st], self.distinct[st] = BottomK(self.need), DistinctCount()
            bk = self.strata[st]
            self.distinct[st].add_keys([keys[j] for j in js.tolist()])
            ps = np.unique(prio[js])
            if len(ps) > bk.k:  # more distinct digests than the sample keeps: only the k smallest can be kept
                js = js[prio[js] <= ps[bk.k - 1]]
                bk.dropped = True
            if (
                len(bk.rows) >= bk.k
            ):  # full: a digest can only enter at or below the largest kept priority (ties by digest)
                below = prio[js] <= -bk.heap[0][0]
                if not below.all():
                    js, bk.dropped = js[below], True
            for j in js.tolist():
                i = int(rows[j])
                a, b = starts[i], starts[i + 1]
                line = int(batch.lines[i])
                messages, tools = request_from_turns(
                    [(r, clean[t]) for r, t in zip(batch.roles[a:b], ids[a:b], strict=True)]
                )
                row = {
                    "messages": messages,
                    **({"tools": tools} if tools else {}),
                    "route": batch.routes[i],
                    "stratum": st,
                    "line": line,
                } | ({"file": part_name} if tag_file else {})
                bk.offer(int(prio[j]), digests[i], (part_name, line), row)

    def merge(self, other: SampleState) -> None:
        self.merge_sample(other)
        self.profiler.merge(other.profiler)
        self.partitions += other.partitions

    def merge_sample(self, other: SampleState) -> None:
        """Everything but the profile and the partitions: the samples, sketches and counts, which merge exactly in
        any grouping (the profile's word sketches and concurrency depend on the order of their updates)."""
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


def scan_partition(part: Partition, config, tag_file: bool, show_progress: bool = False) -> tuple[SampleState, bytes]:
    """One pass over one file: its sampling state (with the file's sha256 in `partitions`), and its rejects as JSONL
    bytes (scrubbed: a rejected record is still production traffic), each with the file, its line number and the
    reason."""
    import pyarrow as pa

    from qgate.progress import progress

    pool = pa.default_memory_pool()
    st = SampleState.empty(config)
    rejects: list[bytes] = []
    digest = hashlib.sha256()  # of the bytes this scan read: the source's lineage hash needs no second pass
    batches = prefetched(read_batches(part, config.max_line_bytes, digest))
    if show_progress:
        batches = progress(batches, f"calibrate: reading {part.name}", unit="block")
    for batch in batches:
        rejects.append(st.take_batch(part, batch, tag_file, config.min_words))
        del batch
        pool.release_unused()  # the batch's arrow buffers: else the allocator keeps every high-water mark
    st.finish_partition(part, digest.hexdigest())
    return st, b"".join(rejects)


def tool_requests(batch: Batch) -> int:
    """How many of the batch's accepted requests offer tools or carry a tool field: chat.request_turns' pseudo-turns."""
    pseudo = np.array([r in (TOOLS_TURN, FIELDS_TURN) for r in batch.roles], bool)
    if not pseudo.any():
        return 0
    return int((np.add.reduceat(pseudo, batch.starts[:-1]) > 0).sum())  # every request has a turn: starts increase


def reject_lines(part: Partition, batch: Batch) -> bytes:
    """The batch's rejected records as rejects.jsonl lines, each with the file, its line number, the reason and an
    excerpt (scrubbed: a rejected record is still production traffic)."""
    out = []
    for item in batch.rejects:
        excerpt, _ = scrub(item.excerpt)
        out.append(
            json.dumps({"file": part.location, "line": item.line, "reason": item.reason, "excerpt": excerpt}).encode()
            + b"\n"
        )
    return b"".join(out)


def _digests(clean, turn_ids: np.ndarray, starts: np.ndarray) -> tuple[list[bytes], np.ndarray]:
    """Per request: `chat.content_digest` of its turns (clean: pyarrow strings, the batch's distinct turns scrubbed;
    turn_ids: each turn's index in it), and its split half for the profile (0 or 1, by content: duplicates fall in
    one half, whatever the order). The normalizing and joining run over columns; only the hash is per request."""
    import pyarrow as pa
    import pyarrow.compute as pc

    odd = np.flatnonzero(pc.match_substring_regex(clean, UNSQUEEZED).to_numpy(zero_copy_only=False))
    norm = _patched(
        clean,
        {i: " ".join(t.split()) for i, t in zip(odd.tolist(), clean.take(pa.array(odd)).to_pylist(), strict=True)},
    )
    norm = norm.take(pa.array(turn_ids))
    filled = pc.binary_length(norm).to_numpy(zero_copy_only=False) > 0
    offsets = np.concatenate(([0], np.cumsum(filled)))[starts].astype(np.int32)
    joined = pc.binary_join(pa.ListArray.from_arrays(pa.array(offsets), norm.filter(pa.array(filled))), " ")
    off = np.frombuffer(joined.buffers()[1], np.int32, len(joined) + 1, joined.offset).tolist()
    data = memoryview(joined.buffers()[2] or b"")
    blake2b = hashlib.blake2b
    digests = [blake2b(data[a:b], digest_size=16).digest() for a, b in zip(off, off[1:])]
    return digests, np.frombuffer(b"".join(d[:1] for d in digests), np.uint8) & 1


def _words(
    batch: Batch, turn_ids: np.ndarray, distinct, clean: list[str], scrubbed: np.ndarray, halves: np.ndarray
) -> tuple[np.ndarray, tuple]:
    """Per request its number of words (profile.words of its turns), and the words of each half's requests. Each
    distinct turn is counted once, weighted by its repeats in each half: by `batch_words` over the column when it is
    ASCII and the scrubber left it as it was, else by `text_words` on its scrubbed text."""
    import pyarrow as pa

    turn_half = halves[np.repeat(np.arange(len(batch.lines)), np.diff(batch.starts))]
    weights = np.zeros((len(distinct), 2), np.int64)
    np.add.at(weights, (turn_ids, turn_half), 1)
    fast = pc_is_ascii(distinct) & ~scrubbed
    per_distinct = np.zeros(len(distinct), np.int64)
    sel = np.flatnonzero(fast)
    per_distinct[sel], bags = batch_words(distinct.take(pa.array(sel, pa.int64())), weights[sel])
    sel = np.flatnonzero(~fast)
    per_distinct[sel], slow = text_words([clean[d] for d in sel.tolist()], weights[sel])
    turn_words = per_distinct[turn_ids]
    cum = np.concatenate(([0], np.cumsum(turn_words)))
    return cum[batch.starts[1:]] - cum[batch.starts[:-1]], tuple(
        pa.concat_tables(b) for b in zip(bags, slow, strict=True)
    )


def _patched(texts, new: dict[int, str]):
    """pyarrow strings with texts[i] replaced by new[i]."""
    import pyarrow as pa

    if not new:
        return texts
    index = np.arange(len(texts))
    index[list(new)] = len(texts) + np.arange(len(new))
    return pa.concat_arrays([texts, pa.array(list(new.values()), pa.string())]).take(pa.array(index))


def pc_is_ascii(texts) -> np.ndarray:
    import pyarrow.compute as pc

    return pc.string_is_ascii(texts).to_numpy(zero_copy_only=False) if len(texts) else np.zeros(0, bool)


def _scrub_batch(distinct, repeats: np.ndarray) -> tuple[list[str], np.ndarray, Counter]:
    """The distinct turns scrubbed: (texts, which changed, PII counts over every turn, repeats included). Only the
    turns scrub.HINT matches can change, so only they are scrubbed, each by the rules whose hint it matches."""
    import pyarrow as pa
    import pyarrow.compute as pc

    texts = distinct.to_pylist()
    changed = np.zeros(len(texts), bool)
    found: Counter = Counter()
    if not texts:
        return texts, changed, found
    flagged = np.flatnonzero(pc.match_substring_regex(distinct, HINT).to_numpy(zero_copy_only=False))
    for t, rules in zip(flagged.tolist(), rule_hints(distinct.take(pa.array(flagged))), strict=True):
        content = texts[t]
        clean, c = scrub(content, rules=rules)
        for kind, k in c.items():
            found[kind] += k * int(repeats[t])
        if clean != content:
            texts[t], changed[t] = clean, True
    return texts, changed, found
