"""One registry writer at a time per model, for writes that read before they write (register, promote, rollback).

    with registry_lock(client, store, "smollm2"):
        previous = production(); set previous-production; set production

Promotion reads `production`, then moves `previous-production` and `production`: two promotions interleaving would
leave `previous-production` pointing at the wrong version, and registration checks for an existing version before it
creates one. So each takes a lock:
- embedded SQLite store: an OS file lock beside the database (the kernel releases it if the holder is killed);
- remote tracking server: a lease kept in the server itself. MLflow has no compare-and-set on aliases, but creating a
  registered model is atomic and unique by name, so `qgate-lease.<model>` exists while a qgate process holds the lease.
  Its description names the holder and the time of its last heartbeat: a thread of the holder rewrites it every
  ttl/3, so a job that holds the lease for longer than `ttl` keeps it, and a lease not renewed for `ttl` (its holder
  died, or was paused) is taken over. The holder checks that the lease is still its own before each write
  (`Lease.check`) and stops, naming the job that took it, when it is not. Without compare-and-set a takeover can still
  land between a check and the write after it; the heartbeat makes a takeover of a live job need a pause of `ttl`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from qgate.errors import RegistryError

LEASE_PREFIX = "qgate-lease."
LEASE_TTL = 900.0  # seconds: a promotion downloads and hashes the model, so allow minutes, not hours
WAIT = 600.0


class Lease:
    """A registry lease held by this process: `check(what)` before each write it guards."""

    def __init__(self, client=None, name: str = "", info: dict | None = None, ttl: float = LEASE_TTL):
        self.client, self.name, self.info, self.ttl = client, name, info or {}, ttl
        self.lost: dict | None = None  # the holder found by the heartbeat once the lease is not this job's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self, what: str) -> None:
        """RegistryError if another job holds the lease now (a file lock cannot be taken over: nothing to check)."""
        if self.client is None:
            return
        holder = _current(self.client, self.name)  # a server that cannot answer raises: it is not a takeover
        if (holder or {}).get("id") != self.info["id"]:
            raise RegistryError(
                f"registry lease {self.name!r} was taken over by {_who(holder)} while this job held it; "
                f"stopped before {what}",
                hint=f"a lease not renewed for {self.ttl:.0f}s is taken over (this process was paused or starved): "
                "see `qgate status`, then re-run this job; what it wrote before is complete and is reused",
            )

    def start(self) -> None:
        if self.client is not None:
            self._thread = threading.Thread(target=self._beat, name=f"heartbeat {self.name}", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _beat(self) -> None:
        """Every ttl/3: renew the lease's time while it is still this job's; stop for good once it is not."""
        while not self._stop.wait(self.ttl / 3):
            try:
                holder = _current(self.client, self.name)
                if (holder or {}).get("id") != self.info["id"]:
                    self.lost = holder or {}
                    return
                renewed = self.info | {"t": time.time()}
                self.client.update_registered_model(self.name, description=json.dumps(renewed))
                self.info = renewed
            except Exception:  # noqa: BLE001 - a beat the server missed (after its client's retries) is tried again
                continue


@contextlib.contextmanager
def _file_lock(path: Path, wait: float) -> Iterator[Lease]:
    from filelock import FileLock

    with FileLock(str(path), timeout=wait):
        yield Lease()


def registry_lock(client, store: Path, model_name: str, wait: float = WAIT):
    """A context manager holding the model's registry lock; it yields the Lease to check before each write.
    store: the embedded store's directory, which holds the lock file (a tracking server holds a lease instead)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return server_lease(client, model_name, wait=wait)
    where = Path(store).resolve() / "locks"
    where.mkdir(parents=True, exist_ok=True)
    return _file_lock(where / "registry.lock", wait)


@contextlib.contextmanager
def server_lease(client, model_name: str, wait: float = WAIT, ttl: float = LEASE_TTL) -> Iterator[Lease]:
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
            with contextlib.suppress(MlflowException):  # not renewed for ttl: its holder died or stalled
                client.delete_registered_model(name)
            continue
        if time.monotonic() > deadline:
            raise RegistryError(
                f"registry lease {name!r} is held by {_who(holder)} for more than {wait:.0f}s",
                hint=f"if no qgate job is running, delete the registered model {name!r}; "
                f"it also expires {ttl:.0f}s after its holder's last heartbeat",
            )
        time.sleep(0.2 + random.random() * 0.3)
    lease = Lease(client, name, me, ttl)
    lease.start()
    try:
        yield lease
    finally:
        lease.stop()
        with contextlib.suppress(MlflowException):
            if (_holder(client, name) or {}).get("id") == lease.info["id"]:
                client.delete_registered_model(name)


def _who(holder: dict | None) -> str:
    if not holder:
        return "another process"
    return f"pid {holder.get('pid')} on {holder.get('host')} (lease {str(holder.get('id'))[:8]})"


def _current(client, name: str) -> dict | None:
    """The lease's holder as stored; None when there is no lease or its description is not one qgate wrote. A server
    error other than that propagates."""
    from mlflow.exceptions import MlflowException

    try:
        return json.loads(client.get_registered_model(name).description or "{}")
    except ValueError:
        return None
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def _holder(client, name: str) -> dict | None:
    """_current, with any server error read as no holder (while acquiring and releasing, which retry or give up)."""
    from mlflow.exceptions import MlflowException

    try:
        return _current(client, name)
    except MlflowException:
        return None
