"""lm-evaluation-harness adapter over a qgate runner, so every engine is evaluated by one code path.

lm = RunnerLM(runner)   # loglikelihood and loglikelihood_rolling on runner.logits_batch(seqs)
"""

from __future__ import annotations

import numpy as np
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from qgate.device import to_device
from qgate.engines.padding import padded_batches, token_batches
from qgate.engines.protocol import ScoresContinuations
from qgate.progress import progress


def prefix_runs(
    contexts: list[tuple[int, ...]], min_prefix: int, min_saved: int = 0
) -> list[tuple[int, list[tuple[int, ...]]]]:
    """Contexts grouped into runs that share their first p >= min_prefix tokens (lexicographic order puts them side
    by side; a run's prefix shrinks to what all its members share), as (p, contexts). Every member keeps at least one
    token after the prefix. Contexts that share nothing long enough, or whose run would save fewer than min_saved
    tokens ((members - 1) x p: a small run costs batches of its own), form one run with p = 0."""
    runs: list[tuple[int, list[tuple[int, ...]]]] = []
    for c in sorted(contexts):
        if runs:
            p, members = runs[-1]
            head = members[0]
            lcp = 0
            limit = min(p, len(c) - 1)
            while lcp < limit and head[lcp] == c[lcp]:
                lcp += 1
            if lcp >= min_prefix:
                members.append(c)
                runs[-1] = (lcp, members)
                continue
        runs.append((len(c) - 1, [c]))
    worth = [len(m) > 1 and (len(m) - 1) * p >= min_saved for p, m in runs]  # a run of one shares nothing
    alone = sorted(c for (_, m), w in zip(runs, worth, strict=True) if not w for c in m)
    return [r for r, w in zip(runs, worth, strict=True) if w] + ([(0, alone)] if alone else [])


def _per_position(x, t):
    """Per position of logits x [n, V] (float32): log p(t) and whether t is the argmax."""
    import torch

    return x[torch.arange(len(t), device=x.device), t] - torch.logsumexp(x, -1), x.argmax(-1) == t


def _summed(lp, hit) -> tuple[float, bool]:
    """(sum of log p(target), every target the argmax) for one request's positions."""
    return _score(float(lp.sum()), bool(hit.all()))


def _summed_requests(lp: np.ndarray, hit: np.ndarray, n: np.ndarray) -> list[tuple[float, bool]]:
    """_summed for consecutive requests of n[j] positions each, in one pass (sums in float64)."""
    ll, greedy = np.zeros(len(n)), np.ones(len(n), bool)  # a request of no positions: log p 0, greedy
    at = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64)
    some = n > 0
    if some.any():
        ll[some] = np.add.reduceat(lp.astype(np.float64), at[some])
        greedy[some] = np.logical_and.reduceat(hit, at[some])
    return [_score(a, b) for a, b in zip(ll.tolist(), greedy.tolist(), strict=True)]


def _score(ll: float, greedy: bool) -> tuple[float, bool]:
    """A request's score from its summed log-probs: NaN, where a position's logits define no distribution (NaN or
    +inf), gives the target nothing: -inf, not greedy."""
    return (float("-inf"), False) if ll != ll else (ll, greedy)


def finish(logits, target: list[int]) -> tuple[float, bool]:
    """Sum of log p(target) and whether every target is the argmax, from logits [n, V] predicting the continuation.
    float32 logsumexp in torch: eval log-likelihoods differ between models by far more than float32 rounding, and
    this is the eval's costliest step after the forward pass (float64 numpy: 28 ms vs 4.1 ms per [64, 49152] block)."""
    import torch

    x = (
        logits.float()
        if isinstance(logits, torch.Tensor)
        else torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))
    )
    return _summed(*_per_position(x, torch.as_tensor(target, device=x.device)))


