"""The README demo's wall time by stage, cold (fresh workdir and store) and warm (the same command again).

    .venv/bin/python benchmarks/bench_pipeline.py                     # the whole demo spec, the search included
    .venv/bin/python benchmarks/bench_pipeline.py --variants awq-w4a16-cpu,gptq-w8a16
    .venv/bin/python benchmarks/bench_pipeline.py --variants awq-w4a16-cpu,gptq-w8a16 --executor serial,ray

With --executor serial,ray the cold run is repeated in a fresh workdir and store per mode (`qgate run --executor MODE`),
and the Ray fan-out's wall time is printed as a ratio to the serial run's, with the core count and both runs' verdicts.

Runs `qgate run` as the README does (a subprocess, no TTY) in a scratch directory; nothing under .qgate/ is touched.
Run it alone: two CPU-heavy processes on 2 cores distort each other badly.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def run(spec: Path, workdir: Path, executor: str = "serial") -> tuple[float, dict]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    t = time.perf_counter()
    p = subprocess.run(
        [str(Path(sys.executable).parent / "qgate"), "run", str(spec), "--executor", executor],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - t
    if p.returncode != 0:
        sys.exit(f"qgate run failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return wall, json.loads((workdir / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", type=Path, default=ROOT / "pipelines/promote.yaml")
    ap.add_argument("--variants", help="comma-separated subset of the spec's variants")
    ap.add_argument(
        "--executor",
        default="serial",
        help="comma-separated modes to compare, e.g. serial,ray (the first is the reference)",
    )
    args = ap.parse_args()
    import torch

    modes = args.executor.split(",")
    others = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for mode in modes:
            spec = yaml.safe_load(args.spec.read_text())
            if args.variants:
                keep = args.variants.split(",")
                spec["variants"] = [v for v in spec["variants"] if v["name"] in keep]
            spec |= {
                "workdir": str(tmp / mode / "demo"),
                "traffic": str((args.spec.parent / spec["traffic"]).resolve()),  # relative to the spec
                "registry": spec["registry"] | {"store": str(tmp / mode / "mlflow")},
            }
            (tmp / mode).mkdir()
            (tmp / mode / "spec.yaml").write_text(yaml.safe_dump(spec))
            if mode == modes[0]:
                cold_wall, cold = run(tmp / mode / "spec.yaml", tmp / mode / "demo", mode)
                warm_wall, warm = run(tmp / mode / "spec.yaml", tmp / mode / "demo", mode)
            else:
                others[mode] = run(tmp / mode / "spec.yaml", tmp / mode / "demo", mode)
    print(
        f"machine: {os.cpu_count()} cores; torch threads {torch.get_num_threads()}; spec {args.spec.name}, variants "
        f"{', '.join(v['variant'] for v in cold['variants'])}"
    )
    print(f"{'stage':36s} {'cold s':>9s} {'warm s':>9s}")
    for stage, secs in cold["stage_seconds"].items():
        w = "skipped" if stage in warm.get("stages_skipped", []) else f"{warm['stage_seconds'].get(stage, 0):.1f}"
        print(f"{stage:36s} {secs:9.1f} {w:>9s}")
    for step, secs in cold.get("step_seconds", {}).items():  # timed work outside the ledger's stages
        print(f"{'(' + step + ')':36s} {secs:9.1f} {warm.get('step_seconds', {}).get(step, 0):9.1f}")

    def timed(run: dict, stages) -> float:  # the seconds its stages (those given) and steps account for
        return sum(run["stage_seconds"].get(s, 0) for s in stages) + sum(run.get("step_seconds", {}).values())

    rest_cold, rest_warm = cold_wall - timed(cold, cold["stage_seconds"]), warm_wall - timed(warm, warm["stages_run"])
    print(f"{'(rest: start-up, imports, summary)':36s} {rest_cold:9.1f} {rest_warm:9.1f}")
    print(f"{'wall (whole command)':36s} {cold_wall:9.1f} {warm_wall:9.1f}   warm / cold = {warm_wall / cold_wall:.3f}")
    for v in cold["variants"]:
        print(f"  {v['variant']:22s} {v['verdict']:12s} KL p99 {v['kl_p99']:.4f}  top-1 {v['top1_agreement']:.3f}")
        if s := v.get("search"):
            pts = ", ".join(f"{x:.1f}" for x in s.get("point_seconds") or [])
            print(
                f"    search: {s['seconds']:.1f} s; AWQ smoothing {s.get('smoothing_seconds')} s (the quantize "
                f"stage's, reused), sensitivity {s.get('sensitivity_seconds')} s, {s['points_tried']} points: {pts} s"
            )
    for mode, (wall, summary) in others.items():
        same = [(v["variant"], v["verdict"]) for v in summary["variants"]] == [
            (v["variant"], v["verdict"]) for v in cold["variants"]
        ]
        print(
            f"cold wall --executor {mode} / --executor {modes[0]} ({os.cpu_count()} cores, {len(cold['variants'])} "
            f"variants): {wall / cold_wall:.3f}x ({wall:.0f} s / {cold_wall:.0f} s); same verdicts: {same}; "
            f"promoted {(summary.get('promoted') or {}).get('variant')} vs "
            f"{(cold.get('promoted') or {}).get('variant')}"
        )
    print(
        json.dumps(
            {
                "cold_wall": cold_wall,
                "warm_wall": warm_wall,
                "cold": cold["stage_seconds"],
                "cold_steps": cold.get("step_seconds"),
                "warm_skipped": warm.get("stages_skipped"),
            }
        )
    )


if __name__ == "__main__":
    main()
