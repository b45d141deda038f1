"""How the eval's scoring batches its work on the reference path: forwards, padded positions and real tokens by kind.

    .venv/bin/python benchmarks/bench_eval_batches.py --model DIR                                  # this CPU's costs
    .venv/bin/python benchmarks/bench_eval_batches.py --model DIR --forward-cost 256 --budget 35000   # an H100's
    .venv/bin/python benchmarks/bench_eval_batches.py --model DIR --forward-cost 256 --budget 35000 --pack  # packing

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
import sys
from pathlib import Path

from eval_counts import PARTS, counted_eval  # beside this script

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / ".qgate/demo/base", help="a checkpoint (its tokenizer counts)")
    ap.add_argument("--forward-cost", type=int, help="positions a forward's fixed cost is worth (default: this CPU's)")
    ap.add_argument("--budget", type=int, help="padded tokens per forward (default: the CPU's, RunnerLM.BATCH_TOKENS)")
    ap.add_argument(
        "--pack", action="store_true", help="pack contexts and continuations into rows, as the reference does on CUDA"
    )
    args = ap.parse_args()
    import torch

    from qgate.engines.runners import TorchRunner
    from qgate.gates.lm import RunnerLM
    from qgate.pipeline.spec import load_spec

    print(f"torch threads {torch.get_num_threads()}, interop {torch.get_num_interop_threads()}", flush=True)
    runner = TorchRunner(args.model)
    if args.pack:
        from qgate.engines import runners

        runners.PACKED_CONTEXTS[runner.device.type] = True
    if args.forward_cost is not None:
        runner.forward_cost = args.forward_cost
    if args.budget is not None:
        runner.batch_tokens = args.budget
    cost = runner.forward_cost
    print(
        f"forward cost {cost} positions, token budget {max(RunnerLM.BATCH_TOKENS, runner.batch_tokens or 0)}, "
        f"contexts {'packed with their continuations' if runner.packs_contexts else 'left-padded'}"
    )
    cfg = load_spec(ROOT / "pipelines/promote.yaml").gate_config().eval
    r = counted_eval(runner, cfg)
    print(f"eval: {r['wall']:.1f} s on this host")
    for kind in (k for k in PARTS if r["forwards"].get(k)):
        p, n = r["positions"].get(kind, 0), r["real"].get(kind, 0)
        print(
            f"  {kind:12s} forwards {r['forwards'].get(kind, 0):4d}  positions {p:7d}  real {n:7d}  "
            f"x{p / max(n, 1):.2f}"
        )
    f, p, n = (sum(r[what].values()) for what in ("forwards", "positions", "real"))
    print(f"  total        forwards {f:4d}  positions {p:7d}  real {n:7d}  x{p / n:.3f}  cost {cost * f + p}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    sys.exit(main())
