"""The engine build's choice of int4 kernels per weight shape, by timing them at the decode steps' row counts.

    splits = choose_splits(model, rows=[1, 2, 4, 8], seconds=lambda f: graph_seconds(f, device))   # torch's layouts
    gemv = choose_gemv(model, rows=[1, 2, 4, 8], seconds=lambda f: graph_seconds(f, device))       # qgate's kernel

Both lay the model's Linears out as chosen (StaticLlama, engines/static_llama.py) and return a record for
engine.json and the artifact's metadata. A candidate is taken only where it saves a share of the time of what it
replaces and computes the same product within a tolerance of its largest magnitude (a wrong layout, not rounding,
which engine parity measures).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from qgate.engines import int4_gemv
from qgate.engines.int4pack import device_pack, int4_mm, split_factors, split_k, split_mm, split_parts
from qgate.engines.static_llama import Linear
from qgate.errors import in_one_line

SPLIT_SAVING = 0.05  # share of the unsplit int4 kernel's time a split_k layout must save to be chosen (choose_splits)
SPLIT_TOLERANCE = 0.02  # a split_k layout's largest difference from the unsplit product, of its largest magnitude
GEMV_SAVING = 0.05  # share of torch's int4 kernel's time qgate's (int4_gemv) must save at a row count to serve it
ROTATED = 8  # Linears of one shape choose_gemv times in turn: their weights together outgrow the card's L2 cache


def int4_by_shape(model) -> dict[str, list[Linear]]:
    """The model's int4 Linears by weight shape (int4pack.int4_shape), in model order."""
    by_shape: dict[str, list[Linear]] = {}
    for m in model.modules():
        if isinstance(m, Linear) and m.weight is None:
            by_shape.setdefault(m.shape, []).append(m)
    return by_shape


def choose_splits(
    model, rows: Sequence[int], seconds: Callable[[Callable[[], object]], float], fused: bool = False
) -> dict:
    """Lay out each int4 weight shape's kernel as the split_k factor (int4pack.py) that serves `rows` fastest, for
    every Linear of that shape. rows: the row counts of the decode steps the engine captures; a Linear's count is
    one its int4 kernel serves (Linear.int4_serves: under KEPT_DENSE_ROWS where its dense matrix is kept, under its
    DENSE_ROWS). seconds(f): the time of one call of f (a CUDA graph's replay on a GPU). A split is taken where its
    time summed over those rows is the least and at least SPLIT_SAVING below the unsplit kernel's, and where it
    computes the unsplit kernel's product within SPLIT_TOLERANCE of its largest magnitude (that catches a wrong
    layout, not rounding, which engine parity measures). fused: forwards will run the elementwise work compiled,
    where the Linears that hand over their partials (Linear.parts: each layer's HANDS_PARTIALS) have them summed
    inside the next function; a shape all of whose Linears do is then timed without the sum, as the served step runs
    it. Needs the portable codes (a device with a dense path). Returns {shape: {"split", "us": {factor: microseconds
    summed over the rows}, "rows", "count", "timed": "with its sum" | "without its sum", "rejected"}}."""
    handing = {id(m) for m in model._handing_partials()}
    record: dict[str, dict] = {}
    for key, ms in int4_by_shape(model).items():
        m = ms[0]
        served = sorted({r for r in rows if m.int4_serves(r)})
        if not served:
            continue
        w = m.int4_weight()
        xs = [torch.randn(r, m.in_features, dtype=m.sz.dtype, device=m.packed.device) for r in served]
        us: dict[int, float] = {}
        rejected: dict[int, str] = {}
        exact: list[torch.Tensor] = []
        apart = fused and all(id(lin) in handing for lin in ms)
        for s in split_factors(m.in_features, m.group_size):
            ws = split_k(w, s)
            packed = device_pack(ws.codes, m.packed.device)

            def f(x, packed=packed, ws=ws, s=s):
                return split_mm(x, packed, ws.group_size, ws.scales_and_zeros, s)

            def as_served(x, packed=packed, ws=ws, s=s, f=f):
                return split_parts(x, packed, ws.group_size, ws.scales_and_zeros, s) if apart and s > 1 else f(x)

            with torch.inference_mode():
                ys = [f(x).float() for x in xs]
            exact = exact or ys  # the unsplit kernel's, s == 1 coming first
            err = max(
                float((y - e).abs().max() / e.abs().max().clamp(min=1e-30)) for y, e in zip(ys, exact, strict=True)
            )
            if not err <= SPLIT_TOLERANCE:
                rejected[s] = f"differs from the unsplit kernel by {err:.3g} of its largest magnitude"
                continue
            us[s] = round(sum(seconds(lambda f=as_served, x=x: f(x)) for x in xs) * 1e6, 2)
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


