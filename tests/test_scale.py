"""Scale-out: sampling state in bounded memory that merges across partitions, traffic in object storage (a real
S3-compatible server on localhost), and the same results from serial and Ray execution."""

import gzip
import hashlib
import heapq
import json
import math
import os
import random
import re
import shutil
import sys
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers import s3_server

from qgate.calibrate import sketches
from qgate.calibrate.profile import Concurrency
from qgate.calibrate.sample import SampleConfig, sample_traffic
from qgate.calibrate.sketches import DistinctCount, HeavyHitters
from qgate.calibrate.sources import Partition, list_partitions, traffic_sha256
from qgate.calibrate.state import SampleState, scan_partition
from qgate.errors import ConfigError, InputError, QgateError

ROUTES = ("chat", "code-assist", "summarize")


def _records(n: int, seed: int = 0, dup_every: int = 7) -> list[bytes]:
    """n requests; every dup_every-th repeats an earlier prompt (sometimes under another route), as real logs do."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(400)]
    out, prompts = [], []
    for i in range(n):
        if prompts and i % dup_every == 0:
            text = rng.choice(prompts)
        else:
            text = " ".join(rng.choice(vocab) for _ in range(rng.randint(2, 60)))
            prompts.append(text)
        out.append(
            json.dumps(
                {
                    "ts": 1_700_000_000 + i * 0.2,
                    "latency_ms": 400 + rng.random() * 900,
                    "route": rng.choice(ROUTES),
                    "tenant": f"t{rng.randint(0, 30)}",
                    "messages": [{"role": "user", "content": text}],
                }
            ).encode()
        )
    return out


def _write_parts(d, records: list[bytes], cuts: list[int]):
    d.mkdir(parents=True, exist_ok=True)
    bounds = [0, *sorted(cuts), len(records)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        body = b"\n".join(records[a:b]) + b"\n" if b > a else b""
        (d / f"part-{i:03d}.jsonl.gz").write_bytes(gzip.compress(body)) if i % 2 else (
            d / f"part-{i:03d}.jsonl"
        ).write_bytes(body)
    return d


def _sets(arts) -> dict:
    """What a sample selects, without where it was read from (file and line differ between one file and partitions)."""

    def rows(a):
        return [
            {k: r[k] for k in ("messages", "route", "stratum")}
            for r in map(json.loads, (a.path / "data.jsonl").read_text().splitlines())
        ]

    return {"calib": rows(arts["calib"]), "shadow": rows(arts["shadow"])}


def test_partitions_merge_to_exactly_the_single_pass_sample(tmp_path):
    records = _records(6000)
    (tmp_path / "one.jsonl").write_bytes(b"\n".join(records) + b"\n")
    parts = _write_parts(tmp_path / "parts", records, [1000, 2500, 2600, 5999])
    cfg = SampleConfig(calib_size=40, shadow_size=20, seed=5)  # small: every stratum's sample fills, sketches estimate
    one = sample_traffic(tmp_path / "one.jsonl", tmp_path / "o1", cfg)
    many = sample_traffic(parts, tmp_path / "o2", cfg)
    assert _sets(one) == _sets(many) and len(_sets(one)["calib"]) == 40 and len(_sets(one)["shadow"]) == 20
    assert one["calib"].meta["stats"] == many["calib"].meta["stats"]
    est = many["calib"].meta["estimates"]
    assert not est["exact"] and est["strata_estimated"], "the sketches were not exercised"
    u = est["unique_prompts"]
    truth = len({json.loads(r)["messages"][0]["content"].strip() for r in records})
    assert u["lower"] <= truth <= u["upper"] and abs(u["estimate"] - truth) / truth < 0.05
    stats = many["calib"].meta["stats"]
    assert stats["records"] == 6000 == stats["kept"] + stats["duplicates"]
    calib = {json.dumps(r["messages"]) for r in _sets(many)["calib"]}
    assert not calib & {json.dumps(r["messages"]) for r in _sets(many)["shadow"]}  # disjoint, even across routes


def test_each_stratum_keeps_the_k_smallest_priorities_of_its_distinct_prompts(tmp_path, monkeypatch):
    """The bottom-k samples against their definition, computed request by request with the sampler's own building
    blocks (scrub, words, content digest, seeded priority): per stratum, the k distinct digests with the smallest
    (priority, digest), each at its first line. Small blocks make many batches, so what each batch offers is filtered
    against samples that are already full."""
    from qgate.calibrate import batches
    from qgate.calibrate.profile import length_bucket, words
    from qgate.calibrate.reader import Request, read_traffic
    from qgate.calibrate.scrub import scrub
    from qgate.calibrate.state import content_digest, priorities

    monkeypatch.setattr(batches, "BLOCK_BYTES", 8 << 10)
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"\n".join(_records(3000, seed=2, dup_every=3)) + b"\n")
    cfg = SampleConfig(calib_size=10, shadow_size=5, seed=9)
    st_, _ = scan_partition(Partition(str(path)), cfg, tag_file=False)
    expected: dict[str, dict[bytes, tuple]] = {}
    for r in read_traffic(path):
        if not isinstance(r, Request):
            continue
        turns = [scrub(c)[0] for _, c in r.messages]
        n = sum(len(words(t)) for t in turns)
        if n < cfg.min_words:
            continue
        d = content_digest(turns)
        expected.setdefault(f"{r.route}|{length_bucket(n)}", {}).setdefault(
            d, (int(priorities(cfg.seed, [d])[0]), r.line)
        )
    assert sum(len(v) for v in expected.values()) > 3 * len(expected) * 15  # most distinct prompts are left out
    for stratum, seen in expected.items():
        want = sorted(seen.items(), key=lambda kv: (kv[1][0], kv[0]))[:15]
        got = st_.strata[stratum].ranked()
        assert [(d, line) for d, (_, line) in want] == [(d, where[1]) for d, where, _ in got], stratum
    assert set(st_.strata) == set(expected)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(0, 400), max_size=6), seed=st.integers(0, 3))
def test_any_partitioning_merges_to_the_same_state(cuts, seed, tmp_path_factory):
    """Bottom-k samples, HLL registers and exact counters are set functions of the records: how the log is cut into
    partitions, and so which machine scanned what, cannot change the sample."""
    d = tmp_path_factory.mktemp("p")
    records = _records(400, seed=seed, dup_every=5)
    cfg = SampleConfig(calib_size=12, shadow_size=6, seed=seed)
    whole = _write_parts(d / "whole", records, [])
    cut = _write_parts(d / "cut", records, cuts)

    def state(where):
        total = SampleState.empty(cfg)
        for p in list_partitions(where):
            total.merge(scan_partition(p, cfg, tag_file=False)[0])
        return total

    a, b = state(whole), state(cut)
    assert {s: [row["messages"] for _, _, row in bk.ranked()] for s, bk in a.strata.items()} == {
        s: [row["messages"] for _, _, row in bk.ranked()] for s, bk in b.strata.items()
    }
    assert a.kept.estimate() == b.kept.estimate()
    assert {s: d.estimate() for s, d in a.distinct.items()} == {s: d.estimate() for s, d in b.distinct.items()}
    assert (a.stats, a.profiler.n, a.profiler.routes) == (b.stats, b.profiler.n, b.profiler.routes)


def test_sampler_memory_is_bounded_by_the_sample_not_the_log(tmp_path, monkeypatch):
    """Memory is the sample, the sketches and one block of lines: with 64 KiB blocks both logs span many blocks."""
    from qgate.calibrate import batches

    monkeypatch.setattr(batches, "BLOCK_BYTES", 1 << 16)
    cfg = SampleConfig(calib_size=30, shadow_size=10)

    def peak(n):
        path = tmp_path / f"log{n}.jsonl"
        path.write_bytes(b"\n".join(_records(n, dup_every=10**9)) + b"\n")  # all distinct: a seen-set would grow
        tracemalloc.start()
        st_, _ = scan_partition(Partition(str(path)), cfg, tag_file=False)
        p = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert sum(len(bk.rows) for bk in st_.strata.values()) <= len(st_.strata) * 40
        return p

    small, large = peak(11_000), peak(33_000)  # both beyond the profile's 10,000-request reorder window
    assert large < 1.3 * small, f"peak {small / 2**20:.1f} MiB for 11k records, {large / 2**20:.1f} MiB for 33k"


def test_a_serial_scan_of_many_partitions_holds_one_partition_state_at_a_time(tmp_path, monkeypatch):
    """A partition's state is merged and dropped before the next partition is scanned, so memory is the merged sample
    plus one scan's, not two scans' (the loop and the progress lines used to keep the previous one alive)."""
    import gc
    import weakref

    from qgate.calibrate import sample

    monkeypatch.setenv("QGATE_PLAIN_PROGRESS", "1")  # the line-based progress (a CI log), as without a TTY
    alive, real_scan, real_load = [], sample.scan_partition_json, sample.state_from_json

    def scan(*args):
        gc.collect()
        alive.append(sum(r() is not None for r in refs))  # earlier partitions' merged states still alive at this scan
        return real_scan(*args)

    def load(doc):  # every state the merge gets is built here from its JSON form
        st_ = real_load(doc)
        refs.append(weakref.ref(st_))
        return st_

    refs: list = []
    monkeypatch.setattr(sample, "scan_partition_json", scan)
    monkeypatch.setattr(sample, "state_from_json", load)
    sample_traffic(
        _write_parts(tmp_path / "parts", _records(600), [150, 300, 450]),
        tmp_path / "out",
        SampleConfig(calib_size=20, shadow_size=8),
    )
    assert alive == [0, 0, 0, 0]


def test_sketches_round_trip_and_bound_their_error(monkeypatch):
    import pickle

    d, h = DistinctCount(), HeavyHitters(lg_max=8)  # 256 counters: forced to estimate
    rng = random.Random(0)
    truth: dict[str, int] = {}
    stream = []
    for i in range(50_000):
        d.add(hashlib.blake2b(str(i).encode(), digest_size=16).digest())  # content digests, as the sampler adds
        w = f"w{min(int(rng.paretovariate(1.2)), 5000)}"
        truth[w] = truth.get(w, 0) + 1
        stream.append(w)
    monkeypatch.setattr(sketches, "PENDING_ROWS", 64)  # many batch updates, as on a long log
    for i in range(0, len(stream), 500):
        h.add(stream[i : i + 500])
    e = pickle.loads(pickle.dumps(d)).estimate()
    assert e["lower"] <= 50_000 <= e["upper"] and e["upper"] - e["lower"] < 0.08 * 50_000
    h2 = pickle.loads(pickle.dumps(h))
    assert h2.max_error() > 0 and h2.total() == sum(truth.values())
    for word, count in h2.top(10):
        assert abs(count - truth[word]) <= h2.max_error()
    assert h2.top(1)[0][0] == max(truth, key=truth.get)


def test_profile_states_which_counts_are_estimates(tmp_path):
    records = _records(800)
    (tmp_path / "t.jsonl").write_bytes(b"\n".join(records) + b"\n")
    arts = sample_traffic(tmp_path / "t.jsonl", tmp_path / "o", SampleConfig(calib_size=20, shadow_size=10))
    prof = json.loads((arts["profile"].path / "profile.json").read_text())
    assert prof["requests"] == 800 and prof["version"] == 3
    halves = prof["unigrams"]["split_halves"]  # by content digest: every request in one half, every word counted once
    assert sum(h["requests"] for h in halves) == 800 and min(h["requests"] for h in halves) > 300
    assert sum(h["total"] for h in halves) == prof["unigrams"]["total"] == sum(prof["unigrams"]["top"].values())
    assert prof["estimates"]["unigrams"] == {
        "exact": True,
        "max_count_error": 0,
        "method": prof["estimates"]["unigrams"]["method"],
    }
    assert prof["estimates"]["unique_prompts"]["value"] == arts["calib"].meta["stats"]["kept"]
    conc = prof["concurrency"]
    assert conc["method"].startswith("in-flight") and conc["samples"] == 800 and conc["out_of_order"] == 0
    assert sum(conc["histogram"].values()) == 800 and 1 <= conc["p50"] <= conc["p99"] <= conc["max"]


def test_too_short_prompts_leave_the_profile_even_when_a_partition_has_nothing_else(tmp_path):
    """A partition of only too-short prompts, and one mixing them with usable ones: the profile counts exactly the
    usable requests' words (the too-short ones are taken back out of each block's bags)."""
    from qgate.calibrate.profile import words

    rng = random.Random(3)
    vocab = [f"v{i}" for i in range(50)]

    def rec(n_words: int, i: int) -> bytes:
        text = " ".join(rng.choice(vocab) for _ in range(n_words)) + f" id{i}"
        return json.dumps(
            {"route": "chat", "tenant": f"t{i % 3}", "messages": [{"role": "user", "content": text}]}
        ).encode()

    short = [rec(rng.randint(0, 3), i) for i in range(300)]  # at most 4 words: all too short
    mixed = [rec(rng.choice([1, 2, 8, 20]), 300 + i) for i in range(1500)]
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "a.jsonl").write_bytes(b"\n".join(short) + b"\n")
    (parts / "b.jsonl").write_bytes(b"\n".join(mixed) + b"\n")
    cfg = SampleConfig(calib_size=20, shadow_size=10, min_words=5)
    arts = sample_traffic(parts, tmp_path / "out", cfg)
    prof = json.loads((arts["profile"].path / "profile.json").read_text())
    truth = Counter()
    usable = 0
    for r in short + mixed:
        ws = words(json.loads(r)["messages"][0]["content"])
        if len(ws) >= 5:
            truth.update(ws)
            usable += 1
    assert 0 < usable < 1500 and prof["requests"] == usable
    assert arts["calib"].meta["stats"]["too_short"] == 1800 - usable
    assert prof["unigrams"]["total"] == sum(truth.values()) and prof["estimates"]["unigrams"]["max_count_error"] == 0
    assert prof["unigrams"]["top"] == dict(
        sorted(truth.items(), key=lambda kv: (-kv[1], kv[0]))[: len(prof["unigrams"]["top"])]
    )


def test_hive_style_partitions_are_named_by_their_path_below_the_root(tmp_path):
    """Hive-style logs repeat file names in every directory: a sampled row's (file, line) must find its record, and a
    prompt logged in two partitions is attributed to its first occurrence in partition order."""
    records = _records(120, seed=4, dup_every=10**9)  # 120 distinct prompts
    dup = records[30]  # also the first line of the later day
    (tmp_path / "dt=01").mkdir()
    (tmp_path / "dt=02").mkdir()
    (tmp_path / "dt=01/part-0000.jsonl").write_bytes(b"\n".join(records[:60]) + b"\n")
    (tmp_path / "dt=02/part-0000.jsonl").write_bytes(b"\n".join([dup, *records[60:]]) + b"\n")
    assert [p.name for p in list_partitions(tmp_path)] == ["dt=01/part-0000.jsonl", "dt=02/part-0000.jsonl"]
    assert [p.name for p in list_partitions(f"{tmp_path}/dt=*/part-*.jsonl")] == [
        "dt=01/part-0000.jsonl",
        "dt=02/part-0000.jsonl",
    ]
    (tmp_path / "dt=02/rejects.jsonl").write_text("{}\n")  # not traffic, even under a matched directory
    for dirs in (f"{tmp_path}/dt=*/", f"{tmp_path}/dt=*"):  # a glob naming directories: their partitions
        assert [p.name for p in list_partitions(dirs)] == ["dt=01/part-0000.jsonl", "dt=02/part-0000.jsonl"], dirs
    (tmp_path / "dt=02/rejects.jsonl").unlink()
    assert [p.name for p in list_partitions(tmp_path / "dt=02/part-0000.jsonl")] == ["part-0000.jsonl"]
    arts = sample_traffic(
        tmp_path, tmp_path / "out", SampleConfig(calib_size=90, shadow_size=30, seed=3)
    )  # every prompt
    rows = [json.loads(r) for a in ("calib", "shadow") for r in (arts[a].path / "data.jsonl").read_text().splitlines()]
    assert len(rows) == 120 and {r["file"] for r in rows} == {"dt=01/part-0000.jsonl", "dt=02/part-0000.jsonl"}
    for r in rows:
        logged = json.loads((tmp_path / r["file"]).read_text().splitlines()[r["line"] - 1])
        assert logged["messages"] == r["messages"], r
    want_dup = json.loads(dup)["messages"]
    assert [(r["file"], r["line"]) for r in rows if r["messages"] == want_dup] == [("dt=01/part-0000.jsonl", 31)]


def test_each_partition_is_read_once_and_the_source_hash_is_of_what_was_read(tmp_path, partition_opens):
    """The scans hash the bytes they read (the rest of a corrupt compressed stream too, and a Parquet file in one
    sequential pass): the artifacts' source hash equals the files' own sha256s, and no intact JSONL partition is
    opened twice (on object storage a second pass is a second download). A corrupt gzip is opened once more, without
    hashing, for the standard library's exact tail (reader._Gunzip)."""
    import zlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    from qgate.artifact import sha256_json
    from qgate.calibrate import sources

    d = tmp_path / "logs"
    _write_parts(d, _records(3000, seed=6), [1000, 2000])  # part-000.jsonl, part-001.jsonl.gz, part-002.jsonl
    # a gzip partition corrupt near its start, with far more bytes after it than one buffered read takes. The noise is
    # seeded: with about one draw in four, 16 bytes of 0xff still inflate (to garbage lines, up to the CRC check at the
    # end) instead of failing at once, and the garbage then fails the sample's malformed-records limit
    rng = random.Random(6)
    noise = [
        json.dumps({"messages": [{"role": "user", "content": rng.randbytes(300).hex()}]}).encode() for _ in range(8000)
    ]
    body = zlib.compressobj(1, zlib.DEFLATED, 31)
    gz = bytearray(body.compress(b"\n".join(noise) + b"\n") + body.flush())
    assert len(gz) > 2 * sources._CHUNK
    gz[4000:4016] = b"\xff" * 16
    (d / "part-003.jsonl.gz").write_bytes(bytes(gz))
    pq.write_table(
        pa.table(
            {"messages": [[{"role": "user", "content": f"parquet prompt {i} about w{i % 7}"}] for i in range(300)]}
        ),
        d / "part-004.parquet",
    )
    arts = sample_traffic(d, tmp_path / "out", SampleConfig(calib_size=40, shadow_size=20))
    names = sorted(p.name for p in d.iterdir())
    # the Parquet file: row groups by random access, then one pass
    assert partition_opens == Counter(names) + Counter({"part-003.jsonl.gz": 1}), partition_opens
    want = sha256_json([[n, hashlib.sha256((d / n).read_bytes()).hexdigest()] for n in names])
    assert arts["profile"].parents == (want,) and arts["calib"].parents[0] == want
    rejects = [json.loads(r) for r in (tmp_path / "out/rejects.jsonl").read_text().splitlines()]
    assert rejects[-1]["file"].endswith("part-003.jsonl.gz") and "compressed stream corrupt" in rejects[-1]["reason"]


