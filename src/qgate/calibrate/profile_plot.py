"""The traffic profile as a picture: what the sampled traffic looks like, at a glance.

    plot_profile(json.loads(Path("runs/calib/profile/profile.json").read_text()), Path("profile.png"))
    sample_traffic(..., picture=True)   # writes runs/calib/profile.png with the sample (calibrate/sample.py)

Four panels: prompt lengths (words, the strata's buckets), routes, in-flight concurrency (the distribution the
TensorRT-LLM bundle's CUDA-graph batch sizes come from, with its p50/p90/p99) and the most frequent words. Counts the
profile holds as estimates say so in their titles.
"""

from __future__ import annotations

from pathlib import Path

TOP_ROUTES = 8
TOP_WORDS = 15


def plot_profile(profile: dict, path: Path) -> Path:
    from qgate.plotting import pyplot

    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))
    n = max(profile["requests"], 1)
    stats = profile.get("stats", {})
    fig.suptitle(
        f"Traffic profile of {profile.get('source', '?')}: {profile['requests']:,} requests profiled, "
        f"{stats.get('records', 0):,} records read, {stats.get('rejected', 0):,} rejected"
        + (f", {tools:,} use tools" if (tools := stats.get("tool_use")) else ""),
        fontsize=10,
    )

    lengths = profile["length_words"]
    ax[0, 0].bar(range(len(lengths)), [v / n for v in lengths.values()], color="#4477aa")
    ax[0, 0].set_xticks(range(len(lengths)), list(lengths))
    ax[0, 0].set(
        xlabel="prompt length (words, all turns up to the last user or tool turn)",
        ylabel="share of requests",
        title="Prompt length",
    )

    routes = list(profile["routes"].items())
    shown = routes[:TOP_ROUTES]
    ax[0, 1].bar(range(len(shown)), [v / n for _, v in shown], color="#228833")
    ax[0, 1].set_xticks(range(len(shown)), [k[:16] for k, _ in shown], rotation=30, ha="right", fontsize=8)
    more = f" (top {TOP_ROUTES} of {len(routes)})" if len(routes) > TOP_ROUTES else ""
    ax[0, 1].set(ylabel="share of requests", title=f"Routes{more}")

    conc = profile["concurrency"]
    hist = {int(k): v for k, v in conc.get("histogram", {}).items()}
    if hist:
        ax[1, 0].bar(list(hist), list(hist.values()), width=1.0, color="#ee7733")
        for q, style in (("p50", ":"), ("p90", "--"), ("p99", "-")):
            ax[1, 0].axvline(conc[q], color="k", ls=style, lw=1, label=f"{q} {conc[q]}")
        ax[1, 0].legend(fontsize=8)
        ax[1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
        ax[1, 0].yaxis.set_major_locator(MaxNLocator(integer=True))
        unit = "in flight at an arrival" if conc["method"].startswith("in-flight") else "arrivals in a second"
        ax[1, 0].set(
            xlabel=f"requests {unit}",
            ylabel="arrivals" if unit.startswith("in") else "seconds",
            title=f"Concurrency ({conc['method']})",
        )
    else:
        ax[1, 0].text(0.5, 0.5, "no timestamps in the log", ha="center", va="center", transform=ax[1, 0].transAxes)
        ax[1, 0].set(title="Concurrency", xticks=[], yticks=[])

    words = list(profile["unigrams"]["top"].items())[:TOP_WORDS]
    total = max(profile["unigrams"]["total"], 1)
    ax[1, 1].barh(range(len(words))[::-1], [v / total for _, v in words], color="#aa3377")
    ax[1, 1].set_yticks(range(len(words))[::-1], [repr(w)[1:-1][:16] for w, _ in words], fontsize=8)
    exact = profile.get("estimates", {}).get("unigrams", {}).get("exact", True)
    ax[1, 1].set(xlabel="share of words", title=f"Top {len(words)} words" + ("" if exact else " (sketch estimates)"))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
