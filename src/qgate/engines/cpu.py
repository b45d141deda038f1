"""CPU engine: onnxruntime-genai with real int4 (MatMulNBits) kernels, keeping the checkpoint's weights.

    art = build_cpu(checkpoint_art, CpuEngineConfig(), out=Path("runs/awq-cpu"))

The compressed-tensors checkpoint is repacked into the AutoAWQ layout (no re-quantization) and handed to
onnxruntime-genai's model builder. lm_head stays full precision unless `lm_head: int8|int4` asks the builder to quantize
it (the gate decides whether that is acceptable). The builder's console output goes to build.log beside the engine.
A build whose rotary tables or attention windows are not the checkpoint's (engines/ort_checks.py: the builder leaves
out what it does not implement for the architecture) is refused.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from qgate.artifact import Artifact, typed_config
from qgate.engines.ort_checks import (
    SWITCHED_ROPE,
    builder_layer_types,
    built_engine_problems,
    write_checkpoint_tables,
)
from qgate.errors import BackendUnavailable, ConfigError, InputError, check_each
from qgate.trust import copy_tokenizer_files

ENGINE_SUBDIR = "onnx"
SUPPORTED_PARTS = ("w4a16", "w8a16")  # 4- and 8-bit group-wise integer layers, any group size


def _supported(fmt: str | None) -> bool:
    """'w4a16', or a per-layer mix of 4- and 8-bit layers at any group sizes ('w4a16+w4a16g32+w8a16'): MatMulNBits
    takes bits and block size per node. Not unquantized layers or FP8."""
    if not fmt or not fmt.startswith("w4a16"):
        return False
    return all(part.split("g")[0] in SUPPORTED_PARTS for part in fmt.split("+"))


NO_KV = "in float: onnxruntime-genai's builder reads no KV-cache scales"
LM_HEAD = ("fp32", "int8", "int4")  # the vocabulary projection: on a small model, most of the bytes read per token


@dataclass(frozen=True)
class CpuEngineConfig:
    accuracy_level: int = 4  # 4: int8 activations (ORT's CPU default, fastest); 1: fp32, exact
    lm_head: str = "fp32"  # "int8" / "int4": the builder quantizes lm_head (RTN, per block): faster decode, gated
    VERSION = 5  # of what the builder writes; what changed in each is in git

    def __post_init__(self):
        check_each(
            (self.accuracy_level not in (1, 2, 3, 4), f"accuracy_level must be 1..4, got {self.accuracy_level}"),
            (self.lm_head not in LM_HEAD, f"lm_head must be one of {', '.join(LM_HEAD)}, got {self.lm_head!r}"),
        )


def refusal(scheme_name: str, scheme, kv_cache: str | None) -> str | None:
    """Why this engine cannot serve a variant of this scheme config, or None: checked at spec load."""
    from qgate.quantize.schemes import weight_format

    fmt = weight_format(scheme)
    if not _supported(fmt):
        return (
            f"the cpu engine takes w4a16 checkpoints (mixed with w8a16 or finer-group w4a16 layers); scheme "
            f"{scheme_name} makes {fmt}"
        )
    if kv_cache:
        return f"the cpu engine keeps its KV cache {NO_KV}, not {kv_cache}"
    return None


def cannot_hold(ckpt: Artifact) -> str | None:
    """Why the builder cannot take this checkpoint's layout (a searched mix it has no kernel for), or None."""
    fmt = ckpt.meta.get("weight_format")
    if fmt and "+" in fmt and not _supported(fmt):
        return (
            f"its layout is {fmt} ({len(ckpt.meta.get('fallback_layers', []))} layers fall back) and "
            "onnxruntime-genai's builder takes only 4- and 8-bit integer layers"
        )
    return None


def load_runner(art: Artifact, device: str = "cpu", dtype: str = "auto"):
    """The gates' runner for a built engine: onnxruntime on this host's CPU (device and dtype do not apply)."""
    from qgate.engines.ort_runner import OrtRunner

    return OrtRunner(art.path / ENGINE_SUBDIR, art.path / ENGINE_SUBDIR)


