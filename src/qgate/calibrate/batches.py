"""A traffic partition as column batches: what the sampler reads, at the speed of a columnar JSON parser.

    for batch in read_batches(Partition("logs/part-0.jsonl.gz")):   # Batch: accepted requests as columns, and rejects
        batch.contents, batch.starts, batch.rejects

The records and rejects are exactly those `reader.read_traffic` gives, in the same order; only the shape differs.
A JSONL partition is read in blocks of whole lines (about BLOCK_BYTES), each parsed by pyarrow's JSON reader when it
can be, and line by line with the reader's own rules (orjson, `parse_record`) where it cannot:
- a block is halved, and the halves tried again, down to runs of LINE_BY_LINE lines read line by line, when pyarrow
  cannot parse it (a malformed line, rows of clashing shapes), when its rows do not map one to one onto its lines
  (blank lines, two values on a line), when it holds a line over `max_line_bytes` or a bare NaN or Infinity (pyarrow
  reads them, orjson does not), or when a field the sampler reads has a type the vectorized checks do not cover
  (ISO-8601 `ts` strings, content parts);
- single rows those checks do not accept outright (a missing or blank user turn, a null or non-text content, a NUL
  character, an over-long label, a negative latency) get whatever `parse_record` says of them.
So the vectorized checks only have to be sufficient for acceptance, never exact; the tests hold the two paths equal.
A Parquet partition is read in row groups of 16,384 rows through the same vectorized checks (rows that fail them,
and tables with column types they do not cover, get `parse_record` on the row as `read_traffic` gives it).
Memory: one block (BLOCK_BYTES plus at most `max_line_bytes`), whatever the partition's size.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from qgate.calibrate.reader import (
    MAX_LABEL_CHARS,
    PARQUET_BATCH,
    ROLES,
    Reject,
    Request,
    lines_of,
    open_decoded,
    parquet_pieces,
    parse_line,
    parse_record,
    read_traffic,
    row_text,
    table_rows,
    truncated,
)
from qgate.calibrate.sources import PARQUET, Partition, drain

# decompressed JSONL bytes per block. A block's parsed columns, word splits and strings are transient memory many times
# its size, so peak RSS follows the largest block: smaller blocks keep it flat as the log grows, at a small cost in
# per-block work (benchmarks/RESULTS.md, "Block size").
BLOCK_BYTES = 2 << 20
# Python's whitespace (str.isspace, what str.strip() removes), as an RE2 class; the tests check it code point by point
PY_SPACE = r"\t\n\x0b\x0c\r\x1c-\x20\x85\xa0\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000}"
LINE_BY_LINE = 32  # a run of lines pyarrow cannot parse is halved down to this many, then read line by line
_MAX_DEPTH = 64  # a field nested deeper may be one orjson refuses (1,024 levels): such a block goes line by line


@dataclass
class Batch:
    """Accepted requests as columns (in line order), and the rejected records of the same lines."""

    lines: np.ndarray  # int64 [n]: line (JSONL) or row (Parquet) number
    routes: list[str]
    tenants: list[str]
    ts: np.ndarray  # float64 [n], NaN where the record has none
    latency: np.ndarray  # float64 [n], NaN where the record has none
    roles: list[str]  # [turns]: the turns each request keeps (up to its last user turn), flattened
    contents: object  # pyarrow StringArray [turns]
    starts: np.ndarray  # int64 [n + 1]: request i's turns are [starts[i], starts[i + 1])
    rejects: list[Reject] = field(default_factory=list)

    @property
    def records(self) -> int:
        return len(self.lines) + len(self.rejects)

    @classmethod
    def from_items(cls, items: list[Request | Reject]) -> Batch:
        import pyarrow as pa

        reqs = [x for x in items if isinstance(x, Request)]
        turns = [t for r in reqs for t in r.messages]
        nan = float("nan")
        return cls(
            lines=np.array([r.line for r in reqs], dtype=np.int64),
            routes=[r.route for r in reqs],
            tenants=[r.tenant for r in reqs],
            ts=np.array([nan if r.ts is None else r.ts for r in reqs], dtype=np.float64),
            latency=np.array([nan if r.latency_ms is None else r.latency_ms for r in reqs], dtype=np.float64),
            roles=[role for role, _ in turns],
            contents=pa.array([c for _, c in turns], pa.string()),
            starts=np.cumsum([0] + [len(r.messages) for r in reqs], dtype=np.int64),
            rejects=[x for x in items if isinstance(x, Reject)],
        )

    def requests(self) -> list[Request]:
        """The accepted records as `read_traffic` gives them (for tests and small callers)."""
        contents = self.contents.to_pylist()
        out = []
        for i, line in enumerate(self.lines.tolist()):
            a, b = int(self.starts[i]), int(self.starts[i + 1])
            ts, lat = float(self.ts[i]), float(self.latency[i])
            out.append(
                Request(
                    line=line,
                    messages=tuple(zip(self.roles[a:b], contents[a:b], strict=True)),
                    route=self.routes[i],
                    tenant=self.tenants[i],
                    ts=None if ts != ts else ts,
                    latency_ms=None if lat != lat else lat,
                )
            )
        return out


def read_batches(part: Partition, max_line_bytes: int, digest=None) -> Iterator[Batch]:
    """The partition's records as batches, in file order. digest: a hashlib object that is fed the whole file's
    bytes once the last batch is out: a JSONL file as it is read (the rest of it after a corrupt compressed stream),
    a Parquet file (read by row group, footer first) in one sequential pass after its rows."""
    for unit in read_units(part, max_line_bytes, digest):
        yield unit_batch(part, unit, max_line_bytes)


def read_units(part: Partition, max_line_bytes: int, digest=None) -> Iterator[tuple[str, int, object]]:
    """What `read_batches` parses, unparsed: (kind, first line or row, payload) in file order, each turned into its
    batch by `unit_batch`, in this process or another (a unit pickles). Kinds: "jsonl" (a block of whole lines),
    "parquet" (a table of rows), "items" (records already decided: an over-long line, a cut compressed stream)."""
    if part.name.endswith(PARQUET):
        for first, piece in parquet_pieces(part, PARQUET_BATCH * 16, max_line_bytes):
            yield ("items", first, [piece]) if isinstance(piece, Reject) else ("parquet", first, piece)
        if digest is not None:
            with part.open(digest) as f:
                drain(f)
        return
    read_traffic(part, max_line_bytes)  # a missing local file fails here, at the call, as read_traffic's does
    n = 0
    with part.open(digest) as raw_stream, open_decoded(part, raw_stream) as f:
        try:
            for first, block in _blocks(f, max_line_bytes):
                if block is None:  # one over-long line, skipped unread
                    yield "items", first, [parse_line(first, None, max_line_bytes)]
                    n = first
                    continue
                yield "jsonl", first, block
                n = first + block.count(b"\n") - (1 if block.endswith(b"\n") else 0)
        except Exception as e:  # gzip/zstd raise several types for a corrupt or truncated stream
            if not part.name.endswith((".gz", ".zst")):
                raise
            yield "items", n, [truncated(n, e)]
        if digest is not None:
            drain(raw_stream)


def unit_batch(part: Partition, unit: tuple[str, int, object], max_line_bytes: int) -> Batch:
    """The batch of one unit of `read_units`."""
    kind, first, payload = unit
    if kind == "jsonl":
        return _parse_block(payload, first, max_line_bytes)
    if kind == "parquet":
        return _parquet_batch(part, first, payload)
    return Batch.from_items(payload)


_END = object()


def prefetched(batches: Iterator) -> Iterator:
    """The batches (or units), each read and parsed on a thread while the caller works on the one before
    (decompression and pyarrow's parser release the GIL, so they run beside the caller's Python). Errors arrive in
    order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="qgate-read") as pool:
        ahead = pool.submit(next, batches, _END)
        while (batch := ahead.result()) is not _END:
            ahead = pool.submit(next, batches, _END)
            yield batch


