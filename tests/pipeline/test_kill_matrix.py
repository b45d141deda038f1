"""SIGKILL at many points of a whole job: `qgate run` and `qgate drift run`, each a real process the test kills.

A point is a line the job prints (a stage starting, a stage or a registration finished) and a delay after it, so
kills land inside stages, inside registration and inside promotion. After each kill the registry holds no duplicate
version and no alias on a version whose gate did not pass, and `production` is where it was or where the completed
job puts it. Then the same command runs to the end: its stage outputs are byte-identical to an uninterrupted run's
(gate reports: identical checks; their timings differ by nature), the registry holds the same versions and aliases
and nothing else. The per-point outcomes are printed as a table.

`qgate run` points after the first stages start from a copy of an uninterrupted run's workdir with the stages from
the point's stage on taken out of its ledger and deleted, and a fresh store, so each point costs what is left of the
job. Every `qgate drift run` point starts from a copy of the deployed state.

    pytest -m slow tests/test_kill_matrix.py -s
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tiny
from specs import SHIFT, STRICT, W8, drift_spec, mlflow_client
from test_crash import _content

from qgate.artifact import Artifact

QGATE = [str(Path(sys.executable).parent / "qgate")]
MODEL = "tiny-llm"
AWQ_ENGINE = {
    "name": "awq-cpu",
    "scheme": "awq-w4a16",
    "options": {"group_size": 32},
    "engine": {"backend": "cpu", "options": {"accuracy_level": 1}},
}

# (the line that arms the kill, seconds after it; None: the process start), in the job's order
RUN_POINTS = [
    (None, 3.0),
    ("> calibrate", 0.3),
    ("> baseline references", 1.0),
    ("> quantize:awq-cpu", 2.0),
    ("> engine:awq-cpu", 1.0),
    ("> gate:awq-cpu", 2.0),
    ("> quantize:w8", 0.5),
    ("> gate:w8", 0.3),
    ("+ gate:w8", 0.5),  # registering the first variant
    ("+ register:awq-cpu", 0.2),  # registering the second
    ("+ register:w8", 0.05),  # promoting
    ("+ register:w8", 0.5),
]
DRIFT_POINTS = [  # the tiny drift run takes ~9 s: ~0.2 s registering after its gate, ~0.06 s promoting
    (None, 1.5),
    ("production:", 0.1),
    ("> calibrate", 0.3),
    ("> quality", 1.5),
    ("drift check: DRIFT", 0.1),
    ("> quantize:w8", 0.2),
    ("> gate:w8", 0.3),
    ("> gate:w8", 0.7),
    ("+ gate:w8", 0.05),  # registering the recalibrated variant
    ("+ gate:w8", 0.12),
    ("+ register:w8", 0.02),  # promoting
    ("+ register:w8", 0.04),
]


def _job(cmd: list[str], cwd: Path, trigger: str | None = None, delay: float = 0.0) -> dict:
    """Run `qgate cmd`; with a delay, SIGKILL it `delay` s after a stderr line containing `trigger` (None: after the
    start). Returns the exit code, the lines printed and the last one before the kill."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    p = subprocess.Popen(
        QGATE + cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, bufsize=1
    )
    lines: list[str] = []
    fired = threading.Event()

    def kill_later():
        time.sleep(delay)
        fired.set()
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)

    armed = delay > 0 and trigger is None
    if armed:
        threading.Thread(target=kill_later, daemon=True).start()
    last = None
    for line in p.stderr:
        lines.append(line.rstrip())
        if fired.is_set() and last is None:
            last = lines[-2] if len(lines) > 1 else ""
        if not armed and delay > 0 and trigger in line:
            armed = True
            threading.Thread(target=kill_later, daemon=True).start()
    p.wait(timeout=1200)
    killed = p.returncode == -signal.SIGKILL
    if killed and last is None:
        last = lines[-1] if lines else ""
    return {"rc": p.returncode, "lines": lines, "killed": killed, "last": (last or "").strip()}


