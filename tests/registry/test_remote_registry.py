"""Against a real MLflow tracking server with basic authentication, started on localhost for the test."""

import json
import os

import pytest
import requests
from servers import ADMIN, mlflow_server

from qgate.cli.main import main


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("flask_wtf", reason="mlflow[auth] is in the dev extra: bash scripts/setup.sh installs it")
    root = tmp_path_factory.mktemp("mlflow-server")
    with mlflow_server(root, auth=True) as url:
        for user, pw in (("ci", "ci-pass-1234"), ("reader", "reader-pass-1234")):
            r = requests.post(
                f"{url}/api/2.0/mlflow/users/create", json={"username": user, "password": pw}, auth=ADMIN, timeout=10
            )
            assert r.ok, r.text
        yield url, root


def _as(monkeypatch, url, user, pw):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", pw)


def test_register_and_promote_through_an_authenticated_server_and_refuse_a_reader(
    server, base_art, w8_art, calib_arts, tmp_path, monkeypatch, capsys
):
    from qgate.gates.gating import GateConfig, run_gates
    from qgate.gates.shadow import ShadowConfig

    url, root = server
    cfg = GateConfig(
        shadow=ShadowConfig(
            max_new_tokens=8, max_prompt_tokens=48, kl_p99_max=None, kl_mean_max=10.0, top1_agreement_min=None
        ),
        eval=None,
    )
    report = run_gates(w8_art, base_art, calib_arts["shadow"], cfg, tmp_path / "g", tmp_path / "c", name="w8")
    _as(monkeypatch, url, "ci", "ci-pass-1234")
    assert main(["register", "--gate", str(report.path), "--candidate", str(w8_art.path), "--model", "remote-llm"]) == 0
    out = capsys.readouterr()
    assert "registered remote-llm version 1" in out.out and "ci-pass-1234" not in out.out + out.err
    assert (
        main(["promote", "--model", "remote-llm", "--version", "1"]) == 0
    )  # checksums verified through the server's artifacts
    assert main(["verify", "--model", "remote-llm"]) == 0
    capsys.readouterr()
    # a user with only the default READ permission may look, not move aliases
    _as(monkeypatch, url, "reader", "reader-pass-1234")
    assert main(["status", "--model", "remote-llm", "--json"]) == 0
    capsys.readouterr()
    assert main(["promote", "--model", "remote-llm", "--version", "1", "--alias", "staging"]) == 1
    err = capsys.readouterr().err
    assert "refused to move an alias for user reader" in err and "PERMISSION_DENIED" in err and "reader-pass" not in err
    # wrong password: refused, with the reason
    _as(monkeypatch, url, "ci", "wrong")
    assert main(["register", "--gate", str(report.path), "--candidate", str(w8_art.path), "--model", "remote-llm"]) == 1
    err = capsys.readouterr().err
    assert "refused" in err and "for user ci" in err and "internal error" not in err
    # nothing half-done: still one version, production untouched
    _as(monkeypatch, url, "ci", "ci-pass-1234")
    from mlflow import MlflowClient

    client = MlflowClient(url, url)
    assert len(client.search_model_versions("name='remote-llm'")) == 1
    assert str(client.get_model_version_by_alias("remote-llm", "production").version) == "1"


def test_parallel_registrations_and_promotions_through_the_server(server, gated, w8_art, tmp_path):
    """The same race as test_concurrency.py, against the real server: the lease kept in the server serializes them."""
    from mlflow import MlflowClient
    from test_concurrency import check_promotion_chain, race

    url, _ = server
    ok, _ = gated
    env = os.environ | {
        "MLFLOW_TRACKING_URI": url,
        "MLFLOW_TRACKING_USERNAME": "ci",
        "MLFLOW_TRACKING_PASSWORD": "ci-pass-1234",
    }
    results = race("-", ok, w8_art, tmp_path, env)
    os.environ.update({k: env[k] for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")})
    try:
        client = MlflowClient(url, url)
        aliases = client.get_registered_model("race").aliases
        assert len(client.search_model_versions("name='race'")) == 6
        assert not [m.name for m in client.search_registered_models() if m.name.startswith("qgate-lease.")]  # released
    finally:
        for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            os.environ.pop(k, None)
    check_promotion_chain(results, None, str(aliases["production"]), str(aliases.get("previous-production")))


def test_a_promotion_whose_lease_is_taken_over_moves_no_alias(server, gated, w8_art, monkeypatch, capsys):
    """Another job takes the registry lease while `qgate promote` verifies checksums (as after a pause past the TTL):
    the promotion stops before its first alias write, says who took the lease, and leaves the aliases as they were."""
    from mlflow import MlflowClient

    from qgate.registry import lease as lease_mod
    from qgate.registry import mlflow_store

    url, _ = server
    _as(monkeypatch, url, "ci", "ci-pass-1234")
    client, ok = MlflowClient(url, url), gated[0]
    version = mlflow_store.register(ok, w8_art, "lease-llm")
    name, real_check = lease_mod.LEASE_PREFIX + "lease-llm", mlflow_store.check_version

    def taken_over_meanwhile(mv):
        client.delete_registered_model(name)
        client.create_registered_model(name, description=json.dumps({"id": "other", "pid": 4242, "host": "ci-2"}))
        return real_check(mv)

    monkeypatch.setattr(mlflow_store, "check_version", taken_over_meanwhile)
    capsys.readouterr()
    assert main(["promote", "--model", "lease-llm", "--version", version]) == 1
    err = capsys.readouterr().err
    assert "was taken over by pid 4242 on ci-2" in err and "stopped before moving @production" in err
    assert "Traceback" not in err and not client.get_registered_model("lease-llm").aliases
    assert json.loads(client.get_registered_model(name).description)["id"] == "other"  # the taker's lease stays
    client.delete_registered_model(name)


def test_tracking_credentials_land_in_nothing_a_job_writes(server, gated, w8_art, tmp_path, monkeypatch, capsys):
    """Register, promote, verify and status as a user with a distinctive password, then grep every file the server
    and the job wrote (artifacts, the tracking database with its params and tags, the server's log) and everything
    printed: the password appears nowhere."""
    url, root = server
    secret = "Qz7-distinct-SECRET-9931"
    r = requests.post(
        f"{url}/api/2.0/mlflow/users/create",
        json={"username": "cred-user", "password": secret},
        auth=("admin", "admin-pass-1234"),
        timeout=30,
    )
    assert r.ok, r.text
    r = requests.patch(  # an admin: earlier tests' experiment belongs to another user
        f"{url}/api/2.0/mlflow/users/update-admin",
        json={"username": "cred-user", "is_admin": True},
        auth=("admin", "admin-pass-1234"),
        timeout=30,
    )
    assert r.ok, r.text
    _as(monkeypatch, url, "cred-user", secret)
    monkeypatch.chdir(tmp_path)
    ok = gated[0]
    assert main(["register", "--gate", str(ok.path), "--candidate", str(w8_art.path), "--model", "cred-llm"]) == 0
    assert main(["promote", "--model", "cred-llm", "--version", "1"]) == 0
    assert main(["verify", "--model", "cred-llm"]) == 0
    assert main(["status", "--model", "cred-llm", "--json"]) == 0
    out = capsys.readouterr()
    assert "cred-llm" in out.out and secret not in out.out + out.err
    files = [p for d in (root, tmp_path) for p in d.rglob("*") if p.is_file()]
    assert any(p.name == "report.json" for p in files) and any(p.suffix == ".db" for p in files)  # what was written
    assert [p for p in files if secret.encode() in p.read_bytes()] == []
