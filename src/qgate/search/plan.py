"""Which layers to move to which setting, and how many moves to gate next: pure functions, no model.

    ladder = rungs(scheme, SearchConfig(fine_group_size=32))   # W4 g64 -> W4 g32 -> W8 g64, bits per weight each
    plan = make_plan(ranking["layers"], ladder, {"lm_head": head_rungs(scheme)})   # the head: W8 g64 -> unquantized
    plan.assignment(12)                                         # {layer: rung tag} after the 12 best moves
    k = next_count(tried={8: False, 16: True}, start=8, max_count=40)   # -> 12

Each quantized layer can sit on a ladder of rungs: the scheme's own setting, optionally the same bits at a finer group
size, and the fallback (W8A16 or unquantized). A move takes one layer one step up its ladder; it costs the extra bits
times the layer's parameters and removes the estimated KL difference between the two rungs. Per layer, only the steps
on the lower convex hull of (bits, KL) are moves (a rung that costs more and removes less per bit than the next is
skipped), so a layer's moves come in order of falling gain and the moves of all layers can be sorted by gain (the greedy
multiple-choice knapsack). The k-move point is then a prefix of the (k+1)-move one and gating quality can be treated
as monotone in k. The search doubles k from `start` until a point passes, then bisects between the largest failing
and the smallest passing count. Counts above `max_count` (the size budget) are never tried.

With `lm_head: int8` the output head is one more layer with a ladder of its own: it starts at W8A16 and can move up
to unquantized, counted at 32 bits per weight, the float32 an engine that unties the head (the CPU engine) serves it
in. Its move competes with every other on KL removed per bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from qgate.errors import ConfigError
from qgate.quantize.schemes import power_of_two


@dataclass(frozen=True)
class SearchConfig:
    fallback_bits: int = 8  # 8: fallen-back layers become W8A16; 16: they stay unquantized
    fine_group_size: int | None = None  # a rung between the scheme and the fallback: its bits at this group size
    max_steps: int = 6  # gate runs (each: a real quantization and the shadow gate)
    max_bits_per_weight: float | None = None  # size budget over the quantized layers; None: up to every layer
    samples: int = 32  # calibration sequences for the sensitivity pass
    start_share: float = 0.5  # first point: the fewest moves removing this share of the estimated KL
    lm_head: str | None = None  # "int8": the output head is searched too, from W8A16 up to unquantized
    VERSION: ClassVar[int] = 3

    def __post_init__(self):
        if self.fallback_bits not in (8, 16):
            raise ConfigError(f"search.fallback_bits must be 8 or 16, got {self.fallback_bits}")
        g = self.fine_group_size
        if g is not None and not (power_of_two(g) and g >= 16):
            raise ConfigError(f"search.fine_group_size must be a power of two of at least 16, got {g!r}")
        if self.max_steps < 1:
            raise ConfigError(f"search.max_steps must be >= 1, got {self.max_steps}")
        if self.max_bits_per_weight is not None and self.max_bits_per_weight <= 0:
            raise ConfigError(f"search.max_bits_per_weight must be positive, got {self.max_bits_per_weight}")
        if not 0 < self.start_share <= 1:
            raise ConfigError(f"search.start_share must be in (0, 1], got {self.start_share}")
        if self.samples < 1:
            raise ConfigError(f"search.samples must be >= 1, got {self.samples}")
        if self.lm_head not in (None, "int8"):
            raise ConfigError(f"search.lm_head must be int8 or null, got {self.lm_head!r}")


@dataclass(frozen=True)
class Rung:
    tag: str  # as in a ranking's kl_at: '4g64'; 'fp' for unquantized
    bits: int
    group_size: int | None
    per_weight: float  # bits per weight as compressed-tensors stores it, in the float format quantize runs in
    label: str  # for people: 'W4A16 g32', 'W8A16', 'unquantized'


def rung_tag(bits: int, group_size: int | None) -> str:
    """The name of a setting, as in a ranking's `kl_at`: '4g64', '8g64'; 'fp' for unquantized."""
    return "fp" if bits >= 16 else f"{bits}g{group_size}"


FLOAT_BITS = (16, 32)  # the float formats a checkpoint stores scales and unquantized layers in: the model's declared
# bf16 or fp16, or the format quantize runs in, float32 on a CPU (quantize.compress.stored_float_bits)


