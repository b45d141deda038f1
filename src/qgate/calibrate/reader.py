"""Stream chat requests out of a production traffic log, one record at a time.

    for item in read_traffic(Path("traffic.jsonl.zst")):  # Request or Reject, never raises on a bad record

Accepts JSONL (plain, `.gz` or `.zst`) or Parquet rows holding an OpenAI chat `messages` list (content as text, or
as text-like parts joined by newlines as vLLM joins them, TEXT_PARTS; a request with an image or any other part is
rejected) or a plain `prompt` string, read as a chat request of one user turn (the gates render it with the chat
template, as a chat endpoint serves it; a completions endpoint serves its prompt untemplated, which qgate does not
score), with optional `route`, `tenant` (strings), `ts` (ISO-8601 or epoch seconds) and `latency_ms`.
Tool use is read as OpenAI logs it: a request's `tools` (a list, or its JSON text), and per message `tool_calls`,
`tool_call_id` and `name` (`chat.TOOL_FIELDS`; a tool call's content may be null). A request is kept up to its last
user or tool message (what follows is the logged answer). Tools and tool calls are kept as logged, nulls included (a
JSON schema's `"default": null` is part of the prompt a template writes), except in a Parquet row's nested columns:
these fill every key of the column's type that a row lacks with null, so there keys whose value is null are dropped.
The legacy `function_call` is not read.
Whatever else a line holds (bad UTF-8, NUL bytes, a truncated tail, nesting deeper than orjson's 1,024 levels,
a field of the wrong type, a line longer than `max_line_bytes`) becomes a Reject with its line number and reason.
A record over `max_line_bytes` is rejected unread: a JSONL line is skipped without being held, a Parquet row is
counted on pyarrow's buffers and never converted (pyarrow decodes the data page that holds it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from qgate.calibrate.sources import PARQUET, Partition
from qgate.calibrate.streams import open_decoded
from qgate.errors import InputError

ROLES = ("system", "user", "assistant", "tool", "developer")
PARQUET_BATCH = 1024
MAX_LINE_BYTES = 4 << 20  # 4 MiB: a 128k-token context is ~0.5 MB of text; longer lines are rejected unread
MAX_LABEL_CHARS = 200  # route / tenant: labels, not payloads (each distinct one is a stratum and a profile bin)
_SKIP = 1 << 16  # bytes read at a time while skipping the rest of an over-long line
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Request:
    line: int  # 1-based line (JSONL) or row (Parquet) number
    messages: tuple[tuple[str, str], ...]  # chat.request_turns: (role, text), ending with the last user or tool turn
    route: str
    tenant: str
    ts: float | None  # epoch seconds
    latency_ms: float | None


@dataclass(frozen=True)
class Reject:
    line: int
    reason: str
    excerpt: str  # raw text, not yet scrubbed: the caller scrubs it before writing it anywhere


def read_traffic(source: str | Path | Partition, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[Request | Reject]:
    """Records in file order. A local file is checked now, at the call, not at the first record."""
    part = source if isinstance(source, Partition) else Partition(str(source))
    if not part.remote:
        path = Path(part.location)
        if not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "not found"
            raise InputError(f"{path}: traffic log {what}", hint="pass --traffic with a JSONL or Parquet file")
    return _read_parquet(part, max_line_bytes) if part.name.endswith(PARQUET) else _read_jsonl(part, max_line_bytes)


def lines_of(f, max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) per line; bytes is None for a line longer than max_line_bytes, which is skipped in
    chunks without ever being held whole."""
    n = 0
    while True:
        raw = f.readline(max_line_bytes + 1)
        if not raw:
            return
        n += 1
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            while (rest := f.readline(_SKIP)) and not rest.endswith(b"\n"):
                pass
            yield n, None
            continue
        yield n, raw


def _read_jsonl(part: Partition, max_line_bytes: int) -> Iterator[Request | Reject]:
    n = 0
    try:
        with part.open() as raw_stream, open_decoded(part, raw_stream) as f:
            for n, raw in lines_of(f, max_line_bytes):
                item = parse_line(n, raw, max_line_bytes)
                if item is not None:
                    yield item
    except Exception as e:  # gzip/zstd raise several types for a corrupt or truncated stream
        if not part.name.endswith((".gz", ".zst")):
            raise
        yield truncated(n, e)