def _artifact_bytes(out) -> dict:
    """Every file a sample wrote, but the profile's `source` (the path it was read from) and the artifacts' manifests."""
    files = {}
    for p in sorted(out.rglob("*")):
        if p.is_file() and p.name != "qgate-artifact.json":
            data = json.loads(p.read_text()) if p.name == "profile.json" else p.read_bytes()
            files[str(p.relative_to(out))] = (
                {k: v for k, v in data.items() if k != "source"} if isinstance(data, dict) else data
            )
    return files


def test_a_scan_cache_rescans_only_new_or_changed_partitions_and_changes_nothing(tmp_path, monkeypatch):
    """A sliding window of partitions: unchanged partitions come from the cache, new, rewritten and corrupt-cached ones
    are scanned; every run writes exactly what an uncached run writes (the word sketches past their capacity
    included), and the cache keeps only the current window's partitions."""
    from qgate.calibrate import sample
    from qgate.calibrate.scan_cache import ScanCache
    from qgate.calibrate.state_json import state_to_json

    rng = random.Random(3)
    records = [
        json.dumps(
            {
                "ts": 1.7e9 + i,
                "latency_ms": 500,
                "route": rng.choice(ROUTES),
                "messages": [
                    {
                        "role": "user",
                        "content": f"{rng.choice(('fix', 'explain', 'summarize'))} w{rng.randint(0, 50)} "
                        + " ".join(f"u{i}x{j}" for j in range(32)),
                    }
                ],
            }
        ).encode()
        for i in range(4000)
    ]
    records.insert(1234, b'{"messages": "not a list"}')
    logs = tmp_path / "logs"
    logs.mkdir()

    def day(i: int, recs=None) -> None:
        (logs / f"day={i:02d}").mkdir(exist_ok=True)
        (logs / f"day={i:02d}/part-0.jsonl").write_bytes(b"\n".join(recs or records[i * 800 : (i + 1) * 800]) + b"\n")

    scanned: list[str] = []
    real_scan = sample.scan_partition_json

    def counting_scan(part, *a, **k):
        scanned.append(part.name)
        return real_scan(part, *a, **k)

    monkeypatch.setattr(sample, "scan_partition_json", counting_scan)
    cfg, cache = SampleConfig(calib_size=30, shadow_size=10, seed=4), tmp_path / "scans"

    def run(name: str, cached: bool = True, executor: str = "serial"):
        scanned.clear()
        sample_traffic(logs, tmp_path / name, cfg, executor=executor, scan_cache=cache if cached else None)
        return _artifact_bytes(tmp_path / name), sorted(scanned)

    for i in range(3):
        day(i)
    cold, first = run("cold")
    assert first == ["day=00/part-0.jsonl", "day=01/part-0.jsonl", "day=02/part-0.jsonl"]
    prof = json.loads((tmp_path / "cold/profile/profile.json").read_text())
    assert not prof["estimates"]["unigrams_half_0"]["exact"]  # each partition's sketches purged: cached past capacity
    assert run("warm") == (cold, []) and run("plain", cached=False)[0] == cold
    monkeypatch.setattr(sample, "scan_partition_json", real_scan)  # workers cannot import a local function
    assert run("processes", cached=False, executor="processes")[0] == cold  # scans that crossed a process boundary
    monkeypatch.setattr(sample, "scan_partition_json", counting_scan)
    shutil.rmtree(logs / "day=00")  # the window slides by a day
    day(3)
    slid, new = run("slid")
    assert new == ["day=03/part-0.jsonl"] and slid == run("slid-plain", cached=False)[0]
    assert len(list(cache.glob("scan-*.json"))) == 3  # day 0's scan is gone with it
    known = ScanCache(cache, cfg, tag_file=True).sha256  # a stage key's hash reads no cached partition
    assert [known(p) for p in sample.list_partitions(logs)] == [p.sha256() for p in sample.list_partitions(logs)]
    opened: list[str] = []
    real_read = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: opened.append(self.name) or real_read(self))
    assert [known(p) for p in sample.list_partitions(logs)] and {n[:4] for n in opened} == {"sha-"}  # no scan is read
    monkeypatch.setattr(Path, "read_bytes", real_read)
    day(1, records[800:1599])  # a partition rewritten: one record fewer
    day2, day3 = (next(p for p in sample.list_partitions(logs) if p.name.startswith(d)) for d in ("day=02", "day=03"))
    [entry] = cache.glob(f"scan-{ScanCache(cache, cfg, tag_file=True).key(day3)[:32]}.json")
    entry.write_bytes(entry.read_bytes().replace(b'"need"', b'"need" ', 1))  # and another's scan edited by hand
    [sha2] = cache.glob(f"sha-{ScanCache(cache, cfg, tag_file=True).key(day2)[:32]}.json")
    sha2.write_bytes(sha2.read_bytes().replace(b'"sha256"', b'"sha256" ', 1))  # and a third's recorded sha256
    parts = sample.list_partitions(logs)
    assert [known(p) is None for p in parts] == [
        True,
        True,
        False,
    ]  # rewritten, sha256 edited, unchanged (its scan edited)
    assert known(parts[2]) == parts[2].sha256()
    assert traffic_sha256(parts, known=known) == traffic_sha256(parts)
    again, rescanned = run("again")
    assert rescanned == ["day=01/part-0.jsonl", "day=03/part-0.jsonl"]  # an edited sha256 alone costs no scan
    assert again == run("again-plain", cached=False)[0]
    assert [known(p) for p in parts] == [p.sha256() for p in parts]  # every recorded sha256 whole again
    st, _ = scan_partition(sample.list_partitions(logs)[0], cfg, True)
    st.extra = 1
    with pytest.raises(RuntimeError, match="extra"):
        state_to_json(st)  # a field the cache would drop is refused


