"""What CI reads: `--json` documents on stdout (schema below), JUnit XML, and the GitHub job summary; and the one-line
summaries people read of a checkpoint (`checkpoint_line`).

    out = Output(json_mode)            # out.say(text): stdout, or stderr when stdout carries JSON
    out.emit(GateDoc(...))             # the one JSON document, when --json
    for line in columns(("alias", "version"), [("production", "3")]): out.say(line)
    write_junit(Path("gate.xml"), {"awq-w4a16": GateReport.from_json(report)})
    step_summary(markdown)             # appended to $GITHUB_STEP_SUMMARY when it is set

Every document has `schema_version` and `command`; floats that are undefined or unbounded (NaN, an infinite CI end) are
null. The JSON Schema is docs/qgate-output.schema.json (generated from these models; a test keeps it in sync).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import typer
from pydantic import BaseModel, ConfigDict, Field

from qgate.errors import QgateError
from qgate.gates.result import GateReport

VERDICT = Literal["pass", "fail", "inconclusive", "error", "info"]


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="null")
    schema_version: Literal[1] = 1
    exit_code: int = Field(description="0 passed/done, 1 error, 2 gate failed or promotion refused, 3 drift found")


class Check(BaseModel):
    model_config = ConfigDict(extra="ignore", ser_json_inf_nan="null")
    gate: str
    metric: str
    verdict: VERDICT
    observed: float | None
    ci: list[float | None] | None = Field(description="95% confidence interval; null ends are unbounded")
    threshold: float | None = Field(description="null: reported, not gated")
    higher_is_better: bool
    n: int
    mde: float | None = Field(description="minimum detectable effect at this n")
    n_to_decide: int | None = Field(description="inconclusive checks: roughly how many items would decide it")
    decided_on: str = Field(
        description="the rule that decided the verdict: ci, point, holm-guard, report-only or not-run "
        "(docs/gate-rules.md)"
    )
    caveat: str | None = Field(default=None, description="what weakens this check's evidence, e.g. a label-biased task")


class GateDoc(_Doc):
    command: Literal["gate"] = "gate"
    verdict: VERDICT
    passed: bool
    candidate: str
    candidate_sha256: str
    report_json: str
    report_html: str
    checks: list[Check]


class RegisterDoc(_Doc):
    command: Literal["register"] = "register"
    model: str
    version: str
    verdict: str
    tracking_uri: str


class PromoteDoc(_Doc):
    command: Literal["promote", "rollback"] = Field(
        default="promote", description="rollback: `production` moved back to `previous-production`, the two swapped"
    )
    model: str
    version: str
    alias: str
    previous: str | None
    tracking_uri: str
    artifact_sha256: str


class VerifyDoc(_Doc):
    command: Literal["verify"] = "verify"
    model: str
    alias: str
    version: str
    artifact_sha256: str
    tracking_uri: str
    source: str = Field(description="where the registered files are, as MLflow stores it")


class AliasRow(BaseModel):
    model_config = ConfigDict(extra="forbid")
    alias: str
    version: str | None = Field(description="null: the alias points at no version")
    verdict: str = Field(description="the gate's verdict for that version; '-' when none")
    variant: str
    scheme: str
    backend: str = Field(description="the runtime the version was gated on")
    created: str
    drift: str = Field(description="the last drift check's verdict and time; '-' when none")
    gate_report: str = Field(description="the gate report's MLflow artifact URI")
    artifact_sha256: str | None


class StatusDoc(_Doc):
    command: Literal["status"] = "status"
    model: str
    aliases: list[AliasRow] = Field(description="production, previous-production, then the other aliases by name")


class VariantDoc(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="null")
    variant: str
    verdict: VERDICT
    passed: bool
    version: str | None
    backend: str
    weights_bytes: int | None = Field(description="the checkpoint's safetensors")
    served_bytes: int | None = Field(
        None, description="the weights of what is served (an engine's own files): what promote.choose: smallest ranks"
    )
    report: str
    checks: list[Check]


class RunDoc(_Doc):
    command: Literal["run"] = "run"
    pipeline: str
    workdir: str
    model: str
    tracking_uri: str
    variants: list[VariantDoc]
    promoted: PromoteDoc | None
    log_file: str | None = Field(description="library logs, when the console is not a terminal")


class Problem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    error: str
    hint: str | None


class ErrorDoc(_Doc):
    command: str
    error: str
    hint: str | None
    problems: list[Problem] = Field(
        description="each problem on its own, with its hint: several for a spec with several, else the one in `error`"
    )


DOCS = (GateDoc, RegisterDoc, PromoteDoc, VerifyDoc, StatusDoc, RunDoc, ErrorDoc)


def json_schema() -> dict:
    from pydantic.json_schema import models_json_schema

    _, schema = models_json_schema([(m, "serialization") for m in DOCS], title="qgate --json output")
    schema["oneOf"] = [{"$ref": f"#/$defs/{m.__name__}"} for m in DOCS]
    return schema


class Output:
    def __init__(self, json_mode: bool):
        self.json = json_mode

    def say(self, text: str) -> None:
        from qgate.progress import console_err, console_out

        typer.echo(text, file=console_err() if self.json else console_out())

    def emit(self, doc: _Doc) -> None:
        global EMITTED
        if self.json:
            from qgate.progress import console_out

            typer.echo(doc.model_dump_json(indent=2), file=console_out())
            EMITTED = True


EMITTED = False  # a command printed its document: the CLI boundary then adds none for a refusal it raises after


def error_doc(
    argv: list[str], e: BaseException, message: str, exit_code: int, groups: tuple[str, ...] = ()
) -> str | None:
    """The JSON document for a failure, when --json was asked for and the command printed none. `command` is the
    command's name, with its subcommand's when it is one of `groups` (e.g. "calibrate sample")."""
    if "--json" not in argv or EMITTED:
        return None
    words = [a for a in argv if not a.startswith("-")][:2]
    words = words if words and words[0] in groups else words[:1]
    error, hint = (e.message, e.hint) if isinstance(e, QgateError) else (message, None)
    each = e.problems if isinstance(e, QgateError) else []
    problems = [Problem(error=p.message, hint=p.hint) for p in each] or [Problem(error=error, hint=hint)]
    return ErrorDoc(
        exit_code=exit_code, command=" ".join(words) or "qgate", error=error, hint=hint, problems=problems
    ).model_dump_json(indent=2)


def columns(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """A table as plain lines, each column as wide as its widest cell: readable in a terminal and in a CI log alike,
    and one grep per row."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in (header, *rows)]