STREAM_BROKE = "compressed stream corrupt or truncated"  # how the reason of `truncated`'s Reject begins


def truncated(n: int, e: Exception) -> Reject:
    """The Reject that ends a compressed stream which failed after line n."""
    return Reject(n + 1, f"{STREAM_BROKE} after line {n} ({type(e).__name__}: {e}); the rest of the file is unread", "")


def parse_line(n: int, raw: bytes | None, max_line_bytes: int) -> Request | Reject | None:
    """Line n of a JSONL log (None: longer than max_line_bytes, not read) as a record; None for a blank line."""
    import orjson

    if raw is None:
        return Reject(n, f"line longer than {max_line_bytes} bytes (not read)", "")
    if n == 1 and raw.startswith(_BOM):
        raw = raw[len(_BOM) :]
    raw = raw.strip()
    if not raw:
        return None
    try:
        obj = orjson.loads(raw)  # strict UTF-8, nesting limited to 1,024 levels, integers to 64 bits
    except orjson.JSONDecodeError as e:
        return Reject(n, f"invalid JSON ({e.msg} at column {e.colno})", _excerpt(raw))
    return parse_record(n, obj, raw)


def parse_row(n: int, row: dict) -> Request | Reject:
    """parse_record on a Parquet row (`table_rows`), whose nested columns fill a key a row lacks with null."""
    return parse_record(n, row, row_text(row), filled=True)


def _read_parquet(part: Partition, max_line_bytes: int) -> Iterator[Request | Reject]:
    for first, piece in parquet_pieces(part, PARQUET_BATCH, max_line_bytes):
        if isinstance(piece, Reject):
            yield piece
            continue
        for i, row in enumerate(table_rows(part, first, piece)):
            yield parse_row(first + i, row)


def parquet_pieces(part: Partition, rows: int, max_line_bytes: int) -> Iterator[tuple[int, object]]:
    """`parquet_tables` with every row over `max_line_bytes` (its strings and binaries, nested ones included) taken
    out as a Reject before any of it becomes a Python object: (first row, Table of consecutive rows) or (row, Reject),
    in file order. The bound is the JSONL reader's, so one limit holds for both formats."""
    for first, table in parquet_tables(part, rows):
        big = np.flatnonzero(row_bytes(table) > max_line_bytes)
        start = 0
        for i in big.tolist():
            if i > start:
                yield first + start, table.slice(start, i - start)
            yield first + i, Reject(first + i, f"row larger than {max_line_bytes} bytes (not read)", "")
            start = i + 1
        if start < table.num_rows:
            yield first + start, table.slice(start) if start else table


def row_bytes(table) -> np.ndarray:
    """int64 [rows]: each row's bytes of string and binary data, through lists, maps and structs, plus 8 per other
    value; computed on pyarrow's buffers, without converting a row."""
    total = np.zeros(table.num_rows, dtype=np.int64)
    for column in table.columns:
        total += _array_bytes(column.combine_chunks())
    return total


def _array_bytes(arr) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    t = arr.type
    if pa.types.is_dictionary(t):
        return _array_bytes(arr.dictionary_decode())
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return pc.binary_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t) or pa.types.is_fixed_size_list(t):
        parents = pc.list_parent_indices(arr).to_numpy(zero_copy_only=False)
        return np.bincount(parents, weights=_array_bytes(arr.flatten()), minlength=len(arr)).astype(np.int64)
    if pa.types.is_struct(t):
        out = np.zeros(len(arr), dtype=np.int64)
        for child in arr.flatten():
            out += _array_bytes(child)
        return out
    return np.full(len(arr), 8, dtype=np.int64)


def table_rows(part: Partition, first: int, table) -> list[dict]:
    """A Parquet table's rows as Python objects (what parse_record reads)."""
    try:
        return table.to_pylist()
    except (OSError, ValueError) as e:  # a column pyarrow cannot convert
        raise InputError(
            f"{part.location}: Parquet file unreadable after row {first - 1} ({e})",
            hint="re-export the partition; the rows before it were read",
        ) from e


