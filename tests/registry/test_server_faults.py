"""Transient server faults: a seeded proxy (tests/faultproxy.py) between the jobs and a real MLflow tracking server
drops connections before and after the server acts, answers 500 and 503, and stalls past the client's timeout. The
jobs must end as they end without faults, with MLflow's own retries (qgate.registry.transport) and no duplicates."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from faultproxy import KINDS, FaultProxy
from servers import mlflow_server
from specs import SHIFT, STRICT, W8, drift_spec

from qgate.artifact import sha256_file
from qgate.cli.main import main
from qgate.registry.transport import HTTP_SETTINGS

GATE = "qgate.gate_report_sha256"


@pytest.fixture
def fast_retries(monkeypatch):
    """qgate's retry count, with a short timeout and no waits between tries, so that a stall costs seconds."""
    for k in HTTP_SETTINGS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")


def _state(url: str, model: str, root: Path) -> dict:
    """What a registry holds for a model, without ids that differ between runs: its versions (evidence tags, whether
    described, the files of each version's model), its aliases, and the runs and logged models made for its gates."""
    from mlflow import MlflowClient

    c = MlflowClient(url, url)
    versions = sorted(c.search_model_versions(f"name = '{model}'"), key=lambda mv: int(mv.version))
    exp = c.get_experiment_by_name("qgate")
    gates = {mv.tags[GATE] for mv in versions}
    keep = ("qgate.artifact_sha256", GATE, "qgate.gate_verdict", "qgate.variant", "qgate.gate_passed")
    return {
        "versions": [
            {
                "version": mv.version,
                "tags": {k: mv.tags.get(k) for k in keep},
                "described": bool(mv.description),
                "files": _files(root, mv.tags["qgate.model_id"]),
            }
            for mv in versions
        ],
        "aliases": dict(c.get_registered_model(model).aliases),
        "runs": sorted(
            g for g in gates for _ in c.search_runs([exp.experiment_id], filter_string=f"tags.`{GATE}` = '{g}'")
        ),
        "logged_models": sorted(
            g
            for g in gates
            for _ in c.search_logged_models([exp.experiment_id], filter_string=f"tags.`{GATE}` = '{g}'")
        ),
    }


def _files(root: Path, model_id: str) -> list[tuple[str, str]]:
    """A logged model's files as the server stored them (name, sha256), read from its artifact directory: MLflow's
    client caches an artifact repository with the tracking URI it was first made for, the proxy's here."""
    (where,) = [d for d in (root / "artifacts").rglob(model_id) if d.is_dir()]
    return sorted((f.relative_to(where).as_posix(), sha256_file(f)) for f in where.rglob("*") if f.is_file())


def _registry_job(uri: str, model: str, gated, w8_art, awq_art, monkeypatch, capsys) -> None:
    """Register a passing and a failing candidate, register the first again, promote it, refuse the second, verify."""
    ok, bad = gated
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    version = {}
    for name, rep, cand in (("ok", ok, w8_art), ("bad", bad, awq_art), ("ok", ok, w8_art)):
        assert main(["register", "--gate", str(rep.path), "--candidate", str(cand.path), "--model", model]) == 0
        got = re.search(rf"registered {model} version (\d+)", capsys.readouterr().out).group(1)
        assert version.setdefault(name, got) == got  # registering again gives the same version
    assert main(["promote", "--model", model, "--version", version["ok"]]) == 0
    assert main(["promote", "--model", model, "--version", version["bad"]]) == 2  # its gate failed
    assert main(["verify", "--model", model]) == 0  # the files hash as gated, read back through the server
    out = capsys.readouterr()
    assert "Traceback" not in out.err


def test_registry_jobs_through_a_faulty_server_end_as_they_do_without_faults(
    gated, w8_art, awq_art, tmp_path, monkeypatch, capsys, fast_retries
):
    with mlflow_server(tmp_path) as url:
        _registry_job(url, "clean", gated, w8_art, awq_art, monkeypatch, capsys)
        with FaultProxy(url, rate=0.2, seed=11, stall_s=3.0) as proxy:
            _registry_job(proxy.url, "faulty", gated, w8_art, awq_art, monkeypatch, capsys)
        clean, faulty = _state(url, "clean", tmp_path), _state(url, "faulty", tmp_path)
    print(f"\nfaults injected: {proxy.counts}")
    assert faulty == clean and len(clean["versions"]) == 2 and clean["aliases"] == {"production": "1"}
    assert all(proxy.counts[k] > 0 for k in KINDS) and proxy.faults >= 0.1 * sum(proxy.counts.values())


