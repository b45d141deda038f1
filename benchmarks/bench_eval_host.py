"""The host's own work in the eval's scoring, with no forward run: what a GPU waits for at each host synchronization.

    .venv/bin/python benchmarks/bench_eval_host.py --tokenizer .whl/tokenizer       # the demo's tasks, an H100's budget

Runs the demo's eval tasks (pipelines/promote.yaml) through RunnerLM on a runner that packs like the GPU runners
(padding.pack_trees for every call) and returns views of one zero row as its logits, so what is timed is lm-eval's
request building, RunnerLM's grouping and the packing of rows: the host work the GPU sits idle for wherever the host
waits for it before building the next call. Prints the scoring calls (RunnerLM._queue), their host seconds, and the
runner calls and the seconds pack_trees took in them. The figures are this host's; run alone (two CPU-heavy processes
slow torch 3-20x).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, required=True, help="a directory with SmolLM2's tokenizer")
    ap.add_argument("--budget", type=int, default=35000, help="tokens per forward (an H100's for the 8B shape)")
    args = ap.parse_args()
    import torch

    from qgate.engines.padding import pack_trees, sequences_as_trees
    from qgate.gates import lm as lm_module
    from qgate.gates.evalgate import run_tasks
    from qgate.pipeline.spec import load_spec
    from qgate.trust import load_tokenizer

    print(f"torch threads {torch.get_num_threads()}, interop {torch.get_num_interop_threads()}", flush=True)
    tokenizer = load_tokenizer(args.tokenizer)
    row = torch.zeros(1, len(tokenizer))

    class PackingRunner:  # the GPU runners' batching, without their forwards
        packs_contexts = True
        forward_cost = 256
        batch_tokens = args.budget
        max_length = 2048

        def __init__(self):
            self.tokenizer, self.calls, self.pack_seconds = tokenizer, 0, 0.0

        def _pack(self, groups, prefix: int) -> None:
            t = time.perf_counter()
            pack_trees(groups, prefix, 0)
            self.pack_seconds += time.perf_counter() - t
            self.calls += 1

        def continuation_logits(self, groups, prefix=()):
            self._pack(groups, len(prefix))
            return [[row.expand(len(k), row.shape[1]) for k in ks] for _, ks in groups]

        def logits_batch(self, seqs, keep_last=None):
            self._pack(sequences_as_trees(seqs, keep_last), 0)
            return [row.expand(min(keep_last or len(s), len(s)), row.shape[1]) for s in seqs]

    queued = {"calls": 0, "seconds": 0.0}
    queue = lm_module.RunnerLM._queue

    def timed(lm, pairs, scores, offset=0):
        t = time.perf_counter()
        queue(lm, pairs, scores, offset)
        queued["seconds"] += time.perf_counter() - t
        queued["calls"] += 1

    lm_module.RunnerLM._queue = timed
    lm_module.Scores.add = lambda self, items: None  # no reductions: views of a zero row
    lm_module.Scores.resolved = lambda self: [(-1.0, False)] * len(self.out)
    runner = PackingRunner()
    cfg = load_spec(ROOT / "pipelines/promote.yaml").gate_config().eval
    t = time.perf_counter()
    run_tasks(runner, cfg)
    wall = time.perf_counter() - t
    print(f"eval without forwards: {wall:.2f} s wall on this host")
    print(
        f"scoring calls {queued['calls']}: {queued['seconds']:.3f} s host "
        f"({1e3 * queued['seconds'] / max(queued['calls'], 1):.1f} ms each); "
        f"runner calls {runner.calls}, pack_trees {runner.pack_seconds:.3f} s"
    )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    sys.exit(main())
