"""Where traffic lives: a local file, a glob, a directory of partitions, or an object-store URI, as partitions.

    parts = list_partitions("s3://bucket/logs/2026-11-*/")   # [Partition], in name order
    with parts[0].open() as f: ...                            # a binary stream (decompression is the reader's job)

URIs with a scheme (s3://, gs://, hdfs://, abfs://, file://) go through pyarrow's filesystems, which read credentials
and the endpoint from the environment as the AWS CLI does (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION,
AWS_ENDPOINT_URL for an S3-compatible store). Plain paths stay on the local filesystem.
"""
from __future__ import annotations

import fnmatch
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

from qgate.errors import InputError

_CHUNK = 1 << 20
JSONL = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
PARQUET = (".parquet", ".pq")
SUFFIXES = JSONL + PARQUET


def is_traffic_file(p: Path) -> bool:
    return p.name.endswith(SUFFIXES)


def _skipped(rel_parts: tuple[str, ...] | list[str]) -> bool:
    """A file under a partition directory that is not traffic: hidden (itself or a folder on its way) or rejects."""
    return any(part.startswith(".") for part in rel_parts) or rel_parts[-1].startswith("rejects")


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
        files = sorted(p for p in path.rglob("*") if p.is_file() and is_traffic_file(p) and not _skipped(p.relative_to(path).parts))
        if not files:
            raise InputError(f"{path}: directory holds no traffic partitions ({', '.join(SUFFIXES)})")
        return files
    if not path.is_file():
        raise InputError(f"{path}: traffic log not found", hint="pass a JSONL or Parquet file, a directory of partitions or a glob")
    return [path]


def is_uri(where: str | Path) -> bool:
    return "://" in str(where)


@dataclass(frozen=True, order=True)
class Partition:
    """One traffic file. `location` is a local path or a URI; `name` is its file name (what manifests record)."""
    location: str

    @property
    def name(self) -> str:
        return self.location.rstrip("/").rsplit("/", 1)[-1]

    @property
    def remote(self) -> bool:
        return is_uri(self.location)

    def _fs(self):
        from pyarrow import fs

        try:
            return fs.FileSystem.from_uri(self.location)
        except Exception as e:   # pyarrow raises ArrowInvalid / OSError by scheme
            raise InputError(f"{self.location}: cannot open this URI ({e})",
                             hint="check the scheme and credentials (AWS_* variables for s3://)") from e

    def open(self):
        """A binary stream of the file's bytes."""
        if not self.remote:
            return open(self.location, "rb")
        filesystem, path = self._fs()
        return io.BufferedReader(_Raw(filesystem.open_input_stream(path, compression=None)), _CHUNK)

    def open_random_access(self):
        """A seekable file (Parquet reads its footer first)."""
        if not self.remote:
            return open(self.location, "rb")
        filesystem, path = self._fs()
        return filesystem.open_input_file(path)

    def sha256(self) -> str:
        h = hashlib.sha256()
        with self.open() as f:
            while block := f.read(_CHUNK):
                h.update(block)
        return h.hexdigest()


class _Raw(io.RawIOBase):
    """A pyarrow input stream as a raw file, so io.BufferedReader gives it a bounded readline()."""

    def __init__(self, stream):
        self.stream = stream

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.stream.read(len(b))
        b[:len(data)] = data
        return len(data)

    def close(self) -> None:
        self.stream.close()
        super().close()


def list_partitions(where: str | Path) -> list[Partition]:
    """Every traffic file of a source, in a stable order. Fails at the call when there is none."""
    if not is_uri(where):
        return [Partition(str(p)) for p in traffic_files(where)]
    from pyarrow import fs

    uri = str(where)
    scheme = uri.split("://", 1)[0]
    pattern = any(c in uri for c in "*?[")
    base_uri = uri.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0].rsplit("/", 1)[0] if pattern else uri
    try:
        filesystem, base = fs.FileSystem.from_uri(base_uri)
        info = filesystem.get_file_info(base)
    except Exception as e:
        raise InputError(f"{uri}: cannot list this URI ({e})", hint="check the scheme, bucket and credentials (AWS_* variables for s3://)") from e
    if info.type == fs.FileType.File and not pattern:
        return [Partition(uri)]
    if info.type == fs.FileType.NotFound:
        raise InputError(f"{uri}: traffic not found", hint="check the bucket and prefix")
    try:
        infos = filesystem.get_file_info(fs.FileSelector(base, recursive=True))
    except Exception as e:
        raise InputError(f"{uri}: cannot list this URI ({e})") from e
    _, path_pattern = uri.split("://", 1)
    files = []
    for i in infos:
        if i.type != fs.FileType.File or not is_traffic_file(Path(i.path)):
            continue
        if _skipped(i.path[len(base):].lstrip("/").split("/")):
            continue
        if pattern and not fnmatch.fnmatchcase(i.path, path_pattern):
            continue
        files.append(Partition(f"{scheme}://{i.path}"))
    if not files:
        raise InputError(f"{uri}: no traffic partitions here ({', '.join(SUFFIXES)})")
    return sorted(files)


def traffic_sha256(parts: list[Partition]) -> str:
    """One file: its sha256. Several: the hash of their names and hashes, in order."""
    from qgate.artifact import sha256_json

    return parts[0].sha256() if len(parts) == 1 else sha256_json([[p.name, p.sha256()] for p in parts])