def _registry(root: Path) -> dict:
    """Versions by (variant, candidate sha256), aliases by variant; asserts no duplicate, no alias on a failed gate,
    and no run or logged model that no version uses."""
    if not (root / "mlflow" / "mlflow.db").exists():
        return {"versions": [], "aliases": {}}
    c = mlflow_client(root)
    try:
        versions = c.search_model_versions(f"name = '{MODEL}'")
    except Exception:  # noqa: BLE001 - no registered model yet
        versions = []
    keys = [
        (mv.tags.get("qgate.variant"), mv.tags.get("qgate.artifact_sha256"), mv.tags.get("qgate.calibration_sha256"))
        for mv in versions
    ]
    assert len(keys) == len(set(keys)), f"duplicate versions: {sorted(keys)}"
    by_version = {mv.version: mv for mv in versions}
    aliases = {}
    if versions:
        for alias, v in c.get_registered_model(MODEL).aliases.items():
            assert by_version[v].tags.get("qgate.gate_passed") == "true", f"@{alias} on v{v}, whose gate did not pass"
            aliases[alias] = (
                by_version[v].tags.get("qgate.variant"),
                by_version[v].tags.get("qgate.calibration_sha256"),
            )
    return {"versions": sorted(k[:2] for k in keys), "aliases": aliases}


def _orphans(root: Path) -> int:
    c = mlflow_client(root)
    exp = c.get_experiment_by_name("qgate")
    versions = c.search_model_versions(f"name = '{MODEL}'")
    runs = c.search_runs([exp.experiment_id], filter_string="tags.`qgate.gate_report_sha256` != ''")
    models = c.search_logged_models([exp.experiment_id])
    return len(runs) + len(models) - 2 * len(versions)


def _outputs(workdir: Path) -> dict:
    """Every stage's output by its ledger (the job's, a drift run's) and name: sha256 for artifacts, the checks for
    gate reports."""
    out = {}
    for ledger_path in sorted(workdir.rglob("stages.json")):
        where = ledger_path.parent
        for name, rec in json.loads(ledger_path.read_text()).items():
            if isinstance(rec, dict) and rec.get("paths") and not name.startswith("register:"):
                path = Path(rec["paths"][0])
                out[f"{where.relative_to(workdir)}/{name}"] = _output(path if path.is_absolute() else where / path)
    return out


def _output(path: Path):
    art = Artifact.load(path)
    art.verify()
    return _content("gate", path) if art.kind == "gate-report" else art.sha256  # a gate report: its checks


def _rewind(src: Path, dst: Path, workdir: str, stage: str | None) -> None:
    """dst: a copy of the finished job in src, its store removed, and the ledger entries (and outputs) of `stage` and
    every stage after it removed, so that a run starts at `stage` (None: at registration)."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "mlflow", ignore_errors=True)
    w = dst / workdir
    ledger = json.loads((w / "stages.json").read_text())
    names = [n for n in ledger if not n.startswith("register:")]
    cut = names.index(stage) if stage in names else len(names)
    for n in list(ledger):
        if n.startswith("register:") or (n in names and names.index(n) >= cut):
            for p in ledger[n].get("paths") or []:
                p = Path(p)
                shutil.rmtree(p if p.is_absolute() else w / p, ignore_errors=True)
            del ledger[n]
    (w / "stages.json").write_text(json.dumps(ledger, indent=1))
    (w / "summary.json").unlink(missing_ok=True)


def _stage_of(trigger: str | None, names: list[str]) -> str | None | bool:
    """The ledger stage a point's trigger starts (False: the job must start from nothing; None: registration)."""
    if trigger is None or trigger.startswith(("> calibrate", "> baseline")):
        return False
    if trigger.startswith("+ "):
        return None
    stage = trigger[2:]
    return stage if stage in names else False


