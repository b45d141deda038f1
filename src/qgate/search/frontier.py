"""A run's size/quality frontier: every gated variant and every search point, bits per weight against shadow KL p99.

    frontier = write_frontier(variants, points, kl_p99_max=0.5, out=Path(".qgate/demo"), promoted=("w8", "best"))
    frontier["pareto"]      # the passing variants no other passing variant beats on both size and KL p99

Variants are gated on the shadow split and search points on the search split, so their KL figures come from
different prompts; the picture marks them apart and frontier.json says so. The size axis is bits per weight of the
quantized layers; promotion (`promote.choose: smallest`) ranks the bytes served, so each variant's label gives those
too, and the variant the run promoted is ringed, with the rule that chose it.
"""

from __future__ import annotations

import json
from pathlib import Path

from qgate.search.plot import COLORS, yerr

SPLITS_NOTE = (
    "variants are gated on the shadow split and search points on the search split: their KL p99 figures come from "
    "different prompts, each with its own 95% interval"
)


def pareto(entries: list[dict]) -> list[str]:
    """Names of the passing entries that no other passing entry matches or beats on both bits per weight and KL p99
    while beating it on one."""
    passing = [e for e in entries if e["verdict"] == "pass" and e["bits_per_weight"] is not None]

    def beaten(e: dict) -> bool:
        return any(
            o is not e
            and o["bits_per_weight"] <= e["bits_per_weight"]
            and o["kl_p99"] <= e["kl_p99"]
            and (o["bits_per_weight"] < e["bits_per_weight"] or o["kl_p99"] < e["kl_p99"])
            for o in passing
        )

    return [e["name"] for e in sorted(passing, key=lambda e: e["bits_per_weight"]) if not beaten(e)]


def write_frontier(
    variants: list[dict],
    points: list[dict],
    kl_p99_max: float | None,
    out: Path,
    promoted: tuple[str, str] | None = None,
) -> dict:
    """variants: {name, bits_per_weight, weights_bytes, served_bytes, kl_p99, kl_p99_ci, verdict}; points: the same
    with the searched variant's name and the point's k. promoted: (the variant the run promotes, the promote.choose
    rule that chose it), or None. Writes out/frontier.json and out/frontier.png; returns the JSON."""
    out = Path(out)
    doc = {
        "kl_p99_max": kl_p99_max,
        "variants": variants,
        "search_points": points,
        "pareto": pareto(variants),
        "promoted": {"variant": promoted[0], "choose": promoted[1]} if promoted else None,
        "note": SPLITS_NOTE,
        "picture": str(out / "frontier.png"),
    }
    text = json.dumps(doc, indent=2, default=float)
    path = out / "frontier.json"
    if path.exists() and path.read_text() == text and (out / "frontier.png").exists():
        return doc  # a re-run that changed nothing: the picture already shows it
    path.write_text(text)
    _plot(variants, points, kl_p99_max, promoted, out / "frontier.png")
    return doc


def _label(r: dict) -> str:
    served = r.get("served_bytes")
    return r["name"] if served is None else f"{r['name']}, {served / 1e6:,.1f} MB served"


def _plot(
    variants: list[dict], points: list[dict], kl_p99_max: float | None, promoted: tuple[str, str] | None, path: Path
) -> None:
    from qgate.plotting import pyplot

    plt = pyplot()
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for rows, is_variant in ((points, False), (variants, True)):
        for r in rows:
            if r["bits_per_weight"] is None or r["kl_p99"] != r["kl_p99"]:
                continue
            ax.errorbar(
                r["bits_per_weight"],
                r["kl_p99"],
                yerr=yerr(r["kl_p99"], r.get("kl_p99_ci")),
                fmt="s" if is_variant else "o",
                ms=9 if is_variant else 5,
                color=COLORS.get(r["verdict"], "k"),
                alpha=1.0 if is_variant else 0.55,
                capsize=2,
            )
            if is_variant:
                ringed = promoted is not None and r["name"] == promoted[0]
                ax.annotate(
                    _label(r),
                    (r["bits_per_weight"], r["kl_p99"]),
                    textcoords="offset points",
                    xytext=(12, 7) if ringed else (6, 4),
                    fontsize=8,
                )
                if ringed:
                    ax.plot(r["bits_per_weight"], r["kl_p99"], "o", ms=18, mfc="none", mec="k", mew=1.5)
    if kl_p99_max is not None:
        ax.axhline(kl_p99_max, color="#6e7781", ls="--", lw=1, label=f"gates.shadow.kl_p99_max {kl_p99_max:g}")
    ax.set_yscale("log")  # with math text off (plotting.py), log ticks are labelled as plain numbers
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("bits per weight (quantized layers)")
    ax.set_ylabel("shadow KL p99 (nats), 95% CI")
    ax.set_title("size against quality: squares = gated variants (shadow split), dots = search points", fontsize=9)
    handles = [
        plt.Line2D([], [], marker="s", ls="", color=COLORS[v], label=v) for v in ("pass", "fail", "inconclusive")
    ]
    if promoted:
        ring = {"marker": "o", "ls": "", "mfc": "none", "mec": "k", "mew": 1.5, "ms": 10}
        handles.append(plt.Line2D([], [], **ring, label=f"promoted (promote.choose: {promoted[1]})"))
    ax.legend(handles=handles + ax.get_legend_handles_labels()[0], fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