def test_a_create_answered_after_the_server_acted_is_not_registered_twice(
    gated, w8_art, tmp_path, monkeypatch, capsys, fast_retries
):
    """The answers to the creates of the run, the logged model and the version are lost after the server made them;
    MLflow's client retries each POST and the server makes each twice. Registration keeps the first version, deletes
    the second and the run and logged model no version uses, and says so."""
    ok, _ = gated
    creates = tuple(f"/api/2.0/mlflow/{c}" for c in ("runs/create", "logged-models", "model-versions/create"))
    with mlflow_server(tmp_path) as url:
        with FaultProxy(url, rate=1.0, kinds=("drop_after",), paths=creates, once_per_path=True) as proxy:
            monkeypatch.setenv("MLFLOW_TRACKING_URI", proxy.url)
            assert main(["register", "--gate", str(ok.path), "--candidate", str(w8_art.path), "--model", "m"]) == 0
        out = capsys.readouterr()
        state = _state(url, "m", tmp_path)
    assert sorted(p for _, p, what in proxy.log if what == "drop_after") == sorted(creates)
    assert [v["version"] for v in state["versions"]] == ["1"] and state["versions"][0]["described"]
    assert len(state["runs"]) == len(state["logged_models"]) == 1
    assert "removed duplicate version 2: a retried request registered it twice" in out.err
    assert out.err.count("removed duplicate run") == 1 and out.err.count("removed duplicate logged model") == 1
    assert "registered m version 1" in out.out


def test_a_server_that_keeps_failing_ends_the_job_with_one_line_naming_it(tmp_path, monkeypatch, capsys, fast_retries):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    with mlflow_server(tmp_path) as url, FaultProxy(url, rate=1.0, kinds=("503",)) as proxy:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", proxy.url)
        assert main(["status", "--model", "m", "--json"]) == 1
    err = capsys.readouterr()
    doc = json.loads(err.out)
    line = err.err.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert line.startswith(f"error: the MLflow tracking server at {proxy.url} failed /api/2.0/mlflow/")
    assert "after 2 retries" in line and "503" in line and doc["exit_code"] == 1
    assert proxy.counts["503"] == 3  # the first try and two retries


def test_sampling_through_a_faulty_s3_server_gives_the_sample_of_a_clean_read(tmp_path, monkeypatch):
    """pyarrow's S3 client with qgate's retry strategy reads partitions through dropped connections, 500s, 503s and
    stalls, and the sets it samples are the bytes of a read without faults."""
    import boto3
    import tiny
    from servers import s3_server

    from qgate.calibrate import sources
    from qgate.calibrate.sample import SampleConfig, sample_traffic

    monkeypatch.setattr(sources, "S3_REQUEST_TIMEOUT", 2.0)
    cfg = SampleConfig(calib_size=20, shadow_size=20, seed=3)
    with s3_server() as (endpoint, bucket):
        client = boto3.client("s3", endpoint_url=endpoint)
        for i in range(8):
            tiny.make_traffic(tmp_path / f"part-{i}.jsonl", n=100, seed=i)
            client.upload_file(str(tmp_path / f"part-{i}.jsonl"), bucket, f"logs/part-{i}.jsonl")
        uri = f"s3://{bucket}/logs/"
        clean = sample_traffic(uri, tmp_path / "clean", cfg)
        with FaultProxy(endpoint, rate=0.2, seed=5, stall_s=3.0) as proxy:
            monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
            faulty = sample_traffic(uri, tmp_path / "faulty", cfg)
    print(f"\nfaults injected: {proxy.counts}")
    assert proxy.faults >= 5 and {k for k in KINDS if proxy.counts[k]} >= {"drop_before", "stall", "503"}
    for k in ("calib", "shadow", "search"):
        if k in clean:
            assert faulty[k].sha256 == clean[k].sha256, k
    assert faulty["profile"].parents == clean["profile"].parents  # the same content hash of the traffic


def test_a_pipeline_and_a_drift_check_through_a_faulty_server_end_as_without_faults(
    tmp_path, workdir, monkeypatch, capsys, fast_retries
):
    """`qgate run` (the tiny model) registers and promotes, and `qgate drift check` reads production's profile and
    tags its verdict, once straight to the server and once through 20% faults: the same registry either way."""
    import tiny
    import yaml

    src = workdir / "tiny-src"
    if not src.exists():
        tiny.make_model(src)
    tiny.make_traffic(tmp_path / "traffic.jsonl", n=300, seed=0)
    tiny.make_traffic(tmp_path / "shifted.jsonl", n=300, seed=12, **SHIFT)
    spec = drift_spec(tmp_path, src, [W8, W8 | {"name": "w8-again"}], STRICT)
    doc = yaml.safe_load(spec.read_text())

    def job(uri: str, model: str) -> int:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        spec.write_text(yaml.safe_dump(doc | {"registry": doc["registry"] | {"model_name": model}}))
        assert main(["run", str(spec)]) == 0
        rc = main(["drift", "check", "--spec", str(spec), "--traffic", str(tmp_path / "shifted.jsonl")])
        assert "Traceback" not in capsys.readouterr().err
        return rc

    with mlflow_server(tmp_path / "srv") as url:
        clean_rc = job(url, "clean")
        with FaultProxy(url, rate=0.2, seed=4, stall_s=3.0) as proxy:
            faulty_rc = job(proxy.url, "faulty")
        clean, faulty = _state(url, "clean", tmp_path / "srv"), _state(url, "faulty", tmp_path / "srv")
        from mlflow import MlflowClient

        c = MlflowClient(url, url)
        drift = [
            c.get_model_version_by_alias(m, "production").tags.get("qgate.drift.verdict") for m in ("clean", "faulty")
        ]
    print(f"\nfaults injected: {proxy.counts}")
    assert clean_rc == faulty_rc == 3 and drift == ["drift", "drift"]
    assert faulty == clean and len(clean["versions"]) == 2 and clean["aliases"] == {"production": "1"}
    assert proxy.faults >= 10
