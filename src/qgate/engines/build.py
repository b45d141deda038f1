"""Build a serving engine for a checkpoint with the backend chosen by name.

    art = build_engine(checkpoint_art, "cpu", out=Path("runs/awq-cpu"))
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from qgate.artifact import Artifact
from qgate.errors import InputError
from qgate.naming import Registry

BACKENDS: Registry[str] = Registry("engine backend")
BACKENDS.register("cpu", "onnxruntime-genai on CPU, int4 MatMulNBits kernels")
BACKENDS.register("trtllm", "TensorRT-LLM (PyTorch backend) bundle for NVIDIA GPUs")


def build_engine(ckpt: Artifact, backend: str, out: Path, profile: Artifact | None = None, **options: Any) -> Artifact:
    BACKENDS.get(backend)  # unknown names fail with a suggestion
    if ckpt.kind != "checkpoint":
        raise InputError(f"{ckpt.path}: engines are built from checkpoints, this is a {ckpt.kind}")
    if backend == "cpu":
        from qgate.engines.cpu import CpuEngineConfig, build_cpu

        return build_cpu(ckpt, CpuEngineConfig(**options), out)
    from qgate.engines.trtllm import TrtllmConfig, build_trtllm

    return build_trtllm(ckpt, TrtllmConfig(**options), out, profile)