def _matrix(
    label: str, ref_root: Path, fresh, cmd: list[str], points, tmp_path: Path, workdir: str, rewind: bool
) -> list[dict]:
    ref_out, ref_reg = _outputs(ref_root / workdir), _registry(ref_root)
    names = [n for n in json.loads((ref_root / workdir / "stages.json").read_text()) if not n.startswith("register:")]
    rows = []
    for i, (trigger, delay) in enumerate(points):
        root = tmp_path / f"{label}-{i}"
        stage = _stage_of(trigger, names) if rewind else False
        if stage is False:
            fresh(root)
        else:
            _rewind(ref_root, root, workdir, stage)
        before = _registry(root)
        t = time.perf_counter()
        killed = _job(cmd, root, trigger, delay)
        after = _registry(root)  # asserts no duplicate and no alias on a failed version
        prod = after["aliases"].get("production")
        assert prod in (before["aliases"].get("production"), ref_reg["aliases"].get("production")), prod
        rerun = _job(cmd, root)
        assert rerun["rc"] == 0, "\n".join(rerun["lines"][-30:])
        final = _registry(root)
        assert final == ref_reg, f"point {i}: registry {final} != {ref_reg}"
        assert _outputs(root / workdir) == ref_out, f"point {i}: outputs differ from the uninterrupted run's"
        assert _orphans(root) == 0
        rows.append(
            {
                "point": f"{trigger or 'start'} +{delay}s",
                "killed": "yes" if killed["killed"] else f"no (exit {killed['rc']})",
                "last line before the kill": killed["last"][:60],
                "versions after kill": len(after["versions"]),
                "production after kill": f"{prod[0]} (calibration {prod[1][:8]})" if prod else "-",
                "re-run": f"exit 0, same ({time.perf_counter() - t:.0f}s)",
            }
        )
    print(f"\n{label}: {len(rows)} kill points, {sum(r['killed'] == 'yes' for r in rows)} killed mid-job")
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    return rows


@pytest.mark.slow
def test_qgate_run_killed_at_points_through_stages_registration_and_promotion(tmp_path, workdir):
    src = workdir / "tiny-src"
    if not src.exists():
        tiny.make_model(src)

    def fresh(root: Path) -> None:
        root.mkdir(parents=True)
        tiny.make_traffic(root / "traffic.jsonl", n=300, seed=0)
        drift_spec(root, src, [AWQ_ENGINE, W8], STRICT)

    ref = tmp_path / "ref"
    fresh(ref)
    assert _job(["run", "spec.yaml"], ref)["rc"] == 0
    assert _registry(ref)["aliases"]["production"][0] == "w8"
    rows = _matrix("qgate run", ref, fresh, ["run", "spec.yaml"], RUN_POINTS, tmp_path, "work", rewind=True)
    assert sum(r["killed"] == "yes" for r in rows) >= 10


@pytest.mark.slow
def test_qgate_drift_run_killed_at_points_through_stages_registration_and_promotion(tmp_path, workdir):
    src = workdir / "tiny-src"
    if not src.exists():
        tiny.make_model(src)
    deployed = tmp_path / "deployed"
    deployed.mkdir()
    tiny.make_traffic(deployed / "traffic.jsonl", n=300, seed=0)
    tiny.make_traffic(deployed / "shifted.jsonl", n=300, seed=12, **SHIFT)
    drift_spec(deployed, src, [W8], STRICT, {"auto_promote": True})
    assert _job(["run", "spec.yaml"], deployed)["rc"] == 0

    def fresh(root: Path) -> None:
        shutil.copytree(deployed, root)

    cmd = ["drift", "run", "--spec", "spec.yaml", "--traffic", "shifted.jsonl"]
    ref = tmp_path / "ref"
    fresh(ref)
    assert _job(cmd, ref)["rc"] == 0
    reg = _registry(ref)
    assert len(reg["versions"]) == 2 and reg["aliases"]["production"] != reg["aliases"]["previous-production"]
    rows = _matrix("qgate drift run", ref, fresh, cmd, DRIFT_POINTS, tmp_path, "work", rewind=False)
    assert sum(r["killed"] == "yes" for r in rows) >= 10
