"""How the eval's scoring batches its work on the reference path: forwards, padded positions and real tokens by kind.

    .venv/bin/python benchmarks/bench_eval_batches.py --model DIR                                  # this CPU's costs
    .venv/bin/python benchmarks/bench_eval_batches.py --model DIR --forward-cost 256 --budget 35000   # an H100's

The batching depends on the tokenizer, the tasks, the forward cost and the token budget, not on the model's weights or
the device, so a GPU's forwards and positions can be counted here with its forward cost (device.FORWARD_COST) and the
budget its free memory gives (device.batch_tokens: ~35,000 tokens for the 8B shape on an H100). Runs the demo's eval
tasks (pipelines/promote.yaml) once and prints the forwards and positions of prefix, context, continuation and
whole-sequence forwards against their real tokens, and forward_cost x forwards + positions (what the grouping into
forwards minimizes). The wall time is this host's; with --forward-cost and --budget set for another device it is not
that device's. Run alone (two CPU-heavy processes slow torch 3-20x).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def counted_eval(runner, cfg) -> dict:
    """Run the eval; its wall time and the forwards, positions and real tokens by kind."""
    from qgate.engines.runners import TorchRunner
    from qgate.gates.evalgate import run_tasks

    pos, real, fwd = collections.Counter(), collections.Counter(), collections.Counter()
    state = {"kind": None, "n": 0, "prefix": 0}
    model_cls = type(runner.model)
    saved = (model_cls.forward, TorchRunner.continuation_logits, TorchRunner.logits_batch)

    def forward(model, *a, **k):
        ids = a[0] if a else k.get("input_ids")
        kind = state["kind"]
        if kind == "call":  # a continuation_logits call: [prefix], contexts, then continuation groups
            n = state["n"] - (1 if state["prefix"] else 0)
            kind = "prefix" if n < 0 else "context" if n == 0 else "continuation"
            state["n"] += 1
        pos[kind] += ids.numel()
        fwd[kind] += 1
        return saved[0](model, *a, **k)

    def continuation_logits(self, groups, prefix=()):
        state.update(kind="call", n=0, prefix=len(prefix))
        real["prefix"] += len(prefix)
        real["context"] += sum(len(c) for c, _ in groups)
        real["continuation"] += sum(len(k) - 1 for _, ks in groups for k in ks)
        try:
            return saved[1](self, groups, prefix)
        finally:
            state["kind"] = None

    def logits_batch(self, seqs, keep_last=None):
        state["kind"] = "whole"
        real["whole"] += sum(len(s) for s in seqs)
        try:
            return saved[2](self, seqs, keep_last)
        finally:
            state["kind"] = None

    model_cls.forward, TorchRunner.continuation_logits, TorchRunner.logits_batch = (
        forward,
        continuation_logits,
        logits_batch,
    )
    try:
        t = time.perf_counter()
        run_tasks(runner, cfg)
        wall = time.perf_counter() - t
    finally:
        model_cls.forward, TorchRunner.continuation_logits, TorchRunner.logits_batch = saved
    return {"wall": wall, "pos": pos, "real": real, "fwd": fwd}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / ".qgate/demo/base", help="a checkpoint (its tokenizer counts)")
    ap.add_argument("--forward-cost", type=int, help="positions a forward's fixed cost is worth (default: this CPU's)")
    ap.add_argument("--budget", type=int, help="padded tokens per forward (default: the CPU's, RunnerLM.BATCH_TOKENS)")
    args = ap.parse_args()
    import torch

    from qgate.engines.runners import TorchRunner
    from qgate.gates.lm import RunnerLM
    from qgate.pipeline.spec import load_spec

    print(f"torch threads {torch.get_num_threads()}, interop {torch.get_num_interop_threads()}", flush=True)
    runner = TorchRunner(args.model)
    if args.forward_cost is not None:
        runner.forward_cost = args.forward_cost
    if args.budget is not None:
        runner.batch_tokens = args.budget
    cost = runner.forward_cost
    print(f"forward cost {cost} positions, token budget {max(RunnerLM.BATCH_TOKENS, runner.batch_tokens or 0)}")
    cfg = load_spec(ROOT / "pipelines/promote.yaml").gate_config().eval
    r = counted_eval(runner, cfg)
    print(f"eval: {r['wall']:.1f} s on this host")
    for kind in ("prefix", "context", "continuation", "whole"):
        p, n = r["pos"][kind], r["real"][kind]
        print(f"  {kind:12s} forwards {r['fwd'][kind]:4d}  positions {p:7d}  real {n:7d}  x{p / max(n, 1):.2f}")
    f, p, n = sum(r["fwd"].values()), sum(r["pos"].values()), sum(r["real"].values())
    print(f"  total        forwards {f:4d}  positions {p:7d}  real {n:7d}  x{p / n:.3f}  cost {cost * f + p}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    sys.exit(main())
