"""Drift report: drift.json for machines, drift.html (self-contained, plots inline) for the on-call engineer.

write_drift_report(out_dir, report, old_profile, new_profile)
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from qgate.calibrate.traffic_drift import facets
from qgate.gates.report import COLORS

_VCOLOR = {"ok": COLORS["pass"], "drift": COLORS["fail"], "no-drift": COLORS["pass"]} | COLORS


def _facet_plot(report: dict, old: dict, new: dict) -> str:
    from qgate.plotting import pyplot

    plt = pyplot()
    import numpy as np

    fo, fn = facets(old), facets(new)
    rows = report["traffic"]
    cols = min(len(rows), 3)
    grid = -(-len(rows) // cols)
    fig, axes = plt.subplots(grid, cols, figsize=(4.2 * cols, 3.8 * grid), squeeze=False)
    for ax in axes.flat[len(rows) :]:
        ax.set_visible(False)
    for ax, row in zip(axes.flat, rows, strict=False):
        a, b = fo[row["facet"]][0], fn[row["facet"]][0]
        sa, sb = sum(a.values()) or 1, sum(b.values()) or 1
        if row["facet"] == "length":
            keys = list(a)  # bucket order
        else:  # the categories that moved most, then the largest
            keys = [s["category"] for s in row["top_shifts"]]
            keys += [
                k
                for k in sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0) / sa + b.get(k, 0) / sb))
                if k not in keys
            ]
            keys = keys[:8]
        x = np.arange(len(keys))
        ax.bar(
            x - 0.2, [a.get(k, 0) / sa for k in keys], 0.4, label=f"calibrated on (n={row['n_old']})", color="#4477aa"
        )
        ax.bar(x + 0.2, [b.get(k, 0) / sb for k in keys], 0.4, label=f"recent (n={row['n_new']})", color="#ee7733")
        ax.set_xticks(x, [str(k)[:14] for k in keys], rotation=40, ha="right", fontsize=8)
        ax.set_title(
            f"{row['facet']}: JS {row['js']:.3f} (limit {row['threshold']:g}) {row['verdict'].upper()}",
            fontsize=9,
            color=_VCOLOR[row["verdict"]],
        )
        ax.set_ylabel("share")
        ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _num(x) -> str:
    return "" if x is None else f"{x:.4g}"


def _cut(scoring: dict) -> str:
    """The prompts the re-gate scored on their last max_prompt_tokens tokens: longer recent traffic shows here."""
    if not scoring.get("caveat"):
        return ""
    return f" <b>Caveat</b>: {html.escape(scoring['caveat'])}."


def _passed_over(held: dict | None) -> str:
    """What the fresh shadow sample passed over: the requests production was made with."""
    if not held:
        return ""
    return (
        f", passing over the {held['requests']} requests production was made with ({held['in_other_splits']} of them "
        "were drawn again, into the sample's other splits)"
    )


def _quality(q: dict | None, held: dict | None = None) -> str:
    if q is None:
        return "<h2>Quality drift</h2><p>Not checked (drift.quality: false).</p>"
    rows = []
    for r in q["results"]:
        if r["threshold"] is None:
            continue
        then = q["gated"].get(r["metric"])
        ci = f"[{_num(r['ci'][0])}, {_num(r['ci'][1])}]" if r["ci"] else ""
        thr = ("&ge; " if r["higher_is_better"] else "&le; ") + _num(r["threshold"])
        rows.append(
            f"<tr class={r['verdict']}><td>{r['verdict'].upper()}</td><td>{html.escape(r['metric'])}</td>"
            f"<td>{_num(then)}</td><td>{_num(r['observed'])}</td><td>{ci}</td><td>{thr}</td><td>{r['n']}</td></tr>"
        )
    return (
        f"<h2>Quality drift: <span style='color:{_VCOLOR[q['verdict']]}'>{q['verdict'].upper()}</span></h2>"
        f"<p>Production re-gated against the baseline with the same shadow gate, on {q['scoring']['prompts']} fresh "
        f"shadow prompts from the recent traffic{_passed_over(held)} ({q['scoring']['gated_positions']} gated "
        "positions)."
        f"{_cut(q['scoring'])}{''.join(f' {html.escape(n)}' for n in q.get('notes', ()))}</p>"
        "<table><tr><th></th><th>check</th><th>when gated</th><th>recent traffic</th><th>95% CI</th><th>threshold</th>"
        f"<th>n</th></tr>{''.join(rows)}</table>"
    )


def write_drift_report(out: Path, report: dict, old: dict, new: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "drift.json").write_text(json.dumps(report, indent=2, default=float))
    css = "".join(f".{k} td:first-child{{color:{c};font-weight:bold}}" for k, c in _VCOLOR.items())
    rows = "".join(
        f"<tr class={r['verdict']}><td>{r['verdict'].upper()}</td><td>{r['facet']}</td><td>{r['js']:.4f}</td>"
        f"<td>{r['threshold']:g}</td><td>{r['noise_p99']:.4f}</td><td>{r['n_old']}</td><td>{r['n_new']}</td>"
        f"<td>{html.escape(r.get('note', ''))}</td></tr>"
        for r in report["traffic"]
    )
    prod = report["production"]
    verdict = report["verdict"]
    (out / "drift.html").write_text(f"""<!doctype html><meta charset="utf-8"><title>qgate drift: {verdict}</title>
<style>body{{font:14px system-ui;margin:2em;max-width:1200px}} td,th{{padding:3px 8px;border-bottom:1px solid #ddd}}
{css} img{{max-width:100%;margin:1em 0}}</style>
<h1>Drift check: <span style="color:{_VCOLOR[verdict]}">{verdict.upper()}</span></h1>
<p>{html.escape(report["model"])} v{prod["version"]} ({html.escape(str(prod["variant"]))})
@{html.escape(report["alias"])}, calibrated on {prod["calibrated_requests"]} requests, checked against
{report["recent"]["requests"]} recent requests from
<code>{html.escape(report["recent"]["source"])}</code> at {html.escape(report["checked_at"])}.</p>
<h2>Traffic drift</h2>
<p>Jensen-Shannon divergence (bits) per facet. A facet drifts when it is above its limit and above the divergence two
samples of the same traffic show at these sizes (noise p99); above the limit but within the noise is INCONCLUSIVE.</p>
<table><tr><th></th><th>facet</th><th>JS</th><th>limit</th><th>noise p99</th><th>n calibrated</th><th>n recent</th>
<th>note</th></tr>{rows}</table>
<img alt="facets" src="data:image/png;base64,{_facet_plot(report, old, new)}">
{_quality(report["quality"], report["recent"].get("shadow_held_from"))}
<p>Why: {html.escape(_why(report))}</p>""")


def _why(report: dict) -> str:
    """The reasons for the verdict, and the traffic facets that could not tell (neither drift nor shown ok)."""
    why = "; ".join(report["reasons"]) or "no facet moved beyond its limit and above the sampling noise"
    if unsure := report.get("inconclusive"):
        why += f"; inconclusive, so not shown ok: {', '.join(unsure)} (see their notes above)"
    return why
