"""The torch-int4 engine's teacher-forced scoring on this CPU: attention by causal segment against attention under
the packed mask (engines/static_runner.py's SEGMENTED), both in one run.

    .venv/bin/python benchmarks/bench_engine_attention.py --model <a torch-int4 engine> [--lengths 1024 4096]

Run alone (two CPU-heavy processes slow torch 3-20x). Prints the host and torch's threads, then per case the seconds
of `logits_batch` each way (best of --reps, the two ways in turn), their ratio, and the KL between the two's
logits (p99 and largest over positions):
  doc-N        one document of N tokens, every position's logits (the long-context check's call)
  shadow-like  48 sequences of 60 to 250 tokens packed into rows (the shadow split's teacher-forced scoring)
Tokens are the demo traffic's messages, cut to length. Cases longer than the engine's max_seq_len are skipped.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from bench_cpu_bf16 import host, kl_rows, prompts  # beside this script


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a torch-int4 engine's directory")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="document lengths")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    import qgate.engines.static_runner as sr
    from qgate.artifact import Artifact
    from qgate.engines.runners import load_runner

    print("host:", host(), flush=True)
    runner = load_runner(Artifact.load(args.model))
    if runner.kind != "torch-int4":
        print(f"{args.model}: not a torch-int4 engine ({runner.kind})", file=sys.stderr)
        return 1
    tok = AutoTokenizer.from_pretrained(args.model / sr.SERVED_SUBDIR)
    longest = runner.spec["max_seq_len"]
    rng = np.random.default_rng(0)
    lengths = rng.integers(60, 251, 48)
    pool = prompts(tok, 1, int(lengths.sum()))[0]
    cut = np.cumsum(lengths)[:-1]
    cases = {f"doc-{n}": prompts(tok, 1, n) for n in args.lengths if n <= longest}
    cases["shadow-like"] = [s.tolist() for s in np.split(np.asarray(pool), cut)]
    for name, seqs in cases.items():
        out, secs = {}, {"mask": [], "segments": []}
        for _ in range(args.reps):  # the two ways in turn, so that the host's drift falls on both
            for way, devices in (("mask", ()), ("segments", ("cpu",))):
                sr.SEGMENTED = devices
                t = time.perf_counter()
                out[way] = runner.logits_batch(seqs)
                secs[way].append(time.perf_counter() - t)
        mask, segments = min(secs["mask"]), min(secs["segments"])
        kl = np.concatenate([kl_rows(a, b) for a, b in zip(out["mask"], out["segments"], strict=True)])
        print(
            f"{name}: {sum(len(s) for s in seqs)} tokens, mask {mask:.2f} s, segments {segments:.2f} s "
            f"(best of {args.reps} each, in turn), x{mask / segments:.2f}; between the two: KL p99 "
            f"{np.percentile(kl, 99):.3g}, max {kl.max():.3g}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
