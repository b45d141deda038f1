"""How often the shadow checks' intervals miss, on a real candidate's per-position KL and top-1 agreement.

    .venv/bin/python benchmarks/bench_shadow_ci.py --baseline .qgate/demo/base \
        --candidate .qgate/demo/variants/awq-w4a16-cpu/checkpoint        # ~6 minutes on 2 cores

A shadow split is a sample of prompts; its checks' intervals claim 95% for the traffic those prompts come from. This
script samples a large held-out split of the demo traffic (`--prompts`, 480 by default), scores the baseline
reference and the candidate on it once (the demo spec's shadow settings and dtype), and takes that split as the
traffic. It then draws many splits of `--split` prompts (48, the demo's) from it, as a shadow split is drawn from
traffic (with replacement: the large split stands for the traffic's distribution), and counts how often each
interval lies wholly on one side of the large split's own value:

  passes  wholly on the good side (below for KL, above for top-1): a candidate on its threshold would pass;
  fails   wholly on the bad side.
Nominal: at most 2.5% each.

kl_mean and top1_agreement are means over positions clustered in prompts: the bootstrap-t resampling whole prompts
(`stats.cluster_bootstrap_t`, what the gate uses), the percentile interval of the same resamples (the rule before),
and the cluster-robust t interval (`stats.ratio_of_sums_ci`, what the long-context check uses over documents).
For kl_mean also two candidates that aim at skew, on the same resamples: the bootstrap-t on the log of the mean, and
BCa (Efron's bias-corrected and accelerated percentile interval, acceleration from the jackknife over prompts).
kl_p99 is the clustered order-statistic interval (`stats.quantile_ci`: Korn & Graubard's effective n, on the
prompts' degrees of freedom), and the same on Kish's n / deff without that adjustment (the rule before). The scored
arrays are cached next to --out, so a second run with other --split/--draws scores nothing.

    .venv/bin/python benchmarks/bench_shadow_ci.py --synthetic        # no model: where these intervals stop holding

--synthetic draws the same splits from made-up traffic whose KL is log-normal within a prompt, with prompt effects of
four shapes (normal, wider normal, heavy-tailed t3, 5% of prompts far worse), and prints each one's design effect at
the p99 over the whole traffic: how much its disagreement gathers in prompts.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def score(args) -> dict[str, np.ndarray]:
    """Per gated position: KL, top-1 agreement and the prompt it belongs to, on a fresh split of args.prompts."""
    import torch

    from qgate.artifact import Artifact
    from qgate.engines.runners import load_runner
    from qgate.gates.shadow import baseline_reference, run_shadow
    from qgate.pipeline.spec import load_spec

    cfg = load_spec(ROOT / "pipelines/promote.yaml").gate_config()
    out = args.out
    if not (out / "calib" / "shadow").exists():
        qgate = str(Path(sys.executable).parent / "qgate")
        subprocess.run(
            [qgate, "calibrate", "sample", "--traffic", str(args.traffic), "--out", str(out / "calib"),
             "--calib-size", "16", "--shadow-size", str(args.prompts), "--seed", "1"],
            check=True, stdin=subprocess.DEVNULL, capture_output=True,
        )  # fmt: skip
    shadow = Artifact.load(out / "calib" / "shadow")
    base = Artifact.load(args.baseline)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; scoring {args.prompts} prompts", flush=True)
    ref, _ = baseline_reference(
        lambda: load_runner(base, cfg.device, cfg.dtype), base, shadow, cfg.shadow, out / "cache"
    )
    check = run_shadow(load_runner(Artifact.load(args.candidate), cfg.device, cfg.dtype), ref, cfg.shadow)
    g = check.gated
    return {
        "kl": check.metrics["kl"][g],
        "agree": check.metrics["agree"][g].astype(float),
        "prompt": ref["prompt_of"][g],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path)
    ap.add_argument("--candidate", type=Path)
    ap.add_argument("--synthetic", action="store_true", help="made-up traffic of four prompt-effect shapes; no model")
    ap.add_argument("--traffic", type=Path, default=ROOT / "data/demo/traffic.jsonl")
    ap.add_argument("--prompts", type=int, default=480, help="the large split taken as the traffic")
    ap.add_argument("--split", type=int, default=48, help="prompts per drawn split (the demo's shadow_size)")
    ap.add_argument("--draws", type=int, default=2000, help="splits drawn (Monte Carlo error ~0.35%% at 2000)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-shadow-ci"))
    args = ap.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores")
    if args.synthetic:
        for name, s in synthetic().items():
            print(f"== {name}")
            count(s, args)
        return
    if args.baseline is None or args.candidate is None:
        ap.error("--baseline and --candidate are needed, unless --synthetic")
    cache = args.out / f"scored-{args.candidate.resolve().parent.name}-{args.prompts}.npz"
    if cache.exists():
        s = dict(np.load(cache))
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        s = score(args)
        np.savez(cache, **s)
    count(s, args)


def synthetic(prompts: int = 480, positions: int = 46) -> dict[str, dict[str, np.ndarray]]:
    """Made-up scored splits: per-position KL log-normal around a per-prompt level, top-1 agreement its lowest 10%
    flipped. The prompt levels' shapes run from mild clustering to disagreement held by a few prompts."""
    rng = np.random.default_rng(5)
    prompt = np.repeat(np.arange(prompts), positions)
    effects = {
        "prompt effect normal, sd 0.5": rng.normal(0, 0.5, prompts),
        "prompt effect normal, sd 1": rng.normal(0, 1.0, prompts),
        "prompt effect t3, scale 0.5": 0.5 * rng.standard_t(3, prompts),
        "5% of prompts e^2 worse": np.where(rng.random(prompts) < 0.05, 2.0, 0.0),
    }
    out = {}
    for name, u in effects.items():
        kl = 0.01 * np.exp(u[prompt] + rng.normal(0, 1, prompt.size))
        out[name] = {"kl": kl, "agree": (kl <= np.quantile(kl, 0.9)).astype(float), "prompt": prompt}
    return out


