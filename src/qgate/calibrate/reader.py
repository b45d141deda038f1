"""Stream chat requests out of a production traffic log, one record at a time.

    for item in read_traffic(Path("traffic.jsonl")):  # Request or Reject, never raises on a bad record

Accepts JSONL or Parquet rows holding an OpenAI chat `messages` list or a plain `prompt`
string, with optional `route`, `tenant` and `ts` (ISO-8601 or epoch seconds) and
`latency_ms`. Memory is bounded by one Parquet batch or one line.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from qgate.errors import InputError

ROLES = ("system", "user", "assistant", "tool", "developer")
PARQUET_BATCH = 1024


@dataclass(frozen=True)
class Request:
    line: int                      # 1-based line (JSONL) or row (Parquet) number
    messages: tuple[tuple[str, str], ...]  # (role, content), ending with the last user turn
    route: str
    tenant: str
    ts: float | None               # epoch seconds
    latency_ms: float | None


@dataclass(frozen=True)
class Reject:
    line: int
    reason: str
    excerpt: str


SUFFIXES = (".jsonl", ".json", ".parquet", ".pq")


def traffic_files(where: str | Path) -> list[Path]:
    """A traffic source as files, in a stable order: one file, a glob (`logs/2026-11-*.jsonl`), or a directory of
    partitions (every JSONL or Parquet file under it, recursively, hidden files and rejects skipped)."""
    s = str(where)
    if any(c in s for c in "*?["):
        import glob

        files = sorted(Path(p) for p in glob.glob(s, recursive=True) if Path(p).is_file())
        if not files:
            raise InputError(f"{s}: no traffic files match this pattern", hint="check the glob; quote it so the shell does not expand it")
        return files
    path = Path(where)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES and not p.name.startswith((".", "rejects"))
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise InputError(f"{path}: directory holds no traffic partitions ({', '.join(SUFFIXES)})")
        return files
    if not path.is_file():
        raise InputError(f"{path}: traffic log not found", hint="pass a JSONL or Parquet file, a directory of partitions or a glob")
    return [path]


def read_traffic(path: Path) -> Iterator[Request | Reject]:
    """Records in file order. Checks the file exists now, at the call, not at the first record."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "not found"
        raise InputError(f"{path}: traffic log {what}", hint="pass --traffic with a JSONL or Parquet file")
    return _read_parquet(path) if path.suffix in (".parquet", ".pq") else _read_jsonl(path)


def _read_jsonl(path: Path) -> Iterator[Request | Reject]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            text = raw.decode("utf-8", errors="replace").strip()
            if not text:
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                yield Reject(n, f"invalid JSON ({e.msg} at column {e.colno})", text[:120])
                continue
            yield parse_record(n, obj, text)


def _read_parquet(path: Path) -> Iterator[Request | Reject]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise InputError(f"{path}: not a readable Parquet file ({e})") from e
    n = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH):
        for row in batch.to_pylist():
            n += 1
            yield parse_record(n, row, json.dumps(row, default=str)[:120])


def parse_record(n: int, obj: object, text: str) -> Request | Reject:
    if not isinstance(obj, dict):
        return Reject(n, f"record is a {type(obj).__name__}, not an object", text[:120])
    messages = obj.get("messages")
    if messages is None and isinstance(obj.get("prompt"), str):
        messages = [{"role": "user", "content": obj["prompt"]}]
    if messages is None:
        return Reject(n, "record has neither 'messages' nor 'prompt'", text[:120])
    turns, why = _turns(messages)
    if why:
        return Reject(n, why, text[:120])
    ts, why = _timestamp(obj.get("ts"))
    if why:
        return Reject(n, why, text[:120])
    latency = obj.get("latency_ms")
    return Request(
        line=n, messages=turns, route=str(obj.get("route") or "default"), tenant=str(obj.get("tenant") or "default"),
        ts=ts, latency_ms=float(latency) if isinstance(latency, (int, float)) else None,
    )


def _turns(messages: object) -> tuple[tuple, str | None]:
    if not isinstance(messages, list) or not messages:
        return (), "'messages' must be a non-empty list"
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return (), f"messages[{i}] is not an object"
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            return (), f"messages[{i}].role {role!r} is not one of {ROLES}"
        if isinstance(content, list):  # content parts: keep the text ones
            content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            return (), f"messages[{i}].content is not text"
        turns.append((role, content))
    last_user = max((i for i, (r, _) in enumerate(turns) if r == "user"), default=None)
    if last_user is None or not turns[last_user][1].strip():
        return (), "no non-empty user message"
    return tuple(turns[: last_user + 1]), None


def _timestamp(ts: object) -> tuple[float | None, str | None]:
    if ts is None:
        return None, None
    if isinstance(ts, (int, float)):
        return float(ts), None
    if isinstance(ts, datetime):
        return ts.timestamp(), None
    if isinstance(ts, str):
        try:
            return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp(), None
        except ValueError:
            return None, f"'ts' {ts[:40]!r} is not ISO-8601 or epoch seconds"
    return None, f"'ts' has type {type(ts).__name__}"
