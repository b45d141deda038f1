"""Build a serving engine for a checkpoint with the backend chosen by name.

art = build_engine(checkpoint_art, "cpu", out=Path("runs/awq-cpu"))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qgate.artifact import Artifact
from qgate.errors import InputError
from qgate.naming import Registry, build_config

BACKENDS: Registry[str] = Registry("engine backend")
BACKENDS.register("cpu", "onnxruntime-genai on CPU, int4 MatMulNBits kernels")
BACKENDS.register("trtllm", "TensorRT-LLM (PyTorch backend) bundle for NVIDIA GPUs")
BACKENDS.register("torch-int4", "torch int4 weight-only kernels, static KV cache, CUDA-graph decode (runs on CPU too)")


def engine_config(backend: str, where: str = "engine.options", **options: Any):
    """The frozen config for `backend`, with defaults filled in; unknown options are ConfigErrors naming `where`."""
    from qgate.engines.cpu import CpuEngineConfig
    from qgate.engines.torch_int4 import TorchInt4Config
    from qgate.engines.trtllm import TrtllmConfig

    BACKENDS.get(backend)  # unknown names fail with a suggestion
    configs = {"cpu": CpuEngineConfig, "trtllm": TrtllmConfig, "torch-int4": TorchInt4Config}
    return build_config(configs[backend], options, where)


def unsupported(ckpt: Artifact, backend: str) -> str | None:
    """Why `backend` cannot build this checkpoint's layout, or None. The pipeline then gates the checkpoint on the
    reference path and says so in the report, instead of failing a search result the engine cannot hold."""
    fmt = ckpt.meta.get("weight_format")
    if backend == "cpu" and fmt and "+" in fmt:
        from qgate.engines.cpu import SUPPORTED_FORMATS

        if fmt not in SUPPORTED_FORMATS:
            return (
                f"its layout is {fmt} ({len(ckpt.meta.get('fallback_layers', []))} layers fall back) and onnxruntime-genai's "
                f"builder takes only {', '.join(SUPPORTED_FORMATS)}"
            )
    return None


def build_engine(ckpt: Artifact, backend: str, out: Path, profile: Artifact | None = None, **options: Any) -> Artifact:
    config = engine_config(backend, **options)
    if ckpt.kind != "checkpoint":
        raise InputError(f"{ckpt.path}: engines are built from checkpoints, this is a {ckpt.kind}")
    if backend == "cpu":
        from qgate.engines.cpu import build_cpu

        return build_cpu(ckpt, config, out)
    if backend == "torch-int4":
        from qgate.engines.torch_int4 import build_torch_int4

        return build_torch_int4(ckpt, config, out, profile)
    from qgate.engines.trtllm import build_trtllm

    return build_trtllm(ckpt, config, out, profile)
