"""Cache files that are checked against their sha256 before they are trusted.

    write_cached(path, data)            # data, then <path>.sha256; each written to a temporary name and renamed
    data = read_cached(path)            # None (and both files removed) if missing, truncated, edited or unverifiable

Baseline caches (shadow answers and log-probs, eval scores, the noise floor) decide verdicts for every later
candidate, so a cache that was cut short by a crash or edited by hand is recomputed, never used. A cache without
its checksum (killed between the two writes, or written by an older qgate) counts as unverifiable.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_cached(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, data)
    _atomic_write(_sidecar(path), hashlib.sha256(data).hexdigest().encode())


def read_cached(path: Path) -> bytes | None:
    from qgate.progress import console_err

    path = Path(path)
    if not path.exists():
        return None
    data = path.read_bytes()
    side = _sidecar(path)
    expected = side.read_text().strip() if side.exists() else None
    if expected == hashlib.sha256(data).hexdigest():
        return data
    why = "has no checksum" if expected is None else "does not match its checksum (truncated or edited)"
    print(f"  ! cache {path} {why}: recomputing it", file=console_err(), flush=True)
    path.unlink(missing_ok=True)
    side.unlink(missing_ok=True)
    return None
