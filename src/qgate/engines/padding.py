"""Rows of different lengths into padded forwards: the grouping every runner and the eval adapter batch by.

    groups = length_groups([3, 3, 9, 40], forward_cost=24)          # [(3, 9), (40, 40)]: ranges run as one forward
    batches = padded_batches(lengths, forward_cost, max_tokens)     # row indices per forward, within a token budget
    batches = token_batches([5, 3, 2, 4], max_tokens=8)              # [[2, 1], [3], [0]]: packed rows, by real tokens
    tokens, mask = left_pad([[5, 6], [7]], pad=0)                    # [[5, 6], [0, 7]], [[1, 1], [0, 1]]
    tokens, mask = right_pad([[5, 6], [7]], pad=0)                   # [[5, 6], [7, 0]], [[1, 1], [1, 0]]
    rows = pack_sequences([5, 3, 2, 4], width=5)                     # [[0], [3], [1, 2]]: sequences per row
    width = packed_width([5, 3, 2, 4])                               # 7: [[0, 2], [3, 1]], 14 positions, not 15
    trees = pack_trees([([5, 6], [[7, 8], [9]])], prefix=0, pad=0)   # a context and its continuations in one row
    groups = sequences_as_trees([[1, 2, 3]], keep_last=2)            # [([1, 2], [[3, 0]])]: its last 2 positions

A forward's fixed cost in positions is the device's (device.forward_cost).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def length_groups(lengths: Sequence[int], forward_cost: float) -> list[tuple[int, int]]:
    """Rows of these lengths, grouped into ranges [lo, hi] run as one right-padded forward each: the grouping that
    minimizes forward_cost x forwards + padded positions (rows x hi), exactly, by dynamic programming over the sorted
    distinct lengths. A forward reads every weight once whatever its size, so a group of a few short rows costs more
    alone than as padding in the next group."""
    if not lengths:
        return []
    counts = Counter(lengths)
    ls = sorted(counts)
    count = [counts[v] for v in ls]
    best = [0.0] + [float("inf")] * len(ls)  # best[j]: cost of ls[:j]
    cut = [0] * (len(ls) + 1)
    for j in range(1, len(ls) + 1):
        rows = 0
        for i in range(j - 1, -1, -1):  # last group ls[i:j], padded to ls[j - 1]
            rows += count[i]
            c = best[i] + forward_cost + rows * ls[j - 1]
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], len(ls)
    while j:
        groups.append((ls[cut[j]], ls[j - 1]))
        j = cut[j]
    return groups[::-1]


def padded_batches(lengths: Sequence[int], forward_cost: float, max_tokens: int) -> list[list[int]]:
    """Indices of rows of these lengths, batched for right- or left-padded forwards: the groups of `length_groups`,
    each split into batches of at most max_tokens padded tokens (rows x the group's longest), rows by length."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    at = 0
    for _, hi in length_groups(lengths, forward_cost):
        group = []
        while at < len(order) and lengths[order[at]] <= hi:
            group.append(order[at])
            at += 1
        rows = max(1, max_tokens // max(hi, 1))
        batches += [group[a : a + rows] for a in range(0, len(group), rows)]
    return batches


def token_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of rows of these lengths, shortest first, cut into batches of at most max_tokens real tokens (a row
    longer than that is alone): the batches of a runner that packs its rows (pack_sequences), where a forward costs
    the tokens it holds, not rows x the longest. Fewer forwards than padded_batches, each as full as the budget."""
    batches: list[list[int]] = []
    held = 0
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        if batches and held + lengths[i] <= max_tokens:
            batches[-1].append(i)
            held += lengths[i]
        else:
            batches.append([i])
            held = lengths[i]
    return batches


def pack_sequences(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Indices of sequences of these lengths packed into rows of `width` positions, first fit in decreasing length
    order (each row's lengths sum to at most width; within a row, longest first)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > width:
            raise ValueError(f"a sequence of {lengths[i]} positions does not fit a row of {width}")
        q = next((q for q, f in enumerate(free) if f >= lengths[i]), None)
        if q is None:
            rows.append([])
            free.append(width)
            q = len(rows) - 1
        rows[q].append(i)
        free[q] -= lengths[i]
    return rows


def packed_width(lengths: Sequence[int], steps: int = 16) -> int:
    """The row width for pack_sequences with the fewest positions (rows x width) among `steps` + 1 widths from the
    longest sequence to twice it (the narrowest of equals). Rows wider than the longest pair sequences longer than
    half of it, which a row of the longest holds one of."""
    longest = max(lengths)
    widths = sorted({min(2 * longest, longest + j * math.ceil(longest / steps)) for j in range(steps + 1)})
    return min(widths, key=lambda w: len(pack_sequences(lengths, w)) * w)


def left_pad(seqs: Sequence[Sequence[int]], pad: int, rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [rows, W] int64 and a mask [rows, W] bool of which are real, for sequences left-padded to the
    longest (W); rows past len(seqs) (default: none) are all padding."""
    return _padded(seqs, pad, rows, left=True)


def right_pad(seqs: Sequence[Sequence[int]], pad: int, rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """As left_pad, with the padding after each sequence."""
    return _padded(seqs, pad, rows, left=False)


def _padded(seqs: Sequence[Sequence[int]], pad: int, rows: int | None, left: bool) -> tuple[np.ndarray, np.ndarray]:
    width = max((len(s) for s in seqs), default=0)
    tokens = np.full((rows or len(seqs), width), pad, dtype=np.int64)
    mask = np.zeros(tokens.shape, dtype=bool)
    for i, s in enumerate(seqs):
        if len(s):
            at = slice(width - len(s), width) if left else slice(0, len(s))
            tokens[i, at] = s
            mask[i, at] = True
    return tokens, mask


@dataclass
class Trees:
    """Contexts and their continuations packed several to a row (pack_trees): one forward scores them all. Each tree
    is a context followed by its continuations, each continuation fed without its last token (nothing reads what it
    predicts), and `mask` lets a token see the prefix, its own context, and the earlier tokens of its own
    continuation: what each sequence context + continuation would see alone."""

    tokens: np.ndarray  # [n, W] int64
    positions: np.ndarray  # [n, W] int64: RoPE positions, counted after the prefix's
    tree: np.ndarray  # [n, W] int64: which group a column holds; -1: padding
    branch: np.ndarray  # [n, W] int64: -1 the group's context, j its j-th continuation
    at: np.ndarray  # [M, 2] int64: (row, column) of every scored position, continuation by continuation
    spans: list[list[tuple[int, int]]]  # per group, per continuation: its rows [a, b) of `at`, one per token

    def per_continuation(self, logits) -> list[list]:
        """The logits read at `at` ([M, V]) as, per group, per continuation, its rows [len(k), V]: views, not copies."""
        return [[logits[a:b] for a, b in spans] for spans in self.spans]

    def segments(self) -> list[tuple[int, int, int]] | None:
        """Where every group is one sequence (a context with at most one continuation, as sequences_as_trees makes
        them), each group's (row, first column, end column): its tokens see the earlier ones of the same columns and
        nothing else, plain causal attention over [first, end). None where a group has several continuations."""
        if any(len(spans) > 1 for spans in self.spans):
            return None
        out = []
        for r in range(self.tree.shape[0]):
            cols = np.flatnonzero(self.tree[r] >= 0)
            cut = np.flatnonzero(np.diff(self.tree[r, cols])) + 1  # a group's columns are one run within its row
            out += [(r, int(c[0]), int(c[-1]) + 1) for c in np.split(cols, cut) if len(c)]
        return out

    def mask(self, prefix: int, device):
        """Which keys each query sees, [n, W, prefix + W] bool on `device`: the prefix's `prefix` cached positions
        first. A padding column sees itself only, so every row of the softmax has a key."""
        import torch

        from qgate.device import to_device

        tree, branch = to_device(self.tree, device), to_device(self.branch, device)
        n, w = tree.shape
        i = torch.arange(w, device=device)
        see = (tree[:, :, None] == tree[:, None, :]) & (tree[:, None, :] >= 0) & (i[:, None] >= i[None, :])
        see &= (branch[:, None, :] < 0) | (branch[:, None, :] == branch[:, :, None])  # a context, or its own branch
        see |= i[:, None] == i[None, :]
        return torch.cat([(tree >= 0)[:, :, None].expand(n, w, prefix), see], -1)


def sequences_as_trees(
    seqs: Sequence[Sequence[int]], keep_last: int | None = None
) -> list[tuple[list[int], list[list[int]]]]:
    """Whole sequences as pack_trees groups that score each one's last k positions (k: keep_last, at most its length;
    all of them by default): the context s[:n - k + 1] and one continuation s[n - k + 1:] plus a token never fed, whose
    k scored positions are the sequence's last k."""
    out = []
    for s in seqs:
        k = min(keep_last or len(s), len(s))
        out.append((list(s[: len(s) - k + 1]), [[*s[len(s) - k + 1 :], 0]]))
    return out


def pack_trees(groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], prefix: int, pad: int) -> Trees:
    """(context, continuations) groups as Trees after `prefix` positions: each group's context and continuations
    (fed without their last token) side by side, groups packed into rows of packed_width(their sizes) by
    pack_sequences. A continuation's scored positions are its context's last and its own fed tokens: len(k) each.
    Contexts and continuations must be non-empty."""
    for g, (c, conts) in enumerate(groups):
        if not len(c) or not all(len(k) for k in conts):
            raise ValueError(f"group {g}: an empty context or continuation has no position to score from")
    sizes = [len(c) + sum(len(k) - 1 for k in conts) for c, conts in groups]
    width = packed_width(sizes)
    rows = pack_sequences(sizes, width)
    shape = (len(rows), width)
    tokens, positions = np.full(shape, pad, dtype=np.int64), np.zeros(shape, dtype=np.int64)
    tree, branch = np.full(shape, -1, dtype=np.int64), np.full(shape, -1, dtype=np.int64)
    at: list[tuple[int, int]] = []
    spans: list[list[tuple[int, int]]] = [[] for _ in groups]
    where = {g: q for q, members in enumerate(rows) for g in members}
    col = [0] * len(rows)  # each row's next free column
    for g, (c, conts) in enumerate(groups):  # in group order: `at` follows the groups and their continuations
        q, a = where[g], col[where[g]]
        b = a + len(c)
        tokens[q, a:b], positions[q, a:b], tree[q, a:b] = c, prefix + np.arange(len(c)), g
        for j, k in enumerate(conts):
            e = b + len(k) - 1
            tokens[q, b:e], tree[q, b:e], branch[q, b:e] = k[:-1], g, j
            positions[q, b:e] = prefix + len(c) + np.arange(e - b)
            spans[g].append((len(at), len(at) + len(k)))
            at += [(q, a + len(c) - 1)] + [(q, x) for x in range(b, e)]
            b = e
        col[q] = b
    return Trees(tokens, positions, tree, branch, np.asarray(at, dtype=np.int64).reshape(-1, 2), spans)
