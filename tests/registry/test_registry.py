import json
import shutil

import pytest

from qgate.artifact import Artifact
from qgate.cli.main import main
from qgate.cli.output import ErrorDoc
from qgate.errors import PromotionRefused
from qgate.gates.gating import GateConfig, run_gates
from qgate.gates.shadow import ShadowConfig
from qgate.registry.mlflow_store import promote, register


def test_register_promote_refuse_and_rollback_alias(
    gated, w8_art, awq_art, base_art, calib_arts, tmp_path, monkeypatch
):
    import mlflow
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ok, bad = gated
    ok_inputs = {
        "baseline": base_art,
        "shadow": calib_arts["shadow"],
        "cfg": GateConfig(
            shadow=ShadowConfig(
                max_new_tokens=8, max_prompt_tokens=48, kl_p99_max=None, kl_mean_max=10.0, top1_agreement_min=None
            ),
            eval=None,
        ),
    }
    store = tmp_path / "mlflow"
    v_ok = register(ok, w8_art, "tiny-llm", store)
    v_bad = register(bad, awq_art, "tiny-llm", store)
    client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}", f"sqlite:///{store / 'mlflow.db'}")
    tags = client.get_model_version("tiny-llm", v_ok).tags
    assert tags["qgate.gate_passed"] == "true" and tags["qgate.scheme"] == "gptq-w8a16"
    assert tags["qgate.calibration_sha256"] == w8_art.meta["calibration_sha256"]
    assert tags["qgate.artifact_sha256"] == w8_art.sha256 and tags["qgate.gate_report_artifact"].endswith(
        "/gate-report/report.html"
    )
    assert "kl_p99" in client.get_model_version("tiny-llm", v_bad).tags["qgate.gate_failed_checks"].split(",")
    with pytest.raises(PromotionRefused, match="gate did not pass"):
        promote("tiny-llm", v_bad, store=store)
    assert main(["promote", "--model", "tiny-llm", "--version", v_bad, "--store", str(store)]) == 2
    info = promote("tiny-llm", v_ok, store=store)
    assert info["previous"] is None
    assert str(client.get_model_version_by_alias("tiny-llm", "production").version) == v_ok
    assert register(ok, w8_art, "tiny-llm", store) == v_ok  # the same evidence again: the same version, no duplicate
    again = run_gates(
        w8_art, ok_inputs["baseline"], ok_inputs["shadow"], ok_inputs["cfg"], tmp_path / "gate-again", tmp_path / "c"
    )
    v_ok2 = register(again, w8_art, "tiny-llm", store)  # a new gate report (its own timings): a new version
    assert v_ok2 != v_ok
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
    client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}", f"sqlite:///{store / 'mlflow.db'}")
    loc = client.get_logged_model(client.get_model_version("tamper", v).tags["qgate.model_id"]).artifact_location
    target = next(
        p for p in (store / "artifacts").rglob("config.json") if str(p).startswith(loc.removeprefix("file://"))
    )
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


def test_verify_catches_an_alias_moved_outside_qgate(gated, w8_art, awq_art, tmp_path, monkeypatch, capsys):
    """The MLflow UI's alias editor calls the same API as this client: qgate verify must notice."""
    from mlflow import MlflowClient

    from qgate.registry.mlflow_store import verify

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ok, bad = gated
    store = tmp_path / "mlflow"
    v_ok, v_bad = register(ok, w8_art, "ui", store), register(bad, awq_art, "ui", store)
    promote("ui", v_ok, store=store)
    assert verify("ui", "production", store)["version"] == v_ok
    assert main(["verify", "--model", "ui", "--store", str(store)]) == 0
    assert f"verified ui@production -> v{v_ok}" in capsys.readouterr().out
    MlflowClient(f"sqlite:///{store / 'mlflow.db'}").set_registered_model_alias(
        "ui", "production", v_bad
    )  # the UI bypass
    with pytest.raises(PromotionRefused, match=f"ui v{v_bad}: gate did not pass"):
        verify("ui", "production", store)
    assert main(["verify", "--model", "ui", "--alias", "production", "--store", str(store)]) == 2
    assert capsys.readouterr().err.startswith("refused: ")
    assert main(["verify", "--model", "ui", "--alias", "canary", "--store", str(store)]) == 1
    err = capsys.readouterr().err
    assert "alias @canary not found" in err
    assert f"hint: its versions: 1 to {max(int(v_ok), int(v_bad))} (less any deleted); " in err
    assert f"its aliases: @production -> v{v_bad}" in err
    assert main(["promote", "--model", "iu", "--version", v_ok, "--store", str(store)]) == 1
    err = capsys.readouterr().err
    assert "model 'iu' not found" in err and "hint: registered models there: ui" in err


