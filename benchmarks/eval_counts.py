"""What the eval's scoring computes, counted by runner kind and forward kind (gpu_scale.py, bench_eval_batches.py).

    with EvalCounter() as counted:
        run_tasks(runner, cfg)                      # or a whole gate
    counted.total("real", "reference")              # real tokens the reference scored
    counted.by_part("positions", "reference")       # {"prefix": ..., "context": ..., "continuation": ..., "whole": ...}
    counted_eval(runner, cfg)                       # the eval alone: its wall and scoring seconds, and those counts

Counts only inside RunnerLM._score_many, the eval's scoring: the runners' calls and the reductions of their logits,
without lm-eval's request building and tokenization. Runner kinds: "engine" (StaticRunner), "reference"
(TorchRunner). Forward kinds: a continuation_logits call's shared prefix, and then either its contexts and
continuations packed into one forward ("packed", where the runner `packs_contexts`) or its contexts (one forward) and
its continuation groups; "whole" for logits_batch calls (whole sequences, scored continuations, perplexity windows).
"""

from __future__ import annotations

import collections
import time

RUNNERS = ("engine", "reference")
PARTS = ("prefix", "packed", "context", "continuation", "whole")


def counted_eval(runner, cfg, kind: str = "reference") -> dict:
    """Run the eval on `runner` (of `kind`): its wall time, RunnerLM's scoring seconds, and the forwards, padded
    positions and real tokens by forward kind."""
    from qgate.gates.evalgate import run_tasks

    with EvalCounter() as counted:
        t = time.perf_counter()
        run_tasks(runner, cfg)
        wall = time.perf_counter() - t
    parts = {what: counted.by_part(what, kind) for what in ("positions", "real", "forwards")}
    return {"wall": wall, "seconds": counted.seconds[kind], **parts}


class EvalCounter:
    """Per (runner kind, forward kind): `real` tokens (unpadded), `forwards` run and their padded `positions`;
    per runner kind: `seconds` spent in RunnerLM._score_many."""

    def __init__(self):
        self.real, self.forwards, self.positions = (collections.Counter() for _ in range(3))
        self.seconds = collections.Counter()

    def total(self, what: str, runner: str) -> int:
        return sum(self.by_part(what, runner).values())

    def by_part(self, what: str, runner: str) -> dict:
        counts = getattr(self, what)
        return {part: counts[runner, part] for part in PARTS if (runner, part) in counts}

    def __enter__(self):
        from transformers import LlamaForCausalLM

        from qgate.engines.runners import TorchRunner
        from qgate.engines.static_llama import StaticLlama
        from qgate.engines.static_runner import StaticRunner
        from qgate.gates.lm import RunnerLM

        # runner: the kind inside _score_many (None outside it); part: the kind of the forwards now running;
        # n: forwards so far in a continuation_logits call, counted from its prefix's; packs: that call's runner packs
        state = {"runner": None, "part": None, "n": 0, "prefix": False, "packs": False}

        def scored(orig):
            def f(lm, pairs, *a):
                runner = state["runner"] = "engine" if isinstance(lm.runner, StaticRunner) else "reference"
                t = time.perf_counter()
                try:
                    return orig(lm, pairs, *a)  # its reductions copy to the host: the device's work is done
                finally:
                    self.seconds[runner] += time.perf_counter() - t
                    state["runner"] = None

            return f

        def logits(orig):
            def f(runner, seqs, keep_last=None):
                if state["runner"] is not None:
                    self.real[state["runner"], "whole"] += sum(len(s) for s in seqs)
                state["part"] = "whole"
                try:
                    return orig(runner, seqs, keep_last)
                finally:
                    state["part"] = None

            return f

        def continuation(orig):
            def f(runner, groups, prefix=()):
                packs = runner.packs_contexts
                if state["runner"] is not None:
                    kind = state["runner"]
                    self.real[kind, "prefix"] += len(prefix)
                    contexts = sum(len(c) for c, _ in groups)
                    continuations = sum(len(k) - 1 for _, ks in groups for k in ks)
                    if packs:
                        self.real[kind, "packed"] += contexts + continuations
                    else:
                        self.real[kind, "context"] += contexts
                        self.real[kind, "continuation"] += continuations
                state.update(part="call", n=0, prefix=bool(prefix), packs=packs)
                try:
                    return orig(runner, groups, prefix)
                finally:
                    state["part"] = None

            return f

        def forward(orig):
            def f(model, *a, **k):
                if state["runner"] is not None and state["part"] is not None:
                    part = state["part"]
                    if part == "call":
                        n = state["n"] - state["prefix"]
                        if n < 0:
                            part = "prefix"
                        elif state["packs"]:
                            part = "packed"  # the call's one forward after its prefix
                        else:
                            part = "context" if n == 0 else "continuation"
                        state["n"] += 1
                    ids = a[0] if a else k.get("input_ids")
                    self.forwards[state["runner"], part] += 1
                    self.positions[state["runner"], part] += int(ids.numel())
                return orig(model, *a, **k)

            return f

        patches = (
            (StaticRunner, "logits_batch", logits),
            (TorchRunner, "logits_batch", logits),
            (TorchRunner, "continuation_logits", continuation),
            (StaticRunner, "continuation_logits", continuation),
            (RunnerLM, "_score_many", scored),
            (StaticLlama, "forward", forward),
            (LlamaForCausalLM, "forward", forward),
        )
        self.saved = [(cls, name, getattr(cls, name)) for cls, name, _ in patches]
        for cls, name, wrap in patches:
            setattr(cls, name, wrap(getattr(cls, name)))
        return self

    def __exit__(self, *exc):
        for cls, name, f in self.saved:
            setattr(cls, name, f)
