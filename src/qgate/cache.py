"""Cache files that are checked against their sha256 before they are trusted.

    write_cached(path, data)            # data, then <path>.sha256; each written to a temporary name and renamed
    data = read_cached(path)            # None (and both files removed) if missing, truncated, edited or unverifiable
    ref = read_cached_arrays(path)      # the same check for an uncompressed .npz: its arrays, as views of the file

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
    path = Path(path)
    if not path.exists():
        return None
    data = path.read_bytes()
    return data if _verified(path, data) else None


def read_cached_arrays(path: Path) -> dict | None:
    """An .npz cache written by np.savez (uncompressed), checked as `read_cached` checks it: {name: array}, each a
    read-only view of the file mapped into memory, so nothing is copied (a warm gate would otherwise fault in a fresh
    copy of the shadow reference). Compressed members are read by np.load, as copies."""
    import io
    import mmap

    import numpy as np

    path = Path(path)
    if not path.exists():
        return None
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else b""
    if not _verified(path, data):
        return None
    views = _npz_views(data) if data else None
    if views is None:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    return views


def _npz_views(buf) -> dict | None:
    """The arrays of an .npz held in buf (an mmap), as views of it; None if a member is compressed or not a plain array.
    A stored member's bytes follow its local header (30 bytes, its name, its extra field), then the .npy header."""
    import struct
    import zipfile

    import numpy as np
    from numpy.lib import format as npy

    out = {}
    with zipfile.ZipFile(buf) as z:
        for info in z.infolist():
            if info.compress_type != zipfile.ZIP_STORED or not info.filename.endswith(".npy"):
                return None
            name_len, extra_len = struct.unpack_from("<HH", buf, info.header_offset + 26)
            buf.seek(info.header_offset + 30 + name_len + extra_len)
            version = npy.read_magic(buf)
            shape, fortran, dtype = (npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0)(buf)
            if dtype.hasobject:
                return None
            arr = np.frombuffer(buf, dtype, int(np.prod(shape)), buf.tell())
            out[info.filename[:-4]] = arr.reshape(shape, order="F" if fortran else "C")
    return out


def _verified(path: Path, data) -> bool:
    """data (path's bytes) matches path's checksum; else both files are removed, with a line saying why."""
    from qgate.progress import console_err

    side = _sidecar(path)
    expected = side.read_text().strip() if side.exists() else None
    if expected == hashlib.sha256(data).hexdigest():
        return True
    why = "has no checksum" if expected is None else "does not match its checksum (truncated or edited)"
    print(f"  ! cache {path} {why}: recomputing it", file=console_err(), flush=True)
    path.unlink(missing_ok=True)
    side.unlink(missing_ok=True)
    return False
