"""Sample a calibration set and a disjoint shadow set from a traffic log.

    arts = sample_traffic(Path("traffic.jsonl"), Path("runs/calib"), SampleConfig(calib_size=256, shadow_size=64))

One streaming pass: parse, scrub PII, dedup exactly, profile, and keep per stratum
(route x prompt-length bucket) the records with the smallest seeded hash priority.
That choice does not depend on record order, so the same log and seed give the
same sets. Quotas are then allocated to strata in proportion to their size.
Output: calib/ and shadow/ (calibration-set artifacts), profile/ (traffic-profile),
rejects.jsonl (every malformed record with its line number and reason).
"""
from __future__ import annotations

import hashlib
import heapq
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path


from qgate.artifact import Artifact, sha256_file, sha256_json, typed_config
from qgate.calibrate.profile import TrafficProfiler, length_bucket, words
from qgate.calibrate.reader import MAX_LINE_BYTES, Reject, Request, read_traffic, traffic_files
from qgate.calibrate.scrub import scrub
from qgate.errors import ConfigError, InputError
from qgate.progress import progress


@dataclass(frozen=True)
class SampleConfig:
    calib_size: int = 256
    shadow_size: int = 64
    seed: int = 0
    min_words: int = 1           # prompts shorter than this are dropped (not rejected)
    max_reject_fraction: float = 0.5   # above this the log is probably not what you meant
    max_line_bytes: int = MAX_LINE_BYTES   # a longer JSONL line is rejected without being read into memory
    VERSION = 1

    def __post_init__(self):
        for name in ("calib_size", "shadow_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"calibrate.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_line_bytes < 1024:
            raise ConfigError(f"calibrate.max_line_bytes must be >= 1024, got {self.max_line_bytes}")
        if not 0 < self.max_reject_fraction <= 1:
            raise ConfigError(f"calibrate.max_reject_fraction must be in (0, 1], got {self.max_reject_fraction}")


def _priority(seed: int, key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, key=seed.to_bytes(8, "little")).digest(), "big")


def _allocate(sizes: dict[str, int], total: int) -> dict[str, int]:
    """Largest-remainder proportional allocation, capped by each stratum's size."""
    n = sum(sizes.values())
    total = min(total, n)
    exact = {k: total * v / n for k, v in sizes.items()}
    alloc = {k: min(sizes[k], int(x)) for k, x in exact.items()}
    for k in sorted(sizes, key=lambda k: (alloc[k] - exact[k], k)):
        if sum(alloc.values()) >= total:
            break
        if alloc[k] < sizes[k]:
            alloc[k] += 1
    return alloc


def _records(files: list[Path], max_line_bytes: int):
    """(file, record) over every file; each file is opened when reached, so memory stays one record."""
    for f in files:
        for item in read_traffic(f, max_line_bytes):
            yield f, item


def traffic_sha256(files: list[Path]) -> str:
    """One file: its sha256. Several: the hash of their names and hashes, in order."""
    return sha256_file(files[0]) if len(files) == 1 else sha256_json([[f.name, sha256_file(f)] for f in files])


