"""What CI and the registry UI get: --json documents, JUnit, the job summary, quiet logs, descriptions, status,
rollback."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from specs import gates_spec

from qgate.cli.main import main
from qgate.cli.output import ErrorDoc, GateDoc, PromoteDoc, RunDoc, StatusDoc, VerifyDoc, json_schema

ROOT = Path(__file__).resolve().parents[2]


def test_checked_in_schema_matches_the_models():
    assert json.loads((ROOT / "docs" / "qgate-output.schema.json").read_text()) == json_schema()


def test_gate_json_junit_and_job_summary(base_art, awq_art, calib_arts, tmp_path, capsys, monkeypatch):
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    spec = gates_spec(
        tmp_path / "spec.yaml",
        {"shadow": {"max_new_tokens": 16, "max_prompt_tokens": 48, "kl_p99_max": 1e-4}, "eval": None},  # 384 positions
    )
    rc = main(
        [
            "gate",
            "--candidate",
            str(awq_art.path),
            "--baseline",
            str(base_art.path),
            "--shadow",
            str(calib_arts["shadow"].path),
            "--out",
            str(tmp_path / "g"),
            "--cache",
            str(tmp_path / "c"),
            "--spec",
            str(spec),
            "--name",
            "awq",
            "--json",
            "--junit",
            str(tmp_path / "junit.xml"),
        ]
    )
    out = capsys.readouterr()
    assert rc == 2
    doc = GateDoc.model_validate_json(out.out)  # stdout is exactly one document; the human lines went to stderr
    assert doc.exit_code == 2 and doc.verdict == "fail" and not doc.passed and "gate FAIL" in out.err
    kl = next(c for c in doc.checks if c.metric == "kl_p99")
    assert kl.verdict == "fail" and kl.threshold == 1e-4 and kl.n > 0
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert suite.get("name") == "awq" and len(cases) == len(doc.checks)
    failed = {c.get("name") for c in cases if c.find("failure") is not None}
    # FAIL and ERROR fail their case, and INCONCLUSIVE too under the default on_inconclusive: block
    assert (
        failed == {c.metric for c in doc.checks if c.verdict in ("fail", "error", "inconclusive")}
        and "kl_p99" in failed
    )
    assert int(suite.get("failures")) == len(failed)
    md = summary.read_text()
    assert "### qgate gate awq: ❌ FAIL" in md and "| `shadow.kl_p99` |" in md


def test_json_error_document_for_a_usage_of_missing_files(tmp_path, capsys):
    rc = main(["promote", "--model", "nope", "--version", "1", "--store", str(tmp_path / "none"), "--json"])
    out = capsys.readouterr()
    doc = ErrorDoc.model_validate_json(out.out)
    assert rc == 1 and doc.exit_code == 1 and "no MLflow store" in doc.error and doc.hint
    assert [(p.error, p.hint) for p in doc.problems] == [(doc.error, doc.hint)]
    assert doc.command == "promote"  # the command, not the command and the model's name after it
    assert main(["run", str(tmp_path / "missing.yaml"), "--json"]) == 1
    assert ErrorDoc.model_validate_json(capsys.readouterr().out).command == "run"


@pytest.fixture
def two_versions(base_art, w8_art, calib_arts, tmp_path, monkeypatch):
    from qgate.gates.gating import GateConfig, run_gates
    from qgate.gates.shadow import ShadowConfig
    from qgate.registry.mlflow_store import promote, register

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = GateConfig(
        shadow=ShadowConfig(
            max_new_tokens=8, max_prompt_tokens=48, kl_p99_max=None, kl_mean_max=10.0, top1_agreement_min=None
        ),
        eval=None,
    )
    store = tmp_path / "mlflow"
    versions = []
    for i in range(2):
        rep = run_gates(w8_art, base_art, calib_arts["shadow"], cfg, tmp_path / f"g{i}", tmp_path / "c", name=f"w8-{i}")
        versions.append(register(rep, w8_art, "tiny-llm", store))
        promote("tiny-llm", versions[-1], store=store)
    return store, versions


def test_version_page_evidence_status_and_rollback(two_versions, capsys):
    from mlflow import MlflowClient

    store, (v1, v2) = two_versions
    uri = f"sqlite:///{store / 'mlflow.db'}"
    client = MlflowClient(uri, uri)
    mv = client.get_model_version("tiny-llm", v2)
    assert mv.description.startswith("## qgate gate: ✅ PASS") and "| `shadow.kl_mean` |" in mv.description
    assert "**Lineage**" in mv.description and mv.tags["qgate.gate_report_artifact"] in mv.description
    assert not any(v.startswith("/") for v in mv.tags.values() if isinstance(v, str))  # no local paths in the UI
    assert "qgate" in client.get_registered_model("tiny-llm").description
    assert main(["status", "--model", "tiny-llm", "--store", str(store), "--json"]) == 0
    status = StatusDoc.model_validate_json(capsys.readouterr().out)
    rows = {r.alias: r for r in status.aliases}
    assert rows["production"].version == v2 and rows["previous-production"].version == v1
    assert rows["production"].verdict == "pass" and rows["production"].gate_report.startswith("runs:/")
    assert main(["status", "--model", "tiny-llm", "--store", str(store)]) == 0
    lines = capsys.readouterr().out.splitlines()  # plain lines, one per alias, columns aligned: no TTY box drawing
    assert lines[0] == "tiny-llm" and lines[1].split()[:3] == ["alias", "version", "verdict"]
    assert lines[2].split()[:3] == ["production", v2, "pass"] and lines[3].split()[:2] == ["previous-production", v1]
    assert lines[1].index("verdict") == lines[2].index("pass") == lines[3].index("pass")
    assert main(["verify", "--model", "tiny-llm", "--store", str(store), "--json"]) == 0
    verified = VerifyDoc.model_validate_json(capsys.readouterr().out)
    assert verified.version == v2 and verified.artifact_sha256 == rows["production"].artifact_sha256
    assert main(["rollback", "--model", "tiny-llm", "--store", str(store), "--json"]) == 0
    doc = PromoteDoc.model_validate_json(capsys.readouterr().out)
    assert doc.command == "rollback" and doc.version == v1 and doc.previous == v2
    assert str(client.get_model_version_by_alias("tiny-llm", "production").version) == v1
    assert str(client.get_model_version_by_alias("tiny-llm", "previous-production").version) == v2
    assert main(["rollback", "--model", "tiny-llm", "--store", str(store)]) == 0  # a second rollback undoes the first
    assert str(client.get_model_version_by_alias("tiny-llm", "production").version) == v2


def test_rollback_refuses_a_target_whose_files_changed(two_versions, capsys):
    from mlflow import MlflowClient

    store, (v1, _) = two_versions
    uri = f"sqlite:///{store / 'mlflow.db'}"
    client = MlflowClient(uri, uri)
    loc = client.get_logged_model(client.get_model_version("tiny-llm", v1).tags["qgate.model_id"]).artifact_location
    target = next(
        p for p in (store / "artifacts").rglob("config.json") if str(p).startswith(loc.removeprefix("file://"))
    )
    target.write_text(target.read_text() + " ")
    assert main(["rollback", "--model", "tiny-llm", "--store", str(store)]) == 2
    assert "stored artifact sha256" in capsys.readouterr().err
    assert str(client.get_model_version_by_alias("tiny-llm", "production").version) != v1


def test_run_without_a_tty_is_quiet_machine_readable_and_logs_libraries_to_a_file(tmp_path, workdir):
    """The CI view of `qgate run`: a subprocess with pipes (no TTY), --json and --junit."""
    from specs import W8, pipeline_spec

    spec = pipeline_spec(tmp_path, workdir, name="tiny-ci", variants=[W8])
    env = {
        k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "TQDM_DISABLE", "QGATE_PLAIN_PROGRESS")
    }
    env["GITHUB_STEP_SUMMARY"] = str(tmp_path / "summary.md")
    qgate = Path(sys.executable).parent / "qgate"
    p = subprocess.run(
        [str(qgate), "run", str(spec), "--json", "--junit", str(tmp_path / "junit.xml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    doc = RunDoc.model_validate_json(p.stdout)
    assert doc.promoted is not None and doc.promoted.version == doc.variants[0].version and doc.exit_code == 0
    assert doc.log_file and Path(doc.log_file).exists() and Path(doc.log_file).stat().st_size > 0
    log = Path(doc.log_file).read_text().splitlines()
    doubled = [b for a, b in zip(log, log[1:], strict=False) if a.strip() and b.endswith(f": {a}")]
    assert not doubled, doubled[:3]  # each library line once
    lines = p.stderr.splitlines()
    assert "\r" not in p.stderr and len(lines) < 80, p.stderr  # no redraws; a few lines per stage
    assert sum("shadow: candidate" in ln for ln in lines) <= 12  # progress lines at most every 10%
    assert ET.parse(tmp_path / "junit.xml").getroot().find("testsuite").get("name") == "w8"
    step = (tmp_path / "summary.md").read_text()
    assert "Promoted **w8**" in step and "| served MB |" in step
    w8 = doc.variants[0]
    assert w8.served_bytes == w8.weights_bytes > 0  # gated on the reference path: its checkpoint is what is served
    assert f"| {w8.served_bytes / 1e6:,.1f} |" in step


def test_a_library_with_its_own_stderr_handler_logs_each_line_once(tmp_path):
    """datasets adds a stderr handler to its logger and still propagates to the root's: after quiet_console sends fd
    2 to the log, each of its lines reached the log twice, once bare and once with a timestamp."""
    log = tmp_path / "run.log"
    code = (
        "import logging, sys; from pathlib import Path; from qgate.progress import quiet_console\n"
        "import datasets\n"  # imported first, as the gates' modules import it
        f"quiet_console(Path({str(log)!r}))\n"
        "logging.getLogger('datasets.builder').info('from datasets')\n"
        "logging.getLogger('lm_eval.api').info('from lm-eval')\n"
        "logging.getLogger('transformers.modeling_utils').warning('from transformers')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    text = log.read_text()
    for line in ("from datasets", "from lm-eval", "from transformers"):
        assert text.count(line) == 1, text


def test_libraries_that_call_tqdm_directly_print_no_bars_without_a_tty(monkeypatch):
    import io
    import sys

    import tqdm.std
    from tqdm.auto import tqdm as bar

    from qgate.cli.options import quiet_libraries

    init = tqdm.std.tqdm.__init__
    monkeypatch.setattr(tqdm.std.tqdm, "__init__", getattr(init, "_qgate_original", init))  # unquieted; restored after
    monkeypatch.setenv("TQDM_DISABLE", "0")
    out = io.StringIO()
    for _ in bar(range(5), desc="before", file=out):
        pass
    assert "5/5" in out.getvalue()  # bars print until qgate quiets them
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a TTY, as in CI or cron
    quiet_libraries()
    out = io.StringIO()
    for _ in bar(
        range(5), desc="Converting and de-quantizing GGUF tensors...", file=out
    ):  # as transformers' GGUF loader does
        pass
    for _ in bar(range(5), desc="explicit", file=out, disable=False):
        pass
    assert out.getvalue() == ""
