"""Every quantization scheme and KV-cache option through the CLI, end to end on the tiny model: quantize, gate,
register."""

import itertools
import json

import pytest

from qgate.artifact import Artifact
from qgate.cli.main import main
from qgate.quantize.schemes import stored_format

# The tiny model's quantized Linears: 2 layers of q (64x64), k and v (32x64), o (64x64), gate and up (128x64), down
# (64x128).
PARAMS = 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 2 * 128 * 64 + 64 * 128)  # 73,728 weights
ROWS = 2 * (64 + 32 + 32 + 64 + 128 + 128 + 64)  # 1,024 output channels
GROUP = 32
# Bits per weight from each format's layout (float32 scales, as the float32 baseline gives):
BITS = {
    "awq-w4a16": 4 + 32 / GROUP + 4 / GROUP,  # int4 codes, a scale and an int4 zero point per group of 32
    "gptq-w4a16": 4 + 32 / GROUP,  # symmetric: no zero point
    "gptq-w8a16": 8 + 32 / GROUP,
    "fp8-dynamic": 8 + 32 * ROWS / PARAMS,
}  # FP8 E4M3 codes and one scale per output channel
CASES = list(itertools.product(BITS, (None, "fp8", "int8")))


@pytest.fixture(scope="module")
def setting(tmp_path_factory, calib_arts):
    d = tmp_path_factory.mktemp("every-scheme")
    spec = d / "spec.yaml"
    spec.write_text(
        "version: 1\nname: every\nworkdir: w\nmodel: {hf_dir: x}\ntraffic: t.jsonl\nvariants: [{name: a, scheme: "
        "awq-w4a16}]\nregistry: {model_name: every}\ngates:\n"
        "  shadow: {max_new_tokens: 4, max_prompt_tokens: 32, kl_p99_max: null, kl_mean_max: 10.0, "
        "top1_agreement_min: null}\n"
        "  eval: {tasks: [bigbench_general_knowledge], limit: 8, min_recovery: null, max_bpb_increase: null}\n"
        "  long_context: {max_documents: 2, max_nll_increase: 10.0}\n"
    )
    return {"dir": d, "spec": spec, "store": d / "store", "cache": d / "cache"}


@pytest.mark.parametrize("scheme,kv", CASES, ids=[f"{s}-{k or 'nokv'}" for s, k in CASES])
def test_every_scheme_quantizes_gates_and_registers(base_art, calib_arts, setting, scheme, kv, capsys):
    from mlflow import MlflowClient

    out, gate = setting["dir"] / f"{scheme}-{kv}", setting["dir"] / f"{scheme}-{kv}-gate"
    argv = [
        "quantize",
        "--model",
        str(base_art.path),
        "--scheme",
        scheme,
        "--out",
        str(out),
        "--calib",
        str(calib_arts["calib"].path),
        "--max-seq-length",
        "64",
    ]
    argv += [] if scheme == "fp8-dynamic" else ["--group-size", str(GROUP)]
    argv += ["--kv-cache", kv] if kv else []
    assert main(argv) == 0, capsys.readouterr().err
    line = capsys.readouterr().out
    art = Artifact.load(out, "checkpoint")
    assert art.meta["bits_per_weight"] == pytest.approx(BITS[scheme], abs=1e-4)
    assert art.meta["linear_bytes"] == pytest.approx(BITS[scheme] * PARAMS / 8)
    assert f"{scheme} (" in line and f"{BITS[scheme]:.2f} bits/weight" in line
    assert (f"KV cache {kv}" in line) == bool(kv) and art.meta["kv_cache_dtype"] == kv
    assert stored_format(out) == (art.meta["weight_format"], kv)  # what an import of it would record
    if kv:
        kv_scheme = json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
        assert kv_scheme["num_bits"] == 8 and kv_scheme["type"] == {"fp8": "float", "int8": "int"}[kv]

    rc = main(
        [
            "gate",
            "--candidate",
            str(out),
            "--baseline",
            str(base_art.path),
            "--shadow",
            str(calib_arts["shadow"].path),
            "--out",
            str(gate),
            "--spec",
            str(setting["spec"]),
            "--cache",
            str(setting["cache"]),
        ]
    )
    report = json.loads((gate / "report.json").read_text())
    assert rc == 0 and report["verdict"] == "pass", [r["metric"] for r in report["results"] if r["verdict"] != "pass"]
    assert all(r["verdict"] == "pass" for r in report["results"] if r["gate"] == "contract")
    assert {r["gate"] for r in report["results"]} >= {"contract", "shadow", "long_context", "eval", "perf"}

    capsys.readouterr()
    assert (
        main(
            [
                "register",
                "--gate",
                str(gate),
                "--candidate",
                str(out),
                "--model",
                "every",
                "--store",
                str(setting["store"]),
            ]
        )
        == 0
    )
    version = capsys.readouterr().out.split("version ")[1].split()[0]
    uri = f"sqlite:///{setting['store'] / 'mlflow.db'}"
    mv = MlflowClient(uri, uri).get_model_version("every", version)
    tags = mv.tags
    assert tags["qgate.bits_per_weight"] == f"{BITS[scheme]:.3f}" and tags["qgate.gate_verdict"] == "pass"
    nbytes = Artifact.load(out).meta["weights_bytes"]
    assert int(tags["qgate.served_bytes"]) == nbytes > 0
    assert f"| served weights | `{nbytes / 1e6:,.1f} MB` |" in mv.description  # the registry UI's page
    assert tags["qgate.scheme"] == scheme and tags["qgate.kv_cache_dtype"] == (kv or "model-default")
