"""lm-evaluation-harness adapter over a qgate runner, so every engine is evaluated by one code path.

    lm = RunnerLM(runner)   # loglikelihood and loglikelihood_rolling on runner.logits(ids)
"""
from __future__ import annotations

import numpy as np
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from qgate.gates.shadow import _log_softmax


class RunnerLM(LM):
    def __init__(self, runner, max_length: int = 1024):
        super().__init__()
        self.runner = runner
        self.tok = runner.tokenizer
        self.max_length = min(max_length, getattr(runner, "max_length", max_length))
        self.prefix = self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id

    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        ids = (context + continuation)[-(self.max_length + 1):]
        logp = _log_softmax(self.runner.logits(ids[:-1]))            # [T-1, V]
        tail = logp[-len(continuation):]                              # rows predicting the continuation
        target = np.asarray(ids[-len(continuation):])
        ll = float(tail[np.arange(len(target)), target].sum())
        return ll, bool((tail.argmax(-1) == target).all())

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        out = []
        for req in tqdm(requests, desc="eval: loglikelihood", disable=disable_tqdm, mininterval=2.0):
            context, continuation = req.args
            n_spaces = len(context) - len(context.rstrip())
            if n_spaces:  # lm-eval convention: trailing context spaces belong to the continuation
                context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
            whole = self._encode(context + continuation)
            ctx = self._encode(context) if context else []
            cont = whole[len(ctx):]
            out.append(self._score([self.prefix] + ctx, cont))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        out = []
        for req in tqdm(requests, desc="eval: perplexity", disable=disable_tqdm, mininterval=2.0):
            (text,) = req.args
            total = 0.0
            windows = get_rolling_token_windows(self._encode(text), self.prefix, self.max_length, context_len=1)
            for ctx, cont in map(make_disjoint_window, windows):
                total += self._score(list(ctx), list(cont))[0]
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("qgate's offline tasks are scored by log-likelihood; generation tasks are not supported")
