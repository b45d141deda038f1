"""Crash safety: each stage runs as `qgate ...` in a subprocess, is killed with SIGKILL at seeded random moments, and is
re-run. After every kill, the output directory is either absent or a complete artifact (never half-written); after
every re-run, the output is byte-identical to an uninterrupted run (a gate report: the same checks, verdicts and
counts, and values equal to float32 reproducibility, see `_same`), no temporary directory is left, and the registry
holds exactly one complete version.

The default run tries 2 kill points per stage; `QGATE_KILL_POINTS=10 pytest tests/test_crash.py` tries 10 (about 15
min).
"""

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from qgate.artifact import UNHASHED, Artifact, sha256_file

QGATE = [str(Path(sys.executable).parent / "qgate")]
STAGES = ("calibrate", "quantize", "engine", "gate", "register")


def _gate_spec(root: Path, base: Path) -> Path:
    spec = {
        "version": 1,
        "name": "crash",
        "workdir": "w",
        "model": {"hf_dir": str(base)},
        "traffic": "t.jsonl",
        "variants": [{"name": "w8", "scheme": "gptq-w8a16", "options": {"group_size": 32}}],
        "gates": {
            "shadow": {
                "max_new_tokens": 8,
                "max_prompt_tokens": 48,
                "kl_p99_max": None,
                "kl_mean_max": 10.0,
                "top1_agreement_min": None,
            },
            "eval": {
                "tasks": ["bigbench_general_knowledge"],
                "limit": 8,
                "min_recovery": None,
                "max_bpb_increase": None,
            },
        },
        "registry": {"model_name": "crash", "store": "mlflow"},
    }
    path = root / "gate-spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _command(stage: str, root: Path, out: Path, arts: dict) -> list[str]:
    if stage == "calibrate":
        return [
            "calibrate",
            "sample",
            "--traffic",
            str(arts["traffic"]),
            "--out",
            str(out),
            "--calib-size",
            "32",
            "--shadow-size",
            "24",
        ]
    if stage == "quantize":
        return [
            "quantize",
            "--model",
            str(arts["base"]),
            "--calib",
            str(arts["calib"]),
            "--scheme",
            "gptq-w8a16",
            "--group-size",
            "32",
            "--max-seq-length",
            "64",
            "--out",
            str(out),
        ]
    if stage == "engine":
        return [
            "engine",
            "build",
            "--backend",
            "cpu",
            "--checkpoint",
            str(arts["awq"]),
            "--accuracy-level",
            "1",
            "--out",
            str(out),
        ]
    if stage == "gate":
        return [
            "gate",
            "--candidate",
            str(arts["w8"]),
            "--baseline",
            str(arts["base"]),
            "--shadow",
            str(arts["shadow"]),
            "--spec",
            str(_gate_spec(root, arts["base"])),
            "--cache",
            str(root / "cache"),
            "--out",
            str(out),
        ]
    return [
        "register",
        "--gate",
        str(arts["gate"]),
        "--candidate",
        str(arts["w8"]),
        "--model",
        "crash",
        "--store",
        str(out),
    ]


def _run(cmd: list[str], kill_after: float | None = None) -> tuple[int, float]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    t = time.perf_counter()
    p = subprocess.Popen(QGATE + cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    if kill_after is None:
        _, err = p.communicate(timeout=600)
        assert p.returncode in (0, 2), err[-3000:]
        return p.returncode, time.perf_counter() - t
    try:
        p.wait(timeout=kill_after)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGKILL)
    p.wait()
    return p.returncode, time.perf_counter() - t


def _content(stage: str, out: Path) -> object:
    """What must be identical between an uninterrupted run and a killed-then-re-run one."""
    if stage == "register":
        return _registry(out)
    if stage == "gate":  # a gate report also holds timings and cache hits, which differ run to run by nature
        report = json.loads((out / "report.json").read_text())
        return [
            {k: r[k] for k in ("gate", "metric", "observed", "ci", "verdict", "n")}
            for r in report["results"]
            if r["gate"] != "perf"
        ]
    return {
        f.relative_to(out).as_posix(): sha256_file(f)
        for f in sorted(out.rglob("*"))
        if f.is_file() and f.name not in UNHASHED
    }  # every file but qgate's own manifests and build logs


NUMERIC_TOLERANCE = {"rel_tol": 1e-3, "abs_tol": 1e-6}


def _same(got: object, want: object) -> bool:
    """Equal, except that floats may differ by float32 reproducibility: a gate's values come from float32 CPU
    forwards, whose last bits are not guaranteed to repeat from one process to the next. 1e-6 nats is four orders of
    magnitude under any KL or NLL threshold; one flipped top-1 in a shadow set, or a changed verdict or count, still
    fails."""
    if isinstance(got, float) and isinstance(want, float):
        return math.isclose(got, want, **NUMERIC_TOLERANCE)
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in got)
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want, strict=True))
    return got == want


