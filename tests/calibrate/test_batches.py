"""The columnar sampler path: column batches give exactly the records and rejects `read_traffic` gives, the PII hints
only skip what cannot change, and the vectorized word counts equal `profile.words`.

Each fast path has the slow one as its oracle, on hostile input (hypothesis) as well as on real traffic.
"""

import contextlib
import gzip
import json
import os
import random
import re
import sys
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qgate.calibrate import batches, state
from qgate.calibrate.batch import Batch
from qgate.calibrate.batches import read_batches
from qgate.calibrate.columns import PY_SPACE
from qgate.calibrate.reader import read_traffic
from qgate.calibrate.scrub import HINT, RULE_HINTS, rule_hints, scrub
from qgate.calibrate.sources import Partition
from qgate.calibrate.streams import open_decoded
from qgate.calibrate.words import bag_counter, batch_words, text_words, words
from qgate.chat import content_digest

sys.path.insert(0, str(Path(__file__).parent))
from test_traffic_fuzz import _bad  # noqa: E402  the hostile lines the reader is already fuzzed with

FUZZ = settings(
    max_examples=int(os.environ.get("QGATE_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
ROOT = Path(__file__).parents[2]

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
_role = st.sampled_from(["system", "user", "assistant", "tool", "developer", "user"])
_call = st.fixed_dictionaries(
    {"id": st.text(max_size=4), "type": st.just("function")},
    optional={"function": st.fixed_dictionaries({"name": st.text(max_size=8)}, optional={"arguments": _text})},
)
_turn = st.one_of(
    st.fixed_dictionaries({"role": _role, "content": _text}),
    st.fixed_dictionaries(  # tool use: a call (maybe without text or a function), a result, a named turn
        {"role": _role, "content": st.one_of(st.none(), _text)},
        optional={
            "tool_calls": st.lists(_call, max_size=2),
            "tool_call_id": st.text(max_size=4),
            "name": st.text(max_size=4),
        },
    ),
)
_tool = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.text(max_size=8)})},
    optional={"extra": st.none()},
)
_record = st.one_of(
    st.fixed_dictionaries(
        {"messages": st.lists(_turn, min_size=1, max_size=4)},
        optional={
            "tools": st.one_of(st.none(), st.lists(_tool, max_size=2)),
            "route": st.one_of(st.none(), st.text(max_size=5), st.just("r" * 201)),
            "tenant": st.sampled_from(["", "acme", "globex"]),
            "ts": st.one_of(st.integers(0, 2**40), st.floats(0, 2e9)),
            "latency_ms": st.one_of(st.integers(-5, 5000), st.floats(-1, 5e3)),
            "extra": st.integers(),
        },
    ),
    st.fixed_dictionaries({"prompt": _text}, optional={"route": st.sampled_from(["chat", "code"])}),
)


def _records_of(source, max_line_bytes=1 << 20):
    """(accepted records, rejects) from the batch path, in line order."""
    reqs, rejects = [], []
    for b in read_batches(source, max_line_bytes):
        reqs += b.requests()
        rejects += b.rejects
    return reqs, rejects


def _oracle(source, max_line_bytes=1 << 20):
    items = list(read_traffic(source, max_line_bytes))
    return [x for x in items if type(x).__name__ == "Request"], [x for x in items if type(x).__name__ == "Reject"]


@FUZZ
@given(
    good=st.lists(_record, min_size=1, max_size=30),
    bad=st.lists(_bad, max_size=4),
    seed=st.integers(0, 99),
    block=st.sampled_from([64, 512, 1 << 20]),
    crlf=st.booleans(),
)
def test_batches_give_exactly_what_the_line_reader_gives(tmp_path_factory, monkeypatch, good, bad, seed, block, crlf):
    """Valid records of every shape (prompt or messages, turns after the last user turn, labels, numbers), mixed with
    the reader's hostile lines, cut into blocks of any size: the same records, in order, with the same rejects."""
    monkeypatch.setattr(batches, "BLOCK_BYTES", block)
    lines = [json.dumps(r).encode() for r in good] + [b for b, _ in bad]
    random.Random(seed).shuffle(lines)
    path = tmp_path_factory.mktemp("b") / "t.jsonl"
    path.write_bytes((b"\r\n" if crlf else b"\n").join(lines) + b"\n")
    got, want = _records_of(Partition(str(path))), _oracle(path)
    assert got[0] == want[0]
    assert [(r.line, r.reason) for r in got[1]] == [(r.line, r.reason) for r in want[1]]


