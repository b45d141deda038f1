"""The long-context check's scoring of one document, two ways in one run: its logits read in blocks (the runner's
`logits_blocks`, engines/protocol.LogitsInBlocks) against its whole [T, V] logits (`logits_batch`).

    .venv/bin/python benchmarks/bench_long_context_memory.py --model <checkpoint or torch-int4 engine> \
        [--tokens 8192] [--device cpu|cuda]

The document is the longest of the shipped long-context set (gates/longctx.py), rendered as the gate renders it and
cut at --tokens. Each way runs in a process of its own, so that neither inherits the other's freed memory. Prints the
host, then per way the memory the scoring took above what the loaded model holds (on a CPU the resident set sampled
every millisecond, on CUDA torch's peak allocation), its seconds, and the largest difference between the two ways'
per-token negative log-likelihoods. Run alone (two CPU-heavy processes slow torch 3-20x).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

WAYS = ("blocks", "whole")


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakResident:
    """The largest resident set seen while inside, sampled every millisecond by a thread."""

    def __enter__(self):
        self.peak, self.done = resident_bytes(), threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.done.wait(0.001):
            self.peak = max(self.peak, resident_bytes())

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, resident_bytes())


def one(model: Path, device: str, tokens: int, way: str, out: Path) -> dict:
    """Score the document one way in this process; its per-token NLL goes to `out` (.npy)."""
    import torch

    from qgate.artifact import Artifact
    from qgate.engines.runners import load_runner
    from qgate.gates import longctx

    runner = load_runner(Artifact.load(model), device=device)
    docs = longctx.load_documents(longctx.DOCUMENTS)
    (seq,), _ = longctx.encode_documents(runner.tokenizer, docs, tokens, 1)
    if way == "whole":
        scored = type("Whole", (), {"logits_batch": runner.logits_batch})()  # the runner without logits_blocks
    else:
        scored = runner
    longctx.nll(scored, seq[:64])  # one short document first: one-off costs (a head's check, kernels) fall outside
    cuda = runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    with PeakResident() as rss:
        before = resident_bytes()
        nll = longctx.nll(scored, seq)
    seconds = time.perf_counter() - t0
    np.save(out, nll)
    extra = torch.cuda.max_memory_allocated() - held if cuda else rss.peak - before
    return {"way": way, "tokens": len(seq), "extra_bytes": int(extra), "seconds": round(seconds, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a checkpoint or a torch-int4 engine directory")
    ap.add_argument("--tokens", type=int, default=8192, help="the document is cut at this many tokens")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--one", choices=WAYS, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.model, args.device, args.tokens, args.one, args.out)), flush=True)
        return 0

    from bench_cpu_bf16 import host  # beside this script

    print("host:", json.dumps(host()), flush=True)
    rows, nll = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for way in WAYS:
            out = Path(tmp) / f"{way}.npy"
            cmd = [sys.executable, __file__, "--model", str(args.model), "--tokens", str(args.tokens)]
            cmd += ["--device", args.device, "--one", way, "--out", str(out)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                print(done.stderr[-4000:], file=sys.stderr)
                return done.returncode
            rows[way] = json.loads(done.stdout.strip().splitlines()[-1])
            nll[way] = np.load(out)
    for way in WAYS:
        r = rows[way]
        print(f"{way:>7}: {r['tokens']} tokens, {r['extra_bytes'] / 2**20:8.1f} MiB above the model, {r['seconds']} s")
    b, w = rows["blocks"], rows["whole"]
    print(f"memory whole/blocks: x{w['extra_bytes'] / max(b['extra_bytes'], 1):.1f}")
    print(f"time whole/blocks: x{w['seconds'] / b['seconds']:.2f}")
    print(f"largest |NLL difference| between the ways: {float(np.abs(nll['blocks'] - nll['whole']).max()):.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
