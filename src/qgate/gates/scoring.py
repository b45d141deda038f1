"""Teacher-forced scoring in batches, reduced to what the shadow gate needs, in float32.

    for idx in length_batches(lengths, max_tokens=1024): ...              # sorted by length: little padding
    top1, picked = reduce_logits(logits, ids)                              # [T], [T, k]
    top_ids, top_lp = top_k_logprobs(logits, k)                            # the baseline's top-k per position

Logits are never copied to float64 and no full-vocabulary log-softmax is materialized: per slab of 8 positions,
torch takes the row max, exp(x - max) in place and its sum (a stable log-sum-exp in float32, the log in float64),
and only the k gathered log-probs go to float64. Log-probs near the top are exact to ~1e-7 nats; the noise floor
(gates/noise.py) measures what the gate can resolve on each baseline.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_BATCH_TOKENS = 1024   # padded tokens per scoring batch: 1024 x 49k vocab x 4 bytes = 200 MB of logits
MAX_BATCH_ROWS = 16


def length_batches(lengths: Sequence[int], max_tokens: int = MAX_BATCH_TOKENS, max_rows: int = MAX_BATCH_ROWS) -> list[list[int]]:
    """Indices grouped into batches of similar length (stable sort, so the grouping is deterministic), each at most
    max_tokens once padded to its longest row, and at most max_rows rows. A row longer than max_tokens is alone."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        b = batches[-1] if batches else None
        if b and len(b) < max_rows and (len(b) + 1) * lengths[i] <= max_tokens:
            b.append(i)
        else:
            batches.append([i])
    return batches


ROWS_PER_PASS = 8   # positions reduced together: a [8, V] slab stays in cache (4x faster than one [T, V] pass)


def _tensor(logits):
    import torch

    x = torch.as_tensor(logits)
    return x if x.dtype == torch.float32 else x.float()


def _log_norm(x):
    """Row max (float32), its argmax, and log sum exp(x - max) (float64) of a [n, V] slab: log p = (x - max) - that.
    Keeping log-probs relative to the row max keeps them exact near the top, where the probability mass is (adding
    the max back would round every log-prob to the float32 spacing of the logits' magnitude, ~1e-6)."""
    import torch

    m, top1 = x.max(-1, keepdim=True)
    z = x - m
    return m, top1[:, 0], torch.log(z.exp_().sum(-1).double())


def reduce_logits(logits, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """logits [T, V] (numpy or torch) and ids [T, k] -> (argmax [T], log-probs of ids [T, k] in float64)."""
    import torch

    x = _tensor(logits)
    idx = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
    top1 = np.empty(x.shape[0], np.int64)
    picked = np.empty(idx.shape, np.float64)
    with torch.inference_mode():
        for a in range(0, x.shape[0], ROWS_PER_PASS):
            xs = x[a:a + ROWS_PER_PASS]
            m, t1, log_s = _log_norm(xs)
            top1[a:a + len(xs)] = t1.numpy()
            picked[a:a + len(xs)] = ((xs.gather(-1, idx[a:a + len(xs)]) - m).double() - log_s[:, None]).numpy()
    return top1, picked


def top_k_logprobs(logits, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[T, V] logits -> the k most likely ids (int32) and their log-probs (float32) per position, top-1 first."""
    import torch

    x = _tensor(logits)
    k = min(k, x.shape[-1])
    ids = np.empty((x.shape[0], k), np.int32)
    lp = np.empty((x.shape[0], k), np.float32)
    with torch.inference_mode():
        for a in range(0, x.shape[0], ROWS_PER_PASS):
            xs = x[a:a + ROWS_PER_PASS]
            vals, top = torch.topk(xs, k, dim=-1, sorted=True)
            m, _, log_s = _log_norm(xs)
            ids[a:a + len(xs)] = top.numpy()
            lp[a:a + len(xs)] = ((vals - m).double() - log_s[:, None]).numpy()
    return ids, lp


def kl_with_tail(top_lp: np.ndarray, cand_lp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """KL(p || q) over the baseline's top-k ids plus one bucket for the rest of the vocabulary, per position, and
    the baseline's tail mass. The sums run in float64 over k terms (cheap; they cancel)."""
    tl = top_lp.astype(np.float64)
    lq = cand_lp.astype(np.float64)
    pk = np.exp(tl)
    p_tail = np.clip(1 - pk.sum(-1), 0, 1)
    q_tail = np.clip(1 - np.exp(lq).sum(-1), 1e-12, 1)
    kl = (pk * (tl - lq)).sum(-1) + np.where(p_tail > 1e-12, p_tail * (np.log(np.maximum(p_tail, 1e-12)) - np.log(q_tail)), 0.0)
    return np.maximum(kl, 0.0), p_tail
