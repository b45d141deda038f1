"""What the eval's scoring computes, counted by runner kind and forward kind (gpu_scale.py, bench_eval_batches.py).

    with EvalCounter() as counted:
        run_tasks(runner, cfg)                      # or a whole gate
    counted.total("real", "reference")              # real tokens the reference scored
    counted.by_part("positions", "reference")       # {"prefix": ..., "context": ..., "continuation": ..., "whole": ...}
    counted.model_flops("reference", flop_shape(config))   # the FLOPs that work needs (model_flops)
    counted_eval(runner, cfg)                       # the eval alone: its wall and scoring seconds, and those counts

Counts only inside RunnerLM._score_many, the eval's scoring: the runners' calls and the reductions of their logits,
without lm-eval's request building and tokenization. Runner kinds: "engine" (StaticRunner), "reference"
(TorchRunner). Forward kinds: a continuation_logits call's shared prefix, and then either its contexts and
continuations packed into one forward ("packed", where the runner `packs_contexts`) or its contexts (one forward) and
its continuation groups; "whole" for logits_batch calls (whole sequences, scored continuations, perplexity windows).

Beside them, what the model FLOPs of that work are made of (model_flops): the logits `rows` the eval reads (one per
continuation token of each request, the row of a context shared by several continuations once) and the causal
(query, key) `pairs` its real tokens attend (each token its sequence's earlier tokens, the shared prefix included,
and itself), whatever the runner's layout of them.
"""

from __future__ import annotations

import collections
import time

RUNNERS = ("engine", "reference")
PARTS = ("prefix", "packed", "context", "continuation", "whole")


def flop_shape(config: dict) -> dict:
    """What a Llama-architecture model's FLOPs per token are made of, from its config.json: the weights of its
    decoder's Linears (every token multiplies them), its head's (each logits row read), and its hidden width and
    layers (attention). The input embedding is a lookup and costs no FLOPs."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    d = config.get("head_dim") or h // heads
    per_layer = h * heads * d * 2 + h * kv * d * 2 + 3 * h * i  # q and o, k and v, gate, up and down
    return {"decoder": layers * per_layer, "head": config["vocab_size"] * h, "attention": heads * d, "layers": layers}


def model_flops(shape: dict, real: int, rows: int, pairs: int) -> float:
    """The FLOPs scoring needs (flop_shape's `shape`): 2 per decoder weight and real token, 2 per head weight and
    logits row read, and per causal (query, key) pair attended in each layer 4 x the query heads' width (QK^T and
    AV, a multiply and an add each per element). What a runner computes beyond that (padding, logits no one reads)
    counts for nothing."""
    return (
        2.0 * shape["decoder"] * real + 2.0 * shape["head"] * rows + 4.0 * shape["attention"] * shape["layers"] * pairs
    )


def causal_pairs(length: int, seen: int = 0) -> int:
    """(query, key) pairs a run of `length` tokens attends causally after `seen` earlier tokens: each token sees
    those, the run's earlier tokens and itself."""
    return length * seen + length * (length + 1) // 2


def counted_eval(runner, cfg, kind: str = "reference") -> dict:
    """Run the eval on `runner` (of `kind`): its wall time, RunnerLM's scoring seconds, and the forwards, padded
    positions, real tokens and attended pairs by forward kind, and the logits rows it read."""
    from qgate.gates.evalgate import run_tasks

    with EvalCounter() as counted:
        t = time.perf_counter()
        run_tasks(runner, cfg)
        wall = time.perf_counter() - t
    parts = {what: counted.by_part(what, kind) for what in ("positions", "real", "forwards", "pairs")}
    return {"wall": wall, "seconds": counted.seconds[kind], "rows": counted.rows[kind], **parts}


class EvalCounter:
    """Per (runner kind, forward kind): `real` tokens (unpadded), causal `pairs` they attend, `forwards` run and
    their padded `positions`; per runner kind: `seconds` spent in RunnerLM._score_many and logits `rows` read."""

    def __init__(self):
        self.real, self.forwards, self.positions, self.pairs = (collections.Counter() for _ in range(4))
        self.seconds, self.rows = collections.Counter(), collections.Counter()

    def total(self, what: str, runner: str) -> int:
        return sum(self.by_part(what, runner).values())

    def model_flops(self, runner: str, shape: dict) -> float:
        """The model FLOPs of the scoring counted for `runner` (module model_flops; shape: flop_shape's)."""
        return model_flops(shape, self.total("real", runner), self.rows[runner], self.total("pairs", runner))

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
                self.rows[runner] += sum(len(k) for _, k in pairs)  # a logits row per continuation token
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
                    self.pairs[state["runner"], "whole"] += sum(causal_pairs(len(s)) for s in seqs)
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
                    kind, p = state["runner"], len(prefix)
                    self.real[kind, "prefix"] += p
                    self.pairs[kind, "prefix"] += causal_pairs(p)
                    contexts = sum(len(c) for c, _ in groups)
                    continuations = sum(len(k) - 1 for _, ks in groups for k in ks)  # the last token is not fed
                    ctx_pairs = sum(causal_pairs(len(c), p) for c, _ in groups)
                    # a context's last row predicts every one of its continuations' first tokens: read once
                    self.rows[kind] -= sum(len(ks) - 1 for _, ks in groups)
                    cont_pairs = sum(causal_pairs(len(k) - 1, p + len(c)) for c, ks in groups for k in ks)
                    if packs:
                        self.real[kind, "packed"] += contexts + continuations
                        self.pairs[kind, "packed"] += ctx_pairs + cont_pairs
                    else:
                        self.real[kind, "context"] += contexts
                        self.real[kind, "continuation"] += continuations
                        self.pairs[kind, "context"] += ctx_pairs
                        self.pairs[kind, "continuation"] += cont_pairs
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
