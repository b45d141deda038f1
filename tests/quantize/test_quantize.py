import json

import pytest
import tiny
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


def test_quantize_cli_names_its_flags_in_errors(base_art, tmp_path, capsys):
    from qgate.cli.main import main

    args = ["quantize", "--model", str(base_art.path), "--out", str(tmp_path / "q")]
    assert main([*args, "--scheme", "awq-w4a16", "--group-size", "48"]) == 1
    assert capsys.readouterr().err.startswith("error: --group-size must be a positive power of two, got 48\n")
    assert main([*args, "--scheme", "gptq-w4a16"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: this scheme calibrates on real prompts, and no calibration set was given\n")
    assert "hint: pass --calib with the calib split that `qgate calibrate sample` writes" in err
    assert main([*args, "--scheme", "fp8-dynamic", "--kv-cache", "fp8"]) == 1
    assert capsys.readouterr().err.startswith("error: a KV-cache scheme calibrates, and no calibration set was given")
    assert not (tmp_path / "q").exists()


def test_quantize_without_a_tty_prints_its_one_line_and_nothing_from_the_libraries(base_art, calib_arts, tmp_path):
    """GPTQ's tracing and sequential onloading make torch and transformers warn on every run; none of it is a
    user's to act on, and a CI log should hold qgate's line alone."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {  # a user's shell: without what in-process `qgate run` tests leave in os.environ
        k: v
        for k, v in os.environ.items()
        if k not in ("TQDM_DISABLE", "PYTHONWARNINGS") and not k.startswith(("LLM_COMPRESSOR_", "QGATE_"))
    }
    argv = ["quantize", "--model", str(base_art.path), "--calib", str(calib_arts["calib"].path)]
    argv += ["--scheme", "gptq-w4a16", "--group-size", "32", "--max-seq-length", "64", "--out", str(tmp_path / "q")]
    qgate = Path(sys.executable).parent / "qgate"
    p = subprocess.run([str(qgate), *argv], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0 and p.stderr == "", p.stderr[-2000:]
    assert p.stdout.startswith(f"checkpoint {tmp_path / 'q'}  gptq-w4a16 (w4a16); ") and p.stdout.count("\n") == 1


def test_a_held_out_split_is_refused_as_calibration_data_and_a_gate_on_what_was_fitted(
    base_art, w8_art, calib_arts, tmp_path, capsys
):
    """Calibrating on the shadow split and gating on it would score the prompts the candidate was fitted to."""
    from dataclasses import replace

    from qgate.cli.main import main
    from qgate.gates.gating import GateConfig, run_gates
    from qgate.search.sensitivity import fisher_sensitivity

    shadow = calib_arts["shadow"]
    with pytest.raises(InputError, match="this is the shadow split, held out to score candidates on") as e:
        quantize(base_art, shadow, scheme_config("gptq-w4a16", group_size=32), tmp_path / "x")
    assert e.value.hint.endswith(f"({shadow.path.parent / 'calib'})")
    args = ["quantize", "--model", str(base_art.path), "--out", str(tmp_path / "q"), "--scheme", "awq-w4a16"]
    assert main([*args, "--calib", str(shadow.path)]) == 1
    assert "held out to score candidates on" in capsys.readouterr().err
    with pytest.raises(InputError, match="--calib must be a calibration-set artifact, found a checkpoint"):
        quantize(base_art, base_art, scheme_config("gptq-w4a16", group_size=32), tmp_path / "x")
    with pytest.raises(InputError, match="this is the shadow split"):
        fisher_sensitivity(base_art, shadow, scheme_config("awq-w4a16", group_size=32))
    fitted = replace(w8_art, meta=w8_art.meta | {"calibration_sha256": shadow.sha256})  # as if quantized on it
    with pytest.raises(InputError, match="was calibrated on this split, so a gate on it would score the prompts"):
        run_gates(fitted, base_art, shadow, GateConfig(eval=None), tmp_path / "g", tmp_path / "c")
    assert not (tmp_path / "x").exists() and not (tmp_path / "q").exists() and not (tmp_path / "g").exists()


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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_baseline_quantized_on_a_cpu_is_stored_and_gated_in_its_own_format(
    base_art, calib_arts, tmp_path, monkeypatch, dtype
):
    """A CPU quantizes in float32, but a baseline that declares bf16 or fp16 is served in it: its checkpoint declares
    that format and stores its scales and unquantized layers in it, 16 bits each as the search counts them (W4 g32
    symmetric: 4.5 bits per weight, not 5), with the codes float32 chose; so the gates score it in that format (a
    float16 one in float16, whatever gates.dtype says), as a server loading it would."""
    from safetensors.torch import load_file

    import qgate.quantize.compress as compress
    from qgate.gates.numerics import scoring_numerics
    from qgate.quantize.compress import stored_float_bits
    from qgate.search.plan import bits_per_weight

    base = tiny.stored_as(base_art, dtype, tmp_path)
    scheme, opts = scheme_config("gptq-w4a16", group_size=32), CalibOptions(max_seq_length=32, max_samples=8)
    ckpt = quantize(base, calib_arts["calib"], scheme, tmp_path / "q", opts=opts)
    config = json.loads((ckpt.path / "config.json").read_text())
    state = load_file(str(ckpt.path / "model.safetensors"))
    assert config["dtype"] == dtype and "torch_dtype" not in config and stored_float_bits(base.path) == 16
    floats = {t.dtype for t in state.values() if t.is_floating_point()}
    assert floats == {getattr(torch, dtype)} and ckpt.meta["bits_per_weight"] == bits_per_weight(4, 32, True, 16)
    assert ckpt.meta["weights_bytes"] == (ckpt.path / "model.safetensors").stat().st_size
    monkeypatch.setattr(compress, "stored_dtype", compress.load_dtype)  # as stored before: float32 throughout
    wide = load_file(
        str(quantize(base, calib_arts["calib"], scheme, tmp_path / "q32", opts=opts).path / "model.safetensors")
    )
    assert {t.dtype for t in wide.values() if t.is_floating_point()} == {torch.float32}
    for k, t in state.items():
        assert torch.equal(t, wide[k].to(t.dtype)), k  # the same codes; scales and weights rounded to 16 bits
    served = "cpu-float16" if dtype == "float16" else "cpu-bfloat16"
    assert scoring_numerics(ckpt, "cpu", "bfloat16") == served
    assert scoring_numerics(ckpt, "cpu", "auto") == ("cpu-float16" if dtype == "float16" else "cpu-float32")


def test_quantize_refuses_an_already_quantized_model(awq_art, calib_arts, tmp_path):
    with pytest.raises(InputError, match="baseline"):
        quantize(awq_art, calib_arts["calib"], scheme_config("gptq-w4a16", group_size=32), tmp_path / "y")


def test_a_model_larger_than_host_memory_is_refused_before_quantize_search_or_smoothing_load_it(
    base_art, calib_arts, tmp_path, monkeypatch
):
    """Quantizing, AWQ's smoothing and a search's sensitivity scan hold the whole model in host memory (float32 on a
    host without CUDA). Where its weights alone exceed the host's available memory and swap, each refuses with both
    figures before Transformers reads a byte, and writes nothing; at exactly its weights it goes on."""
    import qgate.device
    import qgate.trust
    from qgate.errors import BackendUnavailable, human_bytes
    from qgate.quantize.compress import load_host_model
    from qgate.quantize.smoothing import smooth_awq
    from qgate.search.sensitivity import fisher_sensitivity
    from qgate.trust import dense_params

    need = 4 * dense_params(base_art.path)  # float32: this host has no CUDA
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 1048576 kB\nMemAvailable: {need // 1024 - 1} kB\nSwapFree: 0 kB\n")
    monkeypatch.setattr(qgate.device, "MEMINFO", str(meminfo))
    loads = []
    real_load = qgate.trust.load_causal_lm
    monkeypatch.setattr(qgate.trust, "load_causal_lm", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    scheme = scheme_config("awq-w4a16", group_size=32)
    message = rf"the float32 model in host memory: its weights take {human_bytes(need)} on cpu, which has"
    for name, call in (
        ("quantize", lambda: quantize(base_art, calib_arts["calib"], scheme, tmp_path / "q")),
        ("smooth", lambda: smooth_awq(base_art, calib_arts["calib"], scheme, CalibOptions(), tmp_path / "s")),
        ("sensitivity", lambda: fisher_sensitivity(base_art, calib_arts["calib"], scheme)),
    ):
        with pytest.raises(BackendUnavailable, match=message) as e:
            call()
        assert e.value.hint == "run on a host with more memory", name
    assert loads == [] and not (tmp_path / "q").exists() and not (tmp_path / "s").exists()
    meminfo.write_text(f"MemTotal: 1048576 kB\nMemAvailable: {-(-need // 1024)} kB\n")
    assert load_host_model(base_art.path).dtype == torch.float32 and len(loads) == 1


def test_dtype_bytes_matches_every_dtype_safetensors_writes_and_refuses_an_unknown_one(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from qgate.trust import dtype_bytes

    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16]
    dtypes += [torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
    save_file({str(i): torch.zeros(3, dtype=d) for i, d in enumerate(dtypes)}, str(tmp_path / "t.safetensors"))
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as st:
        names = [st.get_slice(str(i)).get_dtype() for i in range(len(dtypes))]
    assert len(set(names)) == len(dtypes)
    assert [dtype_bytes(n) for n in names] == [d.itemsize for d in dtypes]
    with pytest.raises(ValueError, match="unknown safetensors dtype 'I4'"):
        dtype_bytes("I4")
