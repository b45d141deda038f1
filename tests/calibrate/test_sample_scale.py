"""Sampling at scale: state in bounded memory that merges across partitions, traffic in object storage (a real
S3-compatible server on localhost), scan caches, and the same sets from every executor."""

import hashlib
import heapq
import json
import math
import os
import random
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
from traffic_gen import ROUTES, make_records, write_parts

from qgate.calibrate import sketches
from qgate.calibrate.profile import Concurrency
from qgate.calibrate.sample import SampleConfig, sample_traffic
from qgate.calibrate.sketches import DistinctCount, HeavyHitters
from qgate.calibrate.sources import Partition, list_partitions, traffic_sha256
from qgate.calibrate.state import SampleState, scan_partition
from qgate.errors import ConfigError, InputError


def _sets(arts) -> dict:
    """What a sample selects, without where it was read from (file and line differ between one file and partitions)."""

    def rows(a):
        return [
            {k: r[k] for k in ("messages", "route", "stratum")}
            for r in map(json.loads, (a.path / "data.jsonl").read_text().splitlines())
        ]

    return {"calib": rows(arts["calib"]), "shadow": rows(arts["shadow"])}


def test_partitions_merge_to_exactly_the_single_pass_sample(tmp_path):
    records = make_records(6000)
    (tmp_path / "one.jsonl").write_bytes(b"\n".join(records) + b"\n")
    parts = write_parts(tmp_path / "parts", records, [1000, 2500, 2600, 5999])
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
    from qgate.calibrate.state import priorities
    from qgate.chat import content_digest

    monkeypatch.setattr(batches, "BLOCK_BYTES", 8 << 10)
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"\n".join(make_records(3000, seed=2, dup_every=3)) + b"\n")
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
    records = make_records(400, seed=seed, dup_every=5)
    cfg = SampleConfig(calib_size=12, shadow_size=6, seed=seed)
    whole = write_parts(d / "whole", records, [])
    cut = write_parts(d / "cut", records, cuts)

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
        path.write_bytes(b"\n".join(make_records(n, dup_every=10**9)) + b"\n")  # all distinct: a seen-set would grow
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
        write_parts(tmp_path / "parts", make_records(600), [150, 300, 450]),
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
    records = make_records(800)
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
    records = make_records(120, seed=4, dup_every=10**9)  # 120 distinct prompts
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
    hashing, for the standard library's exact tail (streams._Gunzip)."""
    import zlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    from qgate.artifact import sha256_json
    from qgate.calibrate import sources

    d = tmp_path / "logs"
    write_parts(d, make_records(3000, seed=6), [1000, 2000])  # part-000.jsonl, part-001.jsonl.gz, part-002.jsonl
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
    """Every file a sample wrote, but the profile's `source` (the path it was read from) and the artifacts'
    manifests."""
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

    (tmp_path / "t.jsonl").write_bytes(b"\n".join(make_records(100)) + b"\n")
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

    import boto3

    records = make_records(3000, seed=2)
    parts = write_parts(tmp_path / "parts", records, [700, 1900])
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
    write_parts(logs, make_records(300, seed=2), [100, 200])
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


def test_s3_keys_land_in_nothing_a_sampling_job_writes(tmp_path, s3, monkeypatch, capsys):
    """`qgate calibrate sample` from S3 with distinctive keys, one run that works (with a malformed record, so rejects
    are written) and one whose prefix is missing: neither the key id nor the secret appears in anything printed or in
    any file the job wrote."""

    import boto3

    from qgate.cli.main import main

    key_id, secret = "AKIAQGATEDISTINCT77", "qgate/Distinct+Secret/Key-9931"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    body = b"".join(r if r.endswith(b"\n") else r + b"\n" for r in make_records(400, seed=5)) + b"{not json\n"
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