def sample_traffic(traffic: str | Path, out: Path, config: SampleConfig) -> dict[str, Artifact]:
    """traffic: a file, a glob or a directory of partitions (see reader.traffic_files)."""
    files = traffic_files(traffic)           # a missing log fails here, before anything is created
    many = len(files) > 1
    traffic = Path(str(traffic))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    need = config.calib_size + config.shadow_size
    heaps: dict[str, list] = {}      # stratum -> max-heap (negated priority) of the `need` smallest
    sizes: Counter = Counter()       # stratum -> unique records seen
    seen: set[bytes] = set()         # 16-byte digests of normalized prompts: exact dedup
    stats: Counter = Counter()
    pii: Counter = Counter()
    profiler = TrafficProfiler()
    with open(out / "rejects.jsonl", "w") as rej:
        for path, item in progress(_records(files, config.max_line_bytes), "calibrate: reading traffic", unit="record"):
            stats["records"] += 1
            if isinstance(item, Reject):
                stats["rejected"] += 1
                excerpt, _ = scrub(item.excerpt)     # a rejected record is still production traffic: no PII in rejects
                rej.write(json.dumps({"file": str(path), "line": item.line, "reason": item.reason, "excerpt": excerpt}) + "\n")
                continue
            msgs, found = _scrub_messages(item)
            pii.update(found)
            text = "\n".join(c for _, c in msgs)
            toks = words(text)
            if len(toks) < config.min_words:
                stats["too_short"] += 1
                continue
            digest = hashlib.blake2b(" ".join(text.split()).encode(), digest_size=16).digest()
            if digest in seen:
                stats["duplicates"] += 1
                continue
            seen.add(digest)
            stats["kept"] += 1
            profiler.add(item.route, item.tenant, toks, item.ts, item.latency_ms)
            stratum = f"{item.route}|{length_bucket(len(toks))}"
            sizes[stratum] += 1
            row = {"messages": [{"role": r, "content": c} for r, c in msgs], "route": item.route, "stratum": stratum,
                   "line": item.line} | ({"file": path.name} if many else {})
            entry = (-_priority(config.seed, digest), (path.name, item.line), row)
            heap = heaps.setdefault(stratum, [])
            if len(heap) < need:
                heapq.heappush(heap, entry)
            elif entry[0] > heap[0][0]:
                heapq.heapreplace(heap, entry)
    _check_counts(traffic, stats, sizes, config)
    calib, shadow = _split(heaps, sizes, config)
    params = typed_config(config)
    profile_dir = out / "profile"
    profile_dir.mkdir(exist_ok=True)
    source_name = str(traffic) if not many else f"{traffic} ({len(files)} files)"
    profile = profiler.result() | {"source": source_name, "stats": dict(stats), "pii_scrubbed": dict(pii)}
    (profile_dir / "profile.json").write_text(json.dumps(profile, indent=2))
    source = traffic_sha256(files)
    prof_art = Artifact.create("traffic-profile", profile_dir, params, (source,), {"requests": profile["requests"]})
    arts = {"profile": prof_art}
    for name, rows in (("calib", calib), ("shadow", shadow)):
        d = out / name
        d.mkdir(exist_ok=True)
        (d / "data.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        meta = {"split": name, "n": len(rows), "strata": dict(Counter(r["stratum"] for r in rows)), "stats": dict(stats)}
        arts[name] = Artifact.create("calibration-set", d, params, (source, prof_art.sha256), meta)
    return arts


def _scrub_messages(item: Request) -> tuple[list[tuple[str, str]], Counter]:
    found: Counter = Counter()
    msgs = []
    for role, content in item.messages:
        clean, c = scrub(content)
        found.update(c)
        msgs.append((role, clean))
    return msgs, found


def _check_counts(traffic: Path, stats: Counter, sizes: Counter, config: SampleConfig) -> None:
    if stats["records"] == 0:
        raise InputError(f"{traffic}: no records", hint="is this the right file?")
    frac = stats["rejected"] / stats["records"]
    if frac > config.max_reject_fraction:
        raise InputError(
            f"{traffic}: {stats['rejected']} of {stats['records']} records are malformed ({frac:.0%})",
            hint="see rejects.jsonl for line numbers and reasons; expected OpenAI chat 'messages' or 'prompt' records",
        )
    unique = sum(sizes.values())
    if unique < config.calib_size + config.shadow_size:
        raise InputError(
            f"{traffic}: only {unique} unique usable prompts, need calib_size + shadow_size = "
            f"{config.calib_size + config.shadow_size}",
            hint="lower calibrate.calib_size / calibrate.shadow_size or supply more traffic",
        )


def _split(heaps: dict[str, list], sizes: Counter, config: SampleConfig) -> tuple[list, list]:
    """Shadow first (it is the held-out evidence), then calibration, from disjoint ranks per stratum."""
    shadow_q = _allocate(dict(sizes), config.shadow_size)
    rest = {k: sizes[k] - shadow_q[k] for k in sizes}
    calib_q = _allocate(rest, config.calib_size)
    calib, shadow = [], []
    for stratum in sorted(heaps):
        ranked = [e[2] for e in sorted(heaps[stratum], key=lambda e: (-e[0], e[1]))]
        shadow += ranked[: shadow_q[stratum]]
        calib += ranked[shadow_q[stratum]: shadow_q[stratum] + calib_q[stratum]]
    return calib, shadow
