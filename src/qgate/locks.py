"""One job at a time per key, with a lock that a crash cannot leave stuck.

    with job_lock(Path(".qgate/locks/drift-smollm2.lock"), "drift run for smollm2", echo=print):
        ...   # LockHeld (exit 1) if a live process holds it

The lock is an OS file lock (filelock: flock on POSIX), which the kernel releases when its holder dies, even by
SIGKILL. Beside it, `<lock>.owner.json` names the holder (pid, host, start time), so a refused job can say who
holds the lock, and a job that finds the owner file of a holder that is gone reports the stale lock it took over.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from qgate.errors import LockHeld


def _owner(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _who(o: dict | None) -> str:
    if not o:
        return "an unknown process"
    return f"{o.get('what', 'a qgate job')}: pid {o.get('pid')} on {o.get('host')} since {o.get('started')}"


@contextmanager
def job_lock(path: Path, what: str, wait: float = 0.0, echo: Callable[[str], None] = print) -> Iterator[dict]:
    """Hold the lock at `path` for `what` (wait up to `wait` seconds). Yields this holder's owner record."""
    from filelock import FileLock, Timeout

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    owner_file = path.with_name(path.name + ".owner.json")
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=wait)
    except Timeout:
        raise LockHeld(
            f"cannot start {what}: the lock is held ({_who(_owner(owner_file))}); lock {path}",
            hint="wait for it to finish; the lock is released when that process exits, even if it is killed",
        ) from None
    try:
        stale = _owner(owner_file)
        if stale is not None:  # the previous holder exited without its cleanup: killed or crashed
            echo(f"  ! took over a stale lock for {what}: its holder ({_who(stale)}) is gone")
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
            "what": what,
            "stale_taken_over": stale,
            "t": time.time(),
        }
        tmp = owner_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(me))
        tmp.replace(owner_file)
        yield me
    finally:  # a job that ends with an error ends cleanly too: only a killed holder leaves its owner file behind
        owner_file.unlink(missing_ok=True)
        lock.release()


def workdir_lock(workdir: Path, what: str, wait: float = 0.0, echo: Callable[[str], None] = print):
    """The lock every job that writes a pipeline workdir holds (its ledger, caches and stage outputs): `qgate run`
    and the drift jobs. A second job on the same workdir waits up to `wait` seconds, then exits with LockHeld."""
    return job_lock(Path(workdir) / "locks" / "workdir.lock", what, wait=wait, echo=echo)
