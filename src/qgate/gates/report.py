"""Gate report: report.json for machines, report.html with plots for people.

write_report(out_dir, report_dict, shadow_metrics)   # shadow_metrics["gated"]: mask of the positions gated on
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

import numpy as np

from qgate.gates.result import GateReport, decide_notes

KL_FLOOR = 1e-8  # the histogram's log axis clips smaller per-token KL values (exact agreement) to this
COLORS = {"pass": "#228833", "fail": "#cc3311", "inconclusive": "#ee7733", "error": "#aa3377", "info": "#777777"}


def _plots(out: Path, report: dict, m: dict | None) -> dict[str, Path]:
    from qgate.plotting import pyplot

    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    files = {}
    if m is not None:
        fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
        raw = m["kl"][m["gated"]] if "gated" in m else m["kl"]
        infinite = int(np.sum(~np.isfinite(raw)))  # positions whose candidate logits defined no distribution
        kl = np.maximum(raw[np.isfinite(raw)], KL_FLOOR)
        ax[0].hist(np.log10(kl), bins=60, color="#4477aa")
        for q, style in ((50, ":"), (99, "--"), (99.9, "-")):
            with np.errstate(invalid="ignore"):
                v = np.percentile(np.maximum(raw, KL_FLOOR), q) if len(raw) else np.nan
            if np.isfinite(v):  # not where the quantile falls among the infinite ones
                ax[0].axvline(np.log10(v), color="k", ls=style, lw=1, label=f"p{q}")
        thr = next((r["threshold"] for r in report["results"] if r["metric"] == "kl_p99"), None)
        if thr:
            ax[0].axvline(np.log10(thr), color="#cc3311", lw=2, label="p99 threshold")
        clipped = int(np.sum(raw < KL_FLOOR))
        ax[0].set(
            xlabel=f"log10 KL(base || cand) per gated token ({clipped} below {KL_FLOOR:g} drawn at the floor)",
            ylabel="tokens",
            title="Token KL on shadow traffic (gated positions)"
            + (f"\n{infinite} infinite (not drawn): the candidate's logits are NaN or inf there" if infinite else ""),
        )
        ax[0].legend(fontsize=8)
        ax[0].yaxis.set_major_locator(MaxNLocator(integer=True))
        held = m.get("held_out", np.ones(len(m["first_div"]), bool))
        fd, gl = m["first_div"][held], m["gen_lens"][held]
        ax[1].hist(fd, bins=np.arange(0, max(gl.max(), 1) + 2) - 0.5, color="#228833")
        ax[1].set(
            xlabel="answer token where greedy output first differs (= length: identical)",
            ylabel="prompts",
            title="First divergence of greedy generation",
        )
        ax[1].yaxis.set_major_locator(MaxNLocator(integer=True))
        ax[1].xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.tight_layout()
        files["shadow"] = out / "shadow.png"
        fig.savefig(files["shadow"], dpi=110)
        plt.close(fig)
    if routes := _route_figure(plt, out, report):
        files["routes"] = routes
    evals = [r for r in report["results"] if r["gate"] == "eval" and r["ci"]]
    kinds = sorted({r["metric"].rsplit(".", 1)[-1] for r in evals})  # one panel per unit: recovery, bpb_increase
    if evals:
        fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 0.8 + 0.45 * len(evals)), squeeze=False)
        for ax, kind in zip(axes[0], kinds):
            rows = [r for r in evals if r["metric"].endswith("." + kind)]
            _interval_rows(ax, rows, [r["metric"].rsplit(".", 1)[0] for r in rows], kind)
        fig.suptitle(
            "Change vs baseline: 95% CI, black bar = threshold; green pass, red fail, orange inconclusive, grey "
            "report-only",
            fontsize=10,
        )
        fig.tight_layout()
        files["eval"] = out / "eval.png"
        fig.savefig(files["eval"], dpi=110)
        plt.close(fig)
    longs = [r for r in report["results"] if r["gate"] == "long_context" and r["ci"]]
    if longs:
        fig, ax = plt.subplots(figsize=(7.5, 3.4))
        for i, r in enumerate(longs):
            lo, hi = r["ci"]
            ax.errorbar(
                i,
                r["observed"],
                yerr=[[r["observed"] - lo], [hi - r["observed"]]],
                fmt="o",
                capsize=4,
                color=COLORS[r["verdict"]],
            )
        if longs[0]["threshold"] is not None:
            ax.axhline(longs[0]["threshold"], color="k", lw=1.5, label="threshold")
            ax.legend(fontsize=8)
        ax.axhline(0, color="#bbbbbb", lw=1)
        ax.set_xticks(range(len(longs)), [r["metric"].split(".", 1)[1] for r in longs], fontsize=8)
        ax.set(
            xlabel="token positions in the document (window)",
            ylabel="candidate NLL / baseline NLL - 1",
            title="Long context: perplexity increase by position, 95% CI over documents",
        )
        fig.tight_layout()
        files["long_context"] = out / "long_context.png"
        fig.savefig(files["long_context"], dpi=110)
        plt.close(fig)
    return files


def _interval_rows(ax, rows: list[dict], labels: list[str], name: str) -> None:
    """One row per check, top down: its point and interval coloured by its verdict and a black bar at its threshold;
    an end the sample cannot bound is drawn to the panel's edge as an arrow."""
    ends = [
        x for r in rows for x in (*(r["ci"] or ()), r["observed"], r["threshold"]) if x is not None and np.isfinite(x)
    ]
    lo_edge, hi_edge = min(ends), max(ends)
    pad = 0.05 * (hi_edge - lo_edge or 1.0)
    lo_edge, hi_edge = lo_edge - pad, hi_edge + pad
    for i, r in enumerate(rows):
        lo, hi = r["ci"] or (r["observed"], r["observed"])
        color = COLORS[r["verdict"]]
        ax.plot([max(lo, lo_edge), min(hi, hi_edge)], [i, i], color=color, lw=2)
        ax.plot(r["observed"], i, "o", color=color)
        for end, edge, mark in ((lo, lo_edge, "<"), (hi, hi_edge, ">")):
            if not np.isfinite(end):
                ax.plot(edge, i, mark, color=color)
        if r["threshold"] is not None:
            ax.plot([r["threshold"]] * 2, [i - 0.35, i + 0.35], color="k", lw=1.5)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylim(len(rows) - 0.4, -0.6)
    ax.set_xlim(lo_edge, hi_edge)
    ax.locator_params(axis="x", nbins=5)
    better = "higher" if rows[0]["higher_is_better"] else "lower"
    ax.set_title(f"{name} ({better} is better)", fontsize=10)


