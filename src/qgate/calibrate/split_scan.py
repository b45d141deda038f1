"""One partition scanned in blocks by many workers: a log that comes as one big file, or one far larger than the rest.

    doc, rejects = scan_partition_split(part, config, tag_file, executor="processes")   # what scan_partition_json gives
    phases([p.size for p in parts], workers=8)   # [("parts", [0, 1]), ("blocks", [2]), ...]: which files go which way

A file too big for its share of the workers (scanned whole, it would still be running long after the others) is
scanned in blocks; the files between such files are scanned whole, a worker each. Blocks cost more than whole
files (shipping, the driver's share, one more round of workers), so a file goes in blocks when that is expected
to finish sooner: with BLOCK_EFFICIENCY of each worker's time doing useful work, b bytes in blocks beside r other
bytes take about b / (e W) + r / W, whole about max(b, (b + r) / W).

This machine reads the file once (decompression, line splitting and its sha256: a small share of a scan's work) and
hands each block to a worker (`execute.map_ordered`, a window of blocks ahead), which parses, scrubs, counts words,
hashes and samples it into a state of its own. The samples, distinct-count sketches and counts of the blocks merge
exactly (`SampleState.merge_sample`); the profile's word sketches and concurrency depend on the order of their
updates, so each worker hands the profile's inputs back instead (labels, word counts, bags of words, times: a small
share of a block), and this machine feeds them to the partition's profile in block order. The partition's state is
therefore the one `scan_partition` gives in one pass, and every artifact is the same (the tests compare them).
Memory on this machine: the blocks in flight (two per worker, BLOCK_BYTES each) and their results.
"""

from __future__ import annotations

import hashlib

from qgate.calibrate.batches import prefetched, read_units, unit_batch
from qgate.calibrate.sources import Partition
from qgate.calibrate.state import SampleState
from qgate.calibrate.state_json import state_to_json
from qgate.execute import map_ordered


class _ProfileInputs:
    """A stand-in for the profiler that keeps what it is given (`TrafficProfiler.add_batch`'s arguments)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def add_batch(self, *args) -> None:
        self.calls.append(args)


def scan_block(
    part: Partition, unit: tuple, config, tag_file: bool, limits: dict[str, int]
) -> tuple[SampleState, list[tuple], bytes]:
    """One unit of `batches.read_units`, on a worker: its sampling state (its profile left empty), the inputs its
    profile would have been given, and its rejects' lines. limits: per stratum, the priority above which no row can
    enter the partition's sample any more (`BottomK.limit` when the block was handed out): such rows stay here, so
    once the samples are full a block sends back little more than its profile's inputs."""
    st = SampleState.empty(config)
    inputs = _ProfileInputs()
    rejects = st.take_batch(part, unit_batch(part, unit, config.max_line_bytes), tag_file, config.min_words, inputs)
    for stratum, bk in st.strata.items():
        if stratum in limits:
            bk.cut(limits[stratum])
    return st, inputs.calls, rejects


# the share of a worker's time a scan in blocks turns into progress, against a whole file's: less than 1, since the
# blocks are read and cut here and the workers start a second round (benchmarks/RESULTS.md, "Split scans")
BLOCK_EFFICIENCY = 0.6


def phases(sizes: list[int | None], workers: int) -> list[tuple[str, list[int]]]:
    """The files to scan (their sizes in bytes, None where the listing gave none), in order, as runs: ("parts",
    indices) scanned whole, one worker each, or ("blocks", [index]) scanned in blocks by every worker: a file whose
    size b beside the other files' r makes b (W - 1 / BLOCK_EFFICIENCY) > r (the module's cost model). Without
    every size, all files go in blocks when there are fewer than workers, else whole."""
    if workers <= 1 or not sizes:
        return [("parts", list(range(len(sizes))))] if sizes else []
    if any(s is None for s in sizes):
        big = [len(sizes) < workers] * len(sizes)
    else:
        total = sum(sizes)
        big = [s > 0 and s * (workers - 1 / BLOCK_EFFICIENCY) > total - s for s in sizes]
    out: list[tuple[str, list[int]]] = []
    for i, b in enumerate(big):
        if b:
            out.append(("blocks", [i]))
        elif out and out[-1][0] == "parts":
            out[-1][1].append(i)
        else:
            out.append(("parts", [i]))
    return out


def _limits(st: SampleState) -> dict[str, int]:
    return {s: lim for s, bk in st.strata.items() if (lim := bk.limit()) is not None}


def scan_partition_split(
    part: Partition, config, tag_file: bool, executor: str, show_progress: bool = False
) -> tuple[dict, bytes]:
    """`state_json.scan_partition_json` of one partition, its blocks scanned by the executor's workers."""
    from qgate.progress import progress

    st = SampleState.empty(config)
    digest = hashlib.sha256()  # of the bytes read here: the source's lineage hash, as a one-pass scan takes it
    rejects: list[bytes] = []
    units = prefetched(read_units(part, config.max_line_bytes, digest))  # inflating on a thread, beside the merging
    calls = ((part, unit, config, tag_file, _limits(st)) for unit in units)
    results = map_ordered(scan_block, calls, executor)
    if show_progress:
        results = progress(results, f"calibrate: reading {part.name} in blocks ({executor})", unit="block")
    for block, inputs, lines in results:
        st.merge_sample(block)
        for args in inputs:
            st.profiler.add_batch(*args)
        rejects.append(lines)
        del block, inputs, lines
    st.finish_partition(part, digest.hexdigest())
    return state_to_json(st), b"".join(rejects)
