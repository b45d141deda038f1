"""Sampler throughput and memory as the log grows, serial, in local processes and on local Ray, every figure a ratio
measured in this run.

    .venv/bin/python benchmarks/bench_sampler.py [--records 100000,1000000,5000000] [--partitions 8]

Run it alone: two CPU-heavy processes on 2 cores distort each other badly. Each size is a synthetic log written as gzip
JSONL partitions: the demo traffic's real records (ShareGPT prompts with their system prompt, routes and tenants),
repeated with a request id in letters appended to the user turn, so every prompt is distinct (the worst case for a
seen-set) and the text is what production logs hold (a numeric id would put a digit in every prompt; two thirds of the
real ones have none, which the PII scrubber's rules use). Every measurement runs in a child process of its own, so each
peak RSS is its own.
1. Throughput: a serial `sample_traffic` in records/s, as a ratio to a raw orjson parse of the same files
   (gzip decompression and line splitting included in both; the sampler inflates with ISA-L, so the ratio is also
   given against an orjson parse that does too). Goal: at least 0.5. Also on 100k records that all carry
   one 8,000-character system prompt, as production apps do (the sampler handles each distinct turn once per block).
   Beside it, on the --ray-records size, the sampler's own reading alone (decompression, the columnar parse and the
   record checks: `read_batches` on one thread, nothing sampled), as the same ratio: the ceiling of the sampler's
   throughput while its parser is this one.
2. Peak RSS of the serial sampler per size, as a ratio to the smallest size. Goal: flat within 10% beyond 100k.
3. `--executor processes` (one spawned worker per core) and `--executor ray` (local Ray, one task per partition, Ray's
   start-up included) against serial on one size, with the core count; all must give the same calibration set.
   On the same size, a scan cache filled by one run and reused by the next (every partition unchanged), and the
   traffic hash a pipeline's calibrate stage is keyed by, from that cache against reading every partition. And the
   same records as one file, which the processes and Ray executors scan in blocks (fewer files than workers).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def demo_records() -> list[dict]:
    from qgate.calibrate.reader import Request, read_traffic

    return [
        {"route": r.route, "tenant": r.tenant, "messages": [{"role": role, "content": c} for role, c in r.messages]}
        for r in read_traffic(ROOT / "data/demo/traffic.jsonl")
        if isinstance(r, Request)
    ]


def letters(i: int) -> str:
    out = ""
    while True:
        i, r = divmod(i, 26)
        out += chr(97 + r)
        if not i:
            return out


def write_log(d: Path, n: int, partitions: int, demo: list[dict], system: str = "") -> Path:
    """system: a system prompt every request carries instead of its own."""
    rng = random.Random(n)
    d.mkdir(parents=True, exist_ok=True)
    per = -(-n // partitions)
    for p in range(partitions):
        with gzip.open(d / f"part-{p:04d}.jsonl.gz", "wt", compresslevel=1) as f:
            for i in range(p * per, min(n, (p + 1) * per)):
                rec = demo[i % len(demo)]
                head = [{"role": "system", "content": system}] if system else rec["messages"][:-1]
                msgs = head + [{"role": "user", "content": f"{rec['messages'][-1]['content']} (ref {letters(i)})"}]
                f.write(
                    json.dumps(
                        {
                            "ts": 1.7e9 + i * 0.01,
                            "latency_ms": 300 + rng.random() * 900,
                            "route": rec["route"],
                            "tenant": rec["tenant"],
                            "messages": msgs,
                        }
                    )
                    + "\n"
                )
    return d


def child(mode: str, where: str, out: str) -> None:
    t = time.perf_counter()
    if mode in ("orjson", "orjson-isal"):
        import orjson
        from isal import igzip

        records = 0
        for part in sorted(Path(where).iterdir()):
            with (gzip if mode == "orjson" else igzip).open(part, "rb") as f:
                for line in f:
                    orjson.loads(line)
                    records += 1
        result = {"records": records}
    elif mode == "parse":
        from qgate.calibrate.batches import read_batches
        from qgate.calibrate.sample import SampleConfig
        from qgate.calibrate.sources import list_partitions

        records = sum(
            b.records for part in list_partitions(where) for b in read_batches(part, SampleConfig().max_line_bytes)
        )
        result = {"records": records}
    elif mode == "cached":
        from qgate.calibrate.sample import SampleConfig, sample_traffic

        cfg, times, shas = SampleConfig(calib_size=256, shadow_size=64), [], []
        for run in ("cold", "warm"):
            t0 = time.perf_counter()
            arts = sample_traffic(where, Path(out) / run, cfg, scan_cache=Path(out) / "scans")
            times.append(time.perf_counter() - t0)
            shas.append({k: a.sha256 for k, a in arts.items() if k != "profile"})  # the profile names its output path
        from qgate.calibrate.scan_cache import ScanCache
        from qgate.calibrate.sources import list_partitions, traffic_sha256

        parts = list_partitions(where)
        t0 = time.perf_counter()
        read = traffic_sha256(parts)  # a stage key that reads every partition
        t1 = time.perf_counter()
        known = traffic_sha256(
            parts, known=ScanCache(Path(out) / "scans", cfg, len(parts) > 1).sha256
        )  # from the cache
        t2 = time.perf_counter()
        result = {
            "records": arts["calib"].meta["stats"]["records"],
            "cold": times[0],
            "warm": times[1],
            "same": shas[0] == shas[1],
            "key_read": t1 - t0,
            "key_cached": t2 - t1,
            "key_same": read == known == arts["profile"].parents[0],
        }
    else:
        from qgate.calibrate.sample import SampleConfig, sample_traffic

        arts = sample_traffic(where, Path(out), SampleConfig(calib_size=256, shadow_size=64), executor=mode)
        result = {
            "records": arts["calib"].meta["stats"]["records"],
            "calib_sha256": arts["calib"].sha256,
            "exact": arts["calib"].meta["estimates"]["exact"],
        }
    me = resource.getrusage(resource.RUSAGE_SELF)
    result |= {
        "seconds": time.perf_counter() - t,
        "peak_mb": me.ru_maxrss / 1024,
        "cpu_seconds": me.ru_utime + me.ru_stime,
        "worker_peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }
    print(json.dumps(result))


def measure(mode: str, where: Path, out: Path) -> dict:
    r = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(where), str(out)], capture_output=True, text=True
    )
    if r.returncode:
        sys.exit(f"{mode} on {where} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", default="100000,1000000,5000000")
    ap.add_argument("--ray-records", type=int, default=1_000_000, help="the size on which Ray and serial are compared")
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--child", nargs=3)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)
    sizes = [int(x) for x in args.records.split(",")]
    cores = len(os.sched_getaffinity(0))
    print(
        f"machine: {cores} cores; one child process per measurement; sample 256 calib + 64 shadow; "
        f"{args.partitions} gzip JSONL partitions per log; the sampler reads columnar (pyarrow, its threads, and one "
        f"reading thread) and hashes per request in Python; the orjson parse is one thread",
        flush=True,
    )
    demo = demo_records()
    print(
        f"  {len(demo):,} real demo records as templates, "
        f"{sum(len(m['content']) for r in demo for m in r['messages']) / len(demo):.0f} characters per record",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        serial, raw, raw_isal = {}, {}, {}
        for n in sizes:
            t = time.perf_counter()
            logs = write_log(tmp / f"log{n}", n, args.partitions, demo)
            print(f"  wrote {n:,} records in {time.perf_counter() - t:.0f} s", flush=True)
            raw[n] = measure("orjson", logs, tmp / "unused")
            raw_isal[n] = measure("orjson-isal", logs, tmp / "unused")
            serial[n] = measure("serial", logs, tmp / f"out{n}")
            s, r = serial[n], raw[n]
            assert s["records"] == r["records"] == n, (s["records"], r["records"], n)
            print(
                f"  {n:>9,} records: sampler {s['seconds']:7.1f} s {n / s['seconds']:8.0f} rec/s, peak RSS "
                f"{s['peak_mb']:5.0f} MB "
                f"(estimated counts: {not s['exact']}); orjson {r['seconds']:6.1f} s {n / r['seconds']:8.0f} rec/s",
                flush=True,
            )
            if n == args.ray_records:
                parse = measure("parse", logs, tmp / "unused")
                assert parse["records"] == n, (parse["records"], n)
                print(
                    f"  {n:>9,} records, reading alone: {parse['seconds']:7.1f} s {n / parse['seconds']:8.0f} rec/s",
                    flush=True,
                )
                procs = measure("processes", logs, tmp / "out-processes")
                print(
                    f"  {n:>9,} records in processes: {procs['seconds']:7.1f} s {n / procs['seconds']:8.0f} rec/s "
                    f"(driver peak RSS {procs['peak_mb']:.0f} MB, largest worker {procs['worker_peak_mb']:.0f} MB)",
                    flush=True,
                )
                cached = measure("cached", logs, tmp / "out-cached")
                print(
                    f"  {n:>9,} records with a scan cache: cold {cached['cold']:7.1f} s, warm (every partition "
                    f"unchanged) {cached['warm']:5.2f} s, same artifacts: {cached['same']}; a stage key's traffic "
                    f"hash: reading every partition {cached['key_read']:.2f} s, from the cache "
                    f"{cached['key_cached'] * 1000:.1f} ms, "
                    f"same hash: {cached['key_same']}",
                    flush=True,
                )
                ray = measure("ray", logs, tmp / "out-ray")
                print(
                    f"  {n:>9,} records on ray: {ray['seconds']:7.1f} s {n / ray['seconds']:8.0f} rec/s "
                    f"(driver peak RSS {ray['peak_mb']:.0f} MB)",
                    flush=True,
                )
                one = write_log(tmp / "one", n, 1, demo)  # one file: fewer than the workers, so scanned in blocks
                single = {mode: measure(mode, one, tmp / f"out-one-{mode}") for mode in ("serial", "processes", "ray")}
                print(
                    f"  {n:>9,} records in one file: "
                    + ", ".join(f"{m} {r['seconds']:.1f} s" for m, r in single.items())
                    + f" (processes: driver peak RSS {single['processes']['peak_mb']:.0f} MB, largest worker "
                    f"{single['processes']['worker_peak_mb']:.0f} MB)",
                    flush=True,
                )
                shutil.rmtree(one)
            if n != sizes[-1]:
                for p in (tmp / f"log{n}").iterdir():
                    p.unlink()
        system = " ".join(m["content"] for r in demo[:40] for m in r["messages"] if m["role"] == "user")[:8000]
        shared = write_log(tmp / "shared", sizes[0], args.partitions, demo, system)
        raw_shared, serial_shared = (
            measure("orjson", shared, tmp / "unused"),
            measure("serial", shared, tmp / "out-shared"),
        )
        print(
            f"  {sizes[0]:>9,} records with a shared {len(system):,}-character system prompt: sampler "
            f"{serial_shared['seconds']:7.1f} s, orjson {raw_shared['seconds']:6.1f} s",
            flush=True,
        )
        lo = sizes[0]
        print(
            "\n1. sampler throughput / raw orjson parse of the same files (goal >= 0.5); in brackets, against an "
            "orjson parse that inflates with ISA-L as the sampler does:"
        )
        for n in sizes:
            print(
                f"     {n:>9,} records: {raw[n]['seconds'] / serial[n]['seconds']:.2f}x "
                f"({raw_isal[n]['seconds'] / serial[n]['seconds']:.2f}x)"
            )
        print(
            f"     {lo:>9,} records, one shared {len(system):,}-character system prompt: "
            f"{raw_shared['seconds'] / serial_shared['seconds']:.2f}x"
        )
        if args.ray_records in serial:
            n = args.ray_records
            print(
                f"     {n:>9,} records, the sampler's reading alone (no sampling): "
                f"{raw[n]['seconds'] / parse['seconds']:.2f}x; "
                f"the sampling adds {serial[n]['seconds'] - parse['seconds']:.1f} s on the main thread beside the "
                "reading thread"
            )
            print(
                f"     {n:>9,} records, --executor processes ({cores} workers): "
                f"{raw[n]['seconds'] / procs['seconds']:.2f}x"
            )
            print(
                f"     {n:>9,} records, every partition's scan reused from --scan-cache: "
                f"{raw[n]['seconds'] / cached['warm']:.2f}x ({cached['cold'] / cached['warm']:.0f}x faster than the "
                f"cold run that filled the cache); the traffic hash of a stage key from the cache: "
                f"{cached['key_read'] / cached['key_cached']:.0f}x faster than reading the partitions"
            )
        print(f"2. peak RSS / peak RSS at {lo:,} records (goal: within 1.10x):")
        for n in sizes[1:]:
            print(
                f"     {n:>9,} records ({n // lo}x the log): {serial[n]['peak_mb'] / serial[lo]['peak_mb']:.3f}x "
                f"({serial[n]['peak_mb']:.0f} MB / {serial[lo]['peak_mb']:.0f} MB)"
            )
        if args.ray_records in serial:
            s = serial[args.ray_records]
            print(
                f"3. sampler wall time on {args.ray_records:,} records ({args.partitions} partitions, {cores} cores), "
                f"serial / processes: {s['seconds'] / procs['seconds']:.2f}x, serial / ray: "
                f"{s['seconds'] / ray['seconds']:.2f}x; "
                f"same calibration set: {procs['calib_sha256'] == ray['calib_sha256'] == s['calib_sha256']}"
            )
            one_s = single["serial"]["seconds"]
            print(
                "   the same records in one file, its blocks scanned by the workers (calibrate/split_scan.py), "
                f"serial / processes: {one_s / single['processes']['seconds']:.2f}x, serial / ray: "
                f"{one_s / single['ray']['seconds']:.2f}x; "
                f"same calibration set as one serial pass: {len({r['calib_sha256'] for r in single.values()}) == 1}"
            )
            drv = single["processes"]["cpu_seconds"]
            print(
                f"   its driver (reading, merging, feeding the profile) used {drv:.1f} s of CPU: with enough workers "
                f"one file could go at most {n / drv:,.0f} records/s, {raw[n]['seconds'] / drv:.2f}x the orjson parse "
                f"(a bound from this CPU time, not a measured rate: {cores} cores here)"
            )
        print("   variant fan-out on Ray vs serial: benchmarks/bench_pipeline.py --executor serial,ray")


if __name__ == "__main__":
    main()