def _route_figure(plt, out: Path, report: dict) -> Path | None:
    """routes.png: per guarded shadow check, the pooled row (95% CI) over each route's guard (Holm-adjusted CI).
    None without route guards."""
    guards = [r for r in report["results"] if r["gate"] == "shadow" and r["metric"].startswith("route.")]
    if not guards:
        return None
    checks = list(dict.fromkeys(r["metric"].rsplit(".", 1)[1] for r in guards))
    pooled = {r["metric"]: r for r in report["results"] if r["gate"] == "shadow"}
    per = [[pooled[c]] + [r for r in guards if r["metric"].endswith("." + c)] for c in checks]
    fig, axes = plt.subplots(1, len(checks), figsize=(5.5 * len(checks), 1.0 + 0.45 * len(per[0])), squeeze=False)
    for ax, check, rows in zip(axes[0], checks, per, strict=True):
        evs = [r["evidence"] for r in rows[1:]]
        labels = ["all traffic (95%)"] + [
            f"{e['route'][:24]} ({e['share_of_gated']:.0%}; {e['adjusted_level']:.1%})" for e in evs
        ]
        _interval_rows(ax, rows, labels, check)
    fig.suptitle(
        "Shadow checks by traffic route (share of gated positions; interval level): black bar = threshold; a route "
        "fails (red) when its whole interval is on the bad side",
        fontsize=9,
    )
    fig.tight_layout()
    path = out / "routes.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_VERDICT_CSS = "".join(f".{k} td:first-child{{color:{c};font-weight:bold}}" for k, c in COLORS.items())


