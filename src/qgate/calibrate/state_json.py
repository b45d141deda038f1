"""A partition's sampling state as JSON-able data: the one form in which a scan's result reaches the merge.

    doc, rejects = scan_partition_json(part, config, tag_file)   # in any process: serial, a local worker or a Ray task
    state = state_from_json(doc)                                  # on the driver, then SampleState.merge(state)

Every executor, and the scan cache (calibrate/scan_cache.py), merges `state_from_json(state_to_json(scan))` exactly
once. That matters past a word sketch's capacity: DataSketches' frequent-items sketch rebuilt from its serialized
form purges tied tail items differently on later merges than the sketch that was serialized, so a state merged as
the live object and one that crossed a process boundary (or a cache file) would give profiles that differ within
their stated error. One form for all makes serial, processes, Ray and cached runs byte-identical by construction.
A state holding a field this module does not know is refused rather than converted incompletely.
"""

from __future__ import annotations

import base64
from collections import Counter

FORMAT = 1
_STATE_FIELDS = {"need", "seed", "strata", "distinct", "kept", "stats", "pii", "profiler", "partitions"}
_PROFILER_FIELDS = {
    "n",
    "lengths",
    "routes",
    "tenants",
    "total_words",
    "split",
    "split_n",
    "split_words",
    "concurrency",
}
_CONCURRENCY_FIELDS = {
    "size",
    "win_ts",
    "win_lat",
    "ends",
    "last_ts",
    "second",
    "in_second",
    "in_flight",
    "per_second",
    "timed",
    "no_latency",
    "out_of_order",
}
_BOTTOMK_FIELDS = {"k", "rows", "heap", "dropped"}
_HLL_FIELDS = {"lg_k", "sketch"}
_HEAVY_FIELDS = {"lg_max", "sketch", "pending", "pending_rows"}


def scan_partition_json(part, config, tag_file: bool, show_progress: bool = False) -> tuple[dict, bytes]:
    """`state.scan_partition`, its state as `state_to_json` gives it."""
    from qgate.calibrate.state import scan_partition

    st, rejects = scan_partition(part, config, tag_file, show_progress)
    return state_to_json(st), rejects


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _check_fields(obj, expected: set[str]) -> None:
    if set(vars(obj)) != expected:
        raise RuntimeError(
            f"state_json: {type(obj).__name__} has fields {sorted(set(vars(obj)) ^ expected)} that this module "
            "does not convert; update calibrate/state_json.py"
        )


def _pairs(c: Counter) -> list:
    return [[k, v] for k, v in c.items()]


def state_to_json(st) -> dict:
    """A scanned partition's state (after `scan_partition`: its sketches flushed, its concurrency finished)."""
    _check_fields(st, _STATE_FIELDS)
    prof, conc = st.profiler, st.profiler.concurrency
    _check_fields(prof, _PROFILER_FIELDS)
    _check_fields(conc, _CONCURRENCY_FIELDS)
    if len(conc.win_ts) or conc.ends or conc.in_second or any(h.pending for h in (prof.tenants, *prof.split)):
        raise RuntimeError("state_json: the state is mid-partition (unflushed sketches or concurrency window)")
    for bk in st.strata.values():
        _check_fields(bk, _BOTTOMK_FIELDS)
    return {
        "need": st.need,
        "seed": st.seed,
        "strata": {
            s: {
                "k": bk.k,
                "dropped": bk.dropped,
                "rows": [[d.hex(), prio, list(where), row] for d, (prio, where, row) in bk.rows.items()],
            }
            for s, bk in st.strata.items()
        },
        "distinct": {s: _sketch(d, _HLL_FIELDS) for s, d in st.distinct.items()},
        "kept": _sketch(st.kept, _HLL_FIELDS),
        "stats": _pairs(st.stats),
        "pii": _pairs(st.pii),
        "partitions": st.partitions,
        "profiler": {
            "n": prof.n,
            "lengths": _pairs(prof.lengths),
            "routes": _pairs(prof.routes),
            "tenants": _sketch(prof.tenants, _HEAVY_FIELDS),
            "total_words": prof.total_words,
            "split": [_sketch(h, _HEAVY_FIELDS) for h in prof.split],
            "split_n": prof.split_n,
            "split_words": prof.split_words,
            "concurrency": {
                "size": conc.size,
                "in_flight": _pairs(conc.in_flight),
                "per_second": _pairs(conc.per_second),
                "timed": conc.timed,
                "no_latency": conc.no_latency,
                "out_of_order": conc.out_of_order,
            },
        },
    }


def _sketch(obj, fields: set[str]) -> dict:
    """A sketch's own pickling state (what the processes and Ray executors ship), its bytes in base64."""
    _check_fields(obj, fields)
    return {k: _b64(v) if k == "bytes" else v for k, v in obj.__getstate__().items()}


def _unsketch(cls, doc: dict):
    out = cls.__new__(cls)
    out.__setstate__({k: base64.b64decode(v) if k == "bytes" else v for k, v in doc.items()})
    return out


def state_from_json(doc: dict):
    import heapq

    from qgate.calibrate.profile import Concurrency, TrafficProfiler
    from qgate.calibrate.sketches import DistinctCount, HeavyHitters
    from qgate.calibrate.state import BottomK, SampleState

    st = SampleState(need=doc["need"], seed=doc["seed"])
    for s, b in doc["strata"].items():
        bk = BottomK(b["k"])
        bk.dropped = b["dropped"]
        for hexd, prio, where, row in b["rows"]:
            d = bytes.fromhex(hexd)
            bk.rows[d] = (prio, tuple(where), row)
            bk.heap.append((-prio, -int.from_bytes(d, "big"), d))
        heapq.heapify(bk.heap)
        st.strata[s] = bk
    st.distinct = {s: _unsketch(DistinctCount, d) for s, d in doc["distinct"].items()}
    st.kept = _unsketch(DistinctCount, doc["kept"])
    st.stats, st.pii = Counter(dict(doc["stats"])), Counter(dict(doc["pii"]))
    st.partitions = doc["partitions"]
    p = doc["profiler"]
    prof = TrafficProfiler()
    prof.n, prof.lengths, prof.routes = p["n"], Counter(dict(p["lengths"])), Counter(dict(p["routes"]))
    prof.tenants, prof.total_words = _unsketch(HeavyHitters, p["tenants"]), p["total_words"]
    prof.split = [_unsketch(HeavyHitters, h) for h in p["split"]]
    prof.split_n, prof.split_words = p["split_n"], p["split_words"]
    c = p["concurrency"]
    conc = Concurrency(c["size"])
    conc.in_flight, conc.per_second = Counter(dict(c["in_flight"])), Counter(dict(c["per_second"]))
    conc.timed, conc.no_latency, conc.out_of_order = c["timed"], c["no_latency"], c["out_of_order"]
    prof.concurrency = conc
    st.profiler = prof
    return st
