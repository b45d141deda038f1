"""A checkpoint another tool quantized, brought in with `qgate model import`: described by what its files store,
gated as it is, never quantized again, and built into an engine only where the engine serves what it stores."""

import json
import shutil

import pytest
import yaml
from specs import pipeline_spec

from qgate.cli.main import main
from qgate.cli.output import checkpoint_line
from qgate.engines.build import build_engine
from qgate.errors import ConfigError, InputError
from qgate.models import IMPORTED, ModelSource, import_model
from qgate.pipeline.spec import load_spec
from qgate.quantize.compress import CalibOptions, quantize
from qgate.quantize.schemes import KVCacheConfig, scheme_config, stored_format


def _made_elsewhere(base_art, calib_arts, d, kv: str | None = None):
    """A GPTQ W4A16 checkpoint (with a KV-cache scheme when `kv`), and a copy without qgate's manifest: another tool's
    output."""
    ckpt = quantize(
        base_art,
        calib_arts["calib"],
        scheme_config("gptq-w4a16", group_size=32),
        d / "ckpt",
        kv=KVCacheConfig(kv) if kv else None,
        opts=CalibOptions(max_seq_length=32, max_samples=4),
    )
    shutil.copytree(ckpt.path, d / "elsewhere", ignore=shutil.ignore_patterns("qgate-artifact.json"))
    return ckpt, d / "elsewhere"


@pytest.fixture(scope="module")
def w4_fp8kv(base_art, calib_arts, tmp_path_factory):
    return _made_elsewhere(base_art, calib_arts, tmp_path_factory.mktemp("imported"), "fp8")


def test_an_import_of_a_quantized_checkpoint_records_what_it_stores(w4_fp8kv, tmp_path):
    ckpt, elsewhere = w4_fp8kv
    art = import_model(ModelSource(hf_dir=str(elsewhere)), tmp_path / "imp")
    assert art.meta["scheme"] == IMPORTED
    assert (art.meta["weight_format"], art.meta["kv_cache_dtype"]) == ("w4a16", "fp8")
    for key in ("bits_per_weight", "linear_bytes", "linear_params", "weights_bytes"):
        assert art.meta[key] == ckpt.meta[key], key
    assert art.meta["bits_per_weight"] == pytest.approx(4 + 32 / 32)  # int4 codes and a float32 scale per 32
    line = checkpoint_line(art)
    assert "  imported (w4a16); KV cache fp8; 5.00 bits/weight, " in line and "quantized in" not in line


def test_a_quantized_checkpoint_is_never_quantized_again(w4_fp8kv, calib_arts, tmp_path, capsys):
    ckpt, elsewhere = w4_fp8kv
    art = import_model(ModelSource(hf_dir=str(elsewhere)), tmp_path / "imp")
    scheme = scheme_config("gptq-w4a16", group_size=32)
    for model in (art, ckpt):
        with pytest.raises(InputError, match=r"must be a full-precision baseline checkpoint; this one is quantized "):
            quantize(model, calib_arts["calib"], scheme, tmp_path / "again")
    assert not (tmp_path / "again").exists()
    argv = ["quantize", "--model", str(art.path), "--scheme", "gptq-w4a16", "--calib", str(calib_arts["calib"].path)]
    assert main([*argv, "--out", str(tmp_path / "again")]) == 1
    err = capsys.readouterr().err
    assert (
        f"error: {art.path}: --model must be a full-precision baseline checkpoint; this one is quantized already "
        in err
    )
    assert "(w4a16, KV cache fp8)" in err and "qgate gate --candidate" in err and "internal error" not in err


def test_a_pipeline_whose_model_is_quantized_stops_before_calibrating(w4_fp8kv, tmp_path, workdir, capsys):
    spec = pipeline_spec(tmp_path, workdir)
    doc = yaml.safe_load(spec.read_text())
    doc["model"] = {"hf_dir": str(w4_fp8kv[1])}
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert main(["run", str(spec)]) == 1
    err = capsys.readouterr().err
    assert "the spec's model must be a full-precision baseline checkpoint; this one is quantized already" in err
    assert not (tmp_path / "work/calib").exists()