def _row(r: dict) -> str:
    def num(x):
        return "" if x is None else f"{x:.4g}"

    ci = f"[{num(r['ci'][0])}, {num(r['ci'][1])}]" if r["ci"] else ""
    thr = "" if r["threshold"] is None else ("&ge; " if r["higher_is_better"] else "&le; ") + num(r["threshold"])
    verdict = r["verdict"]
    why = r["evidence"].get("why", "") if verdict != "pass" else ""
    level = r["evidence"].get("adjusted_level") if r["decided_on"] == "holm-guard" else None
    adjusted = f"its interval is Holm-adjusted, at {level:.2%}" if level else ""
    notes = (r["evidence"].get("error", ""), *decide_notes(r), adjusted, why, r["evidence"].get("caveat", ""))
    note = "; ".join(x for x in notes if x)
    cells = (
        verdict.upper(),
        r["gate"],
        html.escape(r["metric"]),
        num(r["observed"]),
        ci,
        thr,
        r["decided_on"],
        r["n"],
        num(r.get("mde")) if r["threshold"] is not None else "",
        num(r["p_value"]),
        html.escape(note),
    )
    return f"<tr class={verdict}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def _contract(report: dict) -> str:
    from qgate.gates.contract import describe

    rows = [r for r in report["results"] if r["gate"] == "contract"]
    if not rows:
        return ""
    items, allowed = [], []
    for r in rows:
        for d in r["evidence"]["differences"]:
            items.append(f"<li class=fail><b>different</b>: {html.escape(describe(d))}</li>")
        for d in r["evidence"]["accepted"]:
            items.append(f"<li><b>accepted</b> (gates.contract.allow): {html.escape(describe(d))}</li>")
        for d in r["evidence"].get("allowed", []):
            allowed.append(f"<li><b>allowed</b> (quantization may change it): {html.escape(describe(d))}</li>")
    served = html.escape(rows[0]["evidence"]["served_from"])
    keys = sum(r["n"] for r in rows if r["metric"] != "prompt_rendering")
    body = (
        "".join(items)
        or f"<li>identical: all {keys:,} keys of the tokenizer, generation and model config files, the "
        "chat template, and every shadow prompt's token ids</li>"
    )
    return (
        f"<h2>Serving contract</h2><p>Candidate files as served, from <code>{served}</code>, compared key by key "
        f"with the baseline's (deny by default):</p><ul>{body}{''.join(allowed)}</ul>"
    )


def _context(report: dict) -> str:
    """How far each kind of evidence reaches, against the context the model is served with."""
    c = report.get("long_context")
    if not c:
        return ""
    served, shadow, reach = c["served_context"], c["shadow_tokens"], c["longest_document_tokens"]
    gap = (
        f"<b>The served context is {served - reach:,} tokens longer than anything scored</b>: contexts beyond "
        f"{reach:,} tokens are not evidenced."
        if reach < served
        else f"{c['documents_reaching_context']} of them reach the served context."
    )
    skipped = "".join(f"<li>window {html.escape(w)}: not scored</li>" for w in c["windows_not_scored"])
    return (
        f"<h2>Context coverage</h2><p>The model is served with contexts of up to {served:,} tokens. The shadow gate's "
        f"evidence covers contexts of up to {shadow:,} tokens (prompt plus answer); the long-context gate scored "
        f"{c['documents']} documents, the longest {reach:,} tokens. {gap}</p>"
        + (f"<ul>{skipped}</ul>" if skipped else "")
    )


def _floor(report: dict) -> str:
    f = report.get("noise_floor")
    if not f:
        return ""
    cells = "".join(
        f"<li><b>{k}</b>: {f[k]['observed']:.3g} (95% CI [{f[k]['ci'][0]:.3g}, {f[k]['ci'][1]:.3g}])</li>"
        for k in ("kl_mean", "kl_p99", "top1_agreement", "stop.ends", "stop.continues", "tool.calls", "tool.refrains")
        if k in f and f[k]["ci"]
    )
    return (
        f"<h2>Noise floor</h2><p>The baseline against itself on a second numeric path ({html.escape(f['path'])}): "
        f"disagreement no quantization causes. Thresholds tighter than this are refused.</p><ul>{cells}</ul>"
    )


