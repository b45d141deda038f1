"""Where traffic lives: a local file, a glob, a directory of partitions, or an object-store URI, as partitions.

    parts = list_partitions("s3://bucket/logs/2026-11-*/")   # [Partition], in name order
    with parts[0].open(hashlib.sha256()) as f: ...           # a binary stream, every byte read fed to the hash
                                                              # (decompression is the reader's job)
A partition is named by its path below the source's root (`dt=2026-11-01/part-0000.jsonl.gz`): Hive-style logs repeat
file names in every directory, and a sampled row's `file` must say which one it came from.

URIs with a scheme (s3://, gs://, hdfs://, abfs://, file://) go through pyarrow's filesystems, which read credentials
and the endpoint from the environment as the AWS CLI does (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION,
AWS_ENDPOINT_URL for an S3-compatible store). Plain paths stay on the local filesystem.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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


def _glob_root(pattern: str) -> str:
    """The directory part of a glob before its first wildcard: what partition names are relative to."""
    return pattern.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0].rsplit("/", 1)[0]


def _partitions_under(path: Path) -> list[Path]:
    return sorted(
        p for p in path.rglob("*") if p.is_file() and is_traffic_file(p) and not _skipped(p.relative_to(path).parts)
    )


def _local_partitions(where: str | Path) -> list[Partition]:
    """A local traffic source's partitions in a stable order, each at its absolute path (a Ray task, a worker
    process or a later run may have another working directory) and named by its path below the source's root: one
    file (named by itself), a glob (`logs/2026-11-*.jsonl`; a directory it matches, as in `logs/2026-11-*/`, stands for
    the partitions under it; the root is the glob's part before its first wildcard), or a directory of partitions
    (every JSONL or Parquet file under it, recursively, hidden files and rejects skipped)."""
    s = str(where)
    if any(c in s for c in "*?["):
        import glob

        found: set[Path] = set()
        for m in map(Path, glob.glob(s, recursive=True)):
            found.update([m] if m.is_file() else _partitions_under(m) if m.is_dir() else [])
        if not found:
            raise InputError(
                f"{s}: no traffic files match this pattern",
                hint="check the glob; quote it so the shell does not expand it",
            )
        root = Path(_glob_root(s) or ("/" if s.startswith("/") else "."))
        return [Partition(os.path.abspath(p), p.relative_to(root).as_posix(), p.stat().st_size) for p in sorted(found)]
    path = Path(where)
    if path.is_dir():
        files = _partitions_under(path)
        if not files:
            raise InputError(f"{path}: directory holds no traffic partitions ({', '.join(SUFFIXES)})")
        return [Partition(os.path.abspath(p), p.relative_to(path).as_posix(), p.stat().st_size) for p in files]
    if not path.is_file():
        raise InputError(
            f"{path}: traffic log not found", hint="pass a JSONL or Parquet file, a directory of partitions or a glob"
        )
    return [Partition(os.path.abspath(path), "", path.stat().st_size)]


def is_uri(where: str | Path) -> bool:
    return "://" in str(where)


@dataclass(frozen=True, order=True)
class Partition:
    """One traffic file. `location` is a local path or a URI; `name` is what manifests and sampled rows record: its
    path below the source's root (`rel`, posix), or its file name when the source is the file itself."""

    location: str
    rel: str = ""
    # bytes, as listed (None: not known); not part of its identity
    size: int | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        return self.rel or self.location.rstrip("/").rsplit("/", 1)[-1]

    @property
    def remote(self) -> bool:
        return is_uri(self.location)

    def _fs(self):
        try:
            return filesystem_of(self.location)
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError by scheme
            raise InputError(
                f"{self.location}: cannot open this URI ({e})",
                hint="check the scheme and credentials (AWS_* variables for s3://)",
            ) from e

    def open(self, digest=None):
        """A binary stream of the file's bytes; with `digest` (a hashlib object), every byte read from the file is
        fed to it once, in order, so a reader that reads to the end hashes the very bytes it read."""
        if not self.remote and digest is None:
            return open(self.location, "rb")
        if not self.remote:
            stream = io.FileIO(self.location, "rb")
        else:
            filesystem, path = self._fs()
            stream = filesystem.open_input_stream(path, compression=None)
        return io.BufferedReader(_Raw(stream, digest), _CHUNK)

    def open_random_access(self):
        """A seekable file (Parquet reads its footer first)."""
        if not self.remote:
            return open(self.location, "rb")
        filesystem, path = self._fs()
        return filesystem.open_input_file(path)

    def identity(self) -> dict | None:
        """The file's size and modification time, read without opening it; None when the store does not give them
        (or the file is gone: reading it then says so)."""
        if not self.remote:
            try:
                st = os.stat(self.location)
            except OSError:
                return None
            return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        from pyarrow import fs

        filesystem, path = self._fs()
        info = filesystem.get_file_info(path)
        if info.type != fs.FileType.File or info.mtime is None:
            return None
        return {"size": info.size, "mtime": info.mtime.isoformat()}

    def sha256(self) -> str:
        h = hashlib.sha256()
        with self.open(h) as f:
            drain(f)
        return h.hexdigest()


def drain(f) -> None:
    """Read a stream to its end (what a hashing stream has not yet hashed)."""
    while f.read(_CHUNK):
        pass


class _Raw(io.RawIOBase):
    """A pyarrow input stream or a local file as a raw file, so io.BufferedReader gives it a bounded readline();
    every byte read is fed to `digest` when one is given."""

    def __init__(self, stream, digest=None):
        self.stream, self.digest = stream, digest

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.stream.read(len(b))
        b[: len(data)] = data
        if self.digest is not None:
            self.digest.update(data)
        return len(data)

    def close(self) -> None:
        self.stream.close()
        super().close()


# S3 through pyarrow's client (the AWS SDK): its standard retry strategy retries throttling, 5xx answers, dropped
# connections and timeouts with jittered backoff. qgate reads objects only, so every call it makes is idempotent.
S3_ATTEMPTS = 6  # tries per request in all (the SDK's default is 3)
S3_CONNECT_TIMEOUT = 10.0  # seconds to open a connection
S3_REQUEST_TIMEOUT = 60.0  # seconds without an answer before the try counts as failed


def filesystem_of(uri: str):
    """(pyarrow filesystem, path) for a URI; an s3:// one with qgate's retries and timeouts, in the bucket's region,
    unless the URI sets its own options in a query string."""
    from pyarrow import fs

    filesystem, path = fs.FileSystem.from_uri(uri)
    if filesystem.type_name == "s3" and "?" not in uri:
        found = filesystem.__reduce__()[1][0]  # what from_uri resolved: the bucket's region, AWS_ENDPOINT_URL, ...
        where = {k: found[k] for k in _S3_WHERE if found.get(k) is not None}  # credentials stay with the SDK's chain
        filesystem = fs.S3FileSystem(
            **where,
            retry_strategy=fs.AwsStandardS3RetryStrategy(max_attempts=S3_ATTEMPTS),
            connect_timeout=S3_CONNECT_TIMEOUT,
            request_timeout=S3_REQUEST_TIMEOUT,
        )
    return filesystem, path


_S3_WHERE = ("region", "endpoint_override", "scheme", "force_virtual_addressing", "proxy_options", "tls_ca_file_path")


def list_partitions(where: str | Path) -> list[Partition]:
    """Every traffic file of a source, in a stable order, each named by its path below the source's root (a
    directory, or a glob's part before its first wildcard). Fails at the call when there is none."""
    if not is_uri(where):
        return _local_partitions(where)
    from pyarrow import fs

    uri = str(where)
    scheme = uri.split("://", 1)[0]
    pattern = any(c in uri for c in "*?[")
    base_uri = _glob_root(uri) if pattern else uri
    try:
        filesystem, base = filesystem_of(base_uri)
        info = filesystem.get_file_info(base)
    except Exception as e:
        raise InputError(
            f"{uri}: cannot list this URI ({e})",
            hint="check the scheme, bucket and credentials (AWS_* variables for s3://)",
        ) from e
    if info.type == fs.FileType.File and not pattern:
        return [Partition(uri, "", info.size)]
    if info.type == fs.FileType.NotFound:
        raise InputError(f"{uri}: traffic not found", hint="check the bucket and prefix")
    try:
        infos = filesystem.get_file_info(fs.FileSelector(base, recursive=True))
    except Exception as e:
        raise InputError(f"{uri}: cannot list this URI ({e})") from e
    _, path_pattern = uri.split("://", 1)
    if path_pattern.endswith("/"):  # directories the pattern matches stand for everything under them
        path_pattern += "*"
    files = []
    for i in infos:
        if i.type != fs.FileType.File or not is_traffic_file(Path(i.path)):
            continue
        if _skipped(i.path[len(base) :].lstrip("/").split("/")):
            continue
        if pattern and not fnmatch.fnmatchcase(i.path, path_pattern):
            continue
        files.append(Partition(f"{scheme}://{i.path}", i.path[len(base) :].lstrip("/"), i.size))
    if not files:
        raise InputError(f"{uri}: no traffic partitions here ({', '.join(SUFFIXES)})")
    return sorted(files)


def traffic_sha256(
    parts: list[Partition], executor: str = "serial", known: Callable[[Partition], str | None] | None = None
) -> str:
    """The content hash of a traffic source, reading every partition, on an executor (execute.py: on Ray the
    partitions are hashed in parallel, by the workers). A scan hashes what it reads: `combined_sha256` of its
    partitions' hashes is the same value, without this pass. known: a partition's sha256 when it is known without
    reading it (ScanCache.sha256), else None; only the others are read."""
    from qgate.execute import check_executor, map_ordered

    check_executor(executor)  # a bad name fails even when no partition needs reading
    shas = [known(p) if known else None for p in parts]
    todo = [i for i, sha in enumerate(shas) if sha is None]
    if todo:
        hashed = explained(
            map_ordered(partition_sha256, [(parts[i],) for i in todo], executor), [parts[i] for i in todo], executor
        )
        for i, sha in zip(todo, hashed, strict=True):
            shas[i] = sha
    return combined_sha256(list(zip([p.name for p in parts], shas, strict=True)))


def partition_sha256(part: Partition) -> str:
    return part.sha256()


def explained(results: Iterator, parts: list[Partition], executor: str) -> Iterator:
    """`results` of calls that each read one of `parts`, passed through; on Ray, a local partition that a task could
    not find while this machine reads it fails with why: each task reads its partition on the node it runs on."""
    try:
        yield from results
    except (InputError, FileNotFoundError) as e:
        here = [
            p
            for p in parts
            if executor == "ray" and not p.remote and p.location in str(e) and os.path.isfile(p.location)
        ]
        if not here:
            raise
        where = max(here, key=lambda p: len(p.location)).location
        raise InputError(
            f"{where}: a Ray task could not find this local file, which this machine reads: each task reads "
            "its partition on the node it runs on",
            hint="put the traffic where every node of the cluster sees it (an object-store URI such as "
            "s3://bucket/logs/, or a filesystem mounted at the same path on every node), or scan it on "
            "this machine with --executor processes",
        ) from e


def combined_sha256(named: list[tuple[str, str]]) -> str:
    """(partition name, sha256) in partition order: one file's sha256, or the hash of the names and hashes."""
    from qgate.artifact import sha256_json

    return named[0][1] if len(named) == 1 else sha256_json([list(x) for x in named])
