"""Scan states of unchanged partitions, kept between runs: a scheduled job over a sliding window of partitions scans
only the partitions it has not seen.

    cache = ScanCache(Path("work/cache/scans"), SampleConfig(), tag_file=True)
    key = cache.key(part)                    # None when the store gives no modification time (nothing is cached)
    hit = cache.load(key)                    # (state as JSON, rejects) or None
    cache.sha256(part)                       # the partition's sha256 from its cached scan (None: not cached)
    cache.save(key, doc, rejects); cache.prune()     # prune: entries this cache object did not touch

An entry is two files, each checked against its sha256 (cache.py): the scan (`scan-<key>.json`) and the partition's
sha256 as the scan recorded it (`sha-<key>.json`, a few bytes), so a stage key hashed from the cache reads no scan:
a warm run over a year of hourly partitions reads 8,760 small files, not 8,760 scans of a few MB each.

A partition counts as unchanged when its location, its name below the source's root, its size and its modification
time are (a file rewritten in place keeping both is not noticed). The key also holds the scan's settings, the
versions of the libraries whose behaviour defines a scan, and the hash of qgate.calibrate's own source and of
qgate.chat, so any
change to parsing, scrubbing, words or sampling misses instead of reusing an old scan. An entry is the scan's state
in the JSON form every executor merges (calibrate/state_json.py), checked against its sha256 (cache.py), never a
pickle: a cached partition gives the same artifacts as a fresh scan, byte for byte.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from qgate.calibrate.state_json import FORMAT

_LIBS = ("pyarrow", "datasketches", "phonenumbers", "orjson", "backports.zstd")


@functools.lru_cache(maxsize=1)
def code_sha256() -> str:
    """The source of qgate.calibrate and of qgate.chat (how a request becomes turns), and the versions of the
    libraries a scan's result depends on."""
    import hashlib

    from qgate.artifact import sha256_json, sha256_tree
    from qgate.execute import versions

    here = Path(__file__).parent
    return sha256_json(
        {
            "source": sha256_tree(here, suffix=".py"),
            "chat": hashlib.sha256((here.parent / "chat.py").read_bytes()).hexdigest(),
            "libs": versions(_LIBS),
        }
    )


class ScanCache:
    def __init__(self, root: Path, config, tag_file: bool):
        self.root = Path(root)
        self.settings = {
            "need": config.sample_size,
            "seed": config.seed,
            "min_words": config.min_words,
            "max_line_bytes": config.max_line_bytes,
            "tag_file": tag_file,
        }
        self.used: set[str] = set()

    def key(self, part) -> str | None:
        from qgate.artifact import sha256_json

        ident = part.identity()
        if ident is None:
            return None
        return sha256_json(
            {
                "format": FORMAT,
                "code": code_sha256(),
                "scan": self.settings,
                "partition": {"location": part.location, "name": part.name} | ident,
            }
        )

    def _path(self, key: str) -> Path:
        return self.root / f"scan-{key[:32]}.json"

    def _sha_path(self, key: str) -> Path:
        return self.root / f"sha-{key[:32]}.json"

    def has(self, key: str | None) -> bool:
        return key is not None and self._path(key).exists()

    def sha256(self, part) -> str | None:
        """The partition's sha256 as its cached scan recorded it (of the bytes that scan read), None without a valid
        entry: a source hash built from these reads only the partitions this cache has not seen. It trusts the
        partition's identity exactly as far as reusing its scan does."""
        from qgate.cache import read_cached

        key = self.key(part)
        data = read_cached(self._sha_path(key)) if self.has(key) else None
        return None if data is None else json.loads(data)["sha256"]

    def load(self, key: str) -> tuple[dict, bytes] | None:
        """(state as JSON, rejects bytes), or None when the entry is missing, cut short or edited (then removed)."""
        from qgate.cache import read_cached

        data = read_cached(self._path(key))
        if data is None:
            return None
        self.used.add(key)
        doc = json.loads(data)
        if read_cached(self._sha_path(key)) is None:  # lost or edited beside an intact scan: written again
            self._save_sha(key, doc["state"])
        return doc["state"], doc["rejects"].encode()

    def save(self, key: str | None, doc: dict, rejects: bytes) -> None:
        """doc: a scan's state as `state_json.state_to_json` gives it."""
        from qgate.cache import write_cached

        if key is None:
            return
        write_cached(
            self._path(key), json.dumps({"format": FORMAT, "state": doc, "rejects": rejects.decode()}).encode()
        )
        self._save_sha(key, doc)
        self.used.add(key)

    def _save_sha(self, key: str, doc: dict) -> None:
        from qgate.cache import write_cached

        write_cached(self._sha_path(key), json.dumps({"sha256": doc["partitions"][-1]["sha256"]}).encode())

    def prune(self) -> int:
        """Remove the entries this object neither loaded nor saved (a sliding window's dropped partitions)."""
        keep = {path(k).name for k in self.used for path in (self._path, self._sha_path)}
        gone = 0
        for p in [*self.root.glob("scan-*.json"), *self.root.glob("sha-*.json")]:
            if p.name not in keep:
                p.unlink(missing_ok=True)
                p.with_name(p.name + ".sha256").unlink(missing_ok=True)
                gone += p.name.startswith("scan-")
        return gone