def choose_gemv(model, rows: Sequence[int], seconds: Callable[[Callable[[], object]], float]) -> dict:
    """For each int4 weight shape whose kernel is unsplit, and each row count in `rows` its int4 kernel serves (at
    most int4_gemv.MAX_ROWS), serve those rows with the int4_gemv configuration that is the fastest, where it
    saves GEMV_SAVING of torch's kernel's time (seconds(f): one call of f, a CUDA graph's replay on a GPU; f runs
    the kernel on ROTATED Linears of the shape in turn, so their weights come from memory as in a decode step) and
    computes torch's product within SPLIT_TOLERANCE of its largest magnitude; a configuration that raises (NVRTC
    missing, a compile error) is left out. Returns {shape: {"rows": {rows: configuration}, "us": {rows: {"torch"
    or configuration: microseconds}}, "count", "rejected": {"<configuration> at <rows> rows": why}, where any}}."""
    record: dict[str, dict] = {}
    for key, ms in int4_by_shape(model).items():
        ms = [m for m in ms if m.split == 1 and m.codes is not None]
        if not ms:
            continue
        m = ms[0]
        served = sorted({r for r in rows if m.int4_serves(r) and r <= int4_gemv.MAX_ROWS})
        if not served:
            continue
        turn = ms[:ROTATED]  # read as a decode step reads them: each weight once, from memory, not from the L2 cache
        pairs = [int4_gemv.scale_zero_pairs(lin.sz) for lin in turn]
        chosen: dict[int, str] = {}
        us: dict[int, dict[str, float]] = {}
        rejected: dict[str, str] = {}
        for r in served:
            x = torch.randn(r, m.in_features, dtype=m.sz.dtype, device=m.packed.device)

            def theirs(x=x, turn=turn):
                return [int4_mm(x, lin.packed, lin.group_size, lin.sz) for lin in turn]

            with torch.inference_mode():
                exact = torch.stack(theirs()).float()
            times = {"torch": seconds(theirs) / len(turn)}
            for name, config in int4_gemv.CONFIGS.items():
                if not config.takes(r):
                    continue

                def ours(x=x, turn=turn, pairs=pairs, config=config):
                    return [
                        int4_gemv.gemv(x, lin.codes, p, lin.group_size, config)
                        for lin, p in zip(turn, pairs, strict=True)
                    ]

                try:
                    with torch.inference_mode():
                        y = torch.stack(ours()).float()
                    err = float((y - exact).abs().max() / exact.abs().max().clamp(min=1e-30))
                    if not err <= SPLIT_TOLERANCE:
                        raise ValueError(f"differs from torch's int4 kernel by {err:.3g} of its largest magnitude")
                    times[name] = seconds(ours) / len(turn)
                except Exception as e:  # noqa: BLE001 - torch's kernel serves; the record says why
                    rejected[f"{name} at {r} rows"] = in_one_line(e)
            us[r] = {k: round(v * 1e6, 2) for k, v in times.items()}
            best = min(times, key=times.get)
            if best != "torch" and times[best] <= (1 - GEMV_SAVING) * times["torch"]:
                chosen[r] = best
        for lin in ms:
            lin.serve_gemv({r: int4_gemv.CONFIGS[n] for r, n in chosen.items()})
        record[key] = {"rows": chosen, "us": us, "count": len(ms)} | ({"rejected": rejected} if rejected else {})
    return record