def bits_per_weight(bits: int, group_size: int | None, symmetric: bool, float_bits: int = 32) -> float:
    """Codes, one scale per group and, when asymmetric, a packed zero point per group of the code width. Scales and
    unquantized weights are stored in the float format quantize stores the checkpoint in (stored_float_bits):
    `float_bits` each."""
    if bits >= 16 or not group_size:
        return float(float_bits)
    return bits + (float_bits + (0 if symmetric else bits)) / group_size


def ladder_problem(scheme, cfg: SearchConfig, float_bits: int = 32) -> tuple[str, str] | None:
    """Why cfg's ladder cannot climb from `scheme`, and the fix, or None: each rung must hold more than the one below
    it, and the size budget must hold the first in `float_bits` (the message names the field, without its path).
    With the fewest float bits, min(FLOAT_BITS), it refuses only what no host could search."""
    if cfg.fallback_bits <= scheme.num_bits:
        return (
            f"fallback_bits {cfg.fallback_bits} must be above the scheme's {scheme.num_bits} bits: a layer that falls "
            "back keeps more precision",
            "set search.fallback_bits: 16",
        )
    own = bits_per_weight(scheme.num_bits, scheme.group_size, scheme.symmetric, float_bits)
    if cfg.max_bits_per_weight is not None and cfg.max_bits_per_weight < own:
        return (
            f"max_bits_per_weight {cfg.max_bits_per_weight} is below the scheme's own {own:.4g} bits per weight "
            f"({float_bits}-bit scales): no point of the search fits it",
            "raise search.max_bits_per_weight, or drop it (no budget)",
        )
    g = cfg.fine_group_size
    if g and g >= scheme.group_size:
        return (
            f"fine_group_size {g} must be below the scheme's group_size {scheme.group_size}: it is the finer step "
            "between the scheme and the fallback",
            "lower search.fine_group_size or drop it",
        )
    return None


def rungs(scheme, cfg: SearchConfig, float_bits: int = 32) -> list[Rung]:
    """The ladder every layer can climb: the scheme, the finer group size (when set), the fallback; each rung's bits
    per weight with scales and unquantized layers in `float_bits`."""
    sym = scheme.symmetric

    def rung(bits: int, g: int | None, label: str) -> Rung:
        return Rung(rung_tag(bits, g), bits, g, bits_per_weight(bits, g, sym, float_bits), label)

    out = [rung(scheme.num_bits, scheme.group_size, f"W{scheme.num_bits}A16 g{scheme.group_size}")]
    if problem := ladder_problem(scheme, cfg, float_bits):
        raise ConfigError(f"search.{problem[0]}")
    if cfg.fine_group_size:
        out.append(rung(scheme.num_bits, cfg.fine_group_size, f"W{scheme.num_bits}A16 g{cfg.fine_group_size}"))
    fb = cfg.fallback_bits
    out.append(rung(fb, None if fb >= 16 else scheme.group_size, "W8A16" if fb == 8 else "unquantized"))
    return out


def head_rungs(scheme, float_bits: int = 32) -> list[Rung]:
    """The output head's ladder under `lm_head: int8`: W8A16 at the scheme's group size (its scales in `float_bits`),
    then unquantized, at 32 bits: the float32 the engines that take a quantized head (the CPU engine) serve it in."""
    g = scheme.group_size
    return [
        Rung(rung_tag(8, g), 8, g, bits_per_weight(8, g, scheme.symmetric, float_bits), f"W8A16 g{g}"),
        Rung(rung_tag(16, None), 16, None, bits_per_weight(16, None, scheme.symmetric, 32), "unquantized"),
    ]


def scored_settings(ladder: list[Rung]) -> tuple[tuple[int, int], ...]:
    """The (bits, group size) settings beyond the scheme's whose KL the sensitivity pass estimates (an unquantized
    rung adds none)."""
    return tuple((r.bits, r.group_size) for r in ladder[1:] if r.bits < 16 and r.group_size)


