"""A partition scanned in blocks by many workers (calibrate/split_scan.py) gives exactly what one pass over it gives."""

import gzip
import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from traffic_gen import make_records

from qgate.calibrate import batches, sample, sketches
from qgate.calibrate.sample import SampleConfig, sample_traffic
from qgate.calibrate.sources import list_partitions
from qgate.calibrate.split_scan import scan_partition_split
from qgate.calibrate.state import BottomK
from qgate.calibrate.state_json import scan_partition_json, state_from_json


def _log(tmp_path, fmt: str):
    """6,000 requests (a seventh repeating earlier prompts, some under another route), four of them malformed, and a
    rare route (one request in 200) whose sample is still filling while the others are full."""
    recs = [
        json.dumps(json.loads(r) | {"route": "rare"}).encode() if i % 200 == 7 else r
        for i, r in enumerate(make_records(6000, seed=5))
    ]
    if fmt == "parquet":
        rows = [json.loads(r) for r in recs]
        path = tmp_path / "traffic.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        return path
    for i in (3, 1999, 2000, 4500):
        recs[i] = b'{"messages": [ broken' if i % 2 else b"[1, 2]"
    path = tmp_path / "traffic.jsonl.gz"
    path.write_bytes(gzip.compress(b"\n".join(recs) + b"\n"))
    return path


def _comparable(doc: dict) -> dict:
    """A state document with its HLL sketches as their estimates: a sketch fed every digest and the union of sketches
    fed some each hold the same registers, not the same bytes (the single stream's HIP estimate is not kept)."""
    st = state_from_json(doc)
    return doc | {"distinct": {s: d.estimate() for s, d in st.distinct.items()}, "kept": st.kept.estimate()}


@pytest.fixture
def small_units(monkeypatch):
    """Many blocks (64 KiB) and Parquet tables (1,024 rows), word sketches far past their exact capacity (48
    counters: the profile then depends on the order of its updates), and a count of the rows `BottomK.cut` left out."""
    monkeypatch.setattr(batches, "BLOCK_BYTES", 1 << 16)
    monkeypatch.setattr(batches, "PARQUET_BATCH", 64)
    monkeypatch.setattr(sketches.HeavyHitters.__init__, "__defaults__", (6,))
    cut = {"rows": 0}
    real = BottomK.cut

    def counted(self, limit):
        before = len(self.rows)
        real(self, limit)
        cut["rows"] += before - len(self.rows)

    monkeypatch.setattr(BottomK, "cut", counted)
    return cut


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_partition_scanned_in_blocks_gives_the_one_pass_state(tmp_path, small_units, fmt):
    """Samples, sketches, counts, the order-dependent profile (word sketches past capacity, concurrency) and the
    rejects: equal to the one-pass scan's, while full samples left most rows of later blocks on the workers."""
    part = list_partitions(_log(tmp_path, fmt))[0]
    cfg = SampleConfig(calib_size=12, shadow_size=6, seed=3)
    one, one_rejects = scan_partition_json(part, cfg, False)
    split, split_rejects = scan_partition_split(part, cfg, False, "serial")
    assert _comparable(split) == _comparable(one)
    assert split_rejects == one_rejects and one_rejects.count(b"\n") == (4 if fmt == "jsonl" else 0)
    prof = state_from_json(one).profiler
    assert prof.split[0].max_error() > 0 and prof.concurrency.in_flight  # the order-dependent parts were exercised
    assert small_units["rows"] > 250  # rows that could not enter stayed behind
    assert split["partitions"][0]["sha256"] == hashlib.sha256(part.open().read()).hexdigest()


@pytest.mark.parametrize("executor", ["processes", "ray"])
def test_a_file_too_big_for_its_share_of_the_workers_is_scanned_in_blocks_with_the_same_artifacts(
    tmp_path, small_units, monkeypatch, executor
):
    """`--executor processes` or `ray` on a big file and a small one: the big one is read here and its blocks scanned by
    the workers, the small one scanned whole by a worker, and the calibration, shadow and profile artifacts, the
    profile itself and the rejects equal a serial pass's; a scan cache filled that way gives them again."""
    # the small file is scanned in a worker process, which this test's smaller word sketches would not reach
    monkeypatch.setattr(sketches.HeavyHitters.__init__, "__defaults__", (sketches.HEAVY_LG_MAX,))
    log = tmp_path / "logs"
    log.mkdir()
    _log(log, "jsonl")
    (log / "z-small.jsonl").write_bytes(b"\n".join(make_records(40, seed=9)) + b"\n")
    cfg = SampleConfig(calib_size=12, shadow_size=6, seed=3)
    split_calls, whole = [], []
    monkeypatch.setattr(
        sample, "scan_partition_split", lambda *a, **k: split_calls.append(a[0].name) or scan_partition_split(*a, **k)
    )
    real_map = sample.map_ordered
    monkeypatch.setattr(
        sample,
        "map_ordered",
        lambda fn, calls, executor: whole.append([c[0].name for c in calls]) or real_map(fn, calls, executor),
    )
    serial = sample_traffic(log, tmp_path / "serial", cfg)
    assert not split_calls and whole == [["traffic.jsonl.gz", "z-small.jsonl"]]
    whole.clear()
    runs = {executor: sample_traffic(log, tmp_path / executor, cfg, executor=executor, scan_cache=tmp_path / "scans")}
    assert split_calls == ["traffic.jsonl.gz"] and whole == [["z-small.jsonl"]]
    runs["from the cache"] = sample_traffic(log, tmp_path / "cached", cfg, scan_cache=tmp_path / "scans")
    assert split_calls == ["traffic.jsonl.gz"] and whole == [["z-small.jsonl"]]  # nothing scanned again
    for name, arts in runs.items():
        assert {k: a.sha256 for k, a in arts.items()} == {k: a.sha256 for k, a in serial.items()}, name
        for f in ("profile/profile.json", "rejects.jsonl", "calib/data.jsonl", "shadow/data.jsonl"):
            assert (arts["calib"].path.parent / f).read_bytes() == (tmp_path / "serial" / f).read_bytes(), (name, f)