def skew_intervals(values: np.ndarray, clusters: np.ndarray, seed: int) -> dict[str, tuple]:
    """kl_mean's 95% interval by the bootstrap-t on log(mean) and by BCa, from the same cluster resamples the gate's
    bootstrap-t draws (stats.cluster_bootstrap_t's scheme)."""
    from scipy.stats import norm

    from qgate.gates.stats import N_BOOT, _cluster_var, cluster_resamples, cluster_sums

    c, d = cluster_sums(values, clusters)
    mean = c.sum() / d.sum()
    se = np.sqrt(_cluster_var(c, d, mean))
    means, ses = cluster_resamples(c, d, N_BOOT, seed)
    ok = (means > 0) & (ses > 0)
    t_log = (np.log(means[ok]) - np.log(mean)) / (ses[ok] / means[ok])  # the delta method's se of log(mean)
    q_lo, q_hi = np.quantile(t_log, [0.025, 0.975])
    out = {"log bootstrap-t": (mean * np.exp(-q_hi * se / mean), mean * np.exp(-q_lo * se / mean))}
    z0 = norm.ppf((means < mean).mean())
    jack = (c.sum() - c) / (d.sum() - d)  # [k]: the mean without each prompt
    dev = jack.mean() - jack
    acc = (dev**3).sum() / (6 * ((dev**2).sum()) ** 1.5)
    z = norm.ppf([0.025, 0.975])
    out["BCa"] = tuple(np.quantile(means, norm.cdf(z0 + (z0 + z) / (1 - acc * (z0 + z)))))
    return out


def count(s: dict[str, np.ndarray], args) -> None:
    """Draw args.draws splits of args.split prompts from s and print how often each interval passes and fails a
    candidate that sits on s's own value."""
    from qgate.gates.stats import cluster_bootstrap_t, quantile, quantile_ci, ratio_of_sums_ci

    prompts = np.unique(s["prompt"])
    truth = {"kl_mean": s["kl"].mean(), "top1_agreement": s["agree"].mean(), "kl_p99": quantile(s["kl"], 0.99)}
    whole = quantile_ci(s["kl"], s["prompt"], 0.99)[2]
    print(f"{len(prompts)} prompts, {len(s['kl'])} positions; design effect at the p99 {whole['design_effect']:.2f}")
    print("the whole split: " + ", ".join(f"{k} {v:.4f}" for k, v in truth.items()))
    rng = np.random.default_rng(0)
    by_prompt = {p: np.flatnonzero(s["prompt"] == p) for p in prompts}
    rules = ("bootstrap-t", "percentile", "t (CR2)")
    counts = {f"{m} {r}": np.zeros(2) for m in ("kl_mean", "top1") for r in rules}
    counts |= {"kl_mean log bootstrap-t": np.zeros(2), "kl_mean BCa": np.zeros(2)}
    counts |= {"kl_p99": np.zeros(2), "kl_p99 n/deff": np.zeros(2)}
    t0, seed = time.perf_counter(), {}
    for _ in range(args.draws):
        picked = [by_prompt[p] for p in rng.choice(prompts, args.split)]  # with replacement: draws from the traffic
        idx = np.concatenate(picked)
        cl = np.repeat(np.arange(args.split), [len(x) for x in picked])  # a prompt drawn twice is two prompts
        for metric, values, t, low_good in (
            ("kl_mean", s["kl"][idx], truth["kl_mean"], True),
            ("top1", s["agree"][idx], truth["top1_agreement"], False),
        ):
            seed[metric] = int(rng.integers(2**31))
            _, lo, hi, ev = cluster_bootstrap_t(values, cl, seed=seed[metric])
            intervals = [(lo, hi), ev["percentile"], ratio_of_sums_ci(values, np.ones(len(idx)), cl)[1:3]]
            for rule, (lo, hi) in zip(rules, intervals, strict=True):
                counts[f"{metric} {rule}"] += [hi < t, lo > t] if low_good else [lo > t, hi < t]
        for rule, (lo, hi) in skew_intervals(s["kl"][idx], cl, seed["kl_mean"]).items():  # the same resamples
            counts[f"kl_mean {rule}"] += [hi < truth["kl_mean"], lo > truth["kl_mean"]]
        for rule, df in (("kl_p99", None), ("kl_p99 n/deff", np.inf)):
            lo, hi, _ = quantile_ci(s["kl"][idx], cl, 0.99, design_df=df)
            counts[rule] += [hi < truth["kl_p99"], lo > truth["kl_p99"]]
    print(f"{args.draws} splits of {args.split} prompts, {time.perf_counter() - t0:.0f} s")
    print(f"{'interval':24s} {'passes':>7} {'fails':>7}")
    for name, c in counts.items():
        print(f"{name:24s} {c[0] / args.draws:7.3f} {c[1] / args.draws:7.3f}")


if __name__ == "__main__":
    main()
