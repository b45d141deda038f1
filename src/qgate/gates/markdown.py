"""Gate evidence as Markdown: the MLflow version description and the CI job summary read the same tables.

md = checks_table(report["results"])                 # one row per check: verdict, observed, CI, threshold, n, mde
md = undecided(report["results"])                    # what would decide each INCONCLUSIVE check ("" for none)
md = version_description(report, candidate_meta, "runs:/<id>/gate-report/report.html")
"""

from __future__ import annotations

import math

from qgate.artifact import served_bytes
from qgate.gates.result import GateReport, caveats, what_would_decide

ICON = {"pass": "✅ PASS", "fail": "❌ FAIL", "inconclusive": "⚠️ INCONCLUSIVE", "error": "⛔ ERROR", "info": "ℹ️ info"}


def _num(x) -> str:
    if x is None:
        return ""
    if isinstance(x, float) and math.isinf(x):
        return "∞" if x > 0 else "-∞"
    return f"{x:.4g}"


def _mb(nbytes: int | None) -> str:
    return "" if nbytes is None else f"{nbytes / 1e6:,.1f}"


def checks_table(results: list[dict], gated_only: bool = False) -> str:
    rows = [
        "| verdict | check | observed | 95% CI | threshold | decided on | n | mde |",
        "|---|---|---:|---|---|---|---:|---:|",
    ]
    for r in results:
        if gated_only and r["threshold"] is None:
            continue
        ci = f"[{_num(r['ci'][0])}, {_num(r['ci'][1])}]" if r.get("ci") else ""
        thr = "" if r["threshold"] is None else ("≥ " if r["higher_is_better"] else "≤ ") + _num(r["threshold"])
        mde = _num(r.get("mde")) if r["threshold"] is not None else ""
        rows.append(
            f"| {ICON.get(r['verdict'], r['verdict'])} | `{r['gate']}.{r['metric']}` | {_num(r['observed'])} | {ci} | "
            f"{thr} | {r['decided_on']} | {r['n']} | {mde} |"
        )
    return "\n".join(rows)


def undecided(results: list[dict]) -> str:
    """An "Undecided" section, one list item per INCONCLUSIVE check saying what would decide it as far as its evidence
    says (result.what_would_decide); "" when no check is inconclusive."""
    items = [f"- `{check}`: {said}" for check, said in what_would_decide(results).items()]
    return "**Undecided**\n\n" + "\n".join(items) if items else ""


def _made_from(meta: dict, baseline: str | None) -> str:
    """The model a candidate was quantized from: its manifest's, the baseline for an unquantized candidate (the
    baseline gated against itself), and none known for one quantized elsewhere (`qgate model import`)."""
    made_from = meta.get("base_model") or (None if meta.get("weight_format") else baseline)
    return made_from[:16] if made_from else "- (quantized elsewhere)"


def version_description(report: dict, meta: dict, report_uri: str) -> str:
    """The registry version's description: verdict, gated checks, lineage, and where the full report is."""
    cand = report["candidate"]
    verdict = report["verdict"]
    head = f"## qgate gate: {ICON.get(verdict, verdict)}"
    if GateReport.from_json(report).warned:
        head += " (passed under `on_inconclusive: warn`)"
    lineage = [
        ("variant", cand.get("name")),
        ("scheme", meta.get("scheme") or "unquantized"),
        ("runtime", cand.get("backend")),
        ("KV cache", meta.get("kv_cache_dtype") or "model default"),
        ("base model sha256", _made_from(meta, report["inputs"].get("baseline_sha256"))),
        ("calibration set sha256", (report["inputs"].get("calibration_sha256") or "-")[:16]),
        ("shadow set sha256", str(report["inputs"].get("shadow_sha256"))[:16]),
        ("artifact sha256", str(report["inputs"].get("candidate_sha256"))[:16]),
    ]
    if (nbytes := served_bytes(meta)) is not None:  # what promote.choose: smallest ranks
        lineage.append(("served weights", f"{_mb(nbytes)} MB"))
    if report["inputs"].get("scored_on"):
        lineage.append(("scored on", report["inputs"]["scored_on"]))
    scored = report.get("shadow_scoring") or {}
    info = [r for r in report["results"] if r["threshold"] is None and r["gate"] in ("parity", "perf")]
    parts = [head, "", checks_table(report["results"], gated_only=True), ""]
    if open_checks := undecided(report["results"]):
        parts += [open_checks, ""]
    if scored:
        parts += [
            f"Shadow gate: {scored.get('prompts', 0) - scored.get('fitted_prompts_excluded', 0)} held-out "
            f"traffic prompts, {scored.get('gated_positions')} gated {scored.get('positions')} positions "
            "(chat-template tokens excluded).",
            "",
        ]
    if report.get("notes"):
        parts += ["**Notes**", "", *(f"- {n}" for n in report["notes"]), ""]
    weakened = [f"- {', '.join(f'`{k}`' for k in checks)}: {c}" for c, checks in caveats(report["results"]).items()]
    if weakened:  # one line per caveat, naming every check it weakens
        parts += ["**Caveats**", "", *weakened, ""]
    if info:
        parts += [
            "Reported, not gated: " + "; ".join(f"`{r['gate']}.{r['metric']}` {_num(r['observed'])}" for r in info),
            "",
        ]
    parts += ["**Lineage**", "", "| | |", "|---|---|"] + [f"| {k} | `{v}` |" for k, v in lineage]
    parts += [
        "",
        f"Full report (plots, every check's evidence): `{report_uri}`, the run's **Artifacts** tab, "
        "`gate-report/report.html`.",
    ]
    return "\n".join(parts)


def run_summary(summary: dict) -> str:
    """`qgate run`: one table of variants and the promotion, for GITHUB_STEP_SUMMARY."""
    rows = [
        "| variant | verdict | KL p99 | top-1 | served MB | version | failed | inconclusive |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for v in summary["variants"]:
        rows.append(
            f"| {v['variant']} | {ICON.get(v['verdict'], v['verdict'])} | {_num(v.get('kl_p99'))} | "
            f"{_num(v.get('top1_agreement'))} | {_mb(v.get('served_bytes'))} | {v.get('version') or ''} | "
            f"{', '.join(v['failed_checks'])} | {', '.join(v['inconclusive_checks'])} |"
        )
    p = summary.get("promoted")
    tail = (
        f"Promoted **{p['variant']}** as `{summary['model_name']}` v{p['version']} @{p['alias']}"
        if p
        else "Nothing promoted: no variant passed its gates."
    )
    return "\n".join([f"### qgate run: {summary.get('pipeline', '')}", "", *rows, "", tail, ""])
