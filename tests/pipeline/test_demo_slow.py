"""The README's demo on the real model, in a scratch workdir: `pytest -m slow` (about 55 minutes on 2 cores, cold).

Run as CI runs it: a subprocess without a TTY, so the console contract (one line per stage start and end, progress
at most every 30 s, library output in the log file) is checked on the real job."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_pipeline_rejects_w4_and_promotes_the_smallest_served_passing_variant(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = yaml.safe_load((ROOT / "pipelines/promote.yaml").read_text())
    spec |= {
        "workdir": str(tmp_path / "demo"),
        "traffic": str(ROOT / "data/demo/traffic.jsonl"),
        "registry": spec["registry"] | {"store": str(tmp_path / "mlflow")},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    p = subprocess.run(
        [str(Path(sys.executable).parent / "qgate"), "run", str(tmp_path / "spec.yaml")],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=5400,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    console = p.stdout.splitlines() + p.stderr.splitlines()
    assert len(console) < 200 and "\r" not in p.stderr, f"{len(console)} console lines"  # 65 on 2026-11-22
    assert (tmp_path / "demo/logs/qgate-run.log").stat().st_size > 10_000  # the libraries' output went here
    summary = json.loads((tmp_path / "demo/summary.json").read_text())
    by = {v["variant"]: v for v in summary["variants"]}
    passing = [v for v in summary["variants"] if v["passed"]]
    assert (
        summary["promoted"]["variant"] == min(passing, key=lambda v: v["served_bytes"])["variant"]
    )  # choose: smallest, by what is served
    assert by["gptq-w8a16"]["kl_p99"] < 0.05 and by["gptq-w8a16"]["top1_agreement"] > 0.95
    assert not by["awq-w4a16-cpu"]["passed"] and by["awq-w4a16-cpu"]["kl_p99"] > 0.5
    searched = by["awq-w4a16-searched"]
    # the search found a W4/W8 mix between the uniform variants' checkpoints
    assert by["awq-w4a16-cpu"]["weights_bytes"] < searched["weights_bytes"] < by["gptq-w8a16"]["weights_bytes"]
    assert 4.5 < searched["bits_per_weight"] <= 7.5  # within the spec's size budget
    # its CPU engine serves more: SmolLM2's float32 embedding and, untied from it, a float32 head; W8 is gated on the
    # reference path, so its checkpoint is what is served
    assert searched["served_bytes"] > by["gptq-w8a16"]["served_bytes"] == by["gptq-w8a16"]["weights_bytes"]
    if searched["passed"]:
        assert searched["kl_p99"] < 0.5 and searched["top1_agreement"] > 0.85