def step_summary(markdown: str) -> None:
    path = os.environ.get("GITHUB_STEP_SUMMARY")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(markdown.rstrip() + "\n\n")


def write_junit(path: Path, suites: dict[str, GateReport]) -> Path:
    """One <testsuite> per candidate, one <testcase> per check. fail/error fail the case; inconclusive fails it under
    the report's `block` and is skipped (with its reason) under `warn`; report-only checks pass with their value in
    system-out."""
    import xml.etree.ElementTree as ET

    root = ET.Element("testsuites", name="qgate")
    for suite_name, report in suites.items():
        results = report.results
        suite = ET.SubElement(root, "testsuite", name=suite_name, tests=str(len(results)))
        failures = skipped = 0
        for r in results:
            case = ET.SubElement(suite, "testcase", classname=f"qgate.{suite_name}.{r['gate']}", name=r["metric"])
            ci = f" CI [{r['ci'][0]}, {r['ci'][1]}]" if r.get("ci") else ""
            cmp = ">=" if r["higher_is_better"] else "<="
            text = (
                f"observed {r['observed']}{ci}"
                + (f", threshold {cmp} {r['threshold']}" if r["threshold"] is not None else "")
                + f", n {r['n']}, decided on {r['decided_on']}"
            )
            if not report.lets_through(r):
                failures += 1
                ET.SubElement(case, "failure", type=r["verdict"], message=f"{r['verdict'].upper()}: {text}").text = text
            elif r["verdict"] == "inconclusive":
                skipped += 1
                ET.SubElement(case, "skipped", message=f"INCONCLUSIVE (on_inconclusive: warn): {text}")
            else:
                ET.SubElement(case, "system-out").text = f"{r['verdict'].upper()}: {text}"
        suite.set("failures", str(failures))
        suite.set("skipped", str(skipped))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
    return path


def checks(results: list[dict]) -> list[Check]:
    return [Check.model_validate(r | {"caveat": r.get("evidence", {}).get("caveat")}) for r in results]


def checkpoint_line(art) -> str:
    """A checkpoint artifact in one line: what it is (architecture, or scheme and formats), its size, and its hash."""
    m = art.meta
    mb = f"{m.get('weights_bytes', 0) / 1e6:,.1f} MB of weights"
    if m.get("scheme") == "baseline":
        what = (
            f"baseline {m.get('architecture')}, {m.get('num_hidden_layers')} layers, hidden {m.get('hidden_size')}, "
            f"vocab {m.get('vocab_size'):,}; {mb}"
            if m.get("vocab_size")
            else f"baseline; {mb}"
        )
        from qgate.models import lossy_gguf_types

        if lossy := lossy_gguf_types(m):
            what += f"; dequantized from GGUF {'/'.join(lossy)} weights"
    else:
        parts = [f"{m.get('scheme')} ({m.get('weight_format')})"]
        if m.get("kv_cache_dtype"):
            parts.append(f"KV cache {m['kv_cache_dtype']}")
        if m.get("fallback_layers"):
            parts.append(f"{len(m['fallback_layers'])} layers at {m.get('fallback_bits')} bits")
        if m.get("fine_group_layers"):
            parts.append(f"{len(m['fine_group_layers'])} layers at group size {m.get('fine_group_size')}")
        bits = m.get("bits_per_weight")
        parts.append(f"{bits:.2f} bits/weight, {mb}" if bits is not None else f"bits/weight unknown, {mb}")
        if m.get("calibration_samples"):
            parts.append(f"{m['calibration_samples']} calibration samples")
        if "quantize_seconds" in m:
            parts.append(f"quantized in {m['quantize_seconds']:.0f} s")
        what = "; ".join(parts)
    return f"checkpoint {art.path}  {what}  sha256 {art.sha256[:16]}"
