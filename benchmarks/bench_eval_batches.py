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
that device's. Then the model FLOPs of that work at gpu_scale.py's 8B shape with the tokenizer's vocabulary
(eval_counts.model_flops: logits rows read, causal pairs attended), per real token and against 2 x the shape's
parameters per real token, the MFU convention of the scale runs up to run 8. Run alone (two CPU-heavy processes slow
torch 3-20x).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eval_counts import PARTS, counted_eval, flop_shape, model_flops  # beside this script
from gpu_scale import SHAPES

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
    shape = flop_shape(SHAPES["8b"] | {"vocab_size": len(runner.tokenizer)})
    pairs = sum(r["pairs"].values())
    per_token = model_flops(shape, n, r["rows"], pairs) / n
    all_params = shape["decoder"] + 2 * shape["head"]  # and the input embedding, as gpu_scale counts parameters
    print(
        f"  logits rows read {r['rows']} ({r['rows'] / n:.3f} per real token), causal pairs {pairs} "
        f"({pairs / n:.1f} per real token)"
    )
    print(
        f"  8B shape: model FLOPs per real token {per_token / 1e9:.3f} G against 2 x params "
        f"{2 * all_params / 1e9:.3f} G: x{per_token / (2 * all_params):.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    sys.exit(main())
