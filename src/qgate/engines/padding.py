"""Rows of different lengths into padded forwards: the grouping every runner and the eval adapter batch by.

    groups = length_groups([3, 3, 9, 40], forward_cost=24)          # [(3, 9), (40, 40)]: ranges run as one forward
    batches = padded_batches(lengths, forward_cost, max_tokens)     # row indices per forward, within a token budget
    tokens, mask = left_pad([[5, 6], [7]], pad=0)                    # [[5, 6], [0, 7]], [[1, 1], [0, 1]]
    tokens, mask = right_pad([[5, 6], [7]], pad=0)                   # [[5, 6], [7, 0]], [[1, 1], [1, 0]]
    rows = pack_sequences([5, 3, 2, 4], width=5)                     # [[0], [3], [1, 2]]: sequences per row
    width = packed_width([5, 3, 2, 4])                               # 7: [[0, 2], [3, 1]], 14 positions, not 15

A forward's fixed cost in positions is the device's (device.forward_cost).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

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