def test_names_mlflow_would_refuse_are_all_named_before_any_store_is_read(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    store = tmp_path / "nowhere"
    args = ["--model", "a/b", "--version", "1.0", "--alias", "latest", "--store", str(store), "--json"]
    assert main(["promote", *args]) == 1
    doc = ErrorDoc.model_validate_json(capsys.readouterr().out)
    assert [p.error for p in doc.problems] == [
        "model name: Invalid model name 'a/b'. Names cannot contain '/' or ':'.",
        "alias: 'latest' alias name (case insensitive) is reserved.",
        "version: Parameter 'version' must be an integer, got '1.0'.",
    ]
    assert all(p.hint for p in doc.problems) and "no MLflow store" not in doc.error
    assert main(["verify", "--model", "m", "--alias", "prod env", "--store", str(store)]) == 1
    assert "error: alias: Invalid alias name: 'prod env'" in capsys.readouterr().err
    for cmd in ("status", "rollback"):
        assert main([cmd, "--model", "x:y", "--store", str(store)]) == 1
        assert "error: model name: Invalid model name 'x:y'" in capsys.readouterr().err
    assert not store.exists()


def test_reads_never_create_a_store_and_name_the_one_searched(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["promote", "--model", "m", "--version", "1"]) == 1
    err = capsys.readouterr().err
    assert f"no MLflow store at {tmp_path / '.qgate/mlflow'}" in err and "--store" in err
    assert main(["verify", "--model", "m", "--store", str(tmp_path / "elsewhere")]) == 1
    assert f"no MLflow store at {tmp_path / 'elsewhere'} (searched --store)" in capsys.readouterr().err
    assert not (tmp_path / ".qgate").exists() and not (tmp_path / "elsewhere").exists()


def test_gate_runs_are_named_after_the_variant_and_tagged_with_the_verdict(
    gated, w8_art, awq_art, tmp_path, monkeypatch
):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ok, bad = gated
    store = tmp_path / "mlflow"
    versions = [register(art, cand, "runs", store) for art, cand in ((ok, w8_art), (bad, awq_art))]
    client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}", f"sqlite:///{store / 'mlflow.db'}")
    for art, version, verdict in ((ok, versions[0], "pass"), (bad, versions[1], "fail")):
        mv = client.get_model_version("runs", version)
        run = client.get_run(client.get_logged_model(mv.tags["qgate.model_id"]).source_run_id)
        name = json.loads((art.path / "report.json").read_text())["candidate"]["name"]
        assert run.info.run_name == f"gate-{name}" and run.data.tags["qgate.verdict"] == verdict


def test_an_edited_gate_report_blocks_registration(gated, w8_art, tmp_path):
    from qgate.errors import InputError

    ok, _ = gated
    copy = tmp_path / "gate-copy"
    shutil.copytree(ok.path, copy)
    report = json.loads((copy / "report.json").read_text())
    report["results"][0]["observed"] = 0.0
    (copy / "report.json").write_text(json.dumps(report))
    with pytest.raises(InputError, match="content changed"):
        register(Artifact.load(copy), w8_art, "x", tmp_path / "m")