def _kl(row: dict, r: Rung, first: bool) -> float | None:
    if first:
        return row["kl"]
    if r.bits >= 16:
        return 0.0
    at = row.get("kl_at") or {}
    if r.tag in at:
        return at[r.tag]
    return 0.0 if r.bits >= 8 else None  # a ranking without this rung: W8's error is taken as none, a finer W4 skipped


def _hull_moves(row: dict, ladder: list[Rung]) -> list[dict]:
    """A layer's moves: the steps of the lower convex hull of (bits per weight, KL) from its first rung."""
    pts = [(r.per_weight, kl, r) for i, r in enumerate(ladder) if (kl := _kl(row, r, i == 0)) is not None]
    moves, cur = [], pts[0]
    while True:
        best = None
        for p in pts:
            if p[0] > cur[0] and p[1] < cur[1]:
                gain = (cur[1] - p[1]) / (p[0] - cur[0])
                if best is None or gain > best[0] or (gain == best[0] and p[0] > best[1][0]):
                    best = (gain, p)
        if best is None:
            return moves
        gain, nxt = best  # KL removed per bit per weight
        moves.append(
            {
                "layer": row["layer"],
                "params": row["params"],
                "from": cur[2].tag,
                "to": nxt[2].tag,
                "dbits": nxt[0] - cur[0],
                "kl": cur[1] - nxt[1],
                "kl_per_mbit": gain / (row["params"] / 1e6),  # KL removed per million bits added
                "step": len(moves),
            }
        )
        cur = nxt


@dataclass(frozen=True)
class Plan:
    moves: tuple[dict, ...]  # most KL removed per bit first
    params: int  # the searched layers' parameters
    base_bits: float  # bits per weight with every layer on its first rung
    total_kl: float  # the estimated KL with every layer on the first rung
    labels: dict  # rung tag -> label

    def bits(self, k: int) -> float:
        """Predicted bits per weight of the quantized layers after the first k moves (measured for every point)."""
        return self.base_bits + sum(m["dbits"] * m["params"] for m in self.moves[:k]) / self.params

    def max_count(self, budget: float | None) -> int:
        """The largest k whose predicted bits per weight stay within `budget` (every move when None)."""
        if budget is None:
            return len(self.moves)
        k = 0
        while k < len(self.moves) and self.bits(k + 1) <= budget:
            k += 1
        return k

    def start_count(self, share: float) -> int:
        """The fewest moves whose estimated KL removed adds up to `share` of the total (at least 1)."""
        if self.total_kl <= 0:
            return 1
        acc = 0.0
        for k, m in enumerate(self.moves, 1):
            acc += m["kl"]
            if acc >= share * self.total_kl:
                return k
        return len(self.moves)

    def assignment(self, k: int) -> dict[str, str]:
        """{layer: rung tag} for the layers the first k moves took off their first rung, in move order."""
        out: dict[str, str] = {}
        for m in self.moves[:k]:
            out[m["layer"]] = m["to"]
        return out

    def layout(self, k: int, layers_total: int) -> str:
        """'40 of 210 layers moved: 12 to W8A16, 28 to W4A16 g32'."""
        got = self.assignment(k)
        counts = [(self.labels[t], sum(1 for v in got.values() if v == t)) for t in self.labels]
        parts = [f"{n} to {label}" for label, n in counts if n]
        return f"{len(got)} of {layers_total} layers moved" + (f": {', '.join(parts)}" if parts else "")


def make_plan(layers: list[dict], ladder: list[Rung], ladders: dict[str, list[Rung]] | None = None) -> Plan:
    """The moves of every layer (a ranking's rows: layer, params, kl and kl_at), sorted by gain. `ladders`: layers
    with a ladder of their own (the output head's), by name; a row's kl is at its own ladder's first rung."""
    own = ladders or {}
    moves = [m for row in layers for m in _hull_moves(row, own.get(row["layer"], ladder))]
    moves.sort(key=lambda m: (-m["kl_per_mbit"], m["layer"], m["step"]))
    params = sum(r["params"] for r in layers)
    labels = {r.tag: r.label for lad in (ladder, *own.values()) for r in lad[1:]}
    return Plan(
        tuple(moves),
        params,
        sum(own.get(r["layer"], ladder)[0].per_weight * r["params"] for r in layers) / params,
        sum(r["kl"] for r in layers),
        labels,
    )


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
