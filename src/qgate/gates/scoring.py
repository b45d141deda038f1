"""Teacher-forced scoring in batches, reduced to what the shadow gate needs, in float32.

    for idx in length_batches(lengths, max_tokens=1024): ...              # sorted by length: little padding
    top1, picked = reduce_logits(logits, ids)                              # [T], [T, k]
    top1, kl, tail = reduce_kl(logits, ids, top_lp)                        # [T] each: against the baseline's top-k
    top_ids, top_lp = top_k_logprobs(logits, k)                            # the baseline's top-k per position

Logits are never copied to float64 and no log-softmax is materialized: per slab of 8 positions, numpy takes the
row's argmax and max, exp(x - max) into a reused buffer, and its pairwise sum in float32 (the log in float64); only
the k gathered log-probs go to float64. Taken relative to the row max, log-probs near the top stay exact at any logit
magnitude: on the demo's real logits, top-1 log-probs within 3.5e-7 nats of a float64 oracle and KL within 1.1e-6.
The noise floor (gates/noise.py) measures what the gate can resolve on each baseline.

Logits a runner leaves on a GPU (a torch tensor on CUDA) are reduced there by the same arithmetic in torch, in row
chunks, and only the reduced arrays come back: copying [T, V] float32 logits to the host and reducing them on its
cores would cost more than the forward pass that made them. The shadow gate's KL over the baseline's top-k
(reduce_kl) is computed there too, so [T] arrays come back instead of [T, k] log-probs. A batch's sequences are
reduced there in one pass (engines/logits.reduce_blocks), so the host waits for the device once per batch, not once
per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from qgate.device import to_device

SCORING_LIBRARIES = ("torch", "transformers")  # what a baseline's cached scores depend on beside their inputs
MAX_BATCH_TOKENS = 1024  # padded tokens per scoring batch: 1024 x 49k vocab x 4 bytes = 200 MB of logits
MAX_BATCH_ROWS = 16


def length_batches(
    lengths: Sequence[int], max_tokens: int = MAX_BATCH_TOKENS, max_rows: int = MAX_BATCH_ROWS
) -> list[list[int]]:
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


def split_sequences(tokens: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    """The sequences a reference stores end to end (`tokens`, their `lengths` in order), as lists of ids."""
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [tokens[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


ROWS_PER_PASS = 8  # positions reduced together: a [8, V] slab stays in cache, where one [T, V] pass does not


def _array(logits) -> np.ndarray:
    """[T, V] logits (numpy, or a torch tensor: its memory is shared, not copied) as a float32 numpy array."""
    if hasattr(logits, "detach"):
        t = logits.detach().cpu()
        return (t if str(t.dtype) == "torch.float32" else t.float()).numpy()
    return np.asarray(logits, dtype=np.float32)


def _log_norm(x: np.ndarray, work: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A [n, V] float32 slab -> (argmax [n], row max [n, 1] float32, log sum exp(x - max) [n] float64), so that
    log p = (x - max) - that; `work` is a [>= n, V] float32 buffer for exp(x - max). Keeping log-probs relative to the
    row max keeps them exact near the top, where the probability mass is (adding the max back would round every
    log-prob to the float32 spacing of the logits' magnitude, ~1e-6). numpy's argmax and in-place exp are used because
    they are faster here than torch's max, subtract, exp and sum; both return the first of tied maxima."""
    top1 = x.argmax(-1)
    m = np.take_along_axis(x, top1[:, None], -1)
    z = np.subtract(x, m, out=work[: len(x)])
    np.exp(z, out=z)
    return top1, m, np.log(z.sum(-1).astype(np.float64))


UNDEFINED = -1  # reduce_logits' argmax for a position whose logits define no distribution
DEVICE_ROWS = 4096  # positions reduced together on a GPU: bounds the [n, V] float32 temporary of exp(x - max)