def _parquet_batch(part: Partition, first: int, table) -> Batch:
    """Rows `first`... of a Parquet file: columnar where the vectorized checks accept them, else parse_record's."""
    cols = _columns(table)
    if cols is None:
        rows = table_rows(part, first, table)
        return Batch.from_items([parse_record(first + i, r, row_text(r)) for i, r in enumerate(rows)])
    ok, batch = cols
    batch.lines += first
    bad = np.flatnonzero(~ok)
    if not len(bad):
        return batch
    import pyarrow as pa

    rows = table_rows(part, first, table.take(pa.array(bad)))
    return _merge(
        batch,
        Batch.from_items([parse_record(first + i, r, row_text(r)) for i, r in zip(bad.tolist(), rows, strict=True)]),
    )


def _blocks(f, max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(number of the block's first line, whole lines) in order; (line, None) for a line over max_line_bytes, skipped
    without being held. A block ends at a newline except at the end of the file. When the stream fails, the whole
    lines read before the failure are yielded, then the exception is raised."""
    read = getattr(f, "read1", f.read)  # read1: what one read of the underlying stream gave, so a failure loses no line
    parts: list[bytes] = []  # the bytes read since the last block, in pieces (one join per block)
    size, line, error = 0, 1, None
    while True:
        try:
            chunk = read(BLOCK_BYTES)
        except Exception as e:
            chunk, error = b"", e
        done = not chunk
        if chunk:
            parts.append(chunk)
            size += len(chunk)
            if size < BLOCK_BYTES and (b"\n" in chunk or size <= max_line_bytes):
                continue  # read on to a useful block size
        buf = b"".join(parts)
        parts = []
        cut = len(buf) if done and error is None else buf.rfind(b"\n") + 1  # a failure cut the last line: not a line
        if cut:
            block, buf = buf[:cut], buf[cut:]
            yield line, block
            line += block.count(b"\n")
            del block
        if error is not None:
            raise error
        if done:
            return
        if len(buf) > max_line_bytes:  # the open line is over-long already: skip to its end, holding nothing
            yield line, None
            while b"\n" not in buf:
                buf = read(1 << 16)
                if not buf:
                    return
            buf = buf[buf.index(b"\n") + 1 :]
            line += 1
        parts, size = ([buf] if buf else []), len(buf)


def _parse_block(block: bytes, first: int, max_line_bytes: int) -> Batch:
    """A block, parsed columnar where it can be: a block pyarrow cannot take whole is halved until the parts it can
    take are found, so a malformed line or a row of another shape costs its neighbours little; runs of at most
    LINE_BY_LINE lines that still fail go line by line."""
    fast = _fast_block(block, first, max_line_bytes)
    if fast is not None:
        return fast
    starts, ends = _line_spans(block)
    if len(starts) <= LINE_BY_LINE:
        items = [parse_line(n, raw, max_line_bytes) for n, raw in lines_of(io.BytesIO(block), max_line_bytes)]
        return Batch.from_items([_renumber(x, first - 1) for x in items if x is not None])
    mid = len(starts) // 2
    cut = int(starts[mid])
    return _concat(
        _parse_block(block[:cut], first, max_line_bytes), _parse_block(block[cut:], first + mid, max_line_bytes)
    )


def _concat(a: Batch, b: Batch) -> Batch:
    """Two batches of consecutive lines as one."""
    import pyarrow as pa

    return Batch(
        lines=np.concatenate([a.lines, b.lines]),
        routes=a.routes + b.routes,
        tenants=a.tenants + b.tenants,
        ts=np.concatenate([a.ts, b.ts]),
        latency=np.concatenate([a.latency, b.latency]),
        roles=a.roles + b.roles,
        contents=pa.concat_arrays([a.contents, b.contents]),
        starts=np.concatenate([a.starts, b.starts[1:] + a.starts[-1]]),
        rejects=a.rejects + b.rejects,
    )


def _renumber(item: Request | Reject, offset: int) -> Request | Reject:
    from dataclasses import replace

    return replace(item, line=item.line + offset) if offset else item


def _line_spans(block: bytes) -> tuple[np.ndarray, np.ndarray]:
    nl = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
    ends = nl if block.endswith(b"\n") else np.append(nl, len(block))
    starts = np.concatenate(([0], nl + 1))[: len(ends)]
    return starts, ends


def _fast_block(block: bytes, first: int, max_line_bytes: int) -> Batch | None:
    import pyarrow as pa
    import pyarrow.json as pj

    if first == 1 and block.startswith(b"\xef\xbb\xbf"):
        return None
    starts, ends = _line_spans(block)
    longest = int((ends - starts).max()) if len(ends) else 0
    if longest > max_line_bytes:
        return None
    try:
        table = pj.read_json(
            pa.BufferReader(block), read_options=pj.ReadOptions(use_threads=True, block_size=max(1 << 20, longest + 2))
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, UnicodeDecodeError, ValueError):
        return None
    if table.num_rows != len(starts) or any(_depth(f.type) > _MAX_DEPTH for f in table.schema):
        return None
    if (b"NaN" in block or b"Infinity" in block) and any(_nonfinite(c.combine_chunks()) for c in table.columns):
        return None  # a bare NaN or Infinity somewhere (the words inside a string are fine): orjson rejects the line
    cols = _columns(table)
    if cols is None:
        return None
    ok, batch = cols
    batch.lines += first
    bad = np.flatnonzero(~ok)
    if not len(bad):
        return batch
    # rows the vectorized checks did not accept outright: the line-by-line rules decide them
    slow = []
    for i in bad.tolist():
        item = parse_line(first + i, block[starts[i] : ends[i] + 1], max_line_bytes)
        if item is not None:
            slow.append(item)
    return _merge(batch, Batch.from_items(slow))


def _nonfinite(arr) -> bool:
    import pyarrow as pa
    import pyarrow.compute as pc

    t = arr.type
    if pa.types.is_floating(t):
        return not pc.all(pc.is_finite(arr)).as_py() if arr.null_count < len(arr) else False
    if pa.types.is_struct(t):
        return any(_nonfinite(arr.field(i)) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _nonfinite(arr.flatten())
    return False


def _depth(t) -> int:
    import pyarrow as pa

    if pa.types.is_struct(t):
        return 1 + max((_depth(t.field(i).type) for i in range(t.num_fields)), default=0)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return 1 + _depth(t.value_type)
    return 0


def _merge(a: Batch, b: Batch) -> Batch:
    """The two batches' requests interleaved in line order (b holds few)."""
    import pyarrow as pa

    both = _concat(a, b)
    order = np.argsort(both.lines, kind="stable")
    sizes = np.diff(both.starts)[order]
    take = ranges(both.starts[:-1][order], sizes)
    return Batch(
        lines=both.lines[order],
        routes=[both.routes[i] for i in order.tolist()],
        tenants=[both.tenants[i] for i in order.tolist()],
        ts=both.ts[order],
        latency=both.latency[order],
        roles=[both.roles[i] for i in take.tolist()],
        contents=both.contents.take(pa.array(take, pa.int64())),
        starts=np.concatenate(([0], np.cumsum(sizes))).astype(np.int64),
        rejects=sorted(both.rejects, key=lambda r: r.line),
    )


def ranges(lo: np.ndarray, size: np.ndarray) -> np.ndarray:
    """The concatenation of arange(lo[i], lo[i] + size[i]) over i, without a Python loop."""
    size = np.asarray(size, dtype=np.int64)
    ends = np.cumsum(size)
    return np.repeat(np.asarray(lo, dtype=np.int64) - (ends - size), size) + np.arange(
        int(ends[-1]) if len(ends) else 0
    )


def _string_or_null(col) -> bool:
    import pyarrow as pa

    return col is None or pa.types.is_string(col.type) or pa.types.is_null(col.type)


def _number_or_null(col) -> bool:
    import pyarrow as pa

    return col is None or pa.types.is_floating(col.type) or pa.types.is_integer(col.type) or pa.types.is_null(col.type)


_PER_SECOND = {"s": 1, "ms": 1_000, "us": 1_000_000}


def _epoch_seconds(col):
    """A Parquet timestamp column with a time zone as float epoch seconds (what datetime.timestamp() gives for each
    value, exactly: integer microseconds at most, divided once). A naive one is local time to `parse_record`: it and
    other types stay as they are (and go the row path unless numeric)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if col is None or not pa.types.is_timestamp(col.type) or col.type.tz is None or col.type.unit not in _PER_SECOND:
        return col
    return pc.divide(col.cast(pa.int64()).cast(pa.float64(), safe=False), float(_PER_SECOND[col.type.unit]))


def _columns(table) -> tuple[np.ndarray, Batch] | None:
    """(rows accepted outright, the batch of those rows) from a parsed block; None when a column's type is one the
    vectorized checks do not cover."""
    import pyarrow as pa
    import pyarrow.compute as pc

    names = set(table.column_names)
    col = lambda name: table.column(name).combine_chunks() if name in names else None  # noqa: E731
    messages, prompt = col("messages"), col("prompt")
    route, tenant, ts, latency = col("route"), col("tenant"), _epoch_seconds(col("ts")), col("latency_ms")
    if not all(_string_or_null(c) for c in (prompt, route, tenant)) or not all(
        _number_or_null(c) for c in (ts, latency)
    ):
        return None
    n = table.num_rows
    if messages is not None and not pa.types.is_null(messages.type):
        t = messages.type
        if not (
            pa.types.is_list(t)
            and pa.types.is_struct(t.value_type)
            and all(
                t.value_type.get_field_index(k) >= 0 and pa.types.is_string(t.value_type.field(k).type)
                for k in ("role", "content")
            )
        ):
            return None
        has_msgs = messages.is_valid().to_numpy(zero_copy_only=False)
    else:
        messages, has_msgs = None, np.zeros(n, dtype=bool)
    has_prompt = (
        prompt.is_valid().to_numpy(zero_copy_only=False)
        if prompt is not None and not pa.types.is_null(prompt.type)
        else np.zeros(n, bool)
    )
    use_prompt = ~has_msgs & has_prompt
    ok = has_msgs | use_prompt

    # turns: each row's messages, or its prompt as one user turn
    if messages is not None:
        msg_off = messages.offsets.to_numpy().astype(np.int64)
        flat = messages.values
        flat_valid = flat.is_valid().to_numpy(zero_copy_only=False)
        m_role, m_content = flat.field("role"), flat.field("content")
        m_ok = (
            flat_valid
            & m_role.is_valid().to_numpy(zero_copy_only=False)
            & m_content.is_valid().to_numpy(zero_copy_only=False)
        )
        m_ok &= pc.is_in(m_role, value_set=pa.array(ROLES)).fill_null(False).to_numpy(zero_copy_only=False)
        lo, hi = msg_off[:-1], msg_off[1:]
        per_row_len = np.where(has_msgs, hi - lo, 0)
        ok &= ~has_msgs | (per_row_len > 0)
        bad_before = (
            np.concatenate(([0], np.cumsum(~m_ok[msg_off[0] : msg_off[-1]]))) if len(flat) else np.zeros(1, np.int64)
        )
        base = msg_off[0]
        ok &= ~has_msgs | (bad_before[hi - base] == bad_before[lo - base])
        # a NUL in any turn rejects the record, kept turn or not
        m_nul = (
            pc.match_substring(m_content, "\x00").fill_null(False).to_numpy(zero_copy_only=False)
            if len(flat)
            else np.zeros(0, bool)
        )
        nul_before = np.concatenate(([0], np.cumsum(m_nul[base : msg_off[-1]])))
        ok &= ~has_msgs | (nul_before[hi - base] == nul_before[lo - base])
        is_user = pc.equal(m_role, "user").fill_null(False).to_numpy(zero_copy_only=False)[: msg_off[-1]]
        user_pos = np.where(is_user, np.arange(len(is_user), dtype=np.int64), -1)
        last_user = np.full(n, -1, dtype=np.int64)
        nz = has_msgs & (per_row_len > 0)
        if nz.any():  # segments [lo, next lo) of the non-empty rows are exactly their own turns
            last_user[nz] = np.maximum.reduceat(user_pos, lo[nz])
        ok &= ~has_msgs | (last_user >= 0)
    # the turns kept: a row's messages up to its last user turn, or its prompt
    rows = np.flatnonzero(ok)
    if messages is not None:
        keep_lo = np.where(use_prompt, 0, msg_off[:-1])
        keep_n = np.where(use_prompt, 1, last_user - msg_off[:-1] + 1)
    else:
        keep_lo, keep_n = np.zeros(n, np.int64), np.ones(n, np.int64)
    keep_n = keep_n[rows]
    starts = np.concatenate(([0], np.cumsum(keep_n))).astype(np.int64)
    prompt_rows = use_prompt[rows]
    if messages is not None and (~prompt_rows).any():
        msg_rows = rows[~prompt_rows]
        turn_idx = ranges(keep_lo[msg_rows], keep_n[~prompt_rows])
    else:
        turn_idx = np.zeros(0, np.int64)
    # gather contents and roles in row order: prompt rows from `prompt`, message rows from the flattened messages
    pieces, roles = [], []
    if prompt_rows.all():
        contents = prompt.take(pa.array(rows)) if len(rows) else pa.array([], pa.string())
        roles = ["user"] * len(rows)
    else:
        m_texts = m_content.take(pa.array(turn_idx))
        m_roles = m_role.take(pa.array(turn_idx)).to_pylist()
        if not prompt_rows.any():
            contents, roles = m_texts, m_roles
        else:  # interleave (rare: a block mixing prompt and messages rows)
            p_texts = prompt.take(pa.array(rows[prompt_rows])).to_pylist()
            mt, pt, mr = m_texts.to_pylist(), iter(p_texts), iter(m_roles)
            pos = 0
            for is_p, k in zip(prompt_rows.tolist(), keep_n.tolist()):
                if is_p:
                    pieces.append(next(pt))
                    roles.append("user")
                else:
                    pieces += mt[pos : pos + k]
                    roles += [next(mr) for _ in range(k)]
                    pos += k
            contents = pa.array(pieces, pa.string())
    # per row: its last kept turn (the last user turn, or the prompt) is not blank by Python's strip(); a prompt has
    # no NUL (messages rows were checked above, over all their turns)
    good = np.ones(len(rows), bool)
    if len(contents):
        good &= pc.match_substring_regex(contents, f"[^{PY_SPACE}]").to_numpy(zero_copy_only=False)[starts[1:] - 1]
        good &= ~(pc.match_substring(contents, "\x00").to_numpy(zero_copy_only=False)[starts[1:] - 1] & prompt_rows)
    labels = {}
    for name, c in (("route", route), ("tenant", tenant)):
        if c is None or pa.types.is_null(c.type):
            labels[name] = ["default"] * len(rows)
            continue
        sub = c.take(pa.array(rows))
        good &= ~pc.fill_null(pc.greater(pc.utf8_length(sub), MAX_LABEL_CHARS), False).to_numpy(zero_copy_only=False)
        labels[name] = [v or "default" for v in sub.to_pylist()]
    nums = {}
    for name, c in (("ts", ts), ("latency_ms", latency)):
        if c is None or pa.types.is_null(c.type):
            nums[name] = np.full(len(rows), np.nan)
            continue
        sub = c.take(pa.array(rows))
        # an integer beyond 2**53 rounds to the nearest float, as float(int) does in parse_record
        v = sub.cast(pa.float64(), safe=False).fill_null(np.nan).to_numpy(zero_copy_only=False)
        present = sub.is_valid().to_numpy(zero_copy_only=False)
        good &= ~present | np.isfinite(v)
        if name == "latency_ms":
            good &= ~present | (v >= 0)
        nums[name] = v
    if not good.all():  # those rows go line by line: drop them here
        keep = np.flatnonzero(good)
        ok[rows[~good]] = False
        take = ranges(starts[keep], keep_n[keep])
        contents = contents.take(pa.array(take, pa.int64()))
        roles = [roles[i] for i in take.tolist()]
        starts = np.concatenate(([0], np.cumsum(keep_n[keep]))).astype(np.int64)
        rows = rows[keep]
        labels = {k: [v[i] for i in keep.tolist()] for k, v in labels.items()}
        nums = {k: v[keep] for k, v in nums.items()}
    return ok, Batch(
        lines=rows.astype(np.int64),
        routes=labels["route"],
        tenants=labels["tenant"],
        ts=nums["ts"],
        latency=nums["latency_ms"],
        roles=roles,
        contents=contents,
        starts=starts,
    )