def test_unknown_executor_and_missing_ray_are_clear(tmp_path, monkeypatch):
    import sys

    (tmp_path / "t.jsonl").write_bytes(b"\n".join(_records(100)) + b"\n")
    with pytest.raises(ConfigError, match="unknown executor 'spark'"):
        sample_traffic(
            tmp_path / "t.jsonl", tmp_path / "o", SampleConfig(calib_size=5, shadow_size=5), executor="spark"
        )
    monkeypatch.setitem(sys.modules, "ray", None)
    from qgate.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="ray"):
        sample_traffic(tmp_path / "t.jsonl", tmp_path / "o2", SampleConfig(calib_size=5, shadow_size=5), executor="ray")


def test_a_missing_bucket_prefix_fails_at_the_call(s3):
    with pytest.raises(InputError, match="not found|no traffic"):
        list_partitions(f"s3://{s3}/no-such-prefix/")


@pytest.fixture(scope="module")
def s3():
    """A real S3-compatible server (moto in server mode) on localhost, found through the standard AWS variables."""
    with s3_server() as (_, bucket):
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()  # a local Ray keeps the environment it started with: restart it
        yield bucket


def test_s3_partitions_and_ray_give_the_local_serial_sample(tmp_path, s3):
    """The object-store path against a real S3 endpoint, and the processes and Ray (local Ray) executors on both local
    and S3 partitions: every combination selects the same sets as one serial pass over local files."""
    import os

    import boto3

    records = _records(3000, seed=2)
    parts = _write_parts(tmp_path / "parts", records, [700, 1900])
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    for f in sorted(parts.iterdir()):
        client.upload_file(str(f), s3, f"logs/2026-11-22/{f.name}")
    client.put_object(Bucket=s3, Key="logs/2026-11-22/_SUCCESS", Body=b"")  # not traffic: skipped
    cfg = SampleConfig(calib_size=30, shadow_size=15, seed=1)
    ref = sample_traffic(parts, tmp_path / "local-serial", cfg)
    uri = f"s3://{s3}/logs/2026-11-22/"
    assert [p.name for p in list_partitions(uri)] == [p.name for p in list_partitions(parts)]
    runs = {
        "s3-serial": sample_traffic(uri, tmp_path / "s3-serial", cfg),
        "local-processes": sample_traffic(parts, tmp_path / "local-processes", cfg, executor="processes"),
        "s3-processes": sample_traffic(uri, tmp_path / "s3-processes", cfg, executor="processes"),
        "local-ray": sample_traffic(parts, tmp_path / "local-ray", cfg, executor="ray"),
        "s3-ray": sample_traffic(uri, tmp_path / "s3-ray", cfg, executor="ray"),
    }
    for name, arts in runs.items():
        assert _sets(arts) == _sets(ref), name
        assert arts["calib"].sha256 == ref["calib"].sha256 and arts["shadow"].sha256 == ref["shadow"].sha256, name
        assert arts["calib"].meta["stats"] == ref["calib"].meta["stats"], name
        assert arts["profile"].parents == ref["profile"].parents, name  # the same content hash of the traffic
    import ray

    assert ray.is_initialized() and ray.cluster_resources().get("CPU", 0) >= 1  # the scans were Ray tasks
    # the pipeline's cache key hashes the source on the scan's executor: the same value as the scans' own hashes
    assert (
        traffic_sha256(list_partitions(uri), "ray")
        == traffic_sha256(list_partitions(parts), "processes")
        == traffic_sha256(list_partitions(parts))
        == ref["profile"].parents[0]
    )
    glob_uri = f"s3://{s3}/logs/2026-11-*/part-00[01]*"  # named below the glob's root: the date says which day
    assert [p.name for p in list_partitions(glob_uri)] == ["2026-11-22/part-000.jsonl", "2026-11-22/part-001.jsonl.gz"]
    assert [p.name for p in list_partitions(f"s3://{s3}/logs/2026-11-*/")] == [
        f"2026-11-22/{p.name}" for p in list_partitions(parts)
    ]


