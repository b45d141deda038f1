"""What the shadow gate says of a candidate that ends answers elsewhere than the baseline: the baseline itself with
its stop tokens' logits moved by each shift (below 0: it ends fewer answers; above: it ends them early).

    .venv/bin/python benchmarks/bench_answer_ends.py --baseline B --shadow S [--max-new-tokens 256] [--shifts -6 0 4]

B is a checkpoint (`qgate model import`), S a shadow split (`qgate calibrate sample`). The baseline's reference is
computed once, on the reference path in --dtype, and cached in --cache; each shifted candidate is the same model on
the same path, with its head's output moved by the shift at the ids of its generation config's stop tokens. Printed
per shift: the gated checks at the demo spec's shadow thresholds (kl_p99 0.5, top-1 0.85), the answer-end guards
(gates/answer_ends.py) and the gate's verdict, with the guards and without them. A run with shifts -30 -6 -3 0 4 8 at
192 prompts and 256 new tokens takes ~15 min on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, required=True)
    ap.add_argument("--shadow", type=Path, required=True)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--shifts", type=float, nargs="+", default=[-30.0, -6.0, -3.0, 0.0, 4.0, 8.0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/bench-answer-ends"))
    args = ap.parse_args()

    import torch

    from qgate.artifact import Artifact
    from qgate.engines.runners import TorchRunner
    from qgate.gates.answer_ends import decided
    from qgate.gates.result import GateReport
    from qgate.gates.shadow import ShadowConfig, baseline_reference, run_shadow

    threads = os.environ.get("OMP_NUM_THREADS")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads (OMP_NUM_THREADS={threads})")
    base, shadow = Artifact.load(args.baseline), Artifact.load(args.shadow)
    cfg = ShadowConfig(max_new_tokens=args.max_new_tokens, kl_p99_max=0.5, top1_agreement_min=0.85)
    t0 = time.perf_counter()
    ref, cached = baseline_reference(lambda: TorchRunner(base.path, "cpu", args.dtype), base, shadow, cfg, args.cache)
    done = decided(ref, ref["stop_ids"])
    answer_tokens = int((ref["seq_lens"] - ref["prompt_lens"]).sum())
    print(
        f"reference ({'cached' if cached else f'{time.perf_counter() - t0:.0f} s'}): {len(done)} prompts, "
        f"{answer_tokens} answer tokens, {int(done.sum())} answers ended on a stop token "
        f"{ref['stop_ids'].tolist()} within {args.max_new_tokens}"
    )
    runner = TorchRunner(base.path, "cpu", args.dtype)
    stops = torch.from_numpy(ref["stop_ids"])
    shift = {"by": 0.0}

    def moved(_module, _inputs, out):
        out[..., stops] += shift["by"]
        return out

    runner.model.get_output_embeddings().register_forward_hook(moved)
    heads = ("shift", 5), ("kl_p99", 22), ("top1_agreement", 22), ("stop.ends", 18), ("stop.continues", 18)
    print("  ".join(f"{h:{w}s}" for h, w in heads) + "  gate     no guards")
    for s in args.shifts:
        shift["by"] = s
        results = run_shadow(runner, ref, cfg, desc=f"shadow: stop logits {s:+g}").results
        by = {r.metric: r for r in results}
        kept = [r for r in results if not r.metric.startswith("stop.")]

        def row(name: str) -> str:
            r = by.get(name)
            if r is None:
                return "-"
            if name.startswith("stop."):
                return f"{r.evidence['agree']} of {r.n} ({r.verdict})"
            return f"{r.observed:.4g} ({r.verdict})"

        print(
            f"{s:+5g}  {row('kl_p99'):22s}  {row('top1_agreement'):22s}  {row('stop.ends'):18s}  "
            f"{row('stop.continues'):18s}  {GateReport.decide(results, 'block').verdict:7s}  "
            f"{GateReport.decide(kept, 'block').verdict}",
            flush=True,
        )


if __name__ == "__main__":
    main()
