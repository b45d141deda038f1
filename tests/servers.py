"""Real servers on localhost for tests: an MLflow tracking server (optionally with basic auth)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

ADMIN = ("admin", "admin-pass-1234")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(root: Path, auth: bool = False, db: Path | None = None):
    """An `mlflow server` with its own SQLite store (or the store `db`) and proxied artifacts under root; yields its
    URL."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no Huey job consumers: qgate runs no server-side jobs
    app = []
    if auth:
        ini = root / "auth.ini"
        ini.write_text(
            f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{root / 'auth.db'}\n"
            f"admin_username = {ADMIN[0]}\nadmin_password = {ADMIN[1]}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
            # MLflow's own credential cache: one scrypt check per (user, password) and worker, not one per request
            "auth_cache_ttl_seconds = 600\n"
        )
        env |= {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_FLASK_SERVER_SECRET_KEY": "qgate-test-secret"}
        app = ["--app-name", "basic-auth"]
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = open(root / "server.log", "w")  # noqa: SIM115 - open for the server's lifetime
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", *app, "--host", "127.0.0.1", "--port", str(port)]
        + [
            "--backend-store-uri",
            f"sqlite:///{db or root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
        ]
        + ["--workers", "1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                if requests.get(f"{url}/health", timeout=1).ok:
                    break
            except (requests.ConnectionError, requests.Timeout):  # not listening yet, or slow while starting
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@contextlib.contextmanager
def s3_server(bucket: str = "traffic"):
    """A real S3-compatible server (moto in server mode) on localhost with one bucket, set in the standard AWS
    variables for the duration; yields (endpoint URL, bucket)."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket=bucket)
        yield env["AWS_ENDPOINT_URL"], bucket
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        server.stop()
