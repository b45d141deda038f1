"""Search for the smallest variant that passes the shadow gate: per-layer moves up from a uniform scheme.

    ckpt = search_checkpoint(base, calib, shadow, scheme, SearchConfig(), gate_cfg, out, cache_dir)
    ckpt.meta["search"]     # every gated point, the chosen one, the sensitivity that ranked the layers

1. Estimate each layer's KL at each rung of its ladder: the scheme, the scheme's bits at `fine_group_size` (when set),
   the fallback (search/sensitivity.py: one Fisher pass), and sort the moves up the ladders by KL removed per bit
   (search/plan.py). With `lm_head: int8` the output head is on a ladder of its own, W8A16 up to unquantized.
2. Gate points k = the first k moves: each point is a real compressed-tensors checkpoint with per-layer config
   groups, scored by the same shadow gate as every variant. For AWQ, the smoothing runs once (quantize/smoothing.py,
   cached) and each point is llm-compressor's round-to-nearest on the smoothed weights: seconds, not an AWQ run.
   Other schemes quantize each point in full. search/plan.py picks k: doubling until a point passes, then bisecting,
   within max_steps and the size budget.
3. Return the smallest passing point (by bits per weight over the searched layers) as a checkpoint (or, when none
   passed, the point closest to passing, marked so), with the search's evidence beside it: qgate-search.json and
   qgate-search.png.

Each gated point's result is cached by content hash, so a killed search resumes where it stopped. The pipeline gates
points on the calibration stage's search split, disjoint from the shadow split that then gates the chosen checkpoint:
a point chosen because it passed one sample of traffic is confirmed on another, and the report says which.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from qgate.artifact import MANIFEST, Artifact, sha256_json, typed_config
from qgate.cache import read_cached, write_cached
from qgate.errors import ConfigError
from qgate.quantize.schemes import BUILT, FallbackConfig, smooths
from qgate.quantize.smoothing import cached_smoothing
from qgate.search.plan import SearchConfig, head_rungs, make_plan, next_count, rungs, scored_settings


def _metric(results: list[dict], name: str) -> tuple[float, list | None]:
    for r in results:
        if r["gate"] == "shadow" and r["metric"] == name:
            return r["observed"], r["ci"]
    return float("nan"), None


def search_checkpoint(
    base: Artifact,
    calib: Artifact,
    shadow: Artifact,
    scheme,
    cfg: SearchConfig,
    gate_cfg,
    out: Path,
    cache_dir: Path,
    kv=None,
    opts=None,
    echo: Callable[[str], None] = print,
    confirm: Artifact | None = None,
) -> Artifact:
    """shadow: the held-out split the points are gated on. confirm: the split that gates the chosen checkpoint
    afterwards, recorded in the evidence; when it is `shadow` itself (or not given) the evidence says that the chosen
    point's shadow checks are not independent of its choice."""
    from qgate.calibrate.sample import split_prompts
    from qgate.gates.gating import shadow_check
    from qgate.gates.numerics import numerics_key
    from qgate.quantize.compress import CalibOptions, quantize, storage_key, stored_float_bits
    from qgate.search.plot import plot_points
    from qgate.search.sensitivity import SensitivityConfig, fisher_sensitivity

    t_start = time.perf_counter()
    opts = opts or CalibOptions()
    out, cache_dir = Path(out), Path(cache_dir)
    scfg = SensitivityConfig(samples=cfg.samples, max_seq_length=opts.max_seq_length, seed=opts.seed)
    if reason := fine_groups_refusal(scheme, kv, cfg):
        raise ConfigError(f"search: {reason}", hint="drop search.fine_group_size or the variant's kv_cache")
    float_bits = stored_float_bits(base.path)  # the points' scales and unquantized layers: 32 or 16 bits
    ladder = rungs(scheme, cfg, float_bits)
    settings = scored_settings(ladder)  # KL estimated at each
    head_ladder = head_rungs(scheme, float_bits) if cfg.lm_head else None
    head = (head_ladder[0].bits, head_ladder[0].group_size) if head_ladder else None  # the head's KL is scored there
    skey = sha256_json(
        {
            "base": base.sha256,
            "calib": calib.sha256,
            "scheme": typed_config(scheme),
            "cfg": typed_config(scfg),
            "rungs": settings,
        }
        | ({"head": head} if head else {})
    )
    spath = cache_dir / f"sensitivity-{skey[:24]}.json"
    if (data := read_cached(spath)) is not None:
        sens = json.loads(data)
        echo(f"    sensitivity: cached ({sens['sequences']} sequences, {sens['tokens']} tokens)")
    else:
        sens = fisher_sensitivity(base, calib, scheme, scfg, settings, head)
        write_cached(spath, json.dumps(sens).encode())
        echo(f"    sensitivity: {len(sens['layers'])} layers from {sens['sequences']} sequences in {sens['seconds']}s")
    head_name = sens.get("head")
    plan = make_plan(sens["layers"], ladder, {head_name: head_ladder} if head_name else None)
    if (budget := cfg.max_bits_per_weight) is not None and plan.bits(0) > budget:  # the head's first rung counts too
        raise ConfigError(
            f"search.max_bits_per_weight {budget} is below the first point's {plan.bits(0):.4g} bits per weight "
            f"(every layer at the scheme{', the output head at W8A16' if head_name else ''}): no point fits it",
            hint="raise search.max_bits_per_weight, or drop it (no budget)",
        )
    kmax = plan.max_count(budget)
    smoothed = cached_smoothing(base, calib, scheme, opts, cache_dir, echo) if smooths(scheme, kv) else None
    built = BUILT if smoothed else "full quantization"
    k0 = plan.start_count(cfg.start_share)
    tried: dict[int, bool] = {}
    points: list[dict] = []
    work = out / "_points"
    kept: dict[int, Artifact] = {}
    gate_runs = 0
    numerics = numerics_key(base, gate_cfg.device, gate_cfg.dtype)  # the points are gated in these numerics
    while len(points) < cfg.max_steps and (k := next_count(tried, k0, kmax)) is not None and k not in tried:
        fb = point_overrides(plan.assignment(k), cfg, ladder, head_name)
        key = sha256_json(
            {
                "base": base.sha256,
                "calib": calib.sha256,
                "shadow": shadow.sha256,
                "scheme": typed_config(scheme),
                "kv": typed_config(kv) if kv else None,
                "opts": opts.__dict__,
                "fallback": typed_config(fb),
                "shadow_cfg": typed_config(gate_cfg.shadow),
                "smoothed": smoothed.sha256 if smoothed else None,
            }
            | numerics
            | storage_key(base.path)
        )
        ppath = cache_dir / f"search-point-{key[:24]}.json"
        t = time.perf_counter()
        if (data := read_cached(ppath)) is not None:
            point = json.loads(data) | {"cached": True}
        else:
            ckpt = quantize(base, calib, scheme, work / f"k{k:04d}", kv=kv, opts=opts, fallback=fb, smoothed=smoothed)
            chk = shadow_check(ckpt, base, shadow, gate_cfg, cache_dir)
            gate_runs += 1
            kl, kl_ci = _metric(chk["results"], "kl_p99")
            top1, top1_ci = _metric(chk["results"], "top1_agreement")
            point = {
                "k": k,
                "verdict": chk["verdict"],
                "weights_bytes": ckpt.meta["weights_bytes"],
                "bits_per_weight": _searched_bits(ckpt, fb, head_name, sens),
                "kl_p99": kl,
                "kl_p99_ci": kl_ci,
                "top1": top1,
                "top1_ci": top1_ci,
                "quantize_seconds": ckpt.meta["quantize_seconds"],
                "seconds": round(time.perf_counter() - t, 1),
                "checkpoint_sha256": ckpt.sha256,
            }
            write_cached(ppath, json.dumps(point).encode())
            kept[k] = ckpt
        tried[k] = point["verdict"] == "pass"
        points.append(point)
        echo(
            f"    k={k:>3} moves: {point['verdict'].upper():12s} KL p99 {point['kl_p99']:.4g}  top-1 "
            f"{point['top1']:.4f}  {point['bits_per_weight']:.2f} "
            f"bits/weight{' (cached)' if point.get('cached') else ''}"
        )
        _prune(kept, points)
    passing = [p for p in points if p["verdict"] == "pass"]
    chosen = (
        min(passing, key=lambda p: (p["bits_per_weight"], p["k"]))
        if passing
        else min(points, key=lambda p: (p["kl_p99"] if p["kl_p99"] == p["kl_p99"] else float("inf"), -p["k"]))
    )
    ck = chosen["k"]
    assigned = plan.assignment(ck)
    ckpt = kept.get(ck)
    if ckpt is None:  # gated in an earlier, killed run: quantize it again (seeded: the same bytes)
        ckpt = quantize(
            base,
            calib,
            scheme,
            work / f"k{ck:04d}",
            kv=kv,
            opts=opts,
            fallback=point_overrides(assigned, cfg, ladder, head_name),
            smoothed=smoothed,
        )
    for f in ckpt.path.iterdir():
        if f.name != MANIFEST:
            shutil.move(str(f), str(out / f.name))
    shutil.rmtree(work, ignore_errors=True)
    rank = {r["layer"]: i + 1 for i, r in enumerate(sens["layers"])}
    row = {r["layer"]: r for r in sens["layers"]}
    fell = [
        {
            "layer": layer,
            "to": plan.labels[tag],
            "params": row[layer]["params"],
            "kl": row[layer]["kl"],
            "kl_per_mparam": row[layer]["kl_per_mparam"],
            "kl_rank": rank[layer],
        }
        for layer, tag in assigned.items()
        if layer != head_name
    ]
    head_label = plan.labels.get(assigned.get(head_name), head_ladder[0].label) if head_name else None
    independent = confirm is not None and confirm.sha256 != shadow.sha256
    summary = {
        "chosen_on": {
            "split": shadow.meta.get("split"),
            "sha256": shadow.sha256,
            "prompts": shadow.meta.get("n"),
            "gated_on": confirm.sha256 if confirm else None,
            "independent": independent,
        },
        "found": bool(passing),
        "points_built_by": built,
        "smoothed_weights": smoothed.sha256 if smoothed else None,
        "smoothing_seconds": smoothed.meta.get("smoothing_seconds") if smoothed else None,
        "chosen_k": ck,
        "chosen_verdict": chosen["verdict"],
        "layout": plan.layout(ck, len(sens["layers"]))
        + (f"; lm_head at {head_label}" if head_name and head_name not in assigned else ""),
        "rungs": [r.label for r in ladder],
        "fallback_bits": cfg.fallback_bits,
        "fine_group_size": cfg.fine_group_size,
        "lm_head": head_label,
        "gate_runs": gate_runs,
        "points_tried": len(points),
        "seconds": round(time.perf_counter() - t_start, 1),
        "start_k": k0,
        "max_k": kmax,
        "layers_total": len(sens["layers"]),
        "moves_total": len(plan.moves),
        "budget_bits_per_weight": cfg.max_bits_per_weight,
        "bits_per_weight": chosen["bits_per_weight"],
        "weights_bytes": chosen["weights_bytes"],
        "uniform_bits_per_weight": round(plan.bits(0), 3),
        "points": points,
        "fallback": fell,
        "sensitivity": {k: v for k, v in sens.items() if k != "layers"} | {"top": sens["layers"][:20]},
        "note": None
        if passing
        else f"no point passed the shadow gate within {cfg.max_steps} steps and "
        f"{cfg.max_bits_per_weight or 'no'} bits/weight budget; the point closest to passing is kept",
    }
    (out / "qgate-search.json").write_text(json.dumps(summary | {"sensitivity_all": sens["layers"]}, indent=2))
    plot_points(points, gate_cfg.shadow.kl_p99_max, gate_cfg.shadow.top1_agreement_min, ck, out / "qgate-search.png")
    config = ckpt.config | {"search": typed_config(cfg)}
    meta = ckpt.meta | {"search": summary, "search_prompts": split_prompts(shadow)}  # chosen on these requests
    return Artifact.create("checkpoint", out, config, ckpt.parents + (shadow.sha256,), meta)