def test_variants_fanned_out_on_ray_match_the_serial_run(tmp_path, workdir, monkeypatch):
    """`qgate run --parallel ray`: the variants' chains run as Ray tasks with their declared resources; the
    baseline caches are computed once before the fan-out; calibration sets, checkpoints, engines and every check's
    verdict and observation equal the serial run's, and the driver alone writes the ledger."""
    import yaml
    from test_pipeline import _spec

    from qgate.cli.main import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs = {}
    for mode in ("serial", "ray"):
        d = tmp_path / mode
        d.mkdir()
        spec = _spec(d, workdir)
        data = yaml.safe_load(spec.read_text())
        for v in data["variants"]:
            v["resources"] = {"num_cpus": 1}
        spec.write_text(yaml.safe_dump(data, sort_keys=False))
        assert main(["run", str(spec), "--parallel", mode]) == 0
        runs[mode] = d / "work"
    ledgers = {m: json.loads((w / "stages.json").read_text()) for m, w in runs.items()}
    assert set(ledgers["ray"]) == set(ledgers["serial"])
    for name in ledgers["serial"]:
        if name.startswith(("model", "calibrate", "quantize:", "engine:")):
            assert ledgers["ray"][name]["sha256"] == ledgers["serial"][name]["sha256"], name
    reports = {
        m: {v: json.loads((w / "variants" / v / "gate" / "report.json").read_text()) for v in ("awq-cpu", "w8")}
        for m, w in runs.items()
    }
    for v in ("awq-cpu", "w8"):
        a, b = reports["serial"][v], reports["ray"][v]
        assert a["verdict"] == b["verdict"]
        assert [(r["gate"], r["metric"], r["verdict"], r["observed"]) for r in a["results"] if r["gate"] != "perf"] == [
            (r["gate"], r["metric"], r["verdict"], r["observed"]) for r in b["results"] if r["gate"] != "perf"
        ]
    summary = json.loads((runs["ray"] / "summary.json").read_text())
    assert summary["promoted"]["variant"] == "w8"
    assert main(["run", str(tmp_path / "ray" / "spec.yaml"), "--parallel", "ray"]) == 0  # re-run: every stage skipped
    assert json.loads((runs["ray"] / "summary.json").read_text())["stages_run"] == []


