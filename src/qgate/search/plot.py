"""The search's picture: every gated point's size against its shadow KL p99, the thresholds and the chosen point.

plot_points(points, kl_p99_max=0.5, top1_min=0.85, chosen_k=12, path=Path("qgate-search.png"))
"""

from __future__ import annotations

from pathlib import Path

COLORS = {"pass": "#1a7f37", "fail": "#cf222e", "inconclusive": "#9a6700", "error": "#6e7781"}


def yerr(value: float, ci: list | tuple | None) -> list[list[float]]:
    """Matplotlib's asymmetric error bar for `value` and its 95% CI; an unbounded or missing CI end draws no bar."""
    lo, hi = ci or (value, value)
    hi = hi if hi == hi and hi != float("inf") else value
    return [[max(value - lo, 0)], [max(hi - value, 0)]]


def plot_points(
    points: list[dict],
    kl_p99_max: float | None,
    top1_min: float | None,
    chosen_k: int | None,
    path: Path,
    references: list[dict] = (),
) -> Path:
    """points: {k, bits_per_weight, kl_p99, kl_p99_ci, top1, top1_ci, verdict}; references: {label, bits_per_weight}
    drawn as vertical lines (for example the uniform W4 and W8 sizes)."""
    from qgate.plotting import pyplot

    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, thr, label in (
        (axes[0], "kl_p99", kl_p99_max, "shadow KL p99 (nats), 95% CI"),
        (axes[1], "top1", top1_min, "shadow top-1 agreement, 95% CI"),
    ):
        for p in sorted(points, key=lambda p: p["bits_per_weight"]):
            ax.errorbar(
                p["bits_per_weight"],
                p[key],
                yerr=yerr(p[key], p[f"{key}_ci"]),
                fmt="o",
                color=COLORS.get(p["verdict"], "k"),
                ms=9 if p["k"] == chosen_k else 5,
                capsize=3,
                mec="k" if p["k"] == chosen_k else None,
            )
            ax.annotate(
                f"k={p['k']}", (p["bits_per_weight"], p[key]), textcoords="offset points", xytext=(5, 5), fontsize=8
            )
        if thr is not None:
            ax.axhline(thr, color="k", ls="--", lw=1)
            ax.annotate("threshold", (ax.get_xlim()[0], thr), textcoords="offset points", xytext=(2, 3), fontsize=8)
        for ref in references:
            if ref.get("bits_per_weight"):
                ax.axvline(ref["bits_per_weight"], color="#8c959f", lw=1, ls=":")
                ax.annotate(
                    ref["label"],
                    (ref["bits_per_weight"], ax.get_ylim()[1]),
                    rotation=90,
                    va="top",
                    fontsize=8,
                    textcoords="offset points",
                    xytext=(-10, -2),
                )
        if key == "kl_p99" and all(p[key] > 0 for p in points):
            ax.set_yscale("log")
        ax.set_xlabel("effective bits per weight (quantized layers)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle("search: every gated point (green pass, red fail, amber inconclusive; large: chosen)", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
