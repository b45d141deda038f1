"""How often the shadow gate's per-route guards fail a candidate, good or bad, on a real candidate's scored traffic.

    .venv/bin/python benchmarks/bench_route_guards.py --draws 2000   # ~9 min on 2 cores, from bench_shadow_ci's cache

The input is what `benchmarks/bench_shadow_ci.py` caches: a candidate's per-position KL and top-1 agreement on a
large held-out split (480 prompts of the demo traffic, `--scored`), and that split's rows (`--shadow`), whose
routes say which traffic each prompt is. As there, the large split stands for the traffic and many splits of
`--split` prompts are drawn from it, here stratified by route (each route's share of the split in proportion to its
share of the traffic, its prompts drawn with replacement), as `qgate calibrate sample` stratifies. Each split is
gated with the demo spec's shadow thresholds: the pooled checks and the route guards (gates/routes.py).

  at threshold   each route's KL scaled so that its own p99 (and, separately, its mean) is exactly the threshold,
                 and top-1 agreement's threshold set to the lowest route's: the guards' family-wise FAIL rate
                 (`guard F`), nominal at most 2.5% per check (Holm over the routes).
  one route bad  the candidate's KL on one route (`--route`) scaled up by each factor, and that many times its
                 disagreement: how often the pooled check FAILs it (`pooled F`) and PASSes it (`pooled P`), how
                 often a guard FAILs it, and what the gate does with both (`gate F`, `gate P`: pooled PASS and no
                 guard FAIL). `true` is the value on that route, or the threshold the routes sit at.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path("/tmp/bench-shadow-ci")


def load(scored: Path, shadow: Path) -> dict[str, np.ndarray]:
    s = dict(np.load(scored))
    routes = np.array([json.loads(x)["route"] for x in (shadow / "data.jsonl").read_text().splitlines() if x])
    if s["prompt"].max() >= len(routes):
        sys.exit(f"{scored} scores more prompts than {shadow} holds: pass the split it was scored on")
    return s | {"route": routes[s["prompt"]]}


def draw(s: dict, by_route: dict[str, list[np.ndarray]], alloc: dict[str, int], rng) -> dict[str, np.ndarray]:
    picked = [(r, by_route[r][i]) for r, k in alloc.items() for i in rng.integers(0, len(by_route[r]), k)]
    idx = np.concatenate([x for _, x in picked])
    return {
        "kl": s["kl"][idx],
        "agree": s["agree"][idx].astype(bool),
        "prompt": np.repeat(np.arange(len(picked)), [len(x) for _, x in picked]),  # a prompt drawn twice is two
        "route": np.concatenate([np.full(len(x), r) for r, x in picked]),
    }


def gate(split: dict, cfg) -> tuple[dict[str, str], dict[str, bool]]:
    """The pooled checks' verdicts, and per check whether any route's guard failed."""
    from qgate.gates.kl_checks import kl_top1_checks, route_checks
    from qgate.gates.routes import route_guards

    mask = np.ones(len(split["kl"]), bool)
    pooled = {r.metric: r.verdict for r in kl_top1_checks(split, split["prompt"], mask, cfg)}
    failed = {}
    for g in route_guards(split["route"], mask, route_checks(split, split["prompt"], cfg)):
        name = g.metric.rsplit(".", 1)[1]
        failed[name] = failed.get(name, False) or g.verdict == "fail"
    return pooled, failed


def scaled_to(s: dict, stat, target: float) -> np.ndarray:
    """s's KL with each route's scaled so that stat(route's KL) is `target`."""
    kl = s["kl"].copy()
    for r in np.unique(s["route"]):
        m = s["route"] == r
        kl[m] *= target / stat(kl[m])
    return kl


def degraded(s: dict, route: str, factor: float, rng) -> dict:
    """The candidate `factor` times worse on `route`: its KL there times factor, and as many of its agreeing positions
    there turned to disagreements as make its disagreement factor times as common (capped at all of them)."""
    m = s["route"] == route
    kl, agree = s["kl"].copy(), s["agree"].astype(bool).copy()
    kl[m] *= factor
    share = 1 - agree[m].mean()
    flip = min(1.0, (factor - 1) * share / max(agree[m].mean(), 1e-12))  # of the agreeing positions
    agree[m & agree & (rng.random(len(agree)) < flip)] = False
    return s | {"kl": kl, "agree": agree}


def main() -> None:
    from qgate.calibrate.sample import _allocate  # the split sampler's own rule
    from qgate.gates.kl_checks import KL_THRESHOLDS, THRESHOLD_OF
    from qgate.gates.stats import quantile
    from qgate.pipeline.spec import load_spec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scored", type=Path, default=CACHE / "scored-awq-w4a16-searched-480.npz")
    ap.add_argument("--shadow", type=Path, default=CACHE / "calib" / "shadow")
    ap.add_argument("--split", type=int, action="append", help="prompts per drawn split; repeatable (48 and 192)")
    ap.add_argument("--draws", type=int, default=1000, help="splits drawn per case (Monte Carlo error ~0.5%% at 1000)")
    ap.add_argument("--route", default="code-assist", help="the route made worse in the 'one route bad' cases")
    ap.add_argument("--factors", type=float, nargs="+", default=[1.0, 2.0, 3.0, 4.0])
    args = ap.parse_args()
    if not args.scored.exists():
        sys.exit(f"{args.scored}: not found; run benchmarks/bench_shadow_ci.py on that candidate first (it caches it)")
    import torch

    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, torch {torch.get_num_threads()} threads")
    cfg = load_spec(ROOT / "pipelines/promote.yaml").gate_config().shadow
    s = load(args.scored, args.shadow)
    routes, counts = np.unique(s["route"][np.r_[True, np.diff(s["prompt"]) != 0]], return_counts=True)
    print(f"{args.scored.name}: {len(s['kl'])} positions; prompts per route " + ", ".join(
        f"{r} {c}" for r, c in zip(routes, counts, strict=True)))  # fmt: skip
    print(f"thresholds: kl_p99 <= {cfg.kl_p99_max}, top1_agreement >= {cfg.top1_agreement_min}")
    rng = np.random.default_rng(0)
    for size in args.split or [48, 192]:
        shares = dict(zip(routes.tolist(), counts.tolist(), strict=True))
        alloc = _allocate(shares, size, caps=dict.fromkeys(shares, size))  # with replacement: no route runs out
        print(f"\n== splits of {size} prompts ({', '.join(f'{r} {k}' for r, k in alloc.items())}), {args.draws} each")
        cols = "".join(f"{c:>9s}" for c in ("pooled F", "pooled P", "guard F", "gate F", "gate P"))
        print(f"{'case':34s} {'check':16s} {'true':>7s}{cols}")

        def run(name: str, t: dict, checks: dict, truth: dict) -> None:
            by_route = {r: [np.flatnonzero(t["prompt"] == p) for p in np.unique(t["prompt"][t["route"] == r])]
                        for r in routes}  # fmt: skip
            tally = {c: np.zeros(5) for c in checks}
            t0 = time.perf_counter()
            for _ in range(args.draws):
                pooled, failed = gate(draw(t, by_route, alloc, rng), cfg_of(checks))
                for c in checks:
                    f = pooled[c] == "fail" or failed.get(c, False)
                    g = failed.get(c, False)
                    tally[c] += [pooled[c] == "fail", pooled[c] == "pass", g, f, pooled[c] == "pass" and not g]
            for c in checks:
                rates = "".join(f"{x / args.draws:{w}.3f}" for x, w in zip(tally[c], (9,) * 5, strict=True))
                print(f"{name:34s} {c:16s} {truth[c]:7.4f}{rates}")
            print(f"{'':34s} ({time.perf_counter() - t0:.0f} s)", flush=True)

        def cfg_of(checks: dict):
            from dataclasses import replace

            only = dict.fromkeys(KL_THRESHOLDS) | {THRESHOLD_OF[c]: v for c, v in checks.items()}
            return replace(cfg, **only)

        p99 = cfg.kl_p99_max
        at_p99 = s | {"kl": scaled_to(s, lambda x: quantile(x, 0.99), p99)}
        run("at threshold: every route's p99", at_p99, {"kl_p99": p99}, {"kl_p99": p99})
        print(f"{'':34s} pooled truth: kl_p99 {quantile(at_p99['kl'], 0.99):.4f}")
        at_mean = s | {"kl": scaled_to(s, np.mean, 0.05)}
        run("at threshold: every route's mean", at_mean, {"kl_mean": 0.05}, {"kl_mean": 0.05})
        low = min(s["agree"][s["route"] == r].mean() for r in routes)
        run("at threshold: lowest route's top-1", s, {"top1_agreement": low}, {"top1_agreement": low})
        print(f"{'':34s} pooled truth: top1 {s['agree'].mean():.4f}")
        for f in args.factors:
            t = degraded(s, args.route, f, np.random.default_rng(1))
            on = t["route"] == args.route
            truth = {"kl_p99": quantile(t["kl"][on], 0.99), "top1_agreement": t["agree"][on].mean()}
            run(f"{args.route} x{f:g} (true on the route)", t,
                {"kl_p99": p99, "top1_agreement": cfg.top1_agreement_min}, truth)  # fmt: skip
            print(f"{'':34s} pooled truth: kl_p99 {quantile(t['kl'], 0.99):.4f}, top1 {t['agree'].mean():.4f}")


if __name__ == "__main__":
    main()