def test_engines_refuse_a_kv_cache_they_would_not_serve(w4_fp8kv, tmp_path, workdir):
    """At spec load, and at the build by what config.json stores, whatever the manifest says: an imported
    checkpoint's, or one from before the manifest said it. onnxruntime-genai's builder fails on the KV-cache scales;
    torch-int4 would drop them."""
    variant = {"name": "a", "scheme": "awq-w4a16", "kv_cache": "int8", "engine": {"backend": "cpu"}}
    with pytest.raises(
        ConfigError,
        match=r"variants\[0\].engine: the cpu engine keeps its KV cache in float: onnxruntime-genai's builder",
    ):
        load_spec(pipeline_spec(tmp_path, workdir, variants=[variant]))
    ckpt, elsewhere = w4_fp8kv
    art = import_model(ModelSource(hf_dir=str(elsewhere)), tmp_path / "imp")
    silent = type(art)(art.kind, art.path, art.sha256, art.config, art.parents, art.meta | {"kv_cache_dtype": None})
    for model in (ckpt, art, silent):
        for name, says in (
            ("cpu", "the cpu engine keeps its KV cache in float: onnxruntime-genai's builder reads no KV-cache"),
            ("torch-int4", "the torch-int4 engine keeps"),
        ):
            with pytest.raises(ConfigError, match=f"KV cache fp8: {says}"):
                build_engine(model, name, tmp_path / name)
            assert not (tmp_path / name).exists()


def test_an_imported_w4a16_checkpoint_builds_a_cpu_engine_that_computes_it(base_art, calib_arts, tmp_path):
    """Its manifest says w4a16 as a qgate checkpoint's does: the CPU engine took it for unquantized before."""
    from qgate.engines.runners import load_runner

    _, elsewhere = _made_elsewhere(base_art, calib_arts, tmp_path)
    art = import_model(ModelSource(hf_dir=str(elsewhere)), tmp_path / "imp")
    eng = build_engine(art, "cpu", tmp_path / "eng", accuracy_level=1)
    seq = list(range(5, 40))
    diff = abs(load_runner(eng).logits(seq) - load_runner(art).logits(seq)).max()
    assert diff < 0.01, diff


def test_stored_format_names_other_tools_layouts(tmp_path):
    """Config groups as other tools write them: per-group names, finer int4 groups, layers kept out, activations."""

    def fmt(qc):
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
        return stored_format(tmp_path)

    def group(bits, size=128, kind="int", acts=None):
        w = {"num_bits": bits, "type": kind, "strategy": "group" if size else "channel", "group_size": size}
        return {"targets": ["Linear"], "weights": w, "input_activations": acts}

    fp8_acts = {"num_bits": 8, "type": "float", "dynamic": True}
    assert fmt({"config_groups": {"g": group(4)}, "ignore": ["lm_head"]}) == ("w4a16", None)
    assert fmt({"config_groups": {"a": group(8), "b": group(4, 32), "c": group(4)}}) == ("w4a16+w4a16g32+w8a16", None)
    assert fmt({"config_groups": {"g": group(4)}, "ignore": ["lm_head", "model.layers.3.mlp.down_proj"]}) == (
        "w4a16+unquantized",
        None,
    )
    assert fmt({"config_groups": {"g": group(8, None, "float", fp8_acts)}}) == ("fp8", None)
    assert fmt({"config_groups": {"g": group(8, None, "float")}}) == ("fp8a16", None)
    assert fmt({"config_groups": {"g": group(8, None, acts={"num_bits": 8, "type": "int"})}}) == ("w8a8", None)
    kv = {"num_bits": 8, "type": "int", "strategy": "tensor"}
    assert fmt({"config_groups": {"g": group(4)}, "kv_cache_scheme": kv}) == ("w4a16", "int8")
    assert fmt({"kv_cache_scheme": kv | {"type": "float"}}) == (None, "fp8")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert stored_format(tmp_path) == (None, None)


