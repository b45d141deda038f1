"""The scale run's figures as one picture: decode against its roofline, scoring MFU against its goal, every goal.

    python benchmarks/scale_plot.py /tmp/scale/scale.json                  # writes /tmp/scale/scale.png
    python benchmarks/scale_plot.py scale.json --out docs/img/gpu-scale.png

Reads a scale.json that benchmarks/gpu_scale.py wrote, whole or cut short; needs matplotlib, not torch or a GPU,
so a run's JSON from a bare GPU image is drawn anywhere qgate is installed. Three panels:
  decode   tok/s at each batch size (log scale): the torch-int4 engine, transformers eager bf16 and the engine serving
           dense bf16, against the int4 roofline at batch 1 and its upper bound at larger batches (batch x the batch-1
           roofline: every row's tokens for one read of the weights, ignoring compute and each row's KV cache)
  scoring  model-FLOP MFU of the gate's scoring (the goals' figures) and of the same forward passes alone, warm
  goals    each of issue 35's goals as its headroom: figure / limit for an at-least goal, limit / figure for an
           at-most one, so that every goal is met at 1 or more
A figure the run did not measure is left out of its panel and named under it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scale_goals import GOALS, figure, goal_rows  # beside this script

DECODE_SERIES = (  # (key in decode.by_batch, label)
    ("engine_tok_s", "torch-int4 engine (int4, CUDA graphs)"),
    ("eager_bf16_tok_s", "transformers eager bf16"),
    ("bf16_graph_tok_s", "engine serving dense bf16"),
)
SCORING_BARS = (  # (label, path into the results, whether a goal names it)
    ("eval, candidate (engine)", ("gate", "shadow_mfu", "candidate_eval_scoring"), True),
    ("eval, baseline (reference)", ("gate", "shadow_mfu", "baseline_eval_scoring"), True),
    ("shadow, baseline teacher-forced", ("gate", "shadow_mfu", "baseline_teacher_forced"), True),
    ("forwards alone: engine prefill", ("scoring", "engine_prefill", "mfu"), False),
    ("forwards alone: reference", ("scoring", "baseline_forward", "mfu"), False),
)
MFU_GOAL = 0.4  # issue 35's scoring goal, the figure every goal-named bar is held to


def headroom(value: float | None, limit: float, at_least: bool) -> float | None:
    """A goal's figure over its limit (at least) or its limit over its figure (at most): met at 1 or more."""
    if value is None:
        return None
    if at_least:
        return value / limit
    return limit / value if value > 0 else float("inf")


def panels(r: dict) -> dict:
    """What each panel draws, from the results `r` (a scale.json): {"decode": {label: [(batch, tok/s)]},
    "roofline": tok/s at batch 1 or None, "scoring": [(label, mfu, is a goal)], "goals": [(name, headroom, met)],
    "missing": [what the run did not measure]}."""
    by_batch = (r.get("decode") or {}).get("by_batch") or {}
    batches = sorted(int(b) for b in by_batch)
    decode = {}
    for key, label in DECODE_SERIES:
        points = [(b, by_batch[str(b)][key]) for b in batches if figure(by_batch, (str(b), key))]
        if points:
            decode[label] = points
    missing = [label for key, label in DECODE_SERIES[:2] if label not in decode]
    scoring = []
    for label, path, goal in SCORING_BARS:
        value = figure(r, path)
        if value is None:
            missing.append(f"MFU: {label}")
        else:
            scoring.append((label, value, goal))
    goals = []
    for (_, _, limit, at_least), row in zip(GOALS, goal_rows(r), strict=True):
        h = headroom(row["value"], limit, at_least)
        if h is None:
            missing.append(f"goal: {row['goal']}")
        else:
            goals.append((row["goal"], h, row["met"]))
    return {
        "decode": decode,
        "roofline": figure(r, ("decode", "int4_roofline_tok_s")),
        "scoring": scoring,
        "goals": goals,
        "missing": missing,
    }


