"""A workdir's stage ledger: run a stage unless the same key already built an artifact that is still intact.

    led = Ledger(Path(".qgate/demo"))
    art = led.run("model", {"src": fingerprint}, led.workdir / "base", lambda out: import_model(src, out))

stages.json maps each stage name to the key it ran with, what it produced, and how long it took. Nothing in it is
trusted on its word: an entry is used only if its paths stay inside the workdir and the artifact there still hashes to
the recorded sha256. Anything else is reported and the stage runs again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from qgate.artifact import MANIFEST, Artifact, build_atomically, sha256_json, sha256_tree


class Ledger:
    """persist=False: entries are kept in memory only (`recorded`), for a Ray task whose driver writes them: one
    writer per ledger file."""

    def __init__(self, workdir: Path, echo: Callable[[str], None] = print, persist: bool = True):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.path = self.workdir / "stages.json"
        self.echo = echo
        self.persist = persist
        self.recorded: list[tuple[str, str, dict]] = []
        self.ran: list[str] = []
        self.skipped: list[str] = []
        self.data = {}
        if self.path.exists():
            try:
                self.data = json.loads(self.path.read_text())
                if not isinstance(self.data, dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:
                echo(f"  ! {self.path} is unreadable ({e}): every stage runs again")
                self.data = {}

    def lookup(self, name: str, key: str) -> dict | None:
        """The entry `name` recorded under `key`, with absolute paths, if its artifact is still intact."""
        rec = self.data.get(name)
        if not isinstance(rec, dict) or rec.get("key") != key or not rec.get("paths"):
            return None
        root = self.workdir.resolve()
        paths = [(self.workdir / p).resolve() for p in rec["paths"]]  # relative: the workdir can move
        if any(not p.is_relative_to(root) for p in paths):
            self.echo(f"  ! {name}: ledger entry points outside the workdir ({rec['paths']}); running the stage again")
            return None
        if not all(Path(p, MANIFEST).exists() for p in paths) or "sha256" not in rec:
            return None
        actual = sha256_tree(paths[0])
        if actual != rec.get("sha256"):
            self.echo(
                f"  ! {name}: {paths[0]} changed since it was built (sha256 {actual[:12]} != recorded "
                f"{str(rec.get('sha256'))[:12]}); running the stage again"
            )
            return None
        return rec | {"paths": [str(p) for p in paths]}

    def record(self, name: str, key: str, **values) -> None:
        if "paths" in values:
            values["paths"] = [
                os.path.relpath(p, self.workdir) if Path(p).is_relative_to(self.workdir) else str(p)
                for p in values["paths"]
            ]
        self.data[name] = {"key": key, **values}
        self.recorded.append((name, key, values))
        if not self.persist:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.path)

    def merge(self, recorded: list[tuple[str, str, dict]], ran: list[str], skipped: list[str]) -> None:
        """Record what another process's ledger on this workdir ran and recorded (a Ray task's)."""
        for name, key, values in recorded:
            self.record(name, key, **values)
        self.ran += ran
        self.skipped += skipped

    def run(self, name: str, key_data: dict, out: Path, fn: Callable[[Path], Artifact]) -> Artifact:
        """Skip if the ledger holds this key and its artifact is intact; else `fn(tmp)` builds the stage's whole output
        in a temporary directory that is renamed to `out` when complete (artifact.build_atomically)."""
        key = sha256_json(key_data)
        rec = self.lookup(name, key)
        if rec:
            art = Artifact.load(Path(rec["paths"][0]))
            if art.sha256 == rec["sha256"]:
                self.skipped.append(name)
                self.echo(f"  = {name}: unchanged, skipped ({art.path})")
                return art
        t = time.perf_counter()
        self.echo(f"  > {name} ...")
        art = build_atomically(out, fn)
        secs = round(time.perf_counter() - t, 1)
        self.record(name, key, paths=[str(art.path)], sha256=art.sha256, seconds=secs)
        self.ran.append(name)
        self.echo(f"  + {name}: done in {secs}s ({art.path})")
        return art

    def seconds(self) -> dict[str, float]:
        """Per stage, the wall time of the run that did the work (kept in the ledger, so a skipping re-run keeps it)."""
        return {k: self.data[k]["seconds"] for k in self.ran + self.skipped if "seconds" in self.data.get(k, {})}