def _scored(report: dict) -> str:
    s = report.get("shadow_scoring")
    if not s:
        return ""
    return (
        f"<h2>What the shadow gate scored</h2><p>{s['prompts']} shadow prompts, {s['total_positions']} token "
        f"positions: {s['answer_positions']} answer, {s['traffic_prompt_positions']} traffic prompt, "
        f"{s['template_positions_excluded']} chat-template (excluded: identical across prompts), "
        f"{s['repeated_prefix_excluded']} repeating an earlier prompt's prefix (excluded)"
        + (
            f", {s['fitted_positions_excluded']} in the {s['fitted_prompts_excluded']} prompts the candidate was "
            "made with, its calibration set's or its search's (excluded: not held out)"
            if s.get("fitted_prompts_excluded")
            else ""
        )
        + ". "
        f"Gated on <b>{html.escape(s['positions'])}</b> positions: {s['gated_positions']} scored, "
        f"{s['unique_positions']} unique prefixes in all. The <code>prompt.*</code> rows report the traffic prompt "
        "positions alone; the <code>route.*</code> rows hold each gated check to its threshold on each traffic route's "
        "positions alone (gates.shadow.route_guards), so a route the pooled figure averages away can still fail.</p>"
        + _coverage(s)
    )


def _coverage(s: dict) -> str:
    if "prompts_cut" not in s:
        return ""
    if not s["prompts_cut"]:
        return (
            f"<p>Every prompt was scored whole (the longest has {s['longest_prompt_tokens']} tokens; "
            f"<code>gates.shadow.max_prompt_tokens</code> is {s['max_prompt_tokens']}).</p>"
        )
    return f"<p><b>Caveat</b>: {html.escape(s['caveat'])}. Raise the limit to score them whole.</p>"


def _fallback_label(s: dict) -> str:
    return "W8A16" if s["fallback_bits"] == 8 else "full precision"


def search_layout(s: dict) -> str:
    """What a search chose, in words: '40 of 210 layers moved: 12 to W8A16, 28 to W4A16 g32'. A search recorded
    before finer-group rungs names only its fallback."""
    return s.get("layout") or f"{s['chosen_k']} of {s['layers_total']} layers at {_fallback_label(s)}"


def _search(report: dict) -> str:
    s = report.get("search")
    if not s:
        return ""
    plot = Path(s.get("plot", ""))
    img = (
        f"<img alt='search' src='data:image/png;base64,{base64.b64encode(plot.read_bytes()).decode()}'>"
        if plot.is_file()
        else ""
    )
    fallback = _fallback_label(s)
    rows = "".join(
        f"<tr><td>{i}</td><td><code>{html.escape(f['layer'])}</code></td><td>{html.escape(f.get('to', fallback))}</td>"
        f"<td>{f['params']:,}</td><td>{f['kl']:.3g}</td><td>{f['kl_per_mparam']:.3g}</td><td>{f['kl_rank']}</td></tr>"
        for i, f in enumerate(s["fallback"], 1)
    )
    pts = "".join(
        f"<tr class={p['verdict']}><td>{p['k']}</td><td>{p['verdict'].upper()}</td><td>{p['bits_per_weight']:.2f}</td>"
        f"<td>{p['weights_bytes']:,}</td><td>{p['kl_p99']:.4g}</td><td>{p['top1']:.4f}</td></tr>"
        for p in s["points"]
    )
    found = (
        "the smallest passing point" if s["found"] else f"<b>no point passed</b>: {html.escape(s.get('note') or '')}"
    )
    on = s.get("chosen_on") or {}
    selection = (
        f"Points were chosen on a search split of {on.get('prompts')} prompts, disjoint from the shadow set above: "
        "its checks are data the search never saw."
        if on.get("independent")
        else f"Points were chosen on this shadow set, so its checks above have been looked at {s['points_tried']} "
        "times and flatter the chosen point; the eval checks use other data."
    )
    built = f" Points were built by {html.escape(s['points_built_by'])}." if s.get("points_built_by") else ""
    return (
        f"<h2>Search</h2><p>{s['points_tried']} points tried ({s['gate_runs']} gated in this run, the rest cached), "
        f"{s['seconds']}s. Chosen: k={s['chosen_k']}, {html.escape(search_layout(s))}, "
        f"{s['bits_per_weight']:.2f} bits per weight; {found}. {selection}{built}</p>{img}"
        f"<table><tr><th>k</th><th>shadow verdict</th><th>bits/weight</th><th>weights bytes</th><th>KL p99</th>"
        f"<th>top-1</th></tr>{pts}</table>"
        "<h3>Layers moved</h3><table><tr><th></th><th>layer</th><th>to</th><th>params</th>"
        f"<th>est. KL (nats/token)</th><th>KL per M params</th><th>KL rank</th></tr>{rows}</table>"
    )


