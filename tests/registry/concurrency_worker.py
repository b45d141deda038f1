"""A separate process that registers or promotes into a shared registry, for tests/test_concurrency.py.

    python concurrency_worker.py register STORE MODEL GO_FILE CANDIDATE GATE_REPORT...
    python concurrency_worker.py promote STORE MODEL GO_FILE VERSION...

Waits until GO_FILE exists (so the workers start together), then prints one JSON line per operation.
"""

import json
import sys
import time
from pathlib import Path

from qgate.artifact import Artifact
from qgate.registry.mlflow_store import promote, register

mode, store, model, go, *items = sys.argv[1:]
store = None if store == "-" else Path(store)
cand = Artifact.load(Path(items.pop(0))) if mode == "register" else None
while not Path(go).exists():
    time.sleep(0.01)
for item in items:
    if mode == "register":
        gate = Artifact.load(Path(item))
        print(json.dumps({"gate": item, "version": register(gate, cand, model, store)}), flush=True)
    else:
        info = promote(model, item, store=store)
        print(json.dumps({"version": info["version"], "previous": info["previous"]}), flush=True)