def test_same_allows_float32_noise_and_nothing_more():
    row = {"gate": "shadow", "metric": "kl_mean", "observed": 1.907556e-05, "ci": [1.5213e-05, 2.3415e-05], "n": 192}
    noisy = row | {"observed": 1.906307e-05, "ci": [1.5201e-05, 2.3404e-05]}  # a re-run's last bits
    assert _same([noisy], [row])
    assert not _same([row | {"observed": 1.907556e-05 + 2e-6}], [row])  # a real change in the KL
    agree = {"metric": "top1_agreement", "observed": 191 / 192, "verdict": "pass", "n": 192}
    assert not _same([agree | {"observed": 190 / 192}], [agree])  # one flipped top-1
    assert not _same([agree | {"verdict": "fail"}], [agree])
    assert not _same([agree | {"n": 191}], [agree])
    assert not _same([agree, agree], [agree])


def _registry(store: Path) -> dict:
    from mlflow import MlflowClient

    uri = f"sqlite:///{store / 'mlflow.db'}"
    client = MlflowClient(uri, uri)
    versions = client.search_model_versions("name = 'crash'")
    exp = client.get_experiment_by_name("qgate")
    models = client.search_logged_models([exp.experiment_id])
    runs = client.search_runs([exp.experiment_id])
    assert len(versions) == 1, f"{len(versions)} versions: a duplicate or a lost registration"
    mv = versions[0]
    assert mv.description and mv.tags.get("qgate.gate_report_sha256") and mv.tags.get("qgate.artifact_sha256")
    assert [m.model_id for m in models] == [mv.tags["qgate.model_id"]], (
        "a logged model without a version was left behind"
    )
    assert len(runs) == 1, "a run without a version was left behind"
    return {k: v for k, v in mv.tags.items() if k not in ("qgate.model_id", "qgate.gate_report_artifact")}


def _check_after_kill(stage: str, out: Path) -> str:
    if stage == "register" or not out.exists():
        return "absent" if not out.exists() else "registry"
    manifests = list(out.rglob("qgate-artifact.json"))
    assert manifests, f"{out} exists without an artifact: half-written"
    for m in manifests:
        Artifact.load(m.parent).verify()  # complete and intact, or it would not be here
    return "complete"


@pytest.fixture(scope="module")
def inputs(base_art, calib_arts, awq_art, w8_art, gated, workdir):
    return {
        "traffic": workdir / "traffic.jsonl",
        "base": base_art.path,
        "calib": calib_arts["calib"].path,
        "shadow": calib_arts["shadow"].path,
        "awq": awq_art.path,
        "w8": w8_art.path,
        "gate": gated[0].path,
    }


@pytest.mark.parametrize("stage", STAGES)
def test_killed_stage_reruns_to_the_same_result(stage, inputs, tmp_path):
    points = int(os.environ.get("QGATE_KILL_POINTS", "2"))
    ref_out = tmp_path / "ref"
    _, duration = _run(_command(stage, tmp_path, ref_out, inputs))
    reference = _content(stage, ref_out)
    rng = random.Random(f"{stage}-kill")
    outcomes = []
    for i in range(points):
        out = tmp_path / f"killed-{i}"
        at = rng.uniform(0.2, 1.0) * duration  # the first ~20% is the interpreter starting
        rc, _ = _run(_command(stage, tmp_path, out, inputs), kill_after=at)
        state = _check_after_kill(stage, out)
        _run(_command(stage, tmp_path, out, inputs))
        assert _same(_content(stage, out), reference), f"kill {i} at {at:.1f}s of {duration:.1f}s: re-run differs"
        leftovers = [p.name for p in out.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
        assert not leftovers, leftovers
        outcomes.append(f"{at:.1f}s:{'killed' if rc == -signal.SIGKILL else 'finished'}:{state}")
    print(f"\n{stage}: {duration:.1f}s uninterrupted; kills {outcomes}")


def test_a_full_disk_fails_in_one_line_and_leaves_nothing_half_written(tmp_path, monkeypatch, capsys):
    """The disk fills while `qgate calibrate sample` writes its shadow set (ENOSPC after part of a file went out):
    one line on stderr names the output, what it had written and what is free; no temporary directory and no output
    are left; the next run, with space, finishes."""
    import errno

    import tiny

    from qgate.cli.main import main

    traffic = tiny.make_traffic(tmp_path / "t.jsonl")
    out = tmp_path / "calib"
    argv = ["calibrate", "sample", "--traffic", str(traffic), "--out", str(out), "--calib-size", "32"]
    real = Path.write_text

    def fills_up(self, data, *a, **k):
        if self.name == "data.jsonl" and self.parent.name == "shadow":
            with open(self, "w") as f:
                f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, data, *a, **k)

    monkeypatch.setattr(Path, "write_text", fills_up)
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if line.startswith("error:")]  # beside the progress lines
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0] and "Traceback" not in err
    line = errors[0]
    assert str(out) in line and "disk filled after" in line and "free there now" in line and "needs more than" in line
    assert not out.exists() and not list(tmp_path.glob(".calib.*"))
    monkeypatch.setattr(Path, "write_text", real)
    assert main(argv) == 0
    assert Artifact.load(out / "shadow").kind and not list(tmp_path.glob(".calib.*"))


def test_a_full_disk_outside_a_stage_output_names_the_file():
    import errno

    from qgate.cli.main import _message

    msg, code = _message(OSError(errno.ENOSPC, "No space left on device", "/tmp/cache/x.npz"))
    assert code == 1 and msg.startswith("error: no space left on the device holding /tmp/cache/x.npz")
    assert "\n" not in msg and "free" in msg
