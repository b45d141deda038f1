"""Which fallback count to gate next: pure functions, no model.

    order = fallback_order(ranking["layers"])          # most KL removed per byte first
    k = next_count(tried={8: False, 16: True}, start=8, max_count=40)   # -> 12

Layers fall back in order of estimated KL per parameter (the greedy knapsack order: the extra bytes of a W8 layer are
proportional to its parameters), so the k-layer point is a prefix of the (k+1)-layer one and gating quality can be
treated as monotone in k. The search doubles k from `start` until a point passes, then bisects between the largest
failing and the smallest passing count. Counts above `max_count` (the size budget) are never tried.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from qgate.errors import ConfigError


@dataclass(frozen=True)
class SearchConfig:
    fallback_bits: int = 8  # 8: fallen-back layers become W8A16; 16: they stay unquantized
    max_steps: int = 6  # gate runs (each: a real quantization and the shadow gate)
    max_bits_per_weight: float | None = None  # size budget over the quantized layers; None: up to every layer
    samples: int = 32  # calibration sequences for the sensitivity pass
    start_share: float = 0.5  # first point: the fewest layers holding this share of the estimated KL
    VERSION: ClassVar[int] = 1

    def __post_init__(self):
        if self.fallback_bits not in (8, 16):
            raise ConfigError(f"search.fallback_bits must be 8 or 16, got {self.fallback_bits}")
        if self.max_steps < 1:
            raise ConfigError(f"search.max_steps must be >= 1, got {self.max_steps}")
        if self.max_bits_per_weight is not None and self.max_bits_per_weight <= 0:
            raise ConfigError(f"search.max_bits_per_weight must be positive, got {self.max_bits_per_weight}")
        if not 0 < self.start_share <= 1:
            raise ConfigError(f"search.start_share must be in (0, 1], got {self.start_share}")
        if self.samples < 1:
            raise ConfigError(f"search.samples must be >= 1, got {self.samples}")


def fallback_order(layers: list[dict]) -> list[dict]:
    return sorted(layers, key=lambda r: (-r["kl_per_mparam"], r["layer"]))


def start_count(order: list[dict], share: float) -> int:
    """The fewest layers whose estimated KL adds up to `share` of the total (at least 1)."""
    total = sum(r["kl"] for r in order)
    if total <= 0:
        return 1
    acc = 0.0
    for k, r in enumerate(order, 1):
        acc += r["kl"]
        if acc >= share * total:
            return k
    return len(order)


def predicted_bits(
    order: list[dict],
    k: int,
    bits: int,
    fallback_bits: int,
    group_size: int,
    symmetric: bool = False,
    scale_bits: int = 32,
) -> float:
    """Bits per weight of the quantized layers with the first k fallen back, as compressed-tensors stores them: the codes,
    one scale per group (`scale_bits`: the checkpoint's float32) and, when asymmetric, a packed zero point per group
    of the code width. Unquantized fallback layers keep 32-bit weights. Measured values are reported for every point."""

    def per_weight(b: int) -> float:
        if b >= 16:
            return 32.0
        return b + (scale_bits + (0 if symmetric else b)) / group_size

    params = sum(r["params"] for r in order)
    hi = sum(r["params"] for r in order[:k])
    return ((params - hi) * per_weight(bits) + hi * per_weight(fallback_bits)) / params


def max_count(
    order: list[dict], budget: float | None, bits: int, fallback_bits: int, group_size: int, symmetric: bool = False
) -> int:
    """The largest k whose predicted bits per weight stay within `budget` (every layer when None)."""
    if budget is None:
        return len(order)
    k = 0
    while k < len(order) and predicted_bits(order, k + 1, bits, fallback_bits, group_size, symmetric) <= budget:
        k += 1
    return k


def next_count(tried: dict[int, bool], start: int, max_count: int) -> int | None:
    """The next k to gate, or None when the search has converged or cannot go further within the budget."""
    start = max(0, min(start, max_count))
    if not tried:
        return start
    passing = [k for k, ok in tried.items() if ok]
    failing = [k for k, ok in tried.items() if not ok]
    if not passing:
        top = max(failing)
        if top >= max_count:
            return None
        return min(max_count, max(1, 2 * top))
    hi = min(passing)
    lo = max([k for k in failing if k < hi], default=-1)
    if hi - lo <= 1:
        return None
    return (lo + hi) // 2 if lo >= 0 else (0 if hi == 1 else hi // 2)
