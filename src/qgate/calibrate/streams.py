"""A traffic partition's JSONL bytes from its raw stream: `.gz` and `.zst` decompressed on the fly, bounded.

    with part.open() as raw, open_decoded(part, raw) as f:   # a buffered binary stream of the log's lines
        for n, line in reader.lines_of(f, max_line_bytes): ...

gzip is read by ISA-L where it can be, with the standard library's exact tail after a corrupt stream; zstd by the
backported standard library's reader, which reads every frame. A stream that inflates past MAX_INFLATION times the
compressed bytes read raises DecompressionBomb.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator

from qgate.calibrate.sources import Partition

MAX_INFLATION = 500  # inflated bytes per compressed byte past which a stream is refused (gzip's ceiling is ~1,032)
INFLATION_FLOOR = 64 << 20  # inflated bytes before the ratio is checked: a small file of repeated lines is fine


class DecompressionBomb(ValueError):
    """A compressed stream that inflates past MAX_INFLATION times the compressed bytes read."""


def open_decoded(part: Partition, raw):
    """The file's JSONL bytes from its raw stream, decompressing `.gz` and `.zst` on the fly. A compressed stream that
    has inflated past INFLATION_FLOOR bytes at more than MAX_INFLATION times what it read raises DecompressionBomb:
    memory is bounded by the line limit anyway, but a bomb would keep the job inflating zeros for hours."""
    if not part.name.endswith((".gz", ".zst")):
        return contextlib.nullcontext(raw)
    counted = _Counted(raw)
    if part.name.endswith(".gz"):
        inner = _Gunzip(part, counted)
    else:
        from backports.zstd import ZstdFile  # the standard library's compression.zstd (3.14), backported: reads

        inner = ZstdFile(counted, "rb")  # every frame, and raises EOFError on a truncated one
    return io.BufferedReader(_Bounded(inner, counted), 1 << 16)


class _Counted(io.RawIOBase):
    """`raw`'s bytes, counted as they are read."""

    def __init__(self, raw):
        self.raw, self.n = raw, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = self.raw.readinto(buf) or 0
        self.n += n
        return n


class _Bounded(io.RawIOBase):
    """`inner`'s inflated bytes, counted against the compressed bytes read so far (`counted`)."""

    def __init__(self, inner, counted: _Counted):
        self.inner, self.counted, self.inflated = inner, counted, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = self.inner.readinto(buf) or 0
        self.inflated += n
        if self.inflated > INFLATION_FLOOR:
            read = max(self.counted.n, 1)
            if self.inflated > MAX_INFLATION * read:
                raise DecompressionBomb(
                    f"{self.inflated:,} bytes inflated from {read:,} compressed, over {MAX_INFLATION}x: a "
                    "decompression bomb, refused"
                )
        return n

    def close(self) -> None:
        self.inner.close()
        super().close()


class _Gunzip(io.RawIOBase):
    """A gzip stream inflated by Intel ISA-L (`isal`, faster than the standard library's zlib), whose bytes
    end exactly where the standard library's would. ISA-L drops the output of the read that meets a cut or corrupt
    stream, so after a failure the file is read again with `gzip` (no digest: the raw stream is hashed once, by the
    caller) past what ISA-L gave, up to where it fails; that second read happens for broken files only."""

    def __init__(self, part: Partition, raw):
        from isal import igzip

        self.part, self.fast, self.given = part, igzip.GzipFile(fileobj=raw, mode="rb"), 0
        self.rest: Iterator[bytes] | None = None
        self.pending = b""  # the part of the standard library's last chunk not yet read

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        if self.rest is None:
            try:
                data = self.fast.read1(len(buf))
            except Exception as e:  # gzip/zstd raise several types for a corrupt or truncated stream
                self.rest = self._rest(e)
            else:
                self.given += len(data)
                buf[: len(data)] = data
                return len(data)
        if not self.pending:
            self.pending = next(self.rest, b"")
        n = min(len(buf), len(self.pending))
        buf[:n], self.pending = self.pending[:n], self.pending[n:]
        return n

    def close(self) -> None:
        if self.rest is not None:
            self.rest.close()  # the second reader's file, if it was opened
        self.fast.close()
        super().close()

    def _rest(self, error: Exception) -> Iterator[bytes]:
        """The standard library's bytes after the first `given`, then its error (ISA-L's, should it read on)."""
        import gzip

        with self.part.open() as raw, gzip.GzipFile(fileobj=raw, mode="rb") as f:
            skip = self.given
            while skip and (data := f.read(min(skip, 1 << 20))):
                skip -= len(data)
            while data := f.read1(1 << 20):
                yield data
        raise error