def test_an_imported_candidate_is_gated_and_registered_with_no_lineage_it_lacks(
    w4_fp8kv, base_art, calib_arts, tmp_path, monkeypatch
):
    """Its base model and calibration set are unknown: the report says the shadow split's being held out is not
    checked, and the registry says what is not known where the gate's baseline stood in. Gated against a quantized
    baseline, a report says what that baseline is."""
    from mlflow import MlflowClient

    from qgate.gates.gating import GateConfig, run_gates
    from qgate.gates.shadow import ShadowConfig
    from qgate.registry.mlflow_store import register

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    art = import_model(ModelSource(hf_dir=str(w4_fp8kv[1])), tmp_path / "imp")
    shadow = ShadowConfig(
        max_new_tokens=4, max_prompt_tokens=32, kl_p99_max=None, kl_mean_max=10.0, top1_agreement_min=None
    )
    cfg = GateConfig(shadow=shadow, eval=None, long_context=None)
    gate = run_gates(art, base_art, calib_arts["shadow"], cfg, tmp_path / "gate", tmp_path / "cache")
    assert gate.meta["passed"], gate.meta
    version = register(gate, art, "imported", tmp_path / "store")
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    mv = MlflowClient(uri, uri).get_model_version("imported", version)
    assert {k: mv.tags[f"qgate.{k}"] for k in ("scheme", "kv_cache_dtype", "bits_per_weight")} == {
        "scheme": IMPORTED,
        "kv_cache_dtype": "fp8",
        "bits_per_weight": "5.000",
    }
    assert mv.tags["qgate.base_model_sha256"] == "-" and mv.tags["qgate.calibration_sha256"] == "-"
    assert "| base model sha256 | `- (quantized elsewhere)` |" in mv.description
    assert base_art.sha256[:16] not in mv.description.split("base model sha256")[1].split("\n")[0]
    held_out = "quantized outside qgate (`qgate model import`): the data it was calibrated on is not recorded, so"
    quantized_baseline = "The baseline is itself quantized (w4a16, KV cache fp8): a PASS says the candidate behaves"
    notes = json.loads((gate.path / "report.json").read_text())["notes"]
    assert any(held_out in n for n in notes) and not any(quantized_baseline in n for n in notes)
    ckpt = w4_fp8kv[0]  # qgate's own, gated against the imported copy of itself
    again = run_gates(ckpt, art, calib_arts["shadow"], cfg, tmp_path / "gate2", tmp_path / "cache")
    notes = json.loads((again.path / "report.json").read_text())["notes"]
    assert any(n.startswith(quantized_baseline) for n in notes) and not any(held_out in n for n in notes)


SEQ = list(range(5, 70))


def _oneshot_elsewhere(base_art, out, recipe: list):
    """The checkpoint llm-compressor's oneshot saves with `recipe` (no calibration data) in `out`, beside the
    baseline's tokenizer and generation config, and the logits over SEQ of the model it held in memory when it saved
    it: the model that is served."""
    import torch
    from llmcompressor import oneshot

    from qgate.quantize.compress import cpu_safe_intermediates
    from qgate.trust import copy_tokenizer_files, load_causal_lm

    model = load_causal_lm(base_art.path, dtype=torch.float32)
    with cpu_safe_intermediates():
        oneshot(model=model, recipe=recipe)
    with torch.no_grad():
        served = model(torch.tensor([SEQ])).logits[0].numpy()
    model.save_pretrained(out, save_compressed=True)
    copy_tokenizer_files(base_art.path, out)
    shutil.copyfile(base_art.path / "generation_config.json", out / "generation_config.json")
    return served


def _rotated(base_art, out, rotations: tuple[str, ...]):
    """A W4A16 checkpoint made with SpinQuant's rotations (round to nearest), and the served logits over SEQ."""
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import SpinQuantModifier

    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    recipe = [
        SpinQuantModifier(rotations=list(rotations), transform_type="hadamard"),
        QuantizationModifier(config_groups={"g": {"targets": ["Linear"], "weights": weights}}, ignore=["lm_head"]),
    ]
    return _oneshot_elsewhere(base_art, out, recipe)