def on_device(logits) -> bool:
    """Whether these logits are a torch tensor on an accelerator (reduced there) rather than host memory."""
    return getattr(getattr(logits, "device", None), "type", "cpu") != "cpu"


def _torch_norm(x):
    """_log_norm in torch, for a [n, V] float32 tensor on any device: (argmax, row max [n, 1], log-sum-exp float64)."""
    import torch

    top1 = x.argmax(-1)
    m = x.gather(-1, top1[:, None])
    return top1, m, torch.exp(x - m).sum(-1).double().log()


def reduce_logits_torch(logits, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """reduce_logits for a torch tensor, computed where it lives, by the same arithmetic (row max, float32 sum of
    exp(x - max), log in float64, an UNDEFINED argmax and -inf log-probs for a row that defines no distribution)."""
    top1, picked = _reduced_torch(logits, ids)
    return top1.cpu().numpy(), picked.cpu().numpy()


def _reduced_torch(logits, ids: np.ndarray):
    """reduce_logits_torch's (argmax [T], log-probs of ids [T, k] float64) as tensors where the logits are."""
    import torch

    with torch.inference_mode():
        x = logits.float()
        idx = to_device(np.asarray(ids), x.device).long()  # copied as stored (int32 for a cached reference)
        top1 = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        picked = torch.empty(idx.shape, dtype=torch.float64, device=x.device)
        for a in range(0, x.shape[0], DEVICE_ROWS):
            xs = x[a : a + DEVICE_ROWS]
            t1, m, log_s = _torch_norm(xs)
            p = (xs.gather(-1, idx[a : a + len(xs)]) - m).double() - log_s[:, None]
            bad = torch.isnan(log_s)
            top1[a : a + len(xs)] = torch.where(bad, torch.full_like(t1, UNDEFINED), t1)
            picked[a : a + len(xs)] = torch.where(bad[:, None], torch.full_like(p, -np.inf), p)
        return top1, picked


def top_k_logprobs_torch(logits, k: int) -> tuple[np.ndarray, np.ndarray]:
    """top_k_logprobs for a torch tensor, computed where it lives."""
    import torch

    with torch.inference_mode():
        x = logits.float()
        k = min(k, x.shape[-1])
        ids, lp = [], []
        for a in range(0, x.shape[0], DEVICE_ROWS):
            xs = x[a : a + DEVICE_ROWS]
            vals, top = torch.topk(xs, k, dim=-1, sorted=True)
            _, m, log_s = _torch_norm(xs)
            lp.append(((vals - m).double() - log_s[:, None]).float())
            ids.append(top.int())
        return torch.cat(ids).cpu().numpy(), torch.cat(lp).cpu().numpy()


def reduce_logits(logits, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """logits [T, V] (numpy or torch) and ids [T, k] -> (argmax [T], log-probs of ids [T, k] in float64).
    A row with a NaN or +inf logit, or none above -inf, defines no distribution (a broken kernel, an overflowing
    scale): its argmax is UNDEFINED, which matches no token, and its log-probs are -inf, so it scores as infinitely
    far from any defined distribution instead of as NaN, which every comparison would pass over."""
    if on_device(logits):
        return reduce_logits_torch(logits, ids)
    x = _array(logits)
    ids = np.asarray(ids)
    top1 = np.empty(x.shape[0], np.int64)
    picked = np.empty(ids.shape, np.float64)
    work = np.empty((min(ROWS_PER_PASS, x.shape[0]), x.shape[1]), np.float32)
    for a in range(0, x.shape[0], ROWS_PER_PASS):
        xs = x[a : a + ROWS_PER_PASS]
        with np.errstate(invalid="ignore"):  # inf - inf in a row that defines no distribution
            top1[a : a + len(xs)], m, log_s = _log_norm(xs, work)
            picked[a : a + len(xs)] = (np.take_along_axis(xs, ids[a : a + len(xs)], -1) - m).astype(np.float64) - log_s[
                :, None
            ]
        bad = np.isnan(log_s)  # exp(x - max) is NaN somewhere exactly when the row defines no distribution
        if bad.any():
            rows = a + np.flatnonzero(bad)
            top1[rows], picked[rows] = UNDEFINED, -np.inf
    return top1, picked


def top_k_logprobs(logits, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[T, V] logits -> the k most likely ids (int32) and their log-probs (float32) per position, top-1 first; NaN
    log-probs where a row defines no distribution (see reduce_logits)."""
    import torch

    if on_device(logits):
        return top_k_logprobs_torch(logits, k)
    x = _array(logits)
    k = min(k, x.shape[-1])
    ids = np.empty((x.shape[0], k), np.int32)
    lp = np.empty((x.shape[0], k), np.float32)
    work = np.empty((min(ROWS_PER_PASS, x.shape[0]), x.shape[1]), np.float32)
    with torch.inference_mode():
        for a in range(0, x.shape[0], ROWS_PER_PASS):
            xs = x[a : a + ROWS_PER_PASS]
            # torch.topk: it runs on torch's threads, where numpy's partition runs on one
            vals, top = torch.topk(torch.from_numpy(xs), k, dim=-1, sorted=True)
            with np.errstate(invalid="ignore"):
                _, m, log_s = _log_norm(xs, work)
                lp[a : a + len(xs)] = (vals.numpy() - m).astype(np.float64) - log_s[:, None]
            ids[a : a + len(xs)] = top.numpy()
    return ids, lp


def kl_with_tail(top_lp, cand_lp) -> tuple:
    """KL(p || q) over the baseline's top-k ids plus one bucket for the rest of the vocabulary, per position, and
    the baseline's tail mass. The sums run in float64 over k terms (cheap; they cancel). A baseline id of probability
    0 adds nothing (also where the candidate gives it 0 too); a positive one the candidate gives 0 makes the KL +inf;
    a reference row that defines no distribution (NaN log-probs) makes it NaN.
    top_lp, cand_lp [T, k]: numpy arrays, or cand_lp a torch tensor, where both are then computed, in torch (top_lp
    copied there); returns two [T] arrays of cand_lp's kind."""
    if isinstance(cand_lp, np.ndarray):
        xp, tl, lq = np, np.asarray(top_lp).astype(np.float64), cand_lp.astype(np.float64)
    else:
        import torch as xp

        lq = cand_lp.double()
        tl = to_device(np.asarray(top_lp), lq.device).double()
    pk = xp.exp(tl)
    p_tail = xp.clip(1 - pk.sum(-1), 0, 1)
    q_tail = xp.clip(1 - xp.exp(lq).sum(-1), 1e-12, 1)
    with np.errstate(invalid="ignore"):  # -inf - -inf where both give an id probability 0
        terms = xp.where(pk > 0, pk * (tl - lq), 0.0)
    tail = xp.where(p_tail > 1e-12, p_tail * (xp.log(xp.clip(p_tail, 1e-12, None)) - xp.log(q_tail)), 0.0)
    kl = xp.clip(terms.sum(-1) + tail, 0.0, None)
    return xp.where(xp.isnan(tl).any(-1), xp.nan, kl), p_tail  # no reference distribution: NaN, never a KL of 0


def reduce_kl(logits, ids: np.ndarray, top_lp: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The candidate's side of the shadow gate from its logits [T, V] (numpy or torch) and the baseline's top-k ids
    and log-probs [T, k]: its argmax [T] (reduce_logits) and, per position, KL and the baseline's tail mass [T]
    (kl_with_tail). Logits on a GPU are reduced there and only the three [T] arrays come back to the host."""
    if on_device(logits):
        top1, picked = _reduced_torch(logits, ids)
        kl, tail = kl_with_tail(top_lp, picked)
        return top1.cpu().numpy(), kl.cpu().numpy(), tail.cpu().numpy()
    top1, picked = reduce_logits(logits, ids)
    return (top1, *kl_with_tail(top_lp, picked))
