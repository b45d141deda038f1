"""Concurrent registry writers: two pipelines registering into one store lose no versions, and two promotions racing
leave production and previous-production consistent. Run against the embedded SQLite store here and against a real
`mlflow server` in test_remote_registry.py (same helpers)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qgate.artifact import Artifact

WORKER = Path(__file__).parent / "concurrency_worker.py"


def distinct_reports(ok: Artifact, root: Path, n: int) -> list[Path]:
    """n gate reports for the same candidate that differ only in a timing field: n distinct registrations."""
    out = []
    for i in range(n):
        d = root / f"gate-{i}"
        shutil.copytree(ok.path, d)
        report = json.loads((d / "report.json").read_text())
        report["timings"] = dict(report.get("timings", {}), copy=i)
        (d / "report.json").write_text(json.dumps(report))
        Artifact.create("gate-report", d, ok.config, ok.parents, ok.meta)
        out.append(d)
    return out


def run_workers(
    mode: str, store: str, model: str, go: Path, jobs: list[list[str]], env: dict | None = None
) -> list[list[dict]]:
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), mode, store, model, str(go), *job],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env or os.environ.copy(),
        )
        for job in jobs
    ]
    go.touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append([json.loads(x) for x in out.splitlines() if x.startswith("{")])
    go.unlink()
    return results


def race(store: str, ok: Artifact, w8_art: Artifact, root: Path, env: dict) -> list[list[dict]]:
    """Two workers register three distinct gate reports each into `store` ("-": the tracking server in env), then
    promote alternate versions; asserts no version was lost and returns the promotions' results."""
    gates = [str(p) for p in distinct_reports(ok, root, 6)]
    results = run_workers(
        "register", store, "race", root / "go", [[str(w8_art.path), *gates[:3]], [str(w8_art.path), *gates[3:]]], env
    )
    assert sorted(int(r["version"]) for rs in results for r in rs) == [1, 2, 3, 4, 5, 6]
    return run_workers("promote", store, "race", root / "go", [["1", "3", "5"], ["2", "4", "6"]], env)


def check_promotion_chain(
    results: list[list[dict]], initial: str | None, production: str, previous: str | None
) -> None:
    """Serialized promotions form one chain: each one's `previous` is the version the one before it promoted."""
    steps = [r for rs in results for r in rs]
    after = {}
    for s in steps:
        assert s["previous"] not in after, f"two promotions both replaced v{s['previous']}: they interleaved ({steps})"
        after[s["previous"]] = s["version"]
    chain, cur = [], initial
    while cur in after:
        cur = after[cur]
        chain.append(cur)
    assert len(chain) == len(steps), f"promotions do not form one chain: {steps}"
    assert chain[-1] == production and (chain[-2] if len(chain) > 1 else initial) == previous


def test_parallel_registrations_and_promotions_on_the_embedded_store(gated, w8_art, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ok, _ = gated
    store = tmp_path / "mlflow"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    results = race(str(store), ok, w8_art, tmp_path, env)
    client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}", f"sqlite:///{store / 'mlflow.db'}")
    assert len(client.search_model_versions("name='race'")) == 6
    aliases = client.get_registered_model("race").aliases
    check_promotion_chain(results, None, str(aliases["production"]), str(aliases.get("previous-production")))


def test_a_lease_whose_create_answer_was_lost_is_still_held_by_its_creator():
    """A tracking server racing another job's release can store the lease model and still answer the create with an
    error: the lease is decided by the holder id it stores, so its creator proceeds (instead of waiting on itself),
    and releases it after."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

    from qgate.registry.lease import server_lease

    class Flaky:
        def __init__(self):
            self.models, self.calls = {}, 0

        def create_registered_model(self, name, description=None, tags=None):
            self.calls += 1
            self.models[name] = description
            if self.calls == 1:
                raise MlflowException("Registered Model not found", error_code=RESOURCE_DOES_NOT_EXIST)

        def get_registered_model(self, name):
            if name not in self.models:
                raise MlflowException("not found", error_code=RESOURCE_DOES_NOT_EXIST)
            return type("M", (), {"description": self.models[name]})()

        def delete_registered_model(self, name):
            del self.models[name]

    client = Flaky()
    with server_lease(client, "m", wait=2.0) as lease:
        assert json.loads(client.models["qgate-lease.m"])["id"] == lease.info["id"] and client.calls == 1
    assert client.models == {}


class _Registry:
    """Registered models as a tracking server keeps them (create is unique by name), shared by threads."""

    def __init__(self):
        import threading

        self.models, self.lock = {}, threading.Lock()

    def _missing(self, name):
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

        return MlflowException(f"{name} not found", error_code=RESOURCE_DOES_NOT_EXIST)

    def create_registered_model(self, name, description=None, tags=None):
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS

        with self.lock:
            if name in self.models:
                raise MlflowException(f"{name} exists", error_code=RESOURCE_ALREADY_EXISTS)
            self.models[name] = description

    def get_registered_model(self, name):
        with self.lock:
            if name not in self.models:
                raise self._missing(name)
            return type("M", (), {"description": self.models[name]})()

    def update_registered_model(self, name, description=None):
        with self.lock:
            if name not in self.models:
                raise self._missing(name)
            self.models[name] = description

    def delete_registered_model(self, name):
        with self.lock:
            if self.models.pop(name, None) is None:
                raise self._missing(name)


def test_a_heartbeat_keeps_a_live_lease_and_a_stalled_holder_stops_before_writing():
    """With a 0.3 s TTL: a holder that keeps beating keeps the lease for 3 TTLs against another job; one whose
    heartbeat stopped (a process paused past the TTL) is taken over, its next check names the taker, and its exit
    leaves the taker's lease alone."""
    import time

    from qgate.errors import RegistryError
    from qgate.registry.lease import server_lease

    reg, ttl = _Registry(), 0.3
    with server_lease(reg, "m", wait=1.0, ttl=ttl) as held:
        time.sleep(3 * ttl)
        with pytest.raises(RegistryError, match=r"is held by pid \d+"), server_lease(reg, "m", wait=2 * ttl, ttl=ttl):
            pass
        held.check("a write")
        assert held.lost is None and json.loads(reg.models["qgate-lease.m"])["t"] > time.time() - ttl
    assert reg.models == {}

    stalled_cm = server_lease(reg, "m", wait=1.0, ttl=ttl)
    stalled = stalled_cm.__enter__()
    stalled.stop()  # its heartbeat stops, as in a process paused past the TTL
    time.sleep(1.5 * ttl)
    taker_cm = server_lease(reg, "m", wait=2.0, ttl=ttl)
    taker = taker_cm.__enter__()
    with pytest.raises(RegistryError, match=r"taken over by pid \d+ on .*; stopped before moving @production"):
        stalled.check("moving @production")
    stalled_cm.__exit__(None, None, None)
    taker.check("a write")  # the stalled job's exit did not release the taker's lease
    time.sleep(2 * ttl)
    taker.check("a later write")  # and the taker's own heartbeat keeps it
    taker_cm.__exit__(None, None, None)
    assert reg.models == {}
