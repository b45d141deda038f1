"""One registry writer at a time per model, for writes that read before they write (register, promote, rollback).

    with registry_lock(client, store, "smollm2"):
        previous = production(); set previous-production; set production

Promotion reads `production`, then moves `previous-production` and `production`: two promotions interleaving would
leave `previous-production` pointing at the wrong version, and registration checks for an existing version before it
creates one. So each takes a lock:
- embedded SQLite store: an OS file lock beside the database (the kernel releases it if the holder is killed);
- remote tracking server: a lease kept in the server itself. MLflow has no compare-and-set on aliases, but creating a
  registered model is atomic and unique by name, so `qgate-lease.<model>` exists while a qgate process holds the lease.
  Its description names the holder and the time; a lease older than `ttl` (its holder died) is taken over.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from qgate.errors import RegistryError

LEASE_PREFIX = "qgate-lease."
LEASE_TTL = 900.0  # seconds: a promotion downloads and hashes the model, so allow minutes, not hours
WAIT = 600.0


def registry_lock(client, store: Path | None, model_name: str, wait: float = WAIT):
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return server_lease(client, model_name, wait=wait)
    from filelock import FileLock

    from qgate.registry.mlflow_store import DEFAULT_STORE

    where = Path(store or DEFAULT_STORE).resolve() / "locks"
    where.mkdir(parents=True, exist_ok=True)
    return FileLock(str(where / "registry.lock"), timeout=wait)


@contextlib.contextmanager
def server_lease(client, model_name: str, wait: float = WAIT, ttl: float = LEASE_TTL) -> Iterator[dict]:
    from mlflow.exceptions import MlflowException

    name = LEASE_PREFIX + model_name
    me = {"id": uuid.uuid4().hex, "pid": os.getpid(), "host": socket.gethostname(), "t": time.time()}
    deadline = time.monotonic() + wait
    while True:
        me["t"] = time.time()
        try:
            client.create_registered_model(
                name,
                description=json.dumps(me),
                tags={"qgate.lease": f"held by qgate for {model_name}; deleted when released"},
            )
            break
        except MlflowException as e:
            # RESOURCE_DOES_NOT_EXIST: seen from a server whose create raced another job's release of the lease
            if e.error_code not in ("RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST"):
                raise
        holder = _holder(client, name)
        if holder is not None and holder.get("id") == me["id"]:
            break  # the create went through though its answer did not
        if holder is not None and time.time() - float(holder.get("t", 0)) > ttl:
            with contextlib.suppress(MlflowException):  # its holder died: take it over
                client.delete_registered_model(name)
            continue
        if time.monotonic() > deadline:
            raise RegistryError(
                f"registry lease {name!r} is held by {holder or 'another process'} for more than {wait:.0f}s",
                hint=f"if no qgate job is running, delete the registered model {name!r}; "
                f"it also expires {ttl:.0f}s after it was taken",
            )
        time.sleep(0.2 + random.random() * 0.3)
    try:
        yield me
    finally:
        with contextlib.suppress(MlflowException):
            if (_holder(client, name) or {}).get("id") == me["id"]:
                client.delete_registered_model(name)


def _holder(client, name: str) -> dict | None:
    from mlflow.exceptions import MlflowException

    try:
        return json.loads(client.get_registered_model(name).description or "{}")
    except (MlflowException, ValueError):
        return None
