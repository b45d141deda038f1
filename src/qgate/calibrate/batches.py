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

import numpy as np

from qgate.calibrate.batch import Batch, concat, merge
from qgate.calibrate.columns import MAX_DEPTH, accepted_columns, depth, nonfinite
from qgate.calibrate.reader import (
    PARQUET_BATCH,
    Reject,
    Request,
    lines_of,
    parquet_pieces,
    parse_line,
    parse_row,
    read_traffic,
    table_rows,
    truncated,
)
from qgate.calibrate.sources import PARQUET, Partition, drain
from qgate.calibrate.streams import open_decoded

# decompressed JSONL bytes per block. A block's parsed columns, word splits and strings are transient memory many times
# its size, so peak RSS follows the largest block: smaller blocks keep it flat as the log grows, at a small cost in
# per-block work (benchmarks/RESULTS.md, "Block size").
BLOCK_BYTES = 2 << 20
LINE_BY_LINE = 32  # a run of lines pyarrow cannot parse is halved down to this many, then read line by line


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
    cols = accepted_columns(table)
    if cols is None:
        rows = table_rows(part, first, table)
        return Batch.from_items([parse_row(first + i, r) for i, r in enumerate(rows)])
    ok, batch = cols
    batch.lines += first
    bad = np.flatnonzero(~ok)
    if not len(bad):
        return batch
    import pyarrow as pa

    rows = table_rows(part, first, table.take(pa.array(bad)))
    return merge(
        batch,
        Batch.from_items([parse_row(first + i, r) for i, r in zip(bad.tolist(), rows, strict=True)]),
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
    return concat(
        _parse_block(block[:cut], first, max_line_bytes), _parse_block(block[cut:], first + mid, max_line_bytes)
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
    if table.num_rows != len(starts) or any(depth(f.type) > MAX_DEPTH for f in table.schema):
        return None
    if (b"NaN" in block or b"Infinity" in block) and any(nonfinite(c.combine_chunks()) for c in table.columns):
        return None  # a bare NaN or Infinity somewhere (the words inside a string are fine): orjson rejects the line
    cols = accepted_columns(table)
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
    return merge(batch, Batch.from_items(slow))