def parquet_tables(part: Partition, rows: int) -> Iterator[tuple[int, object]]:
    """(number of the first row, a pyarrow Table of up to `rows` rows) in file order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = part.location
    with part.open_random_access() as f:
        try:
            pf = pq.ParquetFile(f)
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise InputError(f"{path}: not a readable Parquet file ({e})") from e
        n = 0
        try:
            for batch in pf.iter_batches(batch_size=rows):
                yield n + 1, pa.Table.from_batches([batch])
                n += batch.num_rows
        except (OSError, ValueError) as e:  # a corrupt page or a column pyarrow cannot convert
            raise InputError(
                f"{path}: Parquet file unreadable after row {n} ({e})",
                hint="re-export the partition; the rows before it were read",
            ) from e


def row_text(row: dict) -> bytes:
    import orjson

    try:
        return orjson.dumps(row, default=str)[:240]
    except TypeError:  # keys or values orjson cannot encode: the excerpt is only for a human reading rejects
        return repr(row)[:240].encode()


def _excerpt(raw: bytes) -> str:
    return raw[:240].decode("utf-8", errors="replace")[:120]


def parse_record(n: int, obj: object, raw: bytes, filled: bool = False) -> Request | Reject:
    """One record: a Request, or a Reject saying why not. filled: a Parquet row (`parse_row`), whose nulls inside
    tools and tool calls are fill, not data, and are dropped."""
    if not isinstance(obj, dict):
        return Reject(n, f"record is a {type(obj).__name__}, not an object", _excerpt(raw))
    messages = obj.get("messages")
    if messages is None and "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            return Reject(n, f"'prompt' has type {type(obj['prompt']).__name__}, not a string", _excerpt(raw))
        messages = [{"role": "user", "content": obj["prompt"]}]
    if messages is None:
        return Reject(n, "record has neither 'messages' nor 'prompt'", _excerpt(raw))
    turns, why = _turns(messages, obj.get("tools"), filled)
    ts, why = (None, why) if why else _timestamp(obj.get("ts"))
    labels = {}
    for key in ("route", "tenant"):
        v = obj.get(key)
        if why is None and v is not None and not isinstance(v, str):
            why = f"'{key}' has type {type(v).__name__}, not a string"
        elif why is None and v is not None and len(v) > MAX_LABEL_CHARS:
            why = f"'{key}' is {len(v)} characters, more than {MAX_LABEL_CHARS}"
        labels[key] = v or "default"
    latency = obj.get("latency_ms")
    if why is None and latency is not None and not (_number(latency) and latency >= 0):
        why = f"'latency_ms' {str(latency)[:40]!r} is not a non-negative number"
    if why:
        return Reject(n, why, _excerpt(raw))
    return Request(
        line=n,
        messages=turns,
        route=labels["route"],
        tenant=labels["tenant"],
        ts=ts,
        latency_ms=None if latency is None else float(latency),
    )


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


TEXT_PARTS = {"text": "text", "input_text": "text", "refusal": "refusal", "thinking": "thinking"}  # type: its field


def _text_parts(parts: list, i: int) -> tuple[str | None, str | None]:
    """A message's content parts as vLLM hands them to a text chat template: plain strings and the text-like parts
    (TEXT_PARTS) joined by newlines. (text, None), or (None, why) for an image, audio or any other part: qgate scores
    text, and the prompt without that part is not the one served."""
    texts = []
    for p in parts:
        if isinstance(p, str):
            texts.append(p)
            continue
        kind = p.get("type") if isinstance(p, dict) else None
        field = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if field is None:
            what = f"a {kind[:40]!r} part" if isinstance(kind, str) else "a part with no type"
            return None, f"messages[{i}].content has {what}: qgate scores text, and the prompt without it is not served"
        if not isinstance(p.get(field), str):
            return None, f"messages[{i}].content has a {kind} part whose {field!r} is not a string"
        texts.append(p[field])
    return "\n".join(texts), None


def _turns(messages: object, tools: object, filled: bool) -> tuple[tuple, str | None]:
    from qgate.chat import request_turns

    if not isinstance(messages, list) or not messages:
        return (), "'messages' must be a non-empty list"
    tools, why = _tools(tools, filled)
    kept = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return (), f"messages[{i}] is not an object"
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            return (), f"messages[{i}].role {str(role)[:40]!r} is not one of {ROLES}"
        if isinstance(content, list):
            content, why = _text_parts(content, i)
            if why:
                return (), why
        fields, why_field = _tool_fields(m, i, filled)
        if why_field:
            return (), why_field
        if content is None and m.get("function_call") and not fields.get("tool_calls"):
            return (), f"messages[{i}] is a legacy 'function_call' with no text content: log the call as 'tool_calls'"
        if content is None and fields.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            return (), f"messages[{i}].content is not text"
        if "\x00" in content:
            return (), f"messages[{i}].content holds NUL characters (a corrupt or binary record)"
        kept.append({"role": role, "content": content} | fields)
    if not any(m["role"] == "user" and m["content"].strip() for m in kept):
        return (), "no non-empty user message"
    last = max(i for i, m in enumerate(kept) if m["role"] in ("user", "tool"))
    if not kept[last]["content"].strip():
        return (), f"the last {kept[last]['role']} message (messages[{last}]) is empty"
    if why:
        return (), why
    try:
        return tuple(request_turns(kept[: last + 1], tools)), None
    except (TypeError, ValueError) as e:  # a Parquet value JSON cannot hold: bytes, a date, NaN
        return (), f"a tool field is not JSON ({e})"


def _without_nulls(value: object) -> object:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _tools(tools: object, filled: bool) -> tuple[list | None, str | None]:
    """A request's tools, or why they cannot be read. Its JSON text is read as the list it holds, nulls kept."""
    if isinstance(tools, str):
        filled = False
        try:
            tools = json.loads(tools)
        except ValueError:
            return None, "'tools' is a string that is not JSON"
    if tools is None or tools == []:
        return None, None
    if not isinstance(tools, list):
        return None, f"'tools' has type {type(tools).__name__}, not a list"
    tools = _without_nulls(tools) if filled else tools
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str)):
            return None, f"tools[{i}] is not a function tool ({{'type': 'function', 'function': {{'name': ...}}}})"
    return tools, None