def build_cpu(ckpt: Artifact, config: CpuEngineConfig, out: Path, profile: Artifact | None = None) -> Artifact:
    """profile: not used (onnxruntime-genai takes no batch sizes); accepted like every backend's builder."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(
            f"onnxruntime-genai is not importable ({e})", hint="pip install onnxruntime-genai==0.18.0"
        ) from e
    from safetensors.torch import load_file, save_file

    from qgate.engines.awq_layout import to_awq
    from qgate.engines.build import check_served_as_stored
    from qgate.engines.gptq_layout import to_gptq
    from qgate.engines.static_llama import model_config, rope_type
    from qgate.quantize.schemes import stored_format

    fmt = stored_format(ckpt.path)[0]
    if not _supported(fmt):
        raise ConfigError(
            f"{ckpt.path}: the CPU engine takes W4A16 checkpoints (with W8A16 or finer-group W4A16 layers); "
            f"this one is {fmt or 'unquantized'}",
            hint="FP8, W8A16, unquantized-fallback and baseline checkpoints run on the PyTorch reference path: pass "
            "the checkpoint to `qgate gate` directly",
        )
    check_served_as_stored(ckpt, "cpu", NO_KV)
    cfg = json.loads((ckpt.path / "config.json").read_text())
    if (rope := rope_type(model_config(cfg))) in SWITCHED_ROPE:
        raise ConfigError(
            f"{ckpt.path}: the CPU engine cannot serve RoPE type {rope!r}: it switches between two rotary tables at "
            "the original context length, and onnxruntime-genai's builder either builds one plain table (Llama) or "
            "switches inside the graph (Phi-3), where qgate cannot check the tables against the checkpoint's",
            hint="gate this checkpoint on the reference path (a variant without `engine:`), or build the torch-int4 "
            "engine where it takes this architecture",
        )
    state: dict = {}
    for f in sorted(ckpt.path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    mixed = fmt != "w4a16"
    if mixed:  # per-layer bits and group sizes: the AutoGPTQ layout's `dynamic` overrides carry them to the builder
        tensors, qcfg, _ = to_gptq(state, cfg["quantization_config"])
    else:
        tensors, qcfg = to_awq(state, cfg["quantization_config"])
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    staging = out / "awq-staging"
    staging.mkdir(parents=True)
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    staged = cfg | {"quantization_config": qcfg}
    if types := builder_layer_types(cfg):  # the builder reads windows per layer, from layer_types only
        staged["layer_types"] = types
    (staging / "config.json").write_text(json.dumps(staged, indent=2))
    for f in ckpt.path.iterdir():
        if (
            f.is_file()
            and f.name not in ("config.json", "recipe.yaml")
            and f.suffix != ".safetensors"
            and not f.name.startswith("qgate-")
        ):
            shutil.copy(f, staging / f.name)
    options = [f"accuracy_level={config.accuracy_level}"]
    if mixed:  # q, k and v may differ in bits or groups; the builder packs them into one MatMul only when they agree
        options.append("disable_qkv_fusion=true")
    # Untied lm_head, so the embedding Gather keeps full-precision weights whatever the head becomes.
    options.append("shared_embeddings=false")
    # Whole-context KV buffers for windowed layers too, masked to the window: the ring buffers the builder makes
    # otherwise need a capacity that a forward without past state (the gates' scoring) does not give them.
    options.append("windowed_kv_cache=false")
    if config.lm_head == "fp32":
        options.append("nodes_to_exclude=/lm_head/MatMul")
    elif config.lm_head == "int8":  # the builder's MatMulNBits quantizer, 8 bits for the last MatMul
        options.append("matmul_mixed_precision=last_matmul:int8")
    cmd = [
        sys.executable,
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        str(staging),
        "-o",
        str(out / ENGINE_SUBDIR),
        "-p",
        "int4",
        "-e",
        "cpu",
        "-c",
        str(out / "cache"),
        "--extra_options",
        *options,
    ]
    t0 = time.perf_counter()
    with open(out / "build.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        tail = (out / "build.log").read_text()[-1500:]
        raise InputError(
            f"onnxruntime-genai builder failed (exit {rc}); last output:\n{tail}", hint=f"full log: {out / 'build.log'}"
        )
    shutil.rmtree(staging)
    shutil.rmtree(out / "cache", ignore_errors=True)
    written = write_checkpoint_tables(out / ENGINE_SUBDIR / "model.onnx", cfg)
    problems, checked = built_engine_problems(out / ENGINE_SUBDIR / "model.onnx", cfg)
    if problems:
        raise ConfigError(
            f"{ckpt.path}: onnxruntime-genai's builder wrote an engine that does not compute what the checkpoint "
            f"does: {'; '.join(problems)}",
            hint="gate this checkpoint on the reference path (a variant without `engine:`), or build the torch-int4 "
            "engine where it takes this architecture",
        )
    aligned = _keep_token_ids(ckpt.path, out / ENGINE_SUBDIR / "genai_config.json")
    # The builder rewrites tokenizer_config.json (model_max_length, its loading arguments): serve the checkpoint's own.
    copy_tokenizer_files(ckpt.path, out / ENGINE_SUBDIR)
    meta = ckpt.meta | {
        "backend": "cpu",
        "runtime": "onnxruntime-genai",
        "build_seconds": round(time.perf_counter() - t0, 1),
        # the model's files (its graph and weights), as a checkpoint's safetensors: what `choose: smallest` ranks
        "engine_bytes": sum(f.stat().st_size for f in (out / ENGINE_SUBDIR).iterdir() if ".onnx" in f.name),
        "checkpoint": ckpt.sha256,
        "checkpoint_path": str(ckpt.path),
        "builder_cmd": " ".join(cmd[1:]),
        "genai_config_aligned": aligned,
        **checked,
        **(written or {}),
    }
    return Artifact.create(
        "engine", out, {"engine": typed_config(config), "checkpoint": ckpt.config}, (ckpt.sha256,), meta
    )


def _keep_token_ids(ckpt_dir: Path, genai_path: Path) -> dict:
    """The builder derives its own stop ids (for SmolLM2 it adds <|im_start|> to eos); serve with the checkpoint's
    generation_config instead, so the engine stops where the baseline stops. Returns what was changed."""
    gen = ckpt_dir / "generation_config.json"
    if not gen.exists():
        return {}
    want = json.loads(gen.read_text())
    genai = json.loads(genai_path.read_text())
    changed = {}
    for k in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if k in want and genai["model"].get(k) != want[k]:
            changed[k] = {"builder": genai["model"].get(k), "kept": want[k]}
            genai["model"][k] = want[k]
    if changed:
        genai_path.write_text(json.dumps(genai, indent=4))
    return changed