def test_a_pipeline_samples_exactly_the_partitions_its_stage_key_hashed(tmp_path, workdir, monkeypatch):
    """The calibrate stage lists its traffic once: a partition that lands after the stage key was hashed (a live log
    directory or bucket) is not sampled under that key, so the artifacts' source hash is the key's traffic hash (a
    second listing keyed one set of partitions and sampled another)."""
    from test_pipeline import _spec

    from qgate.pipeline import stages
    from qgate.pipeline.ledger import Ledger
    from qgate.pipeline.spec import load_spec

    logs = _write_parts(tmp_path / "logs", _records(300, seed=5), [150])
    spec = load_spec(_spec(tmp_path, workdir, traffic="logs"))
    real, keyed = stages.traffic_key, []

    def then_a_file_lands(*a, **k):
        keyed.append(real(*a, **k))
        (logs / "part-late.jsonl").write_bytes(b"\n".join(_records(40, seed=6)) + b"\n")
        return keyed[-1]

    monkeypatch.setattr(stages, "traffic_key", then_a_file_lands)
    profile = stages.calibrate_stage(
        Ledger(spec.path(spec.workdir), lambda m: None), spec, spec.traffic_source()
    ).profile
    assert profile.parents[0] == keyed[0] and profile.meta["requests"] <= 300


