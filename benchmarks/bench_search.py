"""Search points built from AWQ's smoothing once vs quantized for real, on the demo model: cost and agreement.

    python benchmarks/bench_search.py --workdir .qgate/demo --points 0,12,130   # after `qgate run` on the demo

For each move count k (the search's own plan: the first k moves up each layer's ladder of finer groups and W8A16),
the point is built both ways: round-to-nearest on the weights AWQ smoothed once (quantize/smoothing.py), and a full AWQ
run with the same per-layer settings.
Both go through the same shadow check against the cached baseline reference. Prints per point: KL p99 and top-1
agreement with their 95% CIs each way and whether the CIs overlap, and the cost of a point each way as a ratio to one
shadow check measured in the same run. Run it alone: two CPU-heavy processes on 2 cores distort each other 3-20x.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", type=Path, default=ROOT / "pipelines/promote.yaml")
    ap.add_argument("--variant", default="awq-w4a16-searched")
    ap.add_argument("--points", default="0,12", help="move counts to build both ways")
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-search"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from qgate.gates.gating import baseline_floor, shadow_check
    from qgate.pipeline.ledger import Ledger
    from qgate.pipeline.search import point_overrides
    from qgate.pipeline.spec import load_spec
    from qgate.pipeline.stages import calibrate_stage, model_stage
    from qgate.pipeline.variant import search_config
    from qgate.quantize.compress import CalibOptions, quantize
    from qgate.quantize.schemes import scheme_config
    from qgate.quantize.smoothing import cached_smoothing
    from qgate.search.plan import make_plan, rungs, scored_settings
    from qgate.search.sensitivity import SensitivityConfig, fisher_sensitivity

    print(f"torch threads {torch.get_num_threads()}, cores {os.cpu_count()}", flush=True)
    spec = load_spec(args.spec)
    v = next(x for x in spec.variants if x.name == args.variant)
    led = Ledger(spec.path(spec.workdir), print)
    base = model_stage(led, spec)
    cal = calibrate_stage(led, spec, spec.traffic_source())
    calib, shadow = cal.calib, cal.shadow
    cache = led.workdir / "cache"
    gate = spec.gate_config()
    baseline_floor(base, shadow, gate, cache)
    scheme = scheme_config(v.scheme, **v.options)
    opts = CalibOptions(max_seq_length=spec.quantize.max_seq_length)
    scfg = search_config(v)
    t = time.perf_counter()
    smooth = cached_smoothing(base, calib, scheme, opts, cache, print)
    smooth_s = time.perf_counter() - t
    ladder = rungs(scheme, scfg)
    sens = fisher_sensitivity(
        base,
        calib,
        scheme,
        SensitivityConfig(samples=scfg.samples, max_seq_length=opts.max_seq_length),
        scored_settings(ladder),
    )
    plan = make_plan(sens["layers"], ladder)
    rows = []
    for k in (int(x) for x in args.points.split(",")):
        fb = point_overrides(plan.assignment(k), scfg, ladder)
        if fb.fine:
            raise SystemExit(
                f"k={k} moves {len(fb.fine)} layers to group size {fb.fine_group_size}: a full AWQ run cannot build "
                "that point (llm-compressor smooths a mapping's layers with one group size), so there is nothing to "
                "compare; pick a k below the first finer-group move, or a spec without search.fine_group_size"
            )
        row = {"k": k, "layout": plan.layout(k, len(sens["layers"]))}
        for how in ("smoothed", "real"):
            t = time.perf_counter()
            ck = quantize(
                base,
                calib,
                scheme,
                args.out / f"{how}-{k}",
                opts=opts,
                fallback=fb if k else None,
                smoothed=smooth if how == "smoothed" else None,
            )
            build = time.perf_counter() - t
            t = time.perf_counter()
            chk = shadow_check(ck, base, shadow, gate, cache)
            check = time.perf_counter() - t
            m = {x["metric"]: x for x in chk["results"]}
            row[how] = {
                "build_s": build,
                "check_s": check,
                "bits": ck.meta["bits_per_weight"],
                "kl_p99": m["kl_p99"]["observed"],
                "kl_p99_ci": m["kl_p99"]["ci"],
                "top1": m["top1_agreement"]["observed"],
                "top1_ci": m["top1_agreement"]["ci"],
                "verdict": chk["verdict"],
            }
        s, q = row["smoothed"], row["real"]
        row["kl_ci_overlap"] = bool(s["kl_p99_ci"][0] <= q["kl_p99_ci"][1] and q["kl_p99_ci"][0] <= s["kl_p99_ci"][1])
        row["top1_ci_overlap"] = bool(s["top1_ci"][0] <= q["top1_ci"][1] and q["top1_ci"][0] <= s["top1_ci"][1])
        row["point_cost_vs_check"] = {
            "smoothed": (s["build_s"] + s["check_s"]) / s["check_s"],
            "real": (q["build_s"] + q["check_s"]) / q["check_s"],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"smoothing once: {smooth_s:.1f} s (cached: {smooth_s < 5})")
    print(
        f"{'k':>4} {'bits s/r':>12} {'KL p99 smoothed [CI]':>28} {'KL p99 real [CI]':>28} {'top-1 s/r':>14} overlap  "
        "cost/check s, r"
    )
    for row in rows:
        s, q = row["smoothed"], row["real"]
        print(
            f"{row['k']:>4} {s['bits']:5.2f}/{q['bits']:5.2f} {s['kl_p99']:8.4f} [{s['kl_p99_ci'][0]:.3f}, "
            f"{s['kl_p99_ci'][1]:.3f}]"
            f"   {q['kl_p99']:8.4f} [{q['kl_p99_ci'][0]:.3f}, {q['kl_p99_ci'][1]:.3f}]  {s['top1']:.3f}/{q['top1']:.3f}"
            f"  {row['kl_ci_overlap'] and row['top1_ci_overlap']!s:5}  {row['point_cost_vs_check']['smoothed']:.2f}x, "
            f"{row['point_cost_vs_check']['real']:.2f}x"
        )
    (args.out / "bench_search.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
