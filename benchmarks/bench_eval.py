"""Eval scoring throughput: requests per second for the shipped multiple-choice tasks, by batching strategy,
and the eval wall time before and after the larger pooled task set.

    .venv/bin/python benchmarks/bench_eval.py [--model .qgate/demo/base]

Run alone (two CPU-heavy processes slow torch 3-20x). Prints thread counts, then for each strategy the
wall time and requests/s on the same requests, and ratios measured in this one run:
  full-16     16 sequences per forward, right-padded, logits for every position (the scoring before pooling)
  whole-2048  token budget 2048 per forward, left-padded, logits only for the continuation positions
  shared-2048 as whole-2048, and the choices of one question reuse its context's KV cache
Then the current default tasks, shared contexts and prefixes, with every choice of a batch padded to its longest
(the runner before length groups) against choices padded only within groups of similar length (the default).
Then: the earlier default tasks (369 items) with full-16, against the current default tasks with the default scoring;
and the perplexity set scored one document at a time against rolling windows batched across documents.
Last, the roofline: the positions the default scoring ran through the model (padding included), against plain
forwards in 8 x 256 batches (no cache, last logits only): how close the scoring runs to what
the model costs on this machine. `--roofline` runs only the current default tasks and this comparison.
`--dtype bfloat16` instead times the whole eval (current tasks and the perplexity set, default scoring) with the
reference path in that dtype against the earlier set as it was scored (float32, full-16, documents one at a time), and
compares the float32 and bfloat16 scores of the current tasks: chosen answers and accuracy per task.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


PPL_BEFORE = 120  # perplexity documents in the earlier set (the first 120 of today's file)
BEFORE = {"bigbench_general_knowledge": None, "bigbench_social_iqa": 150, "bigbench_misconceptions": 150}  # items


def requests_for(tasks: dict[str, int | None]) -> tuple[list, int]:
    """The loglikelihood requests lm-eval would issue for these tasks (name -> item limit), and the item count."""
    from lm_eval.tasks import TaskManager, get_task_dict

    from qgate.gates.evalgate import task_config

    reqs, items = [], 0
    for name, limit in tasks.items():
        ((_, task),) = get_task_dict([task_config(name)], TaskManager(include_defaults=False)).items()
        task.build_all_requests(limit=limit, rank=0, world_size=1)
        reqs += [SimpleNamespace(args=r.args) for r in task.instances]
        n = len({r.doc_id for r in task.instances})
        items += n
        print(f"  {name}: {n} items, {len(task.instances)} requests")
    return reqs, items


def timed(lm, reqs) -> tuple[float, list]:
    t = time.perf_counter()
    scores = lm.loglikelihood(reqs, disable_tqdm=True)
    return time.perf_counter() - t, scores


class NoSharing:
    """The runner without continuation_logits: every request scored as one whole sequence."""

    batch_tokens = None

    def __init__(self, runner):
        self.runner, self.tokenizer, self.max_length = runner, runner.tokenizer, runner.max_length

    def logits_batch(self, seqs, keep_last=None):
        return self.runner.logits_batch(seqs, keep_last)


class FullLogits:
    """The earlier strategy: right-padded batches of 16, logits for every position."""

    batch_tokens = None

    def __init__(self, runner):
        self.runner, self.tokenizer, self.max_length = runner, runner.tokenizer, runner.max_length

    def logits_batch(self, seqs, keep_last=None):
        import torch

        out = []
        for i in range(0, len(seqs), 16):
            chunk = seqs[i : i + 16]
            width = max(len(s) for s in chunk)
            x = torch.tensor([list(s) + [0] * (width - len(s)) for s in chunk])
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk])
            with torch.inference_mode():
                logits = self.runner.model(x, attention_mask=mask).logits.float().numpy()
            out += [logits[j, : len(s)][-(keep_last or len(s)) :] for j, s in enumerate(chunk)]
        return out


class Positions:
    """Counts the input positions every forward of a model runs (padding included)."""

    def __init__(self, model):
        self.n, self.forwards = 0, 0
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _module, args, kwargs):
        x = args[0] if args else kwargs["input_ids"]
        self.n += x.numel()
        self.forwards += 1


def roofline(runner, positions: int, secs: float) -> None:
    """Plain forwards (8 x 256, last logits only), up to as many positions as the scoring ran, timed."""
    import torch

    x = torch.randint(0, runner.tokenizer.vocab_size, (8, 256))
    reps = max(1, min(10, round(positions / x.numel())))  # throughput is steady: 10 forwards time it
    with torch.inference_mode():
        runner.model(x, logits_to_keep=1)
        t = time.perf_counter()
        for _ in range(reps):
            runner.model(x, logits_to_keep=1)
        plain = (time.perf_counter() - t) / (reps * x.numel())
    print(
        f"roofline: the default scoring ran {positions:,} positions in {secs:.1f} s ({positions / secs:.0f} "
        f"positions/s); plain forwards {1 / plain:.0f} positions/s over {reps * x.numel():,}: the scoring runs at "
        f"{positions * plain / secs:.2f}x the plain forward's throughput"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=ROOT / ".qgate/demo/base")
    ap.add_argument("--roofline", action="store_true", help="only the current default tasks and the roofline")
    ap.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16: see the module docstring")
    args = ap.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch

    from qgate.artifact import Artifact
    from qgate.cli.options import quiet_libraries
    from qgate.engines.runners import load_runner
    from qgate.gates.evalgate import DEFAULT_TASKS
    from qgate.gates.lm import RunnerLM

    quiet_libraries()
    print(f"torch threads {torch.get_num_threads()}, interop {torch.get_num_interop_threads()}, cpus {os.cpu_count()}")
    runner = load_runner(Artifact.load(args.model, "checkpoint"))
    if args.dtype != "float32":
        return dtype_comparison(runner, load_runner(Artifact.load(args.model, "checkpoint"), "cpu", args.dtype))
    if args.roofline:
        now, _ = requests_for({t: None for t in DEFAULT_TASKS if t != "chatterbot_ppl"})
        count = Positions(runner.model)
        secs, _ = timed(RunnerLM(runner), now)
        print(f"  {len(now)} requests in {secs:.1f} s ({len(now) / secs:.1f} req/s), {count.forwards} forwards")
        return roofline(runner, count.n, secs)
    print("earlier default tasks:")
    reqs, n_before = requests_for(BEFORE)
    results = {}
    for name, budget, wrap in (
        ("full-16", 10**9, FullLogits),
        ("whole-2048", 2048, NoSharing),
        ("shared-2048", 2048, None),
    ):
        lm = RunnerLM(wrap(runner) if wrap else runner)
        lm.batch_tokens = budget
        results[name] = timed(lm, reqs)
        print(
            f"{name:12s} {len(reqs)} requests in {results[name][0]:7.1f} s   {len(reqs) / results[name][0]:7.1f} req/s",
            flush=True,
        )
    base = results["full-16"][0]
    worst = max(
        abs(a[0] - b[0]) for name in results for a, b in zip(results[name][1], results["full-16"][1], strict=True)
    )
    print("ratios vs full-16: " + ", ".join(f"{k} {base / v[0]:.2f}x" for k, v in results.items() if k != "full-16"))
    print(f"max |log-likelihood difference| across strategies: {worst:.2e}")
    print("current default tasks:")
    now, n_now = requests_for({t: None for t in DEFAULT_TASKS if t != "chatterbot_ppl"})
    forward_cost = runner.forward_cost
    runner.forward_cost = 10**9  # one group: every continuation of a batch padded to the longest
    padded, s0 = timed(RunnerLM(runner), now)
    runner.forward_cost = forward_cost
    count = Positions(runner.model)
    secs, s1 = timed(RunnerLM(runner), now)
    ran = count.n
    diff = max(abs(a[0] - b[0]) for a, b in zip(s0, s1, strict=True))
    print(
        f"  choices padded to the batch's longest {padded:.1f} s, within length groups (default) {secs:.1f} s "
        f"({len(now) / secs:.1f} req/s): {padded / secs:.2f}x; max |log-likelihood difference| {diff:.2e}"
    )
    print(
        f"multiple-choice eval wall time: before {n_before} items {base:.1f} s (full-16), after {n_now} items "
        f"{secs:.1f} s (default): {secs / base:.2f}x the time for {n_now / n_before:.2f}x the items"
    )
    docs = perplexity_docs()
    lm = RunnerLM(runner)
    t = time.perf_counter()
    one = [lm.loglikelihood_rolling([d], disable_tqdm=True)[0] for d in docs]
    t_one = time.perf_counter() - t
    t = time.perf_counter()
    many = lm.loglikelihood_rolling(docs, disable_tqdm=True)
    t_many = time.perf_counter() - t
    diff = max(abs(a - b) for a, b in zip(one, many, strict=True))
    print(
        f"perplexity ({len(docs)} documents): one at a time {t_one:.1f} s ({len(docs) / t_one:.1f} docs/s), batched "
        f"across documents {t_many:.1f} s ({len(docs) / t_many:.1f} docs/s): {t_one / t_many:.2f}x; max |difference| "
        f"{diff:.2e}"
    )
    before = base + t_one * PPL_BEFORE / len(docs)  # the earlier set's first 120 documents, one at a time (its method)
    after = secs + t_many
    print(
        f"whole eval (multiple choice + perplexity): before {n_before} items + {PPL_BEFORE} documents {before:.1f} s, "
        f"after {n_now} items + {len(docs)} documents {after:.1f} s: {after / before:.2f}x the time"
    )
    roofline(runner, ran, secs)


def whole_eval(runner, tasks: list[str]) -> tuple[float, dict]:
    """The gate's eval exactly as run_tasks scores it (lm-eval, RunnerLM), wall time and per-task scores."""
    from dataclasses import replace

    from qgate.gates.evalgate import EvalConfig, run_tasks

    t = time.perf_counter()
    scores = run_tasks(runner, replace(EvalConfig(), tasks=tuple(tasks)))
    return time.perf_counter() - t, scores


