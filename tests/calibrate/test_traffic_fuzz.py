"""Fuzzed and hostile traffic logs: the reader and sampler never crash, keep memory bounded, and account for every line.

Property-based (hypothesis) where the input space is large; explicit cases for the 100 MB line, compressed logs and
Parquet files with the wrong schema.
"""

import gzip
import json
import os
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qgate.calibrate.reader import Reject, Request, read_traffic
from qgate.calibrate.sample import SampleConfig, sample_traffic
from qgate.calibrate.sources import list_partitions
from qgate.errors import InputError

FUZZ = settings(
    max_examples=int(os.environ.get("QGATE_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=60)
_word_text = _text.filter(lambda s: s.strip())
_plain = st.text(
    st.characters(min_codepoint=32, blacklist_characters='"\\', blacklist_categories=("Cs",)), min_size=1, max_size=40
)
_containers = st.one_of(
    st.booleans(), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2)
)
_wrong = st.one_of(
    st.integers(), st.floats(allow_nan=False, allow_infinity=False), _containers
)  # anything but a string
WRONG_FIELD = {
    "route": _wrong,
    "tenant": _wrong,
    "ts": _containers,
    "latency_ms": st.one_of(_containers, st.text(max_size=5), st.integers(max_value=-1)),
}


def _valid(text: str, route: str = "chat") -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": text}], "route": route}).encode()


# each strategy gives (line bytes, expected: "ok" | "reject")
_good = st.builds(lambda t, r: (_valid(t, r), "ok"), _word_text, st.sampled_from(["chat", "code", "search"]))
_bad = st.one_of(
    st.binary(min_size=1, max_size=80)
    .filter(lambda b: b.strip() and b"\n" not in b and b"\r" not in b)
    .map(lambda b: (b"\xff" + b, "reject")),
    st.builds(lambda d: (b"[" * d + b"]" * d, "reject"), st.integers(1100, 5000)),  # nesting beyond 1,024
    st.builds(lambda t: (b'{"prompt": "' + t.encode() + b'\x00x"}', "reject"), _plain),  # raw NUL
    st.builds(lambda t: (json.dumps({"prompt": t + "\x00"}).encode(), "reject"), _word_text),  # escaped NUL
    st.sampled_from(sorted(WRONG_FIELD)).flatmap(
        lambda key: WRONG_FIELD[key].map(
            lambda v: (json.dumps({"messages": [{"role": "user", "content": "hi there"}], key: v}).encode(), "reject")
        )
    ),
    st.builds(lambda v: (json.dumps({"messages": v}).encode(), "reject"), _wrong),
    st.builds(lambda v: (json.dumps({"prompt": v}).encode(), "reject"), _wrong),
    st.builds(lambda v: (json.dumps({"messages": [{"role": "user", "content": v}]}).encode(), "reject"), _wrong),
    st.builds(lambda v: (json.dumps({"messages": [{"role": v, "content": "hello"}]}).encode(), "reject"), _wrong),
)


@FUZZ
@given(data=st.binary(max_size=4000))
def test_random_bytes_never_crash_and_lines_are_numbered(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fz") / "t.jsonl"
    path.write_bytes(data)
    items = list(read_traffic(path))
    lines = len(data.split(b"\n")) if data else 0
    assert all(isinstance(x, (Request, Reject)) for x in items)
    assert all(1 <= x.line <= lines for x in items)
    assert [x.line for x in items] == sorted({x.line for x in items})  # one item per line, in order


@FUZZ
@given(
    lines=st.lists(st.one_of(_good, _bad), min_size=1, max_size=40),
    crlf=st.booleans(),
    bom=st.booleans(),
    truncate=st.booleans(),
)
def test_every_line_is_kept_or_rejected_with_its_number(tmp_path_factory, lines, crlf, bom, truncate):
    """The accounting identity: records = kept + rejected + duplicates + too short, and each bad line is in
    rejects.jsonl with its own line number and a reason."""
    d = tmp_path_factory.mktemp("fz")
    filler = [(_valid(f"filler prompt number {i}", "chat"), "ok") for i in range(4)]  # enough to sample
    body = filler + lines
    if truncate:  # a log cut mid-write: the last line is half a record with no newline
        body = body + [(_valid("this record was cut off by the writer")[:-7], "reject")]
    eol = b"\r\n" if crlf else b"\n"
    raw = eol.join(b for b, _ in body) + (b"" if truncate else eol)
    (d / "t.jsonl").write_bytes((b"\xef\xbb\xbf" if bom else b"") + raw)
    arts = sample_traffic(d / "t.jsonl", d / "out", SampleConfig(calib_size=1, shadow_size=1, max_reject_fraction=1.0))
    stats = arts["calib"].meta["stats"]
    assert stats["records"] == len(body)
    assert stats["records"] == stats.get("kept", 0) + stats.get("rejected", 0) + stats.get("duplicates", 0) + stats.get(
        "too_short", 0
    )
    rejects = [json.loads(x) for x in (d / "out/rejects.jsonl").read_text().splitlines()]
    expected_bad = [i for i, (_, kind) in enumerate(body, 1) if kind == "reject"]
    assert [r["line"] for r in rejects] == expected_bad
    assert all(r["reason"] for r in rejects)


def test_a_100_mb_line_is_rejected_without_being_read_into_memory(tmp_path):
    path = tmp_path / "t.jsonl"
    with open(path, "wb") as f:
        f.write(_valid("a normal prompt before it") + b"\n")
        f.write(b'{"prompt": "' + b"x" * (100 << 20) + b'"}\n')
        f.write(_valid("a normal prompt after it") + b"\n")
    tracemalloc.start()
    items = list(read_traffic(path, max_line_bytes=1 << 20))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [type(x).__name__ for x in items] == ["Request", "Reject", "Request"]
    assert items[1].line == 2 and "longer than 1048576 bytes" in items[1].reason
    assert items[2].line == 3
    assert peak < 4 << 20, f"peak {peak / 2**20:.1f} MiB for a 1 MiB line limit"


def test_a_gzip_bomb_line_stays_bounded_and_is_refused(tmp_path):
    """100 MB of one line compresses to ~100 KB (~1,000x): decompression is streamed, so memory stays at the line
    limit, and the stream is refused as a decompression bomb once it has inflated past the floor (64 MiB); the
    records before it are kept."""
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(_valid("before the bomb") + b'\n{"prompt": "' + b"y" * (100 << 20) + b'"}\n' + _valid("after") + b"\n")
    assert path.stat().st_size < 1 << 20
    tracemalloc.start()
    items = list(read_traffic(path, max_line_bytes=1 << 20))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [type(x).__name__ for x in items] == ["Request", "Reject"] and "decompression bomb" in items[-1].reason
    assert peak < 4 << 20, f"peak {peak / 2**20:.1f} MiB"


def test_an_over_long_line_in_a_compressed_stream_is_skipped_and_reading_goes_on(tmp_path):
    """A 3 MiB line of text that compresses like text (not a bomb) past a 1 MiB line limit: rejected unread, memory
    at the line limit, and the record after it is read."""
    import base64
    import random

    text = base64.b64encode(random.Random(0).randbytes(9 << 18))  # 3 MiB of letters: ~1.3x compressible
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(b'{"prompt": "' + text + b'"}\n' + _valid("after the long line") + b"\n")
    tracemalloc.start()
    items = list(read_traffic(path, max_line_bytes=1 << 20))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [type(x).__name__ for x in items] == ["Reject", "Request"] and "longer than" in items[0].reason
    assert peak < 4 << 20, f"peak {peak / 2**20:.1f} MiB"


def _log(n: int) -> bytes:
    return b"".join(
        _valid(f"compressed traffic prompt number {i} about topic {i % 7}", ["chat", "code"][i % 2]) + b"\n"
        for i in range(n)
    )


def test_gzip_and_zstd_logs_sample_exactly_like_plain_ones(tmp_path):
    from backports.zstd import compress as zstd_compress

    raw = _log(120)
    (tmp_path / "t.jsonl").write_bytes(raw)
    (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "t.jsonl.zst").write_bytes(zstd_compress(raw))
    cfg = SampleConfig(calib_size=30, shadow_size=10)
    shas = {}
    for name in ("t.jsonl", "t.jsonl.gz", "t.jsonl.zst"):
        arts = sample_traffic(tmp_path / name, tmp_path / f"out-{name}", cfg)
        shas[name] = (arts["calib"].sha256, arts["shadow"].sha256)
        assert arts["calib"].meta["stats"] == {"records": 120, "kept": 120}
    assert len(set(shas.values())) == 1
    part = tmp_path / "parts"
    part.mkdir()
    (part / "a.jsonl.gz").write_bytes(gzip.compress(raw[: len(raw) // 2]))
    (part / "b.jsonl.zst").write_bytes(zstd_compress(raw[len(raw) // 2 :]))
    (part / "notes.txt").write_text("not traffic")
    assert [p.name for p in list_partitions(part)] == ["a.jsonl.gz", "b.jsonl.zst"]


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_truncated_compressed_log_keeps_what_it_read_and_says_where_it_stopped(tmp_path, suffix):
    from backports.zstd import compress as zstd_compress

    raw = _log(6000)  # ~0.5 MB: several zstd blocks, so the blocks before the cut decode
    blob = gzip.compress(raw) if suffix == ".gz" else zstd_compress(raw)
    path = tmp_path / f"t.jsonl{suffix}"
    path.write_bytes(blob[: len(blob) * 2 // 3])
    items = list(read_traffic(path))
    kept = [x for x in items if isinstance(x, Request)]
    assert isinstance(items[-1], Reject) and "truncated" in items[-1].reason
    assert items[-1].line == len(kept) + 1 and 0 < len(kept) < 6000
    assert [x.line for x in kept] == list(range(1, len(kept) + 1))


@pytest.mark.parametrize(
    "rows,reason",
    [
        ([{"foo": i} for i in range(20)], "neither 'messages' nor 'prompt'"),
        ([{"prompt": i} for i in range(20)], "'prompt' has type int"),
        ([{"messages": f"text {i}"} for i in range(20)], "'messages' must be a non-empty list"),
        ([{"messages": [f"text {i}"]} for i in range(20)], "messages[0] is not an object"),
        ([{"prompt": f"p {i}", "route": i} for i in range(20)], "'route' has type int"),
        ([{"prompt": f"p {i}", "latency_ms": "slow"} for i in range(20)], "'latency_ms'"),
    ],
)
def test_parquet_with_a_wrong_schema_is_rejected_row_by_row(tmp_path, rows, reason):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    items = list(read_traffic(tmp_path / "t.parquet"))
    assert len(items) == 20 and all(isinstance(x, Reject) and reason in x.reason for x in items)
    assert [x.line for x in items] == list(range(1, 21))
    with pytest.raises(InputError, match="20 of 20 records were rejected"):
        sample_traffic(tmp_path / "t.parquet", tmp_path / "o", SampleConfig(calib_size=1, shadow_size=1))


def test_corrupt_parquet_is_a_clear_error(tmp_path):
    (tmp_path / "t.parquet").write_bytes(b"PAR1" + b"\x00" * 100)
    with pytest.raises(InputError, match="not a readable Parquet file"):
        list(read_traffic(tmp_path / "t.parquet"))


def test_rejects_carry_no_pii(tmp_path):
    lines = [_valid(f"prompt {i} is fine") for i in range(10)] + [
        b'{"prompt": "mail jane.doe@example.com card 4111 1111 1111 1111", "route": 7}'
    ]
    (tmp_path / "t.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    sample_traffic(tmp_path / "t.jsonl", tmp_path / "o", SampleConfig(calib_size=2, shadow_size=2))
    rejects = (tmp_path / "o/rejects.jsonl").read_text()
    assert "'route' has type int" in rejects and "<EMAIL>" in rejects
    assert "jane.doe" not in rejects and "4111" not in rejects
