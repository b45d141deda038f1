import json

import pytest
import torch

from qgate.errors import ConfigError, InputError
from qgate.quantize.compress import CalibOptions, quantize
from qgate.quantize.schemes import GPTQConfig, KVCacheConfig, scheme_config


def _linear_weights(path):
    from transformers import AutoModelForCausalLM

    from qgate.engines.runners import dequantize_kwargs

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **dequantize_kwargs(path))
    return {
        n: mod.weight.detach().clone()
        for n, mod in m.named_modules()
        if isinstance(mod, torch.nn.Linear) and "lm_head" not in n
    }


def _sqnr_db(ref, got):
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum()))


def test_unknown_scheme_suggests_the_right_name():
    with pytest.raises(ConfigError, match="did you mean 'awq-w4a16'"):
        scheme_config("awq-w4a61")


def test_scheme_options_are_validated():
    with pytest.raises(ConfigError, match="power of two"):
        scheme_config("gptq-w4a16", group_size=48)
    with pytest.raises(ConfigError, match="options.group_size: unknown key"):
        scheme_config("fp8-dynamic", group_size=64)
    with pytest.raises(ConfigError):
        GPTQConfig(num_bits=3)
    with pytest.raises(ConfigError):
        KVCacheConfig("fp4")


def test_group_size_checked_before_calibration(base_art, calib_arts, tmp_path):
    with pytest.raises(ConfigError, match=r"group_size=128 does not divide.*in_features=64") as e:
        quantize(base_art, calib_arts["calib"], scheme_config("awq-w4a16", group_size=128), tmp_path / "x")
    assert "[32, 64]" in e.value.hint
    assert not (tmp_path / "x").exists()


def test_awq_checkpoint_is_compressed_tensors_with_lineage(awq_art, base_art, calib_arts):
    cfg = json.loads((awq_art.path / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "pack-quantized"
    w = cfg["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["symmetric"]) == (4, 32, False)
    assert cfg["ignore"] == ["lm_head"]
    assert awq_art.parents == (base_art.sha256, calib_arts["calib"].sha256)
    assert awq_art.meta["scheme"] == "awq-w4a16" and awq_art.meta["calibration_samples"] == 32
    assert awq_art.config["scheme"]["type"] == "AWQConfig"


def test_weight_sqnr_for_in_place_schemes(base_art, w8_art, calib_arts, tmp_path):
    """GPTQ and FP8 quantize weights in place, so weight SQNR is meaningful (AWQ rescales: see the logits test)."""
    w4 = quantize(
        base_art,
        calib_arts["calib"],
        scheme_config("gptq-w4a16", group_size=32),
        tmp_path / "w4",
        opts=CalibOptions(max_seq_length=48),
    )
    fp8 = quantize(base_art, None, scheme_config("fp8-dynamic"), tmp_path / "fp8")
    base = _linear_weights(base_art.path)
    for art, floor in ((w4, 14.0), (w8_art, 38.0), (fp8, 28.0)):
        got = _linear_weights(art.path)
        worst = min(_sqnr_db(base[n], got[n]) for n in base)
        assert worst > floor, f"{art.meta['scheme']}: worst-layer SQNR {worst:.1f} dB <= {floor}"


def test_logits_sqnr_orders_schemes(base_art, awq_art, w8_art):
    from qgate.engines.runners import load_runner

    ref = load_runner(base_art)
    ids = ref.tokenizer("please help the model serve traffic with low latency the cat")["input_ids"]
    a = torch.from_numpy(ref.logits(ids))
    awq = _sqnr_db(a, torch.from_numpy(load_runner(awq_art).logits(ids)))
    w8 = _sqnr_db(a, torch.from_numpy(load_runner(w8_art).logits(ids)))
    assert awq > 9.0 and w8 > 25.0 and w8 > awq + 10


def test_fp8_with_kv_cache_records_kv_dtype(base_art, calib_arts, tmp_path):
    art = quantize(
        base_art,
        calib_arts["calib"],
        scheme_config("fp8-dynamic"),
        tmp_path / "fp8",
        kv=KVCacheConfig("fp8"),
        opts=CalibOptions(max_seq_length=32, max_samples=8),
    )
    cfg = json.loads((art.path / "config.json").read_text())["quantization_config"]
    assert cfg["kv_cache_scheme"]["type"] == "float" and cfg["kv_cache_scheme"]["num_bits"] == 8
    assert art.meta["kv_cache_dtype"] == "fp8" and art.meta["weight_format"] == "fp8"


def test_quantize_refuses_an_already_quantized_model(awq_art, calib_arts, tmp_path):
    with pytest.raises(InputError, match="baseline"):
        quantize(awq_art, calib_arts["calib"], scheme_config("gptq-w4a16", group_size=32), tmp_path / "y")