class Scores:
    """The (sum log p, greedy) of each request of one scoring call, filled batch by batch.

    Host logits are reduced request by request (no copy into one array). Logits on an accelerator are reduced in
    one pass over the whole batch there, and the per-position log-probs stay there until `resolved`: request by
    request, the small reductions and their host synchronizations cost more than the forward pass that made the
    logits, and a copy to the host per batch would make the host wait for each forward before it queues the next."""

    def __init__(self, n: int):
        self.out: list = [None] * n
        self.pending: list = []  # (requests [(index, positions)], log-probs, hits) per deferred batch, on the device

    def add(self, items: list[tuple[int, object, list[int]]]) -> None:
        """Score each (request index, logits [n, V], target ids)."""
        import torch

        if not items or not isinstance(items[0][1], torch.Tensor) or items[0][1].device.type == "cpu":
            for i, logits, target in items:
                self.out[i] = finish(logits, target)
        else:
            self.defer(items)

    def defer(self, items: list[tuple[int, object, list[int]]]) -> None:
        """Per-position log-probs and hits of these requests, computed where their logits are, kept for resolved."""
        import torch

        x = torch.cat([logits.float() for _, logits, _ in items])  # [N, V]
        targets = to_device([tok for _, _, target in items for tok in target], x.device, torch.long)
        lp, hit = _per_position(x, targets)  # [N] each, on the device
        self.pending.append(([(i, len(target)) for i, _, target in items], lp, hit))

    def resolved(self) -> list[tuple[float, bool]]:
        """Every request's score: what `defer` left on the device copied to the host at once, summed per request."""
        import torch

        if self.pending:
            lp = torch.cat([p[1] for p in self.pending]).cpu().numpy()
            hit = torch.cat([p[2] for p in self.pending]).cpu().numpy()
            index, n = zip(*(r for requests, _, _ in self.pending for r in requests), strict=True)
            for i, score in zip(index, _summed_requests(lp, hit, np.asarray(n)), strict=True):
                self.out[i] = score
            self.pending = []
        return self.out


