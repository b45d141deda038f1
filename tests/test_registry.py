import shutil

import pytest

from qgate.artifact import Artifact
from qgate.cli.main import main
from qgate.errors import PromotionRefused
from qgate.gates.evalgate import EvalConfig
from qgate.gates.run import GateConfig, run_gates
from qgate.gates.shadow import ShadowConfig
from qgate.registry.mlflow_store import promote, register


@pytest.fixture(scope="module")
def gated(base_art, w8_art, awq_art, calib_arts, workdir):
    """w8 passes lenient thresholds; awq fails an impossible KL threshold."""
    lenient = GateConfig(shadow=ShadowConfig(max_new_tokens=8, max_prompt_tokens=48, kl_p99_max=10.0, top1_agreement_min=0.0),
                         eval=EvalConfig(tasks=("bigbench_general_knowledge",), limit=8, min_recovery=0.0))
    strict = GateConfig(shadow=ShadowConfig(max_new_tokens=8, max_prompt_tokens=48, kl_p99_max=1e-9), eval=None)
    ok = run_gates(w8_art, base_art, calib_arts["shadow"], lenient, workdir / "reg-ok", workdir / "cache-reg")
    bad = run_gates(awq_art, base_art, calib_arts["shadow"], strict, workdir / "reg-bad", workdir / "cache-reg")
    assert ok.meta["passed"] and not bad.meta["passed"]
    return ok, bad


def test_register_promote_refuse_and_rollback_alias(gated, w8_art, awq_art, tmp_path, monkeypatch):
    import mlflow
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ok, bad = gated
    store = tmp_path / "mlflow"
    v_ok = register(ok, w8_art, "tiny-llm", store)
    v_bad = register(bad, awq_art, "tiny-llm", store)
    client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    tags = client.get_model_version("tiny-llm", v_ok).tags
    assert tags["qgate.gate_passed"] == "true" and tags["qgate.scheme"] == "gptq-w8a16"
    assert tags["qgate.calibration_sha256"] == w8_art.meta["calibration_sha256"]
    assert tags["qgate.artifact_sha256"] == w8_art.sha256 and tags["qgate.gate_report_path"].endswith("report.html")
    assert "kl_p99" in client.get_model_version("tiny-llm", v_bad).tags["qgate.gate_failed_checks"].split(",")
    with pytest.raises(PromotionRefused, match="gate did not pass"):
        promote("tiny-llm", v_bad, store=store)
    assert main(["promote", "--model", "tiny-llm", "--version", v_bad, "--store", str(store)]) == 2
    info = promote("tiny-llm", v_ok, store=store)
    assert info["previous"] is None
    assert str(client.get_model_version_by_alias("tiny-llm", "production").version) == v_ok
    v_ok2 = register(ok, w8_art, "tiny-llm", store)
    promote("tiny-llm", v_ok2, store=store)
    assert str(client.get_model_version_by_alias("tiny-llm", "previous-production").version) == v_ok
    assert str(client.get_model_version_by_alias("tiny-llm", "production").version) == v_ok2
    # the gate report is a run artifact
    mv = client.get_model_version("tiny-llm", v_ok)
    run_id = client.get_logged_model(mv.tags["qgate.model_id"]).source_run_id
    assert any(a.path == "gate-report" for a in client.list_artifacts(run_id))
    assert mlflow.get_tracking_uri().startswith("sqlite:///")


def test_promotion_refused_when_stored_artifact_changed(gated, w8_art, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ok, _ = gated
    store = tmp_path / "mlflow"
    v = register(ok, w8_art, "tamper", store)
    client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    loc = client.get_logged_model(client.get_model_version("tamper", v).tags["qgate.model_id"]).artifact_location
    target = next(p for p in (store / "artifacts").rglob("config.json") if str(p).startswith(loc.removeprefix("file://")))
    target.write_text(target.read_text() + " ")
    with pytest.raises(PromotionRefused, match="stored artifact sha256"):
        promote("tamper", v, store=store)


def test_register_refuses_a_report_for_another_candidate(gated, awq_art, tmp_path):
    from qgate.errors import RegistryError

    ok, _ = gated
    with pytest.raises(RegistryError, match="gate report is for candidate"):
        register(ok, awq_art, "x", tmp_path / "m")


def test_register_refuses_a_modified_candidate(gated, w8_art, tmp_path):
    from qgate.errors import InputError

    ok, _ = gated
    copy = tmp_path / "w8copy"
    shutil.copytree(w8_art.path, copy)
    (copy / "config.json").write_text((copy / "config.json").read_text() + "\n")
    with pytest.raises(InputError, match="content changed"):
        register(ok, Artifact.load(copy), "x", tmp_path / "m")
