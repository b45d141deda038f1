"""Gate report: report.json for machines, report.html with plots for people.

    write_report(out_dir, report_dict, shadow_metrics)
"""
from __future__ import annotations

import base64
import html
import json
from pathlib import Path

import numpy as np


def _plots(out: Path, report: dict, m: dict | None) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}
    if m is not None:
        fig, ax = plt.subplots(1, 2, figsize=(11, 3.6))
        kl = np.maximum(m["kl"], 1e-8)
        ax[0].hist(np.log10(kl), bins=60, color="#4477aa")
        for q, style in ((50, ":"), (99, "--"), (99.9, "-")):
            ax[0].axvline(np.log10(np.percentile(kl, q)), color="k", ls=style, lw=1, label=f"p{q}")
        thr = next((r["threshold"] for r in report["results"] if r["metric"] == "kl_p99"), None)
        if thr:
            ax[0].axvline(np.log10(thr), color="#cc3311", lw=2, label="p99 threshold")
        ax[0].set(xlabel="log10 KL(base || cand) per token", ylabel="tokens", title="Token KL on shadow traffic")
        ax[0].legend(fontsize=8)
        fd, gl = m["first_div"], m["gen_lens"]
        ax[1].hist(fd, bins=np.arange(0, max(gl.max(), 1) + 2) - 0.5, color="#228833")
        ax[1].set(xlabel="answer token where greedy output first differs (= length: identical)", ylabel="prompts",
                  title="First divergence of greedy generation")
        fig.tight_layout()
        files["shadow"] = out / "shadow.png"
        fig.savefig(files["shadow"], dpi=110)
        plt.close(fig)
    evals = [r for r in report["results"] if r["gate"] == "eval" and r["ci"]]
    kinds = sorted({r["metric"].rsplit(".", 1)[-1] for r in evals})   # one panel per unit: recovery, bpb_increase
    if evals:
        fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 0.8 + 0.45 * len(evals)), squeeze=False)
        for ax, kind in zip(axes[0], kinds):
            rows = [r for r in evals if r["metric"].endswith("." + kind)]
            for i, r in enumerate(rows):
                lo, hi = r["ci"]
                color = "#228833" if r["passed"] else "#cc3311"
                ax.errorbar(r["observed"], i, xerr=[[r["observed"] - lo], [hi - r["observed"]]], fmt="o", color=color, capsize=4)
                if r["threshold"] is not None:
                    ax.plot([r["threshold"]] * 2, [i - 0.35, i + 0.35], color="k", lw=1.5)
            ax.set_yticks(range(len(rows)), [r["metric"].rsplit(".", 1)[0] for r in rows], fontsize=8)
            ax.set_ylim(-0.6, len(rows) - 0.4)
            ax.locator_params(axis="x", nbins=5)
            better = "higher" if rows[0]["higher_is_better"] else "lower"
            ax.set_title(f"{kind} ({better} is better)", fontsize=10)
        fig.suptitle("Per-task change vs baseline: 95% CI, black bar = threshold", fontsize=10)
        fig.tight_layout()
        files["eval"] = out / "eval.png"
        fig.savefig(files["eval"], dpi=110)
        plt.close(fig)
    return files


def _row(r: dict) -> str:
    def num(x):
        return "" if x is None else f"{x:.4g}"

    ci = f"[{num(r['ci'][0])}, {num(r['ci'][1])}]" if r["ci"] else ""
    thr = "" if r["threshold"] is None else ("&ge; " if r["higher_is_better"] else "&le; ") + num(r["threshold"])
    verdict = "INFO" if r["decided_on"] == "report-only" else ("PASS" if r["passed"] else "FAIL")
    cells = (verdict, r["gate"], html.escape(r["metric"]), num(r["observed"]), ci, thr, r["decided_on"], r["n"], num(r["p_value"]))
    return f"<tr class={verdict.lower()}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def write_report(out: Path, report: dict, shadow_metrics: dict | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=float))
    files = _plots(out, report, shadow_metrics)
    rows = "".join(_row(r) for r in report["results"])
    imgs = "".join(f"<img alt='{k}' src='data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}'>" for k, p in files.items())
    verdict = "PASSED" if report["passed"] else "FAILED"
    lineage = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(str(v))}</li>" for k, v in report["inputs"].items())
    (out / "report.html").write_text(f"""<!doctype html><meta charset="utf-8"><title>qgate {verdict}: {html.escape(report['candidate']['name'])}</title>
<style>body{{font:14px system-ui;margin:2em;max-width:1100px}} td,th{{padding:3px 8px;border-bottom:1px solid #ddd}}
.pass td:first-child{{color:#228833;font-weight:bold}} .info td:first-child{{color:#777}} .fail td:first-child{{color:#cc3311;font-weight:bold}} img{{max-width:100%;margin:1em 0}}
h1 span{{color:{'#228833' if report['passed'] else '#cc3311'}}}</style>
<h1>Gate <span>{verdict}</span>: {html.escape(report['candidate']['name'])} vs {html.escape(report['baseline']['name'])}</h1>
<p>Each check decides on its 95% confidence bound (lower bound for higher-is-better, upper for lower-is-better).</p>
<table><tr><th></th><th>gate</th><th>metric</th><th>observed</th><th>95% CI</th><th>threshold</th><th>decided on</th><th>n</th><th>p</th></tr>{rows}</table>
{imgs}<h2>Inputs</h2><ul>{lineage}</ul><p>Timings (s): {html.escape(json.dumps(report['timings']))}</p>""")