def fine_groups_refusal(scheme, kv, cfg: SearchConfig) -> str | None:
    """Why finer-group layers cannot be built for this variant, or None. An AWQ variant whose points are quantized in
    full (with a KV-cache scheme, its smoothing is not cached) would run llm-compressor's AWQ with layers of two group
    sizes in one smoothing mapping, which it cannot: the scales it computes for one group size are applied to the
    other's weights. Points built from the cached smoothing, and GPTQ points, quantize each layer on its own."""
    if cfg.fine_group_size and hasattr(scheme, "rtn_modifiers") and not smooths(scheme, kv):
        return (
            "fine_group_size needs this AWQ variant's points built from its cached smoothing, and a KV-cache scheme "
            "makes every point a full AWQ run, which cannot smooth layers of two group sizes together"
        )
    return None


def point_overrides(assignment: dict[str, str], cfg: SearchConfig, ladder, head: str | None = None) -> FallbackConfig:
    """The checkpoint's per-layer overrides for a plan's {layer: rung tag}. head: the output head's name when the
    search quantizes it; it stays at W8A16 unless the plan moved it up its own ladder."""
    top = ladder[-1].tag
    body = {x: t for x, t in assignment.items() if x != head}
    fine = tuple(x for x, t in body.items() if t != top)
    return FallbackConfig(
        tuple(x for x, t in body.items() if t == top),
        cfg.fallback_bits,
        fine,
        cfg.fine_group_size if fine else None,
        (head,) if head and head not in assignment else (),
    )


def _searched_bits(ckpt: Artifact, fb: FallbackConfig, head: str | None, sens: dict) -> float:
    """Bits per weight over the layers the search sizes: the checkpoint's quantized Linears (and its unquantized
    fallback layers), plus an unquantized output head at 32 bits when the search could have quantized it."""
    bits = ckpt.meta["bits_per_weight"]
    if head is None or fb.head:
        return bits
    params = ckpt.meta["linear_params"]
    head_params = next(r["params"] for r in sens["layers"] if r["layer"] == head)
    return round((bits * params + 32 * head_params) / (params + head_params), 4)


def _prune(kept: dict[int, Artifact], points: list[dict]) -> None:
    """Keep on disk only the checkpoint that would be chosen now (checkpoints are hundreds of MB each)."""
    passing = [p for p in points if p["verdict"] == "pass" and p["k"] in kept]
    keep = min(passing, key=lambda p: (p["bits_per_weight"], p["k"]))["k"] if passing else max(kept, default=None)
    for k in [k for k in kept if k != keep]:
        shutil.rmtree(kept.pop(k).path, ignore_errors=True)
