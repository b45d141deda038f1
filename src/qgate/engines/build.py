"""The serving-engine backends as one table: name -> config, builder, runner, and the variants it refuses.

    art = build_engine(checkpoint_art, "cpu", out=Path("runs/awq-cpu"))
    runner = load_runner(art)          # engines/runners.py, through this table

Building, loading for the gates and spec validation all read BACKENDS, so a new engine is one module and one row.
Each row names its functions as "module:function" and imports them only when used: `qgate --help` imports no
engine library.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from qgate.artifact import Artifact
from qgate.errors import ConfigError, InputError
from qgate.naming import Registry, build_config


@dataclass(frozen=True)
class Backend:
    name: str
    description: str
    config: str  # its frozen config class
    builder: str  # (checkpoint, config, out, profile) -> engine Artifact
    runner: str | None  # (engine artifact, device, dtype) -> engines.protocol.Runner; None: the gates cannot run it
    refuses: str | None = None  # (scheme name, scheme config, kv_cache) -> why it cannot serve that variant, or None
    cannot_hold: str | None = None  # (checkpoint) -> why it cannot hold this checkpoint's layout, or None
    serves: str = ""  # the schemes to choose instead, for a refusal's hint
    int8_layers: bool = False  # serves W8A16 Linears, the head included, with int8 kernels: a search may move layers
    # to W8 (search.fallback_bits: 8) and quantize the head (search.lm_head) only where this holds; elsewhere W8
    # layers would be served dense (DENSE_W8)
    group_sizes: str | None = None  # the int4 group sizes its kernels take (a tuple, by reference); None: any


DENSE_W8 = "as many bytes as unquantized weights with W8's rounding error on top"  # W8 layers served dense cost


def _load(ref: str) -> Any:
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


BACKENDS: Registry[Backend] = Registry("engine backend")
for _b in (
    Backend(
        "cpu",
        "onnxruntime-genai on CPU, int4 MatMulNBits kernels",
        "qgate.engines.cpu:CpuEngineConfig",
        "qgate.engines.cpu:build_cpu",
        "qgate.engines.cpu:load_runner",
        refuses="qgate.engines.cpu:refusal",
        cannot_hold="qgate.engines.cpu:cannot_hold",
        serves="a 4-bit scheme (awq-w4a16, gptq-w4a16) without kv_cache",
        int8_layers=True,
    ),
    Backend(
        "trtllm",
        "TensorRT-LLM (PyTorch backend) bundle for NVIDIA GPUs",
        "qgate.engines.trtllm:TrtllmConfig",
        "qgate.engines.trtllm:build_trtllm",
        None,
    ),
    Backend(
        "torch-int4",
        "torch int4 weight-only kernels, static KV cache, CUDA-graph decode (runs on CPU too)",
        "qgate.engines.torch_int4:TorchInt4Config",
        "qgate.engines.torch_int4:build_torch_int4",
        "qgate.engines.static_runner:load_runner",
        refuses="qgate.engines.torch_int4:refusal",
        cannot_hold="qgate.engines.torch_int4:cannot_hold",
        serves="awq-w4a16 or gptq-w4a16 without kv_cache",
        group_sizes="qgate.engines.int4pack:KERNEL_GROUPS",
    ),
):
    BACKENDS.register(_b.name, _b)


def backend(name: str) -> Backend:
    """The row for `name`; an unknown name fails with a suggestion."""
    return BACKENDS.get(name)


def engine_config(name: str, where: str = "engine.options", field_name=None, **options: Any):
    """The frozen config for backend `name`, with defaults filled in; errors name `where` (naming.build_config)."""
    return build_config(_load(backend(name).config), options, where, field_name=field_name)


def config_fields(name: str) -> tuple[str, ...]:
    """The options backend `name` takes: its config's fields."""
    return tuple(f.name for f in fields(_load(backend(name).config)))


def refusal(
    name: str, scheme_name: str, scheme, kv_cache: str | None, fine_group_size: int | None = None
) -> str | None:
    """Why backend `name` could never serve a variant of this scheme and KV cache (and a search's finer-group rung),
    or None: checked at spec load, after the spec has refused a backend the gates cannot run (`Backend.runner` None),
    so that a group size its kernels lack fails there and not at the build after quantizing or searching."""
    row = backend(name)
    why = _load(row.refuses)(scheme_name, scheme, kv_cache) if row.refuses else None
    if why or not row.group_sizes:
        return why
    sizes = _load(row.group_sizes)
    takes = f"the {name} engine's int4 kernels take group sizes {', '.join(map(str, sizes))}"
    if getattr(scheme, "num_bits", None) == 4 and scheme.group_size not in sizes:
        return (
            f"{takes}; scheme {scheme_name} has group_size {scheme.group_size} (set options.group_size to one of them)"
        )
    if fine_group_size and fine_group_size not in sizes:
        return f"{takes}; search.fine_group_size is {fine_group_size} (set it to one of them, or drop it)"
    return None


def unsupported(ckpt: Artifact, name: str) -> str | None:
    """Why backend `name` cannot build this checkpoint's layout, or None. The pipeline then gates the checkpoint on the
    reference path and says so in the report, instead of failing a search result the engine cannot hold."""
    row = backend(name)
    return _load(row.cannot_hold)(ckpt) if row.cannot_hold else None


def check_served_as_stored(ckpt: Artifact, engine: str, kv_cache: str) -> None:
    """ConfigError, before a build, for what a checkpoint's config.json stores that `engine` would not serve as
    stored: run-time rotations (quantize.schemes.online_transforms), or a quantized KV cache (kv_cache: how the
    engine keeps its KV cache instead). Read from the file, whatever the manifest says (an imported checkpoint's)."""
    from qgate.quantize.schemes import online_transforms, stored_format

    keep = "gate the checkpoint on the reference path, which serves it as stored"
    if rotations := online_transforms(ckpt.path):
        raise ConfigError(
            f"{ckpt.path}: quantization_config.transform_config rotates activations as the model runs "
            f"({', '.join(sorted(rotations))}): the {engine} engine applies no such rotation",
            hint=keep,
        )
    if kv := stored_format(ckpt.path)[1]:
        raise ConfigError(
            f"{ckpt.path}: KV cache {kv}: the {engine} engine keeps its KV cache {kv_cache}",
            hint=f"quantize without --kv-cache for this engine, or {keep}",
        )


def build_engine(ckpt: Artifact, name: str, out: Path, profile: Artifact | None = None, **options: Any) -> Artifact:
    config = engine_config(name, **options)
    if ckpt.kind != "checkpoint":
        raise InputError(f"{ckpt.path}: engines are built from checkpoints, this is a {ckpt.kind}")
    return _load(backend(name).builder)(ckpt, config, out, profile)


def engine_runner(art: Artifact, device: str, dtype: str):
    """The runner for an engine artifact, by the backend its manifest names; None when the gates cannot run it."""
    name = art.meta.get("backend")
    row = backend(name) if name in BACKENDS.names() else None
    return _load(row.runner)(art, device, dtype) if row is not None and row.runner else None
