"""The engine build's choice of int4 kernel layouts per weight shape, by timing them at the decode steps' row counts.

    splits = choose_splits(model, rows=[1, 2, 4, 8], seconds=lambda f: graph_seconds(f, device))

It lays the model's Linears out as chosen (StaticLlama, engines/static_llama.py) and returns a record for
engine.json and the artifact's metadata. A layout is taken only where it saves a share of the unsplit kernel's time
and computes the same product within a tolerance of its largest magnitude (a wrong layout, not rounding, which
engine parity measures).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qgate.device import Seconds
from qgate.engines.int4_linear import Linear
from qgate.engines.int4pack import device_pack, split_factors, split_k, split_mm, split_parts

SPLIT_SAVING = 0.05  # share of the unsplit int4 kernel's time a split_k layout must save to be chosen (choose_splits)
SPLIT_TOLERANCE = 0.02  # a split_k layout's largest difference from the unsplit product, of its largest magnitude
ROTATED = 8  # Linears of one shape each timing runs in turn: their weights together outgrow the card's L2 cache


def int4_by_shape(model) -> dict[str, list[Linear]]:
    """The model's int4 Linears by weight shape (int4pack.int4_shape), in model order."""
    by_shape: dict[str, list[Linear]] = {}
    for m in model.modules():
        if isinstance(m, Linear) and m.weight is None:
            by_shape.setdefault(m.shape, []).append(m)
    return by_shape


def choose_splits(model, rows: Sequence[int], seconds: Seconds, fused: bool = False) -> dict:
    """Lay out each int4 weight shape's kernel as the split_k factor (int4pack.py) that serves `rows` fastest, for
    every Linear of that shape. rows: the row counts of the decode steps the engine captures; a Linear's count is
    one its int4 kernel serves (Linear.int4_serves: under KEPT_DENSE_ROWS where its dense matrix is kept, under its
    DENSE_ROWS). seconds(f): the time of one call of f (a CUDA graph's replay on a GPU); f runs the layout on up to
    ROTATED Linears of the shape in turn, so that their weights come from memory as in a decode step and not from
    the L2 cache, and the time per Linear is recorded. A split is taken where its time summed over those rows is the
    least and at least SPLIT_SAVING below the unsplit kernel's, and where it computes the unsplit kernel's product
    within SPLIT_TOLERANCE of its largest magnitude (that catches a wrong layout, not rounding, which engine parity
    measures). fused: forwards will run the elementwise work compiled, where the Linears that hand over their
    partials (Linear.parts: each layer's HANDS_PARTIALS) have them summed inside the next function; a shape all of
    whose Linears do is then timed without the sum, as the served step runs it. Needs the portable codes (a device
    with a dense path). Returns {shape: {"split", "us": {factor: microseconds per Linear summed over the rows},
    "rows", "count", "timed": "with its sum" | "without its sum", "rejected"}}."""
    handing = {id(m) for m in model._handing_partials()}
    record: dict[str, dict] = {}
    for key, ms in int4_by_shape(model).items():
        m = ms[0]
        served = sorted({r for r in rows if m.int4_serves(r)})
        if not served:
            continue
        turn = ms[:ROTATED]
        weights = [lin.int4_weight() for lin in turn]  # the first is checked, all of them timed
        xs = [torch.randn(r, m.in_features, dtype=m.sz.dtype, device=m.packed.device) for r in served]
        us: dict[int, float] = {}
        rejected: dict[int, str] = {}
        exact: list[torch.Tensor] = []
        apart = fused and all(id(lin) in handing for lin in ms)
        for s in split_factors(m.in_features, m.group_size):
            layouts = [split_k(w, s) for w in weights]
            packs = [device_pack(ws.codes, m.packed.device) for ws in layouts]

            def as_served(x, layouts=layouts, packs=packs, s=s):  # every Linear of the turn once, as a step runs them
                kernel = split_parts if apart and s > 1 else split_mm
                return [
                    kernel(x, p, ws.group_size, ws.scales_and_zeros, s) for p, ws in zip(packs, layouts, strict=True)
                ]

            with torch.inference_mode():
                ys = [split_mm(x, packs[0], layouts[0].group_size, layouts[0].scales_and_zeros, s).float() for x in xs]
            exact = exact or ys  # the unsplit kernel's, s == 1 coming first
            err = max(
                float((y - e).abs().max() / e.abs().max().clamp(min=1e-30)) for y, e in zip(ys, exact, strict=True)
            )
            if not err <= SPLIT_TOLERANCE:
                rejected[s] = f"differs from the unsplit kernel by {err:.3g} of its largest magnitude"
                continue
            us[s] = round(sum(seconds(lambda x=x, g=as_served: g(x)) for x in xs) / len(turn) * 1e6, 2)
        best = min(us, key=us.get)
        if 1 not in us or us[best] > (1 - SPLIT_SAVING) * us[1]:
            best = 1
        for lin in ms:
            lin.resplit(best)
        timed = "without its sum" if apart else "with its sum"
        record[key] = {"split": best, "us": us, "rows": served, "count": len(ms), "timed": timed} | (
            {"rejected": rejected} if rejected else {}
        )
    return record
