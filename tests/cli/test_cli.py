"""The CLI boundary: usage errors, aborts and exit codes, as a user in a shell sees them."""

import pytest
import typer

from qgate.cli import main as cli_main
from qgate.cli.main import main

ENGINE = ["engine", "build", "--checkpoint", "no-such-checkpoint", "--out", "e"]


@pytest.mark.parametrize(
    "argv, message, see",
    [
        (["promote", "--model", "x"], "Missing option '--version'", "qgate promote --help"),
        (["promote", "--model", "x", "--version", "1", "--bogus"], "No such option: --bogus", "qgate promote --help"),
        (["nosuch"], "No such command 'nosuch'", "qgate --help"),
        (
            ["calibrate", "sample", "--traffic", "t", "--out", "o", "--calib-size", "abc"],
            "Invalid value for '--calib-size'",
            "qgate calibrate sample --help",
        ),
        (["gate"], "Missing option '--candidate'", "qgate gate --help"),
        (["run"], "Missing argument 'spec'", "qgate run --help"),
        (["verify", "--model", "m", "--alias"], "requires an argument", "qgate verify --help"),
        (["run", "s.yaml", "--wait", "-5"], "'--wait': must be a number of seconds, 0 or more", "qgate run --help"),
        (["search", "--spec", "s", "--variant", "v", "--wait", "nan"], "got nan", "qgate search --help"),
        (["drift", "run", "--spec", "s", "--traffic", "t", "--wait", "-1"], "got -1.0", "qgate drift run --help"),
        (  # a flag the chosen backend or scheme would ignore, before the checkpoint is read
            [*ENGINE, "--backend", "cpu", "--dtype", "float32", "--profile", "p", "--no-verify"],
            "--profile, --verify/--no-verify, --dtype do not apply to --backend cpu; "
            "it takes --accuracy-level, --lm-head",
            "qgate engine build --help",
        ),
        (
            [*ENGINE, "--backend", "torch-int4", "--lm-head", "int8"],
            "--lm-head does not apply to --backend torch-int4; "
            "it takes --profile, --verify/--no-verify, --max-seq-len, --dtype",
            "qgate engine build --help",
        ),
        (
            ["quantize", "--model", "m", "--out", "o", "--scheme", "fp8-dynamic", "--group-size", "64"],
            "--group-size does not apply to --scheme fp8-dynamic",
            "qgate quantize --help",
        ),
    ],
)
def test_usage_errors_say_usage_error_and_where_to_look(argv, message, see, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    first, second = err.strip().splitlines()[:2]
    assert first.startswith("usage error: ") and message in first
    assert second.strip() == f"see: {see}"
    assert "internal error" not in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, problems",
    [
        (
            [*ENGINE, "--backend", "cpu", "--accuracy-level", "7", "--lm-head", "int3"],
            ["--accuracy-level must be 1..4, got 7", "--lm-head must be one of fp32, int8, int4, got 'int3'"],
        ),
        (
            [*ENGINE, "--backend", "torch-int4", "--dtype", "float16", "--max-seq-len", "8"],
            ["--dtype must be one of bfloat16, float32, got 'float16'", "--max-seq-len must be >= 16, got 8"],
        ),
        (
            ["quantize", "--model", "m", "--out", "o", "--scheme", "gptq-w4a16", "--max-seq-length", "4"],
            ["--max-seq-length must be >= 8, got 4"],
        ),
        (
            ["calibrate", "sample", "--traffic", "t", "--out", "o", "--calib-size", "0", "--max-reject-fraction", "0"],
            ["--calib-size must be >= 1, got 0", "--max-reject-fraction must be in (0, 1], got 0.0"],
        ),
        (
            ["quantize", "--model", "m", "--out", "o", "--scheme", "fp8-dynamic", "--kv-cache", "fp4"],
            ["--kv-cache must be 'fp8' or 'int8', got 'fp4'"],
        ),
    ],
)
def test_bad_option_values_are_named_by_their_flags_each_one_before_any_input_is_read(argv, problems, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    listed = [line.removeprefix("  - ") for line in err.splitlines() if line.startswith("  - ")]
    assert (listed or [err.strip().removeprefix("error: ")]) == problems
    assert "no-such-checkpoint" not in err and " m:" not in err and " t:" not in err
    assert not any(section in err for section in ("engine.", "quantize.", "calibrate."))


def test_version_names_qgate_and_the_libraries_a_verdict_depends_on(capsys):
    """`qgate --version` exits 0 with one line (it was a usage error); `--version` of `qgate promote` is still the model
    version it takes."""
    from importlib.metadata import version

    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"qgate {version('qgate')} (python ") and len(out.splitlines()) == 1
    for lib in ("torch", "transformers", "llmcompressor", "compressed-tensors", "lm-eval"):
        assert f"{lib} {version(lib)}" in out
    assert main(["promote", "--model", "x"]) == 1 and "Missing option '--version'" in capsys.readouterr().err