def test_promotion_checks_the_stored_gate_report_not_the_tags(gated, w8_art, awq_art, tmp_path, monkeypatch):
    """Tags are editable by anyone with write access in the UI; the gate report stored with the run is the evidence.
    A failed version whose tags were forged to say passed, and a passed version whose stored report was edited
    after registration, are both refused."""
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ok, bad = gated
    store = tmp_path / "mlflow"
    v_ok, v_bad = register(ok, w8_art, "forge", store), register(bad, awq_art, "forge", store)
    client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}", f"sqlite:///{store / 'mlflow.db'}")
    for k, v in {"qgate.gate_passed": "true", "qgate.gate_verdict": "pass", "qgate.gate_failed_checks": "-"}.items():
        client.set_model_version_tag("forge", v_bad, k, v)
    with pytest.raises(PromotionRefused, match=f"forge v{v_bad}: its stored gate report says fail"):
        promote("forge", v_bad, store=store)
    run_id = client.get_model_version("forge", v_ok).tags["qgate.gate_report_artifact"].split("/")[1]
    stored = next(p for p in (store / "artifacts").rglob("report.json") if run_id in str(p))
    stored.write_text(stored.read_text().replace('"verdict": "pass"', '"verdict": "pass" '))
    with pytest.raises(PromotionRefused, match=f"forge v{v_ok}: stored gate report sha256 .* != registered"):
        promote("forge", v_ok, store=store)
    assert main(["promote", "--model", "forge", "--version", v_ok, "--store", str(store)]) == 2


def test_a_registration_killed_halfway_is_cleaned_up_and_a_missing_description_repaired(
    gated, w8_art, tmp_path, monkeypatch, capsys
):
    """What a kill between registration's server calls leaves: a run and a logged model with no version (removed on the
    next registration), or a version without its description (rewritten)."""
    from mlflow import MlflowClient

    from qgate.registry.client import client as registry_client

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ok, _ = gated
    store = tmp_path / "mlflow"
    mlflow, client = registry_client(store)
    exp = client.get_experiment_by_name("qgate")
    with mlflow.start_run(experiment_id=exp.experiment_id, tags={"qgate.gate_report_sha256": ok.sha256}) as run:
        orphan = mlflow.initialize_logged_model(
            name="half",
            source_run_id=run.info.run_id,
            experiment_id=exp.experiment_id,
            tags={"qgate.gate_report_sha256": ok.sha256},
        )
    v = register(ok, w8_art, "half", store)
    err = capsys.readouterr().err
    assert f"removed logged model {orphan.model_id}" in err and f"removed run {run.info.run_id}" in err
    c = MlflowClient(f"sqlite:///{store / 'mlflow.db'}", f"sqlite:///{store / 'mlflow.db'}")
    assert [m.model_id for m in c.search_logged_models([exp.experiment_id])] == [
        c.get_model_version("half", v).tags["qgate.model_id"]
    ]
    c.update_model_version("half", v, description="")
    assert register(ok, w8_art, "half", store) == v
    assert (
        "## " in c.get_model_version("half", v).description
        or "verdict" in c.get_model_version("half", v).description.lower()
    )


def test_a_tracking_uri_naming_a_file_store_is_refused_with_what_to_set_instead(tmp_path, monkeypatch, capsys):
    """MLflow 3 refuses its file store (a plain path or file: URI in MLFLOW_TRACKING_URI) unless
    MLFLOW_ALLOW_FILE_STORE is true; the registry commands say so, and name the sqlite URI of a qgate store there."""
    from qgate.registry.client import client, env_tracking_uri

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    store = tmp_path / "store"
    client(store)  # an embedded store: store/mlflow.db
    for uri in (str(store), store.as_uri()):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        assert main(["status", "--model", "m"]) == 1
        err = capsys.readouterr().err
        assert f"error: MLFLOW_TRACKING_URI={uri} names an MLflow file store ({store})" in err, err
        assert f"hint: that directory holds a qgate store: set MLFLOW_TRACKING_URI=sqlite:///{store}/mlflow.db" in err
        assert "internal error" not in err
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "mlruns"))
    assert main(["verify", "--model", "m"]) == 1
    assert "hint: set it to a tracking server's URL or to sqlite:///PATH/mlflow.db" in capsys.readouterr().err
    assert not (tmp_path / "mlruns").exists()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's own opt-out: the URI is MLflow's to judge
    assert env_tracking_uri() == str(tmp_path / "mlruns")
    for uri in (f"sqlite:///{store}/mlflow.db", "https://mlflow.example.com", "databricks"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
        assert env_tracking_uri() == uri
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert env_tracking_uri() is None
