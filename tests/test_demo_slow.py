"""The README's demo on the real model, in a scratch workdir: `pytest -m slow` (about 10 minutes on 2 cores)."""
import json
from pathlib import Path

import pytest
import yaml

from qgate.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_pipeline_promotes_w8_and_rejects_w4(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = yaml.safe_load((ROOT / "pipelines/promote.yaml").read_text())
    spec |= {"workdir": str(tmp_path / "demo"), "traffic": str(ROOT / "data/demo/traffic.jsonl"),
             "registry": spec["registry"] | {"store": str(tmp_path / "mlflow")}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert main(["run", str(tmp_path / "spec.yaml")]) == 0
    summary = json.loads((tmp_path / "demo/summary.json").read_text())
    by = {v["variant"]: v for v in summary["variants"]}
    assert summary["promoted"]["variant"] == "gptq-w8a16"
    assert by["gptq-w8a16"]["kl_p99"] < 0.05 and by["gptq-w8a16"]["top1_agreement"] > 0.95
    assert not by["awq-w4a16-cpu"]["passed"] and by["awq-w4a16-cpu"]["kl_p99"] > 0.5