def test_bare_group_prints_its_help_and_exits_1(capsys):
    assert main(["calibrate"]) == 1
    out = capsys.readouterr()
    assert "sample" in out.out + out.err and "internal error" not in out.err


def test_abort_and_interrupt_exit_130(monkeypatch, capsys):
    def boom(*a, **k):
        raise typer.Abort()

    monkeypatch.setattr(cli_main, "_dispatch", boom)
    assert main(["--help"]) == 130
    assert capsys.readouterr().err.strip() == "aborted"


def test_a_gpu_out_of_memory_is_an_error_with_what_to_do_not_an_internal_error(monkeypatch, capsys):
    """A CUDA allocation that fails part way (another job took the card) says so, with torch's figures and a hint."""
    import torch

    said = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB "
        "is free.\nSee documentation for Memory Management"
    )

    def boom(*a, **k):
        raise torch.OutOfMemoryError(said)

    monkeypatch.setattr(cli_main, "_dispatch", boom)
    assert main(["gate"]) == 1
    first, hint = capsys.readouterr().err.strip().splitlines()
    assert first == f"error: out of memory on the GPU (torch: {said.splitlines()[0]})"
    assert hint.startswith("  hint: another process may hold the card's memory (nvidia-smi") and "--device" in hint

    def other(*a, **k):
        raise RuntimeError("something else")

    monkeypatch.setattr(cli_main, "_dispatch", other)
    assert main(["gate"]) == 1
    assert capsys.readouterr().err.startswith("internal error: RuntimeError: something else")


def test_a_checkpoint_is_summarized_in_one_readable_line():
    """`model import` and `quantize` print what the checkpoint is, its size and hash, not its raw metadata."""
    from types import SimpleNamespace

    from qgate.cli.output import checkpoint_line

    base = SimpleNamespace(
        path="runs/base",
        sha256="ab" * 32,
        meta={
            "architecture": "LlamaForCausalLM",
            "hidden_size": 576,
            "num_hidden_layers": 30,
            "vocab_size": 49152,
            "scheme": "baseline",
            "weights_bytes": 538_090_408,
        },
    )
    assert checkpoint_line(base) == (
        "checkpoint runs/base  baseline LlamaForCausalLM, 30 layers, hidden 576, vocab 49,152; "
        "538.1 MB of weights  sha256 abababababababab"
    )
    quant = SimpleNamespace(
        path="runs/awq",
        sha256="cd" * 32,
        meta={
            "scheme": "awq-w4a16",
            "weight_format": "pack-quantized",
            "kv_cache_dtype": "fp8",
            "fallback_layers": ["a", "b"],
            "fallback_bits": 8,
            "bits_per_weight": 4.5612,
            "weights_bytes": 174_000_000,
            "calibration_samples": 256,
            "quantize_seconds": 688.04,
        },
    )
    assert checkpoint_line(quant) == (
        "checkpoint runs/awq  awq-w4a16 (pack-quantized); KV cache fp8; 2 layers at 8 bits; "
        "4.56 bits/weight, 174.0 MB of weights; 256 calibration samples; quantized in 688 s  "
        "sha256 cdcdcdcdcdcdcdcd"
    )


def test_a_gate_input_of_the_wrong_kind_is_named_before_any_scoring(base_art, calib_arts, tmp_path, capsys):
    from qgate.cli.main import main

    shadow = str(calib_arts["shadow"].path)
    gate = ["gate", "--baseline", str(base_art.path), "--shadow", shadow, "--out", str(tmp_path / "g")]
    assert main([*gate, "--candidate", str(calib_arts["calib"].path)]) == 1
    err = capsys.readouterr().err
    assert f"{calib_arts['calib'].path}: expected a checkpoint or an engine artifact, found a calibration-set" in err
    assert (
        "hint: checkpoint: `qgate model import` (a baseline) or `qgate quantize` writes one; engine: `qgate engine"
        in err
    )
    wrong_baseline = ["gate", "--candidate", str(base_art.path), "--baseline", shadow, "--shadow", shadow]
    assert main([*wrong_baseline, "--out", str(tmp_path / "g")]) == 1
    assert "hint: checkpoint: `qgate model import`" in capsys.readouterr().err
    from qgate.artifact import Artifact

    (tmp_path / "e").mkdir()
    engine = Artifact.create("engine", tmp_path / "e", {})
    assert main([*gate, "--candidate", str(base_art.path), "--baseline", str(engine.path)]) == 1
    assert f"{engine.path}: expected a checkpoint artifact, found an engine" in capsys.readouterr().err
    assert main([*gate, "--candidate", str(base_art.path), "--device", ""]) == 1  # not silently `auto`
    assert "error: --device: '' is not a device" in capsys.readouterr().err
    assert not (tmp_path / "g").exists()
    (tmp_path / "cache").write_text("not a directory")
    assert main([*gate, "--candidate", str(base_art.path), "--cache", str(tmp_path / "cache")]) == 1
    assert f"error: {tmp_path / 'cache'}: cannot hold the baseline cache: it is a file\n" in capsys.readouterr().err
    assert not (tmp_path / "g").exists()