def test_files_go_in_blocks_when_one_would_hold_up_the_rest():
    """A file that would hold up the others is scanned in blocks, the runs between such files whole (the module's cost
    model); without every size, all files go in blocks only when there are fewer than workers; serially nothing is
    split."""
    from qgate.calibrate.split_scan import phases

    assert phases([90, 5, 5], 2) == [("blocks", [0]), ("parts", [1, 2])]
    assert phases([70, 5, 5, 5, 5, 5, 5], 2) == [("parts", list(range(7)))]  # the other worker scans the rest meanwhile
    assert phases([70, 5, 5, 5, 5, 5, 5], 4) == [("blocks", [0]), ("parts", list(range(1, 7)))]
    assert phases([5, 90, 5, 5], 4) == [("parts", [0]), ("blocks", [1]), ("parts", [2, 3])]
    assert phases([10, 10], 2) == [("parts", [0, 1])]  # each worker takes one: nothing waits
    assert phases([10, 11, 10], 2) == [("parts", [0, 1, 2])]
    assert phases([10, 10, 10, 10, 300], 16) == [("parts", [0, 1, 2, 3]), ("blocks", [4])]
    assert phases([7], 2) == phases([None], 2) == [("blocks", [0])] and phases([0], 2) == [("parts", [0])]
    assert phases([None, 3], 2) == [("parts", [0, 1])] and phases([None, 3], 3) == [("blocks", [0]), ("blocks", [1])]
    assert phases([90, 5], 1) == [("parts", [0, 1])] and phases([], 4) == []


def _count(i: int) -> int:
    return i


@pytest.mark.parametrize("executor", ["serial", "processes"])
def test_calls_are_taken_as_they_are_submitted_not_all_at_once(executor):
    """A scan in blocks hands its blocks out as a stream: map_ordered takes each call when it submits it, a window
    ahead of the result awaited, so the stream is never held whole."""
    from qgate.execute import map_ordered, workers

    taken = []

    def calls():
        for i in range(100):
            taken.append(i)
            yield (i,)

    results = map_ordered(_count, calls(), executor)
    assert next(results) == 0 and len(taken) <= 2 * workers(executor) + 1
    assert list(results) == list(range(1, 100)) and len(taken) == 100


def test_rows_a_full_sample_could_not_take_are_cut_and_the_block_says_so():
    """`BottomK.cut`: rows above the limit leave, and the block's sample is then marked as having left out distinct
    prompts (its stratum's count becomes an estimate, as a one-pass scan would make it); rows at the limit stay (a tie
    is broken by digest, so one may still enter)."""
    bk = BottomK(5)
    for prio in (4, 1, 3, 2):
        bk.offer(prio, bytes([prio]) * 16, ("f", prio), {})
    assert bk.limit() is None and bk.exact()
    bk.cut(9)
    assert len(bk.rows) == 4 and bk.exact()
    bk.cut(2)
    assert sorted(p for p, _, _ in bk.rows.values()) == [1, 2] and not bk.exact()
    assert sorted(-e[0] for e in bk.heap) == [1, 2]
    for prio in (5, 6, 7):
        bk.offer(prio, bytes([prio]) * 16, ("f", prio), {})
    assert bk.limit() == 7


def test_hostile_logs_scanned_in_blocks_equal_one_pass(tmp_path, monkeypatch):
    """Empty, all-malformed, a cut gzip stream, zstd, a line over max_line_bytes (skipped unread), CRLF: the same
    state, counts and rejects as one pass, block by block."""
    from backports import zstd

    monkeypatch.setattr(batches, "BLOCK_BYTES", 1 << 14)
    recs = make_records(800, seed=1)
    body = b"\n".join(recs) + b"\n"
    logs = {
        "empty.jsonl": b"",
        "bad.jsonl": b"{x\n[1]\n\n",
        "cut.jsonl.gz": gzip.compress(body)[:-2000],
        "z.jsonl.zst": zstd.compress(body),
        "crlf.jsonl": body.replace(b"\n", b"\r\n"),
        "long.jsonl": recs[0] + b'\n{"prompt": "' + b"a " * 600_000 + b'"}\n' + body,
    }
    cfg = SampleConfig(calib_size=10, shadow_size=5, max_line_bytes=1 << 20)
    for name, data in logs.items():
        (tmp_path / name).write_bytes(data)
        part = list_partitions(tmp_path / name)[0]
        one, one_rejects = scan_partition_json(part, cfg, False)
        split, split_rejects = scan_partition_split(part, cfg, False, "serial")
        assert _comparable(split) == _comparable(one) and split_rejects == one_rejects, name
        assert dict(one["stats"]).get("rejected", 0) == {"bad.jsonl": 2, "cut.jsonl.gz": 1, "long.jsonl": 1}.get(
            name, 0
        ), name