def dtype_comparison(f32, other) -> None:
    """The earlier eval (369 items + 120 documents, float32, full-16, one document at a time) against today's default
    tasks scored in `other`'s dtype; then today's tasks in float32 and in that dtype, item by item."""
    import numpy as np

    from qgate.gates.evalgate import DEFAULT_TASKS
    from qgate.gates.lm import RunnerLM

    print("earlier default tasks, as scored then (float32, full-16):")
    reqs, n_before = requests_for(BEFORE)
    lm = RunnerLM(FullLogits(f32))
    lm.batch_tokens = 10**9
    full16, _ = timed(lm, reqs)
    docs = perplexity_docs()[:PPL_BEFORE]
    lm = RunnerLM(f32)
    t = time.perf_counter()
    for d in docs:
        lm.loglikelihood_rolling([d], disable_tqdm=True)
    before = full16 + time.perf_counter() - t
    print(f"  {n_before} items {full16:.1f} s + {PPL_BEFORE} documents: {before:.1f} s", flush=True)
    tag = str(other.dtype).removeprefix("torch.")
    after, s_other = whole_eval(other, list(DEFAULT_TASKS))
    print(
        f"today's default tasks in {tag} (default scoring, lm-eval end to end): {after:.1f} s: {after / before:.2f}x "
        f"the earlier eval's time",
        flush=True,
    )
    f32_secs, s_f32 = whole_eval(f32, list(DEFAULT_TASKS))
    print(
        f"today's default tasks in float32: {f32_secs:.1f} s: {f32_secs / before:.2f}x; {tag} / float32 = "
        f"{after / f32_secs:.2f}x"
    )
    for name in DEFAULT_TASKS:
        a, b = s_f32[name], s_other[name]
        if a["kind"] == "mc":
            same = float(np.mean(np.array(a["chosen"]) == np.array(b["chosen"])))
            print(
                f"  {name}: accuracy float32 {np.mean(a['per_item']):.4f}, {tag} {np.mean(b['per_item']):.4f}; "
                f"same answer on {same:.2%} of {len(a['chosen'])} items"
            )
        else:
            print(f"  {name}: log-likelihood sum float32 {sum(a['ll']):.1f}, {tag} {sum(b['ll']):.1f}")


def perplexity_docs() -> list:
    """The perplexity task's documents as lm-eval loglikelihood_rolling requests."""
    from qgate.gates.evalgate import task_config

    path = task_config("chatterbot_ppl")["dataset_kwargs"]["data_files"]["test"]
    return [SimpleNamespace(args=(d["text"],)) for d in map(json.loads, open(path))]


if __name__ == "__main__":
    sys.exit(main())