@pytest.mark.parametrize("rotations", [("R1", "R2", "R3", "R4"), ("R1", "R2")], ids=["online", "fused"])
def test_a_rotated_checkpoint_is_scored_with_its_rotations(base_art, tmp_path, rotations, monkeypatch):
    """Transformers applies none of a checkpoint's run-time rotations on load (R3 on the query and keys, R4 on
    down_proj's input): scored without them its logits were up to 3 away from the model's. The reference path now
    applies them, in every forward it runs; the engines, which cannot, refuse such a checkpoint, and build one whose
    rotations are all fused into its weights (R1, R2)."""
    import numpy as np

    from qgate.engines import runners
    from qgate.engines.runners import load_runner
    from qgate.quantize.schemes import online_transforms

    served = _rotated(base_art, tmp_path / "elsewhere", rotations)
    art = import_model(ModelSource(hf_dir=str(tmp_path / "elsewhere")), tmp_path / "imp")
    runner = load_runner(art)
    assert np.abs(runner.logits(SEQ) - served).max() < 1e-4
    assert np.abs(np.concatenate([np.asarray(b) for b in runner.logits_blocks(SEQ)]) - served).max() < 1e-4
    [batched] = runner.logits_batch([SEQ])
    assert np.abs(batched - served).max() < 1e-4
    monkeypatch.setitem(runners.PACKED_CONTEXTS, "cpu", True)  # as on CUDA: no packing through the hooked attention
    assert runner.packs_contexts is ("R3" not in rotations)
    online = online_transforms(art.path)
    if "R3" in rotations:
        assert sorted(online) == ["R3", "R4"]
        for name in ("torch-int4", "cpu"):
            with pytest.raises(ConfigError, match=r"transform_config rotates activations as the model runs \(R3, R4\)"):
                build_engine(art, name, tmp_path / name)
            assert not (tmp_path / name).exists()
    else:
        assert online == {}
        engine = load_runner(build_engine(art, "torch-int4", tmp_path / "int4", dtype="float32"))
        assert np.abs(engine.logits(SEQ) - served).max() < 1e-4


@pytest.mark.parametrize(
    "preset,stored,bits,tolerance",
    [
        ("NVFP4A16", "fp4a16", 4 + 8 / 16, 0.05),  # fp4 codes, an fp8 scale per 16; decompressed to bf16 (see below)
        ("MXFP4", "fp4a4", 4 + 8 / 32, 1e-4),  # fp4 codes, a power-of-two scale per 32; activations too
    ],
)
def test_fp4_checkpoints_import_and_score_as_the_model_llm_compressor_saved(
    base_art, tmp_path, preset, stored, bits, tolerance
):
    """Their packed weights carry no weight_shape, which sizing the model needs, and compressed-tensors decompresses
    them to bfloat16 whatever dtype the model loads in: the float32 reference path stopped with an internal error
    (a SafetensorError, then a dtype mismatch in the first matmul). NVFP4's dequantized weights are rounded to bf16
    by the decompression itself (its scales are not powers of two), hence its wider tolerance."""
    import numpy as np
    from llmcompressor.modifiers.quantization import QuantizationModifier

    from qgate.engines.runners import load_runner

    recipe = [QuantizationModifier(scheme=preset, targets="Linear", ignore=["lm_head"])]
    served = _oneshot_elsewhere(base_art, tmp_path / "elsewhere", recipe)
    art = import_model(ModelSource(hf_dir=str(tmp_path / "elsewhere")), tmp_path / "imp")
    assert art.meta["weight_format"] == stored and art.meta["linear_params"] == 73_728  # every Linear but the head
    assert art.meta["bits_per_weight"] == pytest.approx(bits, abs=0.01)  # NVFP4's per-tensor global scale on top
    assert np.abs(load_runner(art).logits(SEQ) - served).max() < tolerance