def test_a_variant_no_ray_node_can_hold_is_refused_before_any_work(tmp_path, workdir, monkeypatch):
    """A variant asking for a GPU on a local Ray instance without one would wait forever (Ray only logs that the
    task cannot be scheduled): the run refuses it before the model import, naming the key and what the node has. On
    a cluster (RAY_ADDRESS), where an autoscaler may add such a node, it says what the task waits for instead."""
    import yaml
    from test_pipeline import _spec

    from qgate.pipeline import runner
    from qgate.pipeline.runner import placeable, run_pipeline
    from qgate.pipeline.spec import load_spec

    path = _spec(tmp_path, workdir)
    data = yaml.safe_load(path.read_text())
    data["variants"][1]["resources"] = {"num_gpus": 1}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    spec = load_spec(path)
    monkeypatch.setattr(runner, "_run", lambda *a, **k: pytest.fail("the run started: it would wait forever"))
    with pytest.raises(
        ConfigError,
        match=r"variants\[1\]\.resources: variant w8 asks one node for CPU 1, GPU 1; the largest "
        r"node of this Ray instance has CPU \d+, memory [\d.]+ GiB, so its task would wait forever",
    ):
        run_pipeline(spec, echo=lambda m: None, executor="ray")
    assert not (tmp_path / "work").exists()  # refused before anything was made
    said: list[str] = []
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")  # the same nodes, as a cluster's: a warning
    placeable(spec.variants, said.append)  # (the first variant asks for nothing: it fits)
    assert (
        len(said) == 1
        and said[0].startswith("  ! variants[1].resources: variant w8 asks one node for CPU 1, GPU 1")
        and "of this Ray cluster has" in said[0]
        and "waits until such a node joins" in said[0]
    )


def test_a_variant_failing_on_ray_keeps_every_stage_that_finished(tmp_path, workdir, monkeypatch):
    """`--parallel ray` with a variant whose chain fails after its checkpoint, listed before one that passes: the
    run fails with that variant's own error, and the ledger holds every stage that finished, the failed chain's
    checkpoint and the whole chain that ran beside it, so a re-run rebuilds nothing (before, the driver dropped what
    the tasks returned once one had failed). The failure: a TensorRT-LLM bundle cannot be verified without CUDA (a
    spec file naming one is refused at load now; the spec object here is built without that check)."""
    import yaml
    from test_pipeline import _spec

    from qgate.errors import BackendUnavailable
    from qgate.pipeline.runner import run_pipeline
    from qgate.pipeline.spec import PipelineSpec

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    data = yaml.safe_load(_spec(tmp_path, workdir).read_text())
    data["variants"] = [
        {
            "name": "trt",
            "scheme": "gptq-w8a16",
            "options": {"group_size": 32},
            "engine": {"backend": "trtllm"},
            "resources": {"num_cpus": 1},
        },
        {"name": "w8", "scheme": "gptq-w8a16", "options": {"group_size": 32}, "resources": {"num_cpus": 1}},
    ]
    spec, said = PipelineSpec(**data, root=tmp_path.resolve()), []
    with pytest.raises(BackendUnavailable, match="TensorRT-LLM bundle written to .* but not verified"):
        run_pipeline(spec, echo=said.append, executor="ray")
    assert any(
        m.startswith("  ! trt failed: TensorRT-LLM bundle") and "every finished stage is kept" in m for m in said
    )
    ledger = json.loads((tmp_path / "work" / "stages.json").read_text())
    assert {"quantize:trt", "quantize:w8", "gate:w8"} <= set(ledger) and "engine:trt" not in ledger
    built = {d: (tmp_path / "work/variants" / d).stat().st_ino for d in ("trt/checkpoint", "w8/checkpoint", "w8/gate")}
    said.clear()
    with pytest.raises(BackendUnavailable):
        run_pipeline(spec, echo=said.append, executor="ray")
    assert not any("stale lock" in m for m in said)  # the failed run released its lock cleanly
    assert {d: (tmp_path / "work/variants" / d).stat().st_ino for d in built} == built  # nothing was built again


class _TwoArgs(Exception):
    def __init__(self, what: str, where: str):  # pickles, but cannot be rebuilt from its message alone
        super().__init__(f"{what} at {where}")


def test_a_failed_chains_error_reaches_the_driver_whatever_its_class():
    """A chain's error travels back beside its finished stages: as itself when it survives a pickle round trip, else
    as a QgateError with its type and message (never a serialization error that would lose the stages too)."""
    from qgate.pipeline.runner import _portable

    same = InputError("part-1.jsonl:7: bad record", hint="fix the writer")
    assert _portable(same) is same
    odd = _portable(_TwoArgs("CUDA out of memory", "layer 3"))
    assert type(odd) is QgateError and str(odd) == "_TwoArgs: CUDA out of memory at layer 3"


def _slow_or_bad(i: int, marks: str, returned: bool = False):
    """Call 1 fails: raised, or `returned` as a result (as a variant chain returns its failure)."""
    import pathlib
    import time

    if i == 1:
        if returned:
            return ("failed", i)
        raise ValueError(f"bad partition {i}")
    time.sleep(0.3)
    (pathlib.Path(marks) / str(i)).write_text("done")
    return i


