"""Sample a calibration set and a disjoint shadow set from a traffic log of any size.

    config = SampleConfig(calib_size=256, shadow_size=64)
    arts = sample_traffic("s3://bucket/logs/", Path("runs/calib"), config, executor="ray")

Each partition (file) is scanned once, on its own (calibrate/state.py), or in blocks by every worker when it is too
big for its share of them (calibrate/split_scan.py): parse, scrub PII, profile, and keep per stratum (route x
prompt-length bucket) the distinct prompts with the smallest seeded hash priority, with an HLL sketch of every
distinct prompt. The states merge in partition order on this machine, each rebuilt from one JSON form
(calibrate/state_json.py) whichever process scanned it or whether a scan cache kept it (calibrate/scan_cache.py), so
serial, local-process, Ray and cached runs write the same artifacts, and the choice does not depend on record order.
Quotas go to strata in proportion to their
distinct prompts: counted exactly while a stratum's sample is not full, estimated by its sketch beyond (the
calibration set's `estimates` says which, with bounds). Memory is bounded by the sample size, not the log.
Each partition is read once: its scan hashes the bytes it reads, and the source's content hash (the artifacts' parent)
is made of those, so it describes exactly what was sampled. A sampled row's `file` (logs of several files) is the
partition's path below the source's root, and `line` its line there.
Output: calib/, shadow/ and, with a search_size, search/ (calibration-set artifacts), profile/ (traffic-profile),
rejects.jsonl (every malformed record with its file, line number and reason). `load_sampled(out)` reads them back.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from qgate.artifact import Artifact, typed_config
from qgate.calibrate.reader import MAX_LINE_BYTES, STREAM_BROKE
from qgate.calibrate.scan_cache import ScanCache
from qgate.calibrate.sources import combined_sha256, explained, is_uri, list_partitions
from qgate.calibrate.split_scan import phases, scan_partition_split
from qgate.calibrate.state import SampleState
from qgate.calibrate.state_json import scan_partition_json, state_from_json
from qgate.chat import row_digest
from qgate.errors import InputError, check_each
from qgate.execute import check_executor, map_ordered, workers
from qgate.naming import field_namer
from qgate.progress import progress

SPLITS = ("calib", "shadow", "search")  # the calibration-set artifacts, by directory name under `out`


def load_sampled(out: Path) -> dict[str, Artifact]:
    """The artifacts `sample_traffic` wrote under `out`, by name: calib, shadow, profile and, when sampled, search."""
    out = Path(out)
    arts = {"profile": Artifact.load(out / "profile", "traffic-profile")}
    return arts | {s: Artifact.load(out / s, "calibration-set") for s in SPLITS if (out / s).is_dir()}


def split_rows(split: Artifact) -> list[dict]:
    """The requests of a split `sample_traffic` wrote (its data.jsonl), in order."""
    return [json.loads(line) for line in (split.path / "data.jsonl").read_text().splitlines() if line.strip()]


def split_prompts(split: Artifact) -> list[str]:
    """The chat.prompt_digest of every request in a split, sorted: what a checkpoint made with it records
    (`calibration_prompts`, a search's `search_prompts`), so that a gate leaves those requests out of a later
    sample's shadow split (gates/held_out.py)."""
    return sorted({row_digest(row) for row in split_rows(split)})


@dataclass(frozen=True)
class SampleConfig:
    calib_size: int = 256  # prompts in the calibration set quantization runs on
    shadow_size: int = 64  # held-out prompts the gates score on, disjoint from the calibration set
    search_size: int = 0  # a third held-out split, disjoint from both: where `qgate search` chooses its point
    seed: int = 0  # of the sample's priorities: the same seed and traffic give the same sets
    min_words: int = 1  # prompts shorter than this are dropped (not rejected)
    max_reject_fraction: float = 0.5  # above this the log is probably not what you meant
    max_line_bytes: int = MAX_LINE_BYTES  # a longer JSONL line is rejected without being read into memory
    VERSION = 3

    def __post_init__(self):
        at_least = {"calib_size": 1, "shadow_size": 1, "search_size": 0, "seed": 0, "min_words": 0}
        check_each(
            *((getattr(self, k) < low, f"{k} must be >= {low}, got {getattr(self, k)}") for k, low in at_least.items()),
            (self.max_line_bytes < 1024, f"max_line_bytes must be >= 1024, got {self.max_line_bytes}"),
            (
                not 0 < self.max_reject_fraction <= 1,
                f"max_reject_fraction must be in (0, 1], got {self.max_reject_fraction}",
            ),
        )

    @property
    def sample_size(self) -> int:
        """Unique prompts drawn in all: the calibration, shadow and search splits."""
        return self.calib_size + self.shadow_size + self.search_size


def _allocate(sizes: dict[str, int], total: int, caps: dict[str, int]) -> dict[str, int]:
    """Largest-remainder allocation in proportion to `sizes`, each stratum capped by the rows it has (`caps`)."""
    n = sum(sizes.values())
    total = min(total, sum(caps.values()))
    exact = {k: total * v / n for k, v in sizes.items()}
    alloc = {k: min(caps[k], int(x)) for k, x in exact.items()}
    while sum(alloc.values()) < total:
        open_ = [k for k in sizes if alloc[k] < caps[k]]
        for k in sorted(open_, key=lambda k: (alloc[k] - exact[k], k)):
            if sum(alloc.values()) >= total:
                break
            alloc[k] += 1
    return alloc


def sample_traffic(
    traffic: str | Path,
    out: Path,
    config: SampleConfig,
    executor: str = "serial",
    scan_cache: Path | None = None,
    parts: list | None = None,
    picture: bool = False,
    failed_rejects: Path | None = None,
    field_name=None,
    held_from: frozenset[str] | tuple[str, ...] = (),
) -> dict[str, Artifact]:
    """traffic: a file, a glob, a directory of partitions or an object-store URI (calibrate/sources.py).
    executor: "serial"; "processes" to scan partitions in one local process per core; or "ray" to scan them as Ray
    tasks (execute.py). A partition too big for its share of the workers (one file, or one much larger than the rest)
    is read here and its blocks are scanned by the workers instead (calibrate/split_scan.py). Every executor gives the
    same artifacts.
    scan_cache: a directory of earlier scans (calibrate/scan_cache.py): partitions unchanged since are not read
    again, the artifacts are the same, and entries this run did not use are removed afterwards.
    parts: `list_partitions(traffic)` when the caller has listed it already (a pipeline keys its stage by them).
    picture: also write out/profile.png (calibrate/profile_plot.py), beside the artifacts, not in them.
    failed_rejects: where rejects.jsonl goes when the traffic fails the sample's checks (too many malformed records,
    too few prompts), for a caller whose `out` is removed on failure (artifact.build_atomically); the error names it.
    A successful run removes an earlier run's file there.
    field_name: how an error names a setting of `config` (`calibrate.calib_size` by default; a command names its
    flag, `--calib-size`), as naming.build_config does.
    held_from: requests (chat.prompt_digest keys, a checkpoint's `calibration_prompts`) the shadow split leaves to the
    other splits, so that a model calibrated on them can be gated on it; the shadow split's meta says how many there
    were and how many the other splits hold (`held_from`)."""
    check_executor(executor)
    if parts is None:
        parts = list_partitions(traffic)  # a missing log fails here, before anything is created
    many = len(parts) > 1
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = SampleState.empty(config)
    cache = ScanCache(scan_cache, config, many) if scan_cache is not None else None
    keys = [cache.key(p) for p in parts] if cache else [None] * len(parts)
    fresh = [i for i, k in enumerate(keys) if not (cache and cache.has(k))]
    scans = explained(_scans([parts[i] for i in fresh], config, many, executor), [parts[i] for i in fresh], executor)
    states = _in_order(parts, keys, set(fresh), scans, cache, config, many)
    if many:
        reused = (
            f"; {len(parts) - len(fresh)} unchanged since an earlier scan, reused" if len(fresh) < len(parts) else ""
        )
        states = progress(
            states,
            f"calibrate: scanning {len(fresh)} of {len(parts)} partitions ({executor}{reused})",
            unit="partition",
            total=len(parts),
        )
    quoted: list[bytes] = []  # the first few rejects, quoted by an error
    broken: list[bytes] = []  # the reject that ends each compressed stream that broke off
    with open(out / "rejects.jsonl", "wb") as rej:
        for st, rejects in states:  # in partition order: the merged state is the same whatever ran the scans
            rej.write(rejects)
            if len(quoted) < _QUOTED and rejects:
                quoted += rejects.splitlines()[: _QUOTED - len(quoted)]
            last = rejects[rejects.rfind(b"\n", 0, len(rejects) - 1) + 1 :]
            if _BROKE in last:  # reader.truncated: the partition's last reject
                broken.append(last)
            state.merge(st)
            del st, rejects  # not alive beside the next partition's scan: memory is one sample plus one scan
    if cache:
        cache.prune()
    source_name = str(traffic) if not many else f"{traffic} ({len(parts)} files)"
    quoted += [b for b in broken[:_QUOTED] if b not in quoted]
    try:
        calib, shadow, search, counts = _select(
            state,
            config,
            source_name,
            [json.loads(r) for r in quoted],
            field_namer("calibrate", field_name),
            frozenset(held_from),
        )
    except InputError as e:
        raise _naming_rejects(e, out / "rejects.jsonl", failed_rejects) from None
    if failed_rejects is not None:
        Path(failed_rejects).unlink(missing_ok=True)
    params = typed_config(config)
    profile_dir = out / "profile"
    profile_dir.mkdir(exist_ok=True)
    profile = state.profiler.result() | {
        "source": source_name,
        "stats": counts["stats"],
        "pii_scrubbed": dict(state.pii),
    }
    profile["estimates"]["unique_prompts"] = counts["estimates"]["unique_prompts"]
    (profile_dir / "profile.json").write_text(json.dumps(profile, indent=2))
    source = combined_sha256([(p["name"], p["sha256"]) for p in state.partitions])  # hashed by the scans themselves
    prof_art = Artifact.create("traffic-profile", profile_dir, params, (source,), {"requests": profile["requests"]})
    arts = {"profile": prof_art}
    for name, rows in (("calib", calib), ("shadow", shadow)) + ((("search", search),) if config.search_size else ()):
        d = out / name
        d.mkdir(exist_ok=True)
        (d / "data.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        meta = {
            "split": name,
            "n": len(rows),
            "strata": dict(Counter(r["stratum"] for r in rows)),
            "stats": counts["stats"],
            "estimates": counts["estimates"],
        } | ({"remote_source": True} if is_uri(traffic) else {})
        if name == "shadow" and "held_from" in counts:
            meta["held_from"] = counts["held_from"]
        arts[name] = Artifact.create("calibration-set", d, params, (source, prof_art.sha256), meta)
    if picture:
        from qgate.calibrate.profile_plot import plot_profile

        plot_profile(profile, out / "profile.png")
    return arts


def _scans(todo: list, config: SampleConfig, many: bool, executor: str):
    """(state JSON, rejects) of each partition in `todo`, in order: runs of them scanned whole by the executor's
    workers, and a partition too big for its share of the workers scanned in blocks (calibrate/split_scan.py)."""
    for how, idx in phases([p.size for p in todo], workers(executor)) if todo else []:
        if how == "blocks":
            yield scan_partition_split(todo[idx[0]], config, many, executor, show_progress=not many)
        else:
            yield from map_ordered(
                scan_partition_json, [(todo[i], config, many, executor == "serial" and not many) for i in idx], executor
            )


def _in_order(
    parts: list, keys: list, fresh: set[int], scans, cache: ScanCache | None, config: SampleConfig, many: bool
):
    """(state, rejects) of every partition, in partition order: the next fresh scan (then saved to the cache), or the
    cached one (scanned here after all when its entry turns out cut short or edited). Every state is rebuilt from its
    JSON form (calibrate/state_json.py), whichever way it came."""
    for i, (part, key) in enumerate(zip(parts, keys, strict=True)):
        hit = None if i in fresh else cache.load(key)
        doc, rejects = next(scans) if i in fresh else hit or scan_partition_json(part, config, many)
        if cache and hit is None:
            cache.save(key, doc, rejects)
        st = state_from_json(doc)
        del doc, hit  # the JSON form is not alive beside the next partition's
        yield st, rejects
        del st, rejects


def _select(
    state: SampleState, config: SampleConfig, source: str, quoted: list[dict], name, held_from: frozenset[str]
) -> tuple[list, list, list, dict]:
    """Calibration and shadow rows, and the counts: exact where the samples hold every distinct prompt, else the
    sketches' estimates with their bounds. quoted: the rejects an error quotes when there are too many. held_from:
    chat.prompt_digest keys the shadow split passes over (they stay eligible for the other splits)."""
    # a prompt under two routes sits in two strata: its first occurrence (file, line) keeps it
    first: dict[bytes, tuple] = {}
    for stratum, bk in state.strata.items():
        for digest, (_, where, _) in bk.rows.items():
            if digest not in first or where < first[digest][0]:
                first[digest] = (where, stratum)
    ranked = {s: [row for d, _, row in bk.ranked() if first[d][1] == s] for s, bk in state.strata.items()}
    exact = all(bk.exact() for bk in state.strata.values())
    sizes = {}
    for s, bk in state.strata.items():
        est = state.distinct[s].estimate()["estimate"]
        sizes[s] = len(ranked[s]) if bk.exact() else max(len(ranked[s]), round(est))
    kept_est = state.kept.estimate()
    unique = len(first) if exact else min(state.stats["usable"], max(len(first), round(kept_est["estimate"])))
    stats = {
        k: v
        for k, v in (
            ("records", state.stats["records"]),
            ("rejected", state.stats["rejected"]),
            ("too_short", state.stats["too_short"]),
            ("tool_use", state.stats["tool_use"]),  # accepted records that offer tools or carry tool calls
            ("kept", unique),
            ("duplicates", state.stats["usable"] - unique),
        )
        if v
    }
    estimates = {
        "exact": exact,
        "unique_prompts": {"value": unique, "exact": exact}
        | (
            {}
            if exact
            else {k: round(kept_est[k], 1) for k in ("estimate", "lower", "upper")}
            | {"rse": kept_est["rse"], "method": "HLL sketch (Apache DataSketches), bounds at 2 standard deviations"}
        ),
        "strata_estimated": sorted(s for s, bk in state.strata.items() if not bk.exact()),
    }
    _check_counts(source, stats, sum(len(r) for r in ranked.values()), config, state.partitions, quoted, name)
    # the rows a shadow split may take: none that `held_from` names (a model calibrated on it is gated on this split)
    held: set[int] = set()
    if held_from:
        held = {id(r) for rows in ranked.values() for r in rows if row_digest(r) in held_from}
    open_ = {s: [r for r in rows if id(r) not in held] for s, rows in ranked.items()}
    shadow_q = _allocate(sizes, config.shadow_size, {s: len(r) for s, r in open_.items()})
    rest = {s: sizes[s] - shadow_q[s] for s in sizes}
    calib_q = _allocate(rest, config.calib_size, {s: len(ranked[s]) - shadow_q[s] for s in ranked})
    rest = {s: rest[s] - calib_q[s] for s in sizes}
    search_q = (
        _allocate(rest, config.search_size, {s: len(ranked[s]) - shadow_q[s] - calib_q[s] for s in ranked})
        if config.search_size
        else dict.fromkeys(ranked, 0)
    )
    calib, shadow, search = [], [], []
    for s in sorted(ranked):  # shadow first (the held-out evidence), calibration, then search, from disjoint ranks:
        taken = open_[s][: shadow_q[s]]  # a search split leaves the other two as they were
        ids = {id(r) for r in taken}
        left = [r for r in ranked[s] if id(r) not in ids]
        shadow += taken
        calib += left[: calib_q[s]]
        search += left[calib_q[s] : calib_q[s] + search_q[s]]
    counts = {"stats": stats, "estimates": estimates}
    if held_from:
        drawn = sum(id(r) in held for r in calib + search)
        counts["held_from"] = {"requests": len(held_from), "in_other_splits": drawn}
    return calib, shadow, search, counts


def _check_counts(
    traffic: str, stats: dict, available: int, config: SampleConfig, partitions: list[dict], quoted: list[dict], name
) -> None:
    records, rejected = stats.get("records", 0), stats.get("rejected", 0)
    if records == 0:
        raise InputError(f"{traffic}: no records", hint="is this the right file?")
    frac = rejected / records
    if frac > config.max_reject_fraction:
        raise InputError(
            f"{traffic}: {rejected} of {records} records were rejected ({frac:.0%}, more than "
            f"{name('max_reject_fraction')} = {config.max_reject_fraction}){_worst(partitions)}",
            hint="expected OpenAI chat 'messages' (text turns, tool calls) or 'prompt' records, one JSON object per "
            "line; the first rejects, and where any compressed stream broke off (its lines before may be garbage):"
            + "".join(f"\n    {r['file']}:{r['line']}: {r['reason']}" for r in quoted),
        )
    sizes = " + ".join(name(f) for f in ("calib_size", "shadow_size", "search_size"))
    if available < config.sample_size:  # exact: a sample holds every prompt until it is full
        raise InputError(
            f"{traffic}: only {available} unique usable prompts, need {sizes} = {config.sample_size}",
            hint=f"lower {sizes.replace(' + ', ' / ')} or supply more traffic",
        )


def _worst(partitions: list[dict], shown: int = 3) -> str:
    """Where most of the rejects are, when the traffic is several partitions: often one corrupt or foreign file."""
    if len(partitions) < 2:
        return ""
    worst = sorted((p for p in partitions if p["rejected"]), key=lambda p: (-p["rejected"], p["name"]))
    more = f", and {len(worst) - shown} more" if len(worst) > shown else ""
    return "; most in " + ", ".join(f"{p['name']} ({p['rejected']} of {p['records']})" for p in worst[:shown]) + more


_QUOTED = 3
_BROKE = json.dumps({"reason": STREAM_BROKE})[1:-2].encode()  # as reject_lines writes it: '"reason": "compressed ...'


def _naming_rejects(e: InputError, path: Path, keep: Path | None) -> InputError:
    """`e` with its hint naming the rejects file, moved to `keep` first when the caller gave one."""
    import shutil

    if not path.exists() or path.stat().st_size == 0:
        return e
    if keep is not None:
        keep = Path(keep).absolute()
        keep.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(path, keep)
        path = keep
    e.hint = f"{e.hint}\n  every reject, with its file, line and reason: {path}"
    return e