class RunnerLM(LM):
    BATCH_TOKENS = (
        2048  # padded tokens per runner.logits_batch call (benchmarks/bench_eval.py: fastest of 2k-8k on 2 cores)
    )
    MIN_PREFIX = 8  # leading tokens a run of contexts must share to compute them once per batch
    MIN_SAVED = 512  # and the tokens that saves: smaller runs would cost more in small batches than they save

    def __init__(self, runner, max_length: int = 1024):
        super().__init__()
        self.runner = runner
        self.batch_tokens = max(self.BATCH_TOKENS, runner.batch_tokens or 0)  # a GPU runner's, from its free memory
        self.tok = runner.tokenizer
        self.max_length = min(max_length, getattr(runner, "max_length", max_length))
        self.prefix = self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id

    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _score_many(
        self, pairs: list[tuple[list[int], list[int]]], step: int | None = None, desc: str | None = None, unit: str = ""
    ) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) -> (sum log p(continuation), continuation is the greedy path), per pair.

        The pairs are queued a step at a time (all at once by default; a progress line per step when desc is given)
        into one Scores, resolved at the end: on an accelerator the host then waits for the device once, not once per
        step, and builds the next step's batches while the device runs this one's forwards (there a line marks a
        step queued, which the device finishes later). A step is `step` requests on the CPU's token budget, scaled
        with the runner's (_step)."""
        scores = Scores(len(pairs))
        step = self._step(step) if step else max(len(pairs), 1)
        starts = range(0, len(pairs), step)
        for start in starts if desc is None else progress(starts, desc, unit=f"x{step} {unit}"):
            self._queue(pairs[start : start + step], scores, start)
        return scores.resolved()

    def _step(self, requests: int) -> int:
        """Requests per step, for `requests` per step on the CPU's token budget (BATCH_TOKENS): as many times more as
        the runner's budget is larger (a GPU's, from its free memory), so a step holds about as many batches on every
        device. Each step ends in a partial batch of each forward kind, and splits the runs of contexts that share a
        prefix and the choices of a question at its edges: the CPU's step on a GPU's budget would make most of the
        eval's forwards partial ones (benchmarks/bench_eval_batches.py counts them)."""
        return requests * max(1, self.batch_tokens // self.BATCH_TOKENS)

    def _queue(self, pairs: list[tuple[list[int], list[int]]], scores: Scores, offset: int = 0) -> None:
        """Score these requests into `scores`, request i as offset + i.

        Continuations that share a context (the choices of one multiple-choice question) reuse its KV cache when
        the runner supports it, and contexts that share a leading prefix (a task's instructions, few-shot examples)
        compute it once per batch; the rest are scored as whole sequences in token-budgeted batches.
        """
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (c, k) in enumerate(pairs):
            groups.setdefault(tuple(c), []).append(i)
        shared: list[tuple[int, tuple[int, ...], list[int]]] = []  # (shared prefix length, context, request indices)
        packs = False
        if isinstance(self.runner, ScoresContinuations):
            fits = {
                c: ix
                for c, ix in groups.items()
                if len(ix) >= 2 and len(c) >= 2 and len(c) + max(len(pairs[i][1]) for i in ix) <= self.max_length
            }
            # else nothing to share, or too long to fit: scored whole (and truncated like lm-eval does)
            # a question with many long choices is split to stay within the token budget, and where the runner packs
            # a question into one row, within max_length: no row is wider than the longest sequence scored whole
            packs = self.runner.packs_contexts
            for p, contexts in prefix_runs(list(fits), self.MIN_PREFIX, self.MIN_SAVED):
                for c in contexts:
                    ix = sorted(fits[c], key=lambda i: len(pairs[i][1]))
                    sub: list[int] = []
                    fed = 0
                    for i in ix:
                        more = fed + len(pairs[i][1])
                        if sub and (more > self.batch_tokens or (packs and len(c) - p + more > self.max_length)):
                            shared.append((p, c, sub))
                            sub, fed = [], 0
                        sub.append(i)
                        fed += len(pairs[i][1])
                    shared.append((p, c, sub))

        def add(items: list[tuple[int, object, list[int]]]) -> None:
            scores.add([(offset + i, logits, target) for i, logits, target in items])

        self._score_shared(pairs, shared, add, packs)
        done = {i for _, _, ix in shared for i in ix}
        self._score_whole(pairs, [i for i in range(len(pairs)) if i not in done], add, packs)

    def _score_shared(self, pairs, shared: list[tuple[int, tuple[int, ...], list[int]]], add, packs: bool) -> None:
        """Batches of contexts with one shared prefix each, within the token budget: where the runner packs contexts
        and continuations into the rows of one forward, their tokens together; otherwise the contexts' suffixes
        left-padded to the longest, and the continuation tokens (which the runner pads only within groups of similar
        length), each. add: Scores.add for these pairs."""
        # one prefix per run, suffixes by length
        shared = sorted(shared, key=lambda g: (g[1][: g[0]], len(g[1]) - g[0]))
        start = 0
        while start < len(shared):
            p, c0, ix0 = shared[start]
            end, fed, held = start + 1, sum(len(pairs[i][1]) for i in ix0), len(c0) - p
            while end < len(shared):
                q, c, ix = shared[end]
                if q != p or c[:p] != c0[:p]:
                    break
                more = sum(len(pairs[i][1]) for i in ix)
                held = held + len(c) - p if packs else (end - start + 1) * (len(c) - p)  # the contexts' positions
                if (held + fed + more if packs else max(held, fed + more)) > self.batch_tokens:
                    break
                end, fed = end + 1, fed + more
            chunk = shared[start:end]
            start = end
            batch = self.runner.continuation_logits(
                [(list(c[p:]), [pairs[i][1] for i in ix]) for _, c, ix in chunk], prefix=list(c0[:p])
            )
            add(
                [
                    (i, logits, pairs[i][1])
                    for (_, _, ix), per_cont in zip(chunk, batch, strict=True)
                    for i, logits in zip(ix, per_cont, strict=True)
                ]
            )

    def _score_whole(self, pairs, todo: list[int], add, packs: bool) -> None:
        """Whole sequences (truncated like lm-eval does) in batches the runner's logits_batch runs as one forward each:
        where it packs its rows, shortest first within the token budget (engines/padding.token_batches); otherwise
        left-padded, in its device's cheapest grouping of lengths (engines/padding.padded_batches). add: Scores.add
        for these pairs."""
        whole = [(pairs[i][0] + pairs[i][1])[-(self.max_length + 1) :] for i in todo]
        n = [len(pairs[i][1]) for i in todo]  # continuation tokens: the last n positions are scored
        lengths = [len(w) - 1 for w in whole]
        if packs:
            batches = token_batches(lengths, self.batch_tokens)
        else:
            batches = padded_batches(lengths, getattr(self.runner, "forward_cost", 0), self.batch_tokens)
            # forward_cost 0: a runner that runs rows one at a time
        for chunk in batches:
            batch = self.runner.logits_batch([whole[j][:-1] for j in chunk], keep_last=max(n[j] for j in chunk))
            add([(todo[j], logits[-n[j] :], whole[j][-n[j] :]) for j, logits in zip(chunk, batch, strict=True)])

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        pairs = []
        for req in requests:
            context, continuation = req.args
            n_spaces = len(context) - len(context.rstrip())
            if n_spaces:  # lm-eval convention: trailing context spaces belong to the continuation
                context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
            whole = self._encode(context + continuation)
            ctx = self._encode(context) if context else []
            pairs.append(([self.prefix] + ctx, whole[len(ctx) :]))
        return self._score_many(pairs, 512, None if disable_tqdm else "eval: loglikelihood", "request")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        """Rolling windows of every document, batched across documents; summed back per document."""
        pairs, owner = [], []
        for d, req in enumerate(requests):
            (text,) = req.args
            windows = get_rolling_token_windows(self._encode(text), self.prefix, self.max_length, context_len=1)
            for ctx, cont in map(make_disjoint_window, windows):
                pairs.append((list(ctx), list(cont)))
                owner.append(d)
        out = [0.0] * len(requests)
        desc = None if disable_tqdm else "eval: perplexity"
        for d, (ll, _) in zip(owner, self._score_many(pairs, 256, desc, "window"), strict=True):
            out[d] += ll
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(
            "qgate's offline tasks are scored by log-likelihood; generation tasks are not supported"
        )
