import json
import subprocess
import sys

import pytest
import yaml

import tiny
from qgate.cli.main import main
from qgate.errors import ConfigError
from qgate.pipeline.spec import load_spec


def _spec(tmp_path, workdir, **over):
    src = workdir / "tiny-src"
    if not src.exists():
        tiny.make_model(src)
    tiny.make_traffic(tmp_path / "traffic.jsonl", n=240, bad_lines={5: "{oops"})
    spec = {
        "version": 1, "name": "tiny", "workdir": "work", "model": {"hf_dir": str(src)}, "traffic": "traffic.jsonl",
        "calibrate": {"calib_size": 24, "shadow_size": 16},
        "quantize": {"max_seq_length": 48},
        "variants": [
            {"name": "awq-cpu", "scheme": "awq-w4a16", "options": {"group_size": 32}, "engine": {"backend": "cpu", "options": {"accuracy_level": 1}}},
            {"name": "w8", "scheme": "gptq-w8a16", "options": {"group_size": 32}},
        ],
        "gates": {"shadow": {"max_new_tokens": 8, "max_prompt_tokens": 48, "kl_p99_max": 0.01, "top1_agreement_min": 0.8},
                  "eval": {"tasks": ["bigbench_general_knowledge", "chatterbot_ppl"], "limit": 10, "min_recovery": 0.5,
                           "max_bpb_increase": 0.2}},
        "registry": {"model_name": "tiny-llm", "store": "mlflow"},
    }
    spec.update(over)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_pipeline_end_to_end_promotes_the_passing_variant_and_skips_on_rerun(tmp_path, workdir, monkeypatch, capsys):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = _spec(tmp_path, workdir)
    assert main(["run", str(spec)]) == 0
    summary = json.loads((tmp_path / "work/summary.json").read_text())
    by = {v["variant"]: v for v in summary["variants"]}
    assert by["w8"]["passed"] and not by["awq-cpu"]["passed"]
    assert by["awq-cpu"]["backend"] == "cpu" and "kl_p99" in by["awq-cpu"]["failed_checks"]
    assert summary["promoted"]["variant"] == "w8"
    client = MlflowClient(summary["tracking_uri"])
    assert str(client.get_model_version_by_alias("tiny-llm", "production").version) == by["w8"]["version"]
    assert len(client.search_model_versions("name='tiny-llm'")) == 2
    out = capsys.readouterr()
    assert "promoted w8 as tiny-llm" in out.out and "mlflow ui --backend-store-uri" in out.out
    # second run: nothing changed, every stage is skipped and nothing is registered twice
    assert main(["run", str(spec)]) == 0
    err = capsys.readouterr().err
    assert err.count("unchanged, skipped") == 7 and "already v" in err
    assert len(client.search_model_versions("name='tiny-llm'")) == 2


def test_pipeline_with_no_passing_variant_exits_2(tmp_path, workdir, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = _spec(tmp_path, workdir, variants=[{"name": "w4", "scheme": "gptq-w4a16", "options": {"group_size": 32}}],
                 gates={"shadow": {"max_new_tokens": 4, "max_prompt_tokens": 32, "kl_p99_max": 1e-9}, "eval": None})
    assert main(["run", str(spec)]) == 2
    assert json.loads((tmp_path / "work/summary.json").read_text())["promoted"] is None


@pytest.mark.parametrize("patch, message", [
    ({"variants": [{"name": "a", "scheme": "awq-w4a16", "sheme": "x"}]}, "variants.0.sheme: unknown key"),
    ({"gates": {"shadow": {"kl_p99": 0.1}}}, "gates.shadow.kl_p99: unknown key; did you mean 'kl_p99_max'"),
    ({"variants": [{"name": "a", "scheme": "awq-w4a61"}]}, "variants[0] (a): unknown quantization scheme 'awq-w4a61'"),
    ({"variants": [{"name": "a", "scheme": "awq-w4a16", "options": {"group_size": 48}}]}, "power of two"),
    ({"calibrate": {"calib_size": 1, "extra": 2}}, "calibrate.extra: unknown key"),
])
def test_strict_spec_errors_name_the_key(tmp_path, workdir, patch, message):
    with pytest.raises(ConfigError) as e:
        load_spec(_spec(tmp_path, workdir, **patch))
    assert message in str(e.value)


def test_cli_errors_are_one_line_with_exit_1(tmp_path, workdir, capsys):
    bad = _spec(tmp_path, workdir, surprise=1)
    assert main(["run", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "surprise: unknown key" in err and "Traceback" not in err
    assert main(["calibrate", "sample", "--traffic", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")]) == 1
    assert "traffic log not found" in capsys.readouterr().err
    assert main(["quantize", "--bogus"]) == 1


def test_gate_cli_exit_code_2_on_failure(base_art, awq_art, calib_arts, tmp_path, capsys):
    spec = _spec(tmp_path, base_art.path.parent, gates={"shadow": {"max_new_tokens": 4, "max_prompt_tokens": 32, "kl_p99_max": 1e-9},
                                                        "eval": None})
    rc = main(["gate", "--candidate", str(awq_art.path), "--baseline", str(base_art.path), "--shadow", str(calib_arts["shadow"].path),
               "--out", str(tmp_path / "g"), "--spec", str(spec), "--cache", str(tmp_path / "c")])
    assert rc == 2
    out = capsys.readouterr().out
    assert "FAIL  shadow.kl_p99" in out and "gate FAILED" in out


def test_help_does_not_import_heavy_libraries():
    code = "import sys; from qgate.cli.main import main; main(['--help']); print(sorted(m for m in ('torch','mlflow','transformers','tensorrt_llm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("[]")