def draw(r: dict, out: Path) -> dict:
    """The picture of the results `r` at `out` (PNG); returns what it drew (panels)."""
    from matplotlib.ticker import FuncFormatter

    from qgate.plotting import pyplot

    p = panels(r)
    plt = pyplot()
    plain = FuncFormatter(lambda v, _: f"{v:g}")  # log axes' own labels are TeX, which qgate.plotting leaves unparsed
    fig, (dec, mfu, goals) = plt.subplots(1, 3, figsize=(18, 5.4), gridspec_kw={"width_ratios": [1.2, 1.0, 1.1]})
    run = {k: r.get(k, "?") for k in ("shape", "layers", "device", "date")}
    fig.suptitle(f"qgate scale run: {run['shape']} shape, {run['layers']} layers, on {run['device']} ({run['date']})")

    for label, points in p["decode"].items():
        xs, ys = zip(*points, strict=True)
        dec.plot(xs, ys, marker="o", label=label)
    if p["roofline"]:
        batches = sorted({b for points in p["decode"].values() for b, _ in points} | {1})
        dec.plot(batches, [b * p["roofline"] for b in batches], ls="--", color="grey", label="batch x int4 roofline")
        dec.scatter([1], [p["roofline"]], marker="_", s=400, color="black", zorder=3, label="int4 roofline, batch 1")
    dec.set(xscale="log", yscale="log", xlabel="decode batch size", ylabel="tokens/s, all rows", title="decode")
    dec.set_xticks(sorted({b for points in p["decode"].values() for b, _ in points} | {1}))
    dec.xaxis.set_major_formatter(plain)
    dec.yaxis.set_major_formatter(plain)
    if p["decode"] or p["roofline"]:
        dec.legend(fontsize=8, loc="lower right")
    else:  # a run with --no-decode
        dec.text(0.5, 0.5, "decode not measured in this run", ha="center", va="center", transform=dec.transAxes)
    dec.grid(alpha=0.3, which="both")

    labels = [label for label, _, _ in p["scoring"]]
    colors = [("tab:green" if v >= MFU_GOAL else "tab:red") if goal else "tab:grey" for _, v, goal in p["scoring"]]
    mfu.barh(range(len(labels)), [v for _, v, _ in p["scoring"]], color=colors)
    for i, (_, v, _) in enumerate(p["scoring"]):
        mfu.text(v, i, f" {v:.3g}", va="center", fontsize=8)
    mfu.axvline(MFU_GOAL, color="black", ls="--", lw=1)
    mfu.text(MFU_GOAL, len(labels) - 0.4, f" goal {MFU_GOAL}", fontsize=8)
    mfu.set_yticks(range(len(labels)), labels, fontsize=8)
    mfu.invert_yaxis()
    mfu.set(xlabel="MFU, model FLOPs of real tokens", title="scoring (grey: forwards alone, warm)")
    mfu.set_xlim(0, max([0.7, *(v * 1.15 for _, v, _ in p["scoring"])]))

    names = [name for name, _, _ in p["goals"]]
    values = [min(h, 1e3) for _, h, _ in p["goals"]]
    colors = ["tab:green" if met else "tab:red" for _, _, met in p["goals"]]
    goals.barh(range(len(names)), [v - 1 for v in values], left=1.0, color=colors)  # from 1: met to the right
    for i, (_, h, _) in enumerate(p["goals"]):
        goals.text(
            values[i],
            i,
            f" {h:.3g}x " if h >= 1 else f"{h:.3g}x ",
            va="center",
            ha="left" if h >= 1 else "right",
            fontsize=8,
        )
    goals.axvline(1.0, color="black", lw=1)
    goals.set_xscale("log")
    goals.set_xlim(min([0.5, *(v / 5 for v in values)]), max([2.0, *(v * 5 for v in values)]))  # room for labels
    goals.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    goals.set_yticks(range(len(names)), names, fontsize=8)
    goals.invert_yaxis()
    goals.set(xlabel="figure / limit (at least), limit / figure (at most)", title="issue 35's goals (met: 1+)")

    if p["missing"]:
        fig.text(0.01, 0.01, "not measured: " + "; ".join(p["missing"]), fontsize=8, color="tab:red")
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scale_json", type=Path, help="a scale.json from benchmarks/gpu_scale.py")
    ap.add_argument("--out", type=Path, help="the PNG to write (default: scale.png beside the JSON)")
    args = ap.parse_args()
    out = args.out or args.scale_json.with_suffix(".png")
    p = draw(json.loads(args.scale_json.read_text()), out)
    print(f"wrote {out}: {len(p['goals'])} of {len(GOALS)} goals measured", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
