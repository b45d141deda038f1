"""lm-evaluation-harness adapter over a qgate runner, so every engine is evaluated by one code path.

    lm = RunnerLM(runner)   # loglikelihood and loglikelihood_rolling on runner.logits_batch(seqs)
"""
from __future__ import annotations

import numpy as np
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from qgate.gates.shadow import _log_softmax


class RunnerLM(LM):
    BATCH_TOKENS = 2048   # padded tokens per runner.logits_batch call (benchmarks/bench_eval.py: fastest of 2k-8k on 2 cores)

    def __init__(self, runner, max_length: int = 1024):
        super().__init__()
        self.runner = runner
        self.tok = runner.tokenizer
        self.max_length = min(max_length, getattr(runner, "max_length", max_length))
        self.prefix = self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id

    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _score_many(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) -> (sum log p(continuation), continuation is the greedy path)."""
        seqs = [(c + k)[-(self.max_length + 1):] for c, k in pairs]
        out: list = [None] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: len(seqs[i]))  # similar lengths share a batch: less padding
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and (end - start + 1) * len(seqs[order[end]]) <= self.BATCH_TOKENS:
                end += 1
            chunk = order[start:end]
            start = end
            need = max(len(pairs[i][1]) for i in chunk)
            batch = self.runner.logits_batch([seqs[i][:-1] for i in chunk], keep_last=need)  # each [<=need, V]
            for i, logits in zip(chunk, batch, strict=True):
                n = len(pairs[i][1])
                logp = _log_softmax(logits[-n:])                          # rows predicting the continuation
                target = np.asarray(seqs[i][-n:])
                out[i] = (float(logp[np.arange(n), target].sum()), bool((logp.argmax(-1) == target).all()))
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        pairs = []
        for req in requests:
            context, continuation = req.args
            n_spaces = len(context) - len(context.rstrip())
            if n_spaces:  # lm-eval convention: trailing context spaces belong to the continuation
                context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
            whole = self._encode(context + continuation)
            ctx = self._encode(context) if context else []
            pairs.append(([self.prefix] + ctx, whole[len(ctx):]))
        out = []
        step = 512
        for start in tqdm(range(0, len(pairs), step), desc="eval: loglikelihood", unit=f" x{step} req", disable=disable_tqdm):
            out += self._score_many(pairs[start:start + step])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        out = []
        for req in tqdm(requests, desc="eval: perplexity", disable=disable_tqdm, mininterval=2.0):
            (text,) = req.args
            windows = get_rolling_token_windows(self._encode(text), self.prefix, self.max_length, context_len=1)
            pairs = [(list(ctx), list(cont)) for ctx, cont in map(make_disjoint_window, windows)]
            out.append(sum(ll for ll, _ in self._score_many(pairs)))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("qgate's offline tasks are scored by log-likelihood; generation tasks are not supported")