def test_a_failing_ray_task_raises_its_own_error_and_leaves_nothing_running(tmp_path):
    """A task's exception reaches the caller as itself; tasks already submitted are waited for, not cancelled (a
    cancel racing a finishing task aborted the whole driver in Ray 2.60), and later calls are never submitted."""
    import sys
    import time

    ray_cloudpickle = pytest.importorskip("ray.cloudpickle")
    from qgate.execute import map_ordered

    ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    with pytest.raises(ValueError, match="bad partition 1"):
        list(map_ordered(_slow_or_bad, [(i, str(tmp_path)) for i in range(40)], executor="ray"))
    ran = sorted(p.name for p in tmp_path.iterdir())
    time.sleep(1.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ran  # nothing was left running behind the caller
    assert "0" in ran and len(ran) < 20  # the window was awaited; later calls never ran
    assert list(map_ordered(_slow_or_bad, [(0, str(tmp_path)), (2, str(tmp_path))], executor="ray")) == [
        0,
        2,
    ]  # driver alive


@pytest.mark.parametrize("executor", ["serial", "processes", "ray"])
def test_a_result_that_stops_the_submitting_loses_none_of_the_work_in_flight(tmp_path, executor):
    """stop_after: after a result it flags, no more calls are made, and the calls already running finish and are
    yielded, in order: a variant fan-out records every chain that finished beside a failed one."""
    import sys

    from qgate.execute import map_ordered

    if executor == "ray":
        pytest.importorskip("ray.cloudpickle").register_pickle_by_value(sys.modules[__name__])
    got = list(
        map_ordered(
            _slow_or_bad,
            [(i, str(tmp_path), True) for i in range(40)],
            executor=executor,
            stop_after=lambda r: isinstance(r, tuple),
        )
    )
    assert got[:2] == [0, ("failed", 1)] and got[2:] == list(range(2, len(got))) and len(got) < 12
    if executor == "serial":
        assert len(got) == 2  # nothing else was running
    else:
        assert len(got) > 2  # the calls in flight were yielded, not dropped
    assert sorted(int(p.name) for p in tmp_path.iterdir()) == [0] + got[2:]  # and no call beyond them ran


_INTERRUPTED = """
import os, signal, threading, time
from qgate.execute import map_ordered
threading.Timer(12, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
t = time.perf_counter()
try:
    list(map_ordered(time.sleep, [(120,), (120,)], "ray"))
except KeyboardInterrupt:
    print("INTERRUPTED after", round(time.perf_counter() - t))
"""


def test_ctrl_c_during_a_ray_fan_out_returns_at_once(tmp_path):
    """A failed task makes the driver wait for the tasks in flight (their work is kept), but Ctrl-C does not: the
    tasks end with the driver's job, and a user who stops a run of hour-long chains gets the prompt back now."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", _INTERRUPTED], capture_output=True, text=True, timeout=300, env=env)
    took = re.search(r"INTERRUPTED after (\d+)", out.stdout)
    assert took and int(took[1]) < 60, out.stdout + out.stderr[-3000:]  # the tasks sleep 120 s


def _bad_input(i: int) -> int:
    import os

    if i == 2:
        raise InputError(f"part-{i}.jsonl:7: bad record", hint="fix the writer")
    if i == 9:
        os._exit(1)  # a worker killed mid-call (the OOM killer, a segfault in a native library)
    return i * i


def test_the_processes_executor_keeps_order_raises_each_error_as_itself_and_places_no_gpus(tmp_path):
    """Results in input order from worker processes; a worker's QgateError arrives with its hint; calls not yet
    started after a failure never run; GPU resources, and variant fan-out (which needs them), are refused."""
    from qgate.execute import map_ordered
    from qgate.pipeline.runner import run_pipeline

    assert list(map_ordered(_bad_input, [(i,) for i in (3, 0, 1)], executor="processes")) == [9, 0, 1]
    with pytest.raises(InputError) as err:
        list(map_ordered(_bad_input, [(i,) for i in range(5)], executor="processes"))
    assert err.value.message == "part-2.jsonl:7: bad record" and err.value.hint == "fix the writer"
    with pytest.raises(ValueError, match="bad partition 1"):
        list(map_ordered(_slow_or_bad, [(i, str(tmp_path)) for i in range(40)], executor="processes"))
    ran = sorted(p.name for p in tmp_path.iterdir())
    assert "0" in ran and len(ran) < 10  # the window was awaited; later calls never ran
    with pytest.raises(
        QgateError, match="worker process of the processes executor died while running _bad_input"
    ) as died:
        list(map_ordered(_bad_input, [(i,) for i in (0, 9, 1)], executor="processes"))
    assert "serial executor" in died.value.hint and 'if __name__ == "__main__":' in died.value.hint
    with pytest.raises(ConfigError, match="cannot place num_gpus\n"):
        list(map_ordered(_bad_input, [(1,)], executor="processes", resources={"num_gpus": 1}))
    with pytest.raises(ConfigError, match="unknown executor 'processes'; choose one of serial, ray"):
        run_pipeline(None, executor="processes")


class _StreamedConcurrency:
    """The in-flight count one request at a time, as `Concurrency` was first written: the reference its batches
    (vectorized where requests come in timestamp order) must equal."""

    def __init__(self, window: int):
        self.size, self.window, self.seq, self.ends = window, [], 0, []
        self.last_ts, self.second, self.in_second = float("-inf"), None, 0
        self.in_flight, self.per_second, self.timed, self.no_latency, self.out_of_order = Counter(), Counter(), 0, 0, 0

    def add(self, ts, latency_ms):
        if ts is None:
            return
        self.timed += 1
        self.no_latency += latency_ms is None
        heapq.heappush(self.window, (ts, self.seq, latency_ms))
        self.seq += 1
        if len(self.window) > self.size:
            self._arrive(*heapq.heappop(self.window))

    def _arrive(self, ts, _seq, latency_ms):
        if ts < self.last_ts:
            self.out_of_order += 1
        self.last_ts = max(self.last_ts, ts)
        while self.ends and self.ends[0] <= ts:
            heapq.heappop(self.ends)
        if latency_ms is not None:
            heapq.heappush(self.ends, ts + latency_ms / 1000.0)
            self.in_flight[len(self.ends)] += 1
        sec = math.floor(ts)
        if sec != self.second:
            self._close()
            self.second = sec
        self.in_second += 1

    def _close(self):
        if self.in_second:
            self.per_second[self.in_second] += 1
        self.in_second = 0

    def finish(self):
        while self.window:
            self._arrive(*heapq.heappop(self.window))
        self._close()
        self.ends, self.second, self.last_ts = [], None, float("-inf")


_TIMES = st.one_of(
    st.none(), st.sampled_from([0.0, 0.5, 0.999, 1.0, 1.25, 2.0, 7.0]), st.floats(0, 20, allow_nan=False)
)
_LATENCIES = st.one_of(st.none(), st.sampled_from([0.0, 1.0, 500.0, 1000.0]), st.floats(0, 5000, allow_nan=False))


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.lists(st.tuples(_TIMES, _LATENCIES), max_size=40), min_size=1, max_size=4),
    window=st.integers(1, 12),
    mostly_sorted=st.booleans(),
)
def test_concurrency_batches_equal_one_request_at_a_time(parts, window, mostly_sorted):
    """The in-flight and per-second histograms, out-of-order count and state between batches equal the one-at-a-time
    reference, for batches sorted (the vectorized path, ties and zero latencies included) or not, and across two
    partitions (`finish` in between)."""
    ref, got = _StreamedConcurrency(window), Concurrency(window)
    for k, batch in enumerate(parts):
        if mostly_sorted:
            batch = sorted(batch, key=lambda r: -1.0 if r[0] is None else r[0])
        for ts, lat in batch:
            ref.add(ts, lat)
        got.add_batch(
            np.array([np.nan if t is None else t for t, _ in batch], dtype=np.float64),
            np.array([np.nan if la is None else la for _, la in batch], dtype=np.float64),
        )
        assert (got.in_flight, got.per_second, got.out_of_order, got.timed, got.no_latency) == (
            ref.in_flight,
            ref.per_second,
            ref.out_of_order,
            ref.timed,
            ref.no_latency,
        )
        assert sorted(got.ends) == sorted(ref.ends) and (got.second, got.in_second, got.last_ts) == (
            ref.second,
            ref.in_second,
            ref.last_ts,
        )
        if k == 1:
            ref.finish()
            got.finish()
    ref.finish()
    got.finish()
    assert (got.in_flight, got.per_second, got.out_of_order) == (ref.in_flight, ref.per_second, ref.out_of_order)


def test_concurrency_in_order_log_is_vectorized(monkeypatch):
    """A log in timestamp order never takes the one-by-one path (the speed the sampler's benchmark depends on), and
    its in-flight counts are right: 1,000 requests 0.1 s apart lasting 0.35 s each have 4 in flight (3 at the start)."""
    c = Concurrency(100)
    monkeypatch.setattr(Concurrency, "_arrive", lambda *a: pytest.fail("one-by-one path taken"))
    ts = np.arange(1000) * 0.1
    for part in np.array_split(np.arange(1000), 7):
        c.add_batch(ts[part], np.full(len(part), 350.0))
    c.finish()
    assert c.in_flight == Counter({1: 1, 2: 1, 3: 1, 4: 997}) and c.out_of_order == 0
    assert sum(k * v for k, v in c.per_second.items()) == 1000


def test_a_local_file_a_ray_task_cannot_find_is_explained(tmp_path, monkeypatch):
    """On a cluster each Ray task reads its partition on its own node: a local file this machine reads but a task
    could not find fails with why and what to do, not as "not found"; a file missing here too keeps its own error."""
    from qgate.calibrate import sample
    from qgate.calibrate.sources import explained

    logs = tmp_path / "logs"
    _write_parts(logs, _records(300, seed=2), [100, 200])
    monkeypatch.chdir(tmp_path)
    parts = list_partitions("logs")
    assert all(Path(p.location).is_absolute() for p in parts) and [p.name for p in parts][0] == "part-000.jsonl"

    def as_on_another_node(fn, calls, executor="serial", resources=None):  # what the worker raises, re-raised here
        yield fn(*calls[0])
        raise InputError(f"{calls[1][0].location}: traffic log not found", hint="pass a JSONL or Parquet file")

    monkeypatch.setattr(sample, "map_ordered", as_on_another_node)
    with pytest.raises(InputError, match="a Ray task could not find this local file") as e:
        sample_traffic("logs", tmp_path / "out", SampleConfig(calib_size=20, shadow_size=10), executor="ray")
    assert str(e.value).startswith(parts[1].location) and "s3://" in e.value.hint
    with pytest.raises(InputError, match="traffic log not found"):  # the processes executor: the file's own error
        sample_traffic("logs", tmp_path / "out2", SampleConfig(calib_size=20, shadow_size=10), executor="processes")
    gone = Partition(str(tmp_path / "gone.jsonl"))

    def missing():
        raise FileNotFoundError(f"[Errno 2] No such file or directory: '{gone.location}'")
        yield

    with pytest.raises(FileNotFoundError):  # missing on this machine too: as it was
        list(explained(missing(), [gone], "ray"))


_OTHER_CODE = """
import sys
import ray
ray.init(runtime_env={"py_modules": [sys.argv[1]]}, include_dashboard=False, logging_level="ERROR")
from qgate.errors import ConfigError
from qgate.execute import map_ordered
try:
    print("RAN", list(map_ordered(sys.argv.append, [("ran on the worker",)], "ray")))
except ConfigError as e:
    print("REFUSED", e)
"""


def test_a_ray_worker_with_other_qgate_code_runs_nothing(tmp_path):
    """Ray tasks run on whatever the cluster's nodes have installed: a worker whose qgate source (or a dependency's
    version) is not the driver's refuses the call before running it, so a scan or a variant chain is never made by
    code other than what the artifacts record. Here the workers import an edited copy of qgate (runtime_env), then a
    copy that fails to import at all, which Ray reports in its own words: qgate names the node and the fix."""
    import subprocess
    import sys

    import qgate

    copy = tmp_path / "mods" / "qgate"
    shutil.copytree(Path(qgate.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "calibrate" / "words.py").write_text(
        (copy / "calibrate" / "words.py").read_text() + "\n# edited on the cluster\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run(
        [sys.executable, "-c", _OTHER_CODE, str(copy)], capture_output=True, text=True, timeout=600, env=env
    )
    assert "REFUSED a Ray worker on" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "qgate source" in out.stdout and "nothing was run there" in out.stdout and "RAN" not in out.stdout
    (copy / "__init__.py").write_text('raise ImportError("no module named qgate.calibrate (a broken install)")\n')
    out = subprocess.run(
        [sys.executable, "-c", _OTHER_CODE, str(copy)], capture_output=True, text=True, timeout=600, env=env
    )
    assert re.search(
        r"REFUSED a Ray worker on [0-9a-f.:]+ could not import qgate's code \(ImportError: no module named "
        r"qgate\.calibrate \(a broken install\)\); nothing was run there",
        out.stdout,
    ), out.stdout + out.stderr[-3000:]
    from importlib.metadata import version

    from qgate.execute import environment

    here = environment()  # releases, not builds: this machine's torch is a +cpu build
    assert (
        "+" in version("torch")
        and here["torch"] == version("torch").split("+")[0]
        and here["pyarrow"] == version("pyarrow")
    )


def test_s3_keys_land_in_nothing_a_sampling_job_writes(tmp_path, s3, monkeypatch, capsys):
    """`qgate calibrate sample` from S3 with distinctive keys, one run that works (with a malformed record, so rejects
    are written) and one whose prefix is missing: neither the key id nor the secret appears in anything printed or in
    any file the job wrote."""
    import os

    import boto3

    from qgate.cli.main import main

    key_id, secret = "AKIAQGATEDISTINCT77", "qgate/Distinct+Secret/Key-9931"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    body = b"".join(r if r.endswith(b"\n") else r + b"\n" for r in _records(400, seed=5)) + b"{not json\n"
    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).put_object(
        Bucket=s3, Key="keys/part-000.jsonl", Body=body
    )
    out = tmp_path / "calib"
    argv = ["calibrate", "sample", "--traffic", f"s3://{s3}/keys/", "--out", str(out), "--calib-size", "32"]
    assert main(argv) == 0
    missing = ["calibrate", "sample", "--traffic", f"s3://{s3}/nothing-here/", "--out", str(tmp_path / "none")]
    assert main(missing) == 1
    printed = capsys.readouterr()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert (out / "rejects.jsonl").stat().st_size > 0 and len(files) > 5
    for s in (key_id, secret):
        assert s not in printed.out + printed.err
        assert [p for p in files if s.encode() in p.read_bytes()] == []