def test_batches_read_the_demo_traffic_mostly_columnar_and_agree_with_the_line_reader(monkeypatch):
    parsed = []
    real = batches._fast_block
    monkeypatch.setattr(batches, "_fast_block", lambda *a: parsed.append(r := real(*a)) or r)
    got = _records_of(Partition(str(ROOT / "data/demo/traffic.jsonl")))
    assert got == _oracle(ROOT / "data/demo/traffic.jsonl")
    # its 9 lines that are not objects and the other malformed records cost only their own runs of lines
    fast = sum(p.records for p in parsed if p is not None)
    assert fast >= 0.8 * sum(len(x) for x in got), fast


@pytest.mark.parametrize(
    "line",
    [
        b'{"prompt": "a", "note": NaN}',
        b'{"prompt": "a", "x": [Infinity]}',
        b'{"prompt": "a", "prompt": "b"}',
        b'{"prompt": "a"} {"prompt": "b"}',
        b"  ",
        b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x\\u0000"}]}',
        b'{"messages": [{"role": "user", "content": "\\u3000\\u2003 "}]}',
        b'{"prompt": "ok", "ts": "2024-01-01T00:00:00Z"}',
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}]}',
        b'{"messages": [{"role": "user", "content": null}]}',
        b'{"messages": [{"role": "user", "content": "hi"}], "ts": true}',
        b'{"prompt": "a", "deep": ' + b"[" * 100 + b"]" * 100 + b"}",
    ],
)
def test_lines_pyarrow_reads_differently_from_orjson_take_the_line_path(tmp_path, line):
    """Where pyarrow and orjson disagree (NaN, duplicate keys, two values on a line) or the fast checks do not decide (a
    NUL after the last user turn, Unicode-only blank text, ISO timestamps, content parts), the line reader decides."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join([b'{"prompt": "before"}', line, b'{"prompt": "after"}']) + b"\n")
    assert _records_of(Partition(str(path))) == _oracle(path)


def test_a_truncated_gzip_log_keeps_its_whole_lines(tmp_path):
    raw = b"".join(
        json.dumps({"prompt": f"record number {i} of a log cut mid-write"}).encode() + b"\n" for i in range(20000)
    )
    blob = gzip.compress(raw)
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(blob[: len(blob) // 2])
    got, want = _records_of(Partition(str(path))), _oracle(path)
    assert got[0] == want[0] and 0 < len(got[0]) < 20000
    # every whole line the standard library's gzip gets out of the cut file (ISA-L alone drops its last read's output)
    with gzip.open(path, "rb") as f:
        whole = b""
        with contextlib.suppress(EOFError):
            while chunk := f.read1(1 << 16):
                whole += chunk
    assert len(got[0]) == whole.count(b"\n") > 0
    with Partition(str(path)).open() as raw, open_decoded(Partition(str(path)), raw) as f:
        out, size = b"", 1 << 21  # a block's read (ISA-L fails in it), then small ones, as readline makes
        with contextlib.suppress(EOFError):
            while chunk := f.read1(size):
                out, size = out + chunk, 1000
    assert out == whole
    assert [(r.line, r.reason[:40]) for r in got[1]] == [(r.line, r.reason[:40]) for r in want[1]]
    assert "truncated" in got[1][-1].reason


def test_an_over_long_line_is_skipped_with_memory_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(batches, "BLOCK_BYTES", 1 << 20)
    path = tmp_path / "t.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"prompt": "a normal prompt before it"}\n')
        f.write(b'{"prompt": "' + b"x" * (60 << 20) + b'"}\n')
        f.write(b'{"prompt": "a normal prompt after it"}\n')
    tracemalloc.start()
    reqs, rejects = _records_of(Partition(str(path)), max_line_bytes=1 << 20)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [r.line for r in reqs] == [1, 3] and [(r.line, "longer than 1048576" in r.reason) for r in rejects] == [
        (2, True)
    ]
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB for a 1 MiB line limit and 1 MiB blocks"


def test_batch_round_trips_records():
    reqs, _ = _oracle(ROOT / "data/demo/traffic.jsonl")
    b = Batch.from_items(reqs[:50])
    assert b.requests() == reqs[:50] and b.records == 50


# ---- PII hints: the vectorized prefilter only skips rules that cannot change a text -------------------------------


def _labeled_texts() -> list[str]:
    return [json.loads(x)["text"] for x in (ROOT / "data/pii/labeled.jsonl").read_text().splitlines()]


def test_rule_hints_never_change_what_scrub_does():
    """On the labeled PII set, its texts cut and glued together, and the look-alikes: running only the rules whose
    hint matches gives what running every rule gives, and a text no hint matches is left as it is."""
    rows = _labeled_texts()
    rng = random.Random(11)
    texts = rows + [
        "Authorization: BeArEr " + "x" * 24,
        "order #7758975076",
        "at 12:30:45",
        "v1.2.3.4",
        "std::vector<int>",
    ]
    for _ in range(3000):
        a, b = rng.choice(rows), rng.choice(rows)
        texts.append(
            a[rng.randint(0, len(a)) :] + rng.choice(("", " ", "\n", ":", "@", "-")) + b[: rng.randint(0, len(b))]
        )
    flagged = pc.match_substring_regex(pa.array(texts), HINT).to_pylist()
    for t, f, rules in zip(texts, flagged, rule_hints(pa.array(texts)), strict=True):
        full = scrub(t, prefilter=False)
        assert scrub(t, rules=rules) == full, t
        assert f == any(rules)
        if not f:
            assert full == (t, Counter()), t
    assert 0 < sum(flagged) < len(texts)


@FUZZ
@given(text=st.text(st.sampled_from("0123456789٣۷ -.():@+ABCDEFabcdefXYZ_/\n"), max_size=60))
def test_a_text_no_hint_matches_is_left_alone(text):
    rules = rule_hints(pa.array([text]))[0]
    assert scrub(text, rules=rules) == scrub(text, prefilter=False)


def test_re2_classes_equal_pythons():
    """PY_SPACE is what str.isspace() (and str.strip()) call whitespace, and \\p{Nd} covers Python's \\d, code
    point by code point."""
    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    arr = pa.array(chars)
    space = pc.match_substring_regex(arr, f"^[{PY_SPACE}]$").to_numpy(zero_copy_only=False)
    assert np.array_equal(space, np.array([c.isspace() for c in chars]))
    nd = pc.match_substring_regex(arr, r"^\p{Nd}$").to_numpy(zero_copy_only=False)
    digit = np.array([re.match(r"\d", c) is not None for c in chars])
    assert not (digit & ~nd).any()
    assert len(RULE_HINTS) == 10


# ---- words: the vectorized counts are profile.words ---------------------------------------------------------------


@FUZZ
@given(
    texts=st.lists(st.text(st.characters(blacklist_categories=("Cs",)), max_size=50), max_size=20),
    ascii_texts=st.lists(st.text(st.characters(max_codepoint=127), max_size=50), max_size=20),
)
def test_vectorized_words_equal_python_words(texts, ascii_texts):
    """Counts and Counters, plain and weighted (a distinct text standing for its repeats, in two halves)."""
    for fn, src in ((text_words, texts), (lambda t, w=None: batch_words(pa.array(t, pa.string()), w), ascii_texts)):
        ref = [words(t) for t in src]
        counts, [bag] = fn(src)
        assert list(counts) == [len(r) for r in ref]
        assert bag_counter(bag) == Counter(w for r in ref for w in r)
        weights = np.array([[i % 3, (i * 7) % 4] for i in range(len(src))], dtype=np.int64).reshape(-1, 2)
        _, bags = fn(src, weights)
        for j in (0, 1):
            want = Counter()
            for r, wt in zip(ref, weights[:, j].tolist()):
                want.update({w: c * wt for w, c in Counter(r).items()})
            assert bag_counter(bags[j]) == +want


_spacey = st.text(
    st.sampled_from(
        [
            "a",
            "B",
            "é",
            "😀",
            " ",
            "\t",
            "\n",
            "\r",
            "\x0b",
            "\x0c",
            "\x1c",
            "\x1f",
            "\x85",
            "\xa0",
            "\u1680",
            "\u2000",
            "\u200a",
            "\u200b",
            "\u2028",
            "\u3000",
            "\ufeff",
        ]
    ),
    max_size=12,
)


@FUZZ
@given(requests=st.lists(st.lists(_spacey, min_size=1, max_size=4), min_size=1, max_size=12), scrub_some=st.booleans())
def test_vectorized_digests_equal_the_content_digest(requests, scrub_some):
    """Per request, the columnar digest (whitespace runs by RE2, turns joined by pyarrow) is `content_digest` of its
    turns: blank and whitespace-only turns, every kind of Python whitespace and its near misses (U+200B, U+FEFF are
    not whitespace), repeated turns, and scrubbed turns patched into the distinct column."""
    turns = [t for r in requests for t in r]
    enc = pc.dictionary_encode(pa.array(turns, pa.string()))
    ids, distinct = enc.indices.to_numpy(zero_copy_only=False), enc.dictionary
    clean = distinct.to_pylist()
    scrubbed = np.array([scrub_some and i % 2 == 1 for i in range(len(clean))], bool)
    for i in np.flatnonzero(scrubbed).tolist():
        clean[i] = f" [EMAIL]\t{clean[i]}"
    starts = np.cumsum([0] + [len(r) for r in requests], dtype=np.int64)
    digests, halves = state._digests(
        state._patched(distinct, {i: clean[i] for i in np.flatnonzero(scrubbed).tolist()}), ids, starts
    )
    want = [content_digest([clean[t] for t in ids[a:b].tolist()]) for a, b in zip(starts[:-1], starts[1:])]
    assert digests == want
    assert halves.tolist() == [d[0] & 1 for d in want]


def test_words_on_real_text_with_every_script():
    texts = [r.messages[-1][1] for r in _oracle(ROOT / "data/demo/traffic.jsonl")[0]] + [
        "İstanbul ǅemal 😀 𝐀𝟙 ½ Ⅻ ٣ ς\u00a0σ"
    ]
    counts, [bag] = text_words(texts)
    assert list(counts) == [len(words(t)) for t in texts]
    assert bag_counter(bag) == Counter(w for t in texts for w in words(t))


def test_the_code_point_classes_are_res_own():
    """text_words' table (built from str.isalnum and str.isspace) classes every BMP code point as re's \\w and \\s
    do."""
    from qgate.calibrate.words import _bmp_classes, _class_of

    table = _bmp_classes()
    assert [c for c in range(0x10000) if table[c] != _class_of(chr(c))] == []


# ---- Parquet: the same vectorized checks, the row reader as the oracle --------------------------------------------


@FUZZ
@given(good=st.lists(_record, min_size=1, max_size=30))
def test_parquet_batches_give_exactly_what_the_row_reader_gives(tmp_path_factory, good):
    import pyarrow.parquet as pq
    from hypothesis import assume

    try:
        table = pa.Table.from_pylist(good)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):  # rows Parquet cannot hold as one table
        assume(False)
    path = tmp_path_factory.mktemp("pq") / "t.parquet"
    pq.write_table(table, path)
    assert _records_of(Partition(str(path))) == _oracle(path)


def test_parquet_timestamps_take_the_columnar_path_when_their_zone_is_known(tmp_path, monkeypatch):
    """Zoned timestamps become epoch seconds exactly as datetime.timestamp() gives them; naive ones (local time to the
    row reader) and NaN latencies go through parse_record, with its verdicts."""
    import datetime as dt

    import pyarrow.parquet as pq

    columnar = []
    real = batches.accepted_columns
    monkeypatch.setattr(batches, "accepted_columns", lambda t: columnar.append(r := real(t)) or r)
    zone = dt.timezone(dt.timedelta(hours=2))
    base = [{"prompt": f"prompt number {i}", "latency_ms": float(i)} for i in range(50)]
    cases = {
        "zoned": [
            r | {"ts": dt.datetime(2026, 11, 23, 12, 0, i % 60, 123457 * i % 1_000_000, tzinfo=zone)}
            for i, r in enumerate(base)
        ],
        "naive": [r | {"ts": dt.datetime(2026, 11, 23, 12, 0, i % 60)} for i, r in enumerate(base)],
        "nan": [r | {"latency_ms": float("nan") if i % 7 == 0 else r["latency_ms"]} for i, r in enumerate(base)],
    }
    for name, rows in cases.items():
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        columnar.clear()
        got = _records_of(Partition(str(path)))
        assert got == _oracle(path), name
        assert (columnar[0] is not None) == (name != "naive"), name
    assert len(_oracle(tmp_path / "nan.parquet")[1]) == 8  # the NaN latencies are rejected, by parse_record


def test_a_parquet_row_over_the_line_bound_is_rejected_before_python_sees_it(tmp_path, monkeypatch):
    """Rows whose strings (nested in messages, or a top-level prompt) exceed max_line_bytes are rejected by number, in
    both readers, and never reach to_pylist; the rows around them read as they would without them."""
    import pyarrow.parquet as pq

    from qgate.calibrate import reader

    limit = 1 << 16
    rows = [
        {"messages": [{"role": "user", "content": f"question {i} about rivers"}], "route": "chat"} for i in range(40)
    ]
    rows[3]["messages"] = [{"role": "system", "content": "s"}, {"role": "user", "content": "x" * (limit + 1)}]
    rows[17]["route"] = "r" * limit  # with its message, over the bound by a few bytes
    rows[39]["messages"][0]["content"] = "y" * (4 * limit)
    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=16)
    seen = []
    real = reader.table_rows
    monkeypatch.setattr(
        reader, "table_rows", lambda p, f, t: seen.append(int(reader.row_bytes(t).max())) or real(p, f, t)
    )
    reqs, rejects = _oracle(path, limit)
    assert [(r.line, r.reason) for r in rejects] == [
        (n, f"row larger than {limit} bytes (not read)") for n in (4, 18, 40)
    ]
    assert [r.line for r in reqs] == [n for n in range(1, 41) if n not in (4, 18, 40)]
    assert max(seen) <= limit
    assert _records_of(Partition(str(path)), limit) == (reqs, rejects)
    # under a bound that admits them, the rows read whole; the long route is then refused as a label
    ok, bad = _oracle(path, 8 * limit)
    assert len(ok) == 39 and [r.line for r in bad] == [18] and "route" in bad[0].reason