def _tool_fields(m: dict, i: int, filled: bool) -> tuple[dict, str | None]:
    """The message's tool fields (chat.TOOL_FIELDS; a null field left out, and nulls inside tool calls where
    `filled`; an empty tool_calls dropped), or why not. A call's null arguments are none, as absent ones are."""
    fields = {}
    calls = m.get("tool_calls")
    if calls is not None and calls != []:
        if not isinstance(calls, list):
            return {}, f"messages[{i}].tool_calls has type {type(calls).__name__}, not a list"
        calls = _without_nulls(calls) if filled else calls
        for j, c in enumerate(calls):
            f = c.get("function") if isinstance(c, dict) else None
            if not (isinstance(f, dict) and isinstance(f.get("name"), str)):
                return {}, f"messages[{i}].tool_calls[{j}] has no 'function' with a 'name'"
            if f.get("arguments") is not None and not isinstance(f["arguments"], (str, dict)):
                return {}, f"messages[{i}].tool_calls[{j}].function.arguments is neither JSON text nor an object"
        fields["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        v = m.get(key)
        if v is not None and not isinstance(v, str):
            return {}, f"messages[{i}].{key} has type {type(v).__name__}, not a string"
        if v is not None:
            fields[key] = v
    return fields, None


def _timestamp(ts: object) -> tuple[float | None, str | None]:
    if ts is None:
        return None, None
    if _number(ts):
        return float(ts), None
    if isinstance(ts, datetime):
        return ts.timestamp(), None
    if isinstance(ts, str):
        try:
            return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp(), None
        except (ValueError, OverflowError, OSError):
            return None, f"'ts' {ts[:40]!r} is not ISO-8601 or epoch seconds"
    return None, f"'ts' has type {type(ts).__name__}" + (" (not finite)" if isinstance(ts, float) else "")