def write_report(out: Path, report: dict, shadow_metrics: dict | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=float))
    files = _plots(out, report, shadow_metrics)
    rows = "".join(_row(r) for r in report["results"])
    imgs = "".join(
        f"<img alt='{k}' src='data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}'>"
        for k, p in files.items()
    )
    verdict = report["verdict"].upper() + (
        " (passed under on_inconclusive: warn)" if GateReport.from_json(report).warned else ""
    )
    cand = report["candidate"]
    title = f"{cand['name']} ({cand.get('scheme') or 'unquantized'}, {cand.get('backend')})"
    lineage = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(str(v))}</li>" for k, v in report["inputs"].items())
    cache = ", ".join(f"{k}: {v}" for k, v in report["cache"].items())
    (
        out / "report.html"
    ).write_text(f"""<!doctype html><meta charset="utf-8"><title>qgate {verdict}: {html.escape(title)}</title>
<style>body{{font:14px system-ui;margin:2em;max-width:1200px}} td,th{{padding:3px 8px;border-bottom:1px solid #ddd}}
{_VERDICT_CSS} img{{max-width:100%;margin:1em 0}}
h1 span{{color:{COLORS[report["verdict"]]}}} dt{{font-weight:bold;margin-top:.4em}}</style>
<h1>Gate <span>{verdict}</span>: {html.escape(title)} vs {html.escape(report["baseline"]["name"])}</h1>
<p>Each check follows one rule, named in its <i>decided on</i> column. <b>ci</b>: <b>PASS</b> when its 95%
confidence interval lies wholly on the good side of the threshold, <b>FAIL</b> when wholly on the bad side,
<b>INCONCLUSIVE</b> when it straddles it (on_inconclusive: {html.escape(report.get("on_inconclusive", "block"))}).
<b>point</b>: no interval (a count, a p-value, an infinite value), the observed value against the threshold.
<b>holm-guard</b>: a per-task (eval), per-route or answer-end (shadow) guard under a pooled check, FAIL when its
Holm-adjusted interval lies wholly on the bad side of the same threshold, otherwise reported: it can stop a
candidate, never pass one. <b>INFO</b> rows are reported, not gated.</p>
<table><tr><th></th><th>gate</th><th>metric</th><th>observed</th><th>95% CI</th><th>threshold</th><th>decided on</th>
<th>n</th><th>mde</th><th>p</th><th>note</th></tr>{rows}</table>
<dl><dt>n</dt><dd>Shadow checks: token positions scored. Their CIs resample whole prompts (tokens of one prompt are not
independent), so the evidence is closer to the number of prompts than to n; quantiles use a clustered order-statistic
interval, unbounded (inf) when the sample is too small to bound them. Eval checks: items (documents for
perplexity). Long-context checks: documents, each a cluster of its tokens (counted in the evidence); their
interval is a t interval over documents, wide when few documents reach a window.</dd>
<dt>mde</dt><dd>Minimum detectable effect: the true distance from the observed value that this n detects with 80% power
at the 95% level (from the CI's width).</dd>
<dt>p</dt><dd>Multiple-choice recovery: the exact two-sided McNemar p-value on the items that flipped (reported; it
decides only the <code>no_significant_loss</code> rows, when <code>gates.eval.significant_loss_alpha</code> is set).
Task guards: the Holm-adjusted p-value of a loss beyond the margin.</dd></dl>
{"".join(f"<p class=inconclusive><b>Note:</b> {html.escape(n)}</p>" for n in report.get("notes", []))}
{_contract(report)}
{_context(report)}
{_search(report)}
{_scored(report)}
{_floor(report)}
{imgs}<h2>Inputs</h2><ul>{lineage}</ul><p>Baseline cache: {html.escape(cache)}</p>
<p>Timings (s): {html.escape(json.dumps(report["timings"]))}</p>
<p>Environment: {html.escape(", ".join(f"{k} {v}" for k, v in report.get("environment", {}).items()))}</p>""")
