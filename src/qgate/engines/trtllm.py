"""TensorRT-LLM deployment bundle: the checkpoint plus an LLM-API options file sized from real traffic.

    art = build_trtllm(checkpoint_art, TrtllmConfig(), out, profile=profile_art)

Current TensorRT-LLM (PyTorch backend) has no engine-build step: `trtllm-serve CKPT
--extra_llm_api_options llm_api_options.yaml` serves the checkpoint directly. The
CUDA-graph batch sizes come from the traffic profile's observed concurrency. Where
`tensorrt_llm` imports with CUDA, the bundle is loaded, every batch size's graph is
captured and warmed, and a smoke generation must produce tokens; elsewhere the bundle
is still written and BackendUnavailable says why it could not be verified.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from qgate.artifact import Artifact, typed_config
from qgate.engines.batch_sizes import graph_batch_sizes, profile_concurrency
from qgate.errors import BackendUnavailable, ConfigError, check_each

KV_DTYPES = {None: "auto", "fp8": "fp8"}


@dataclass(frozen=True)
class TrtllmConfig:
    max_batch_size_cap: int = 256
    free_gpu_memory_fraction: float = 0.85
    verify: bool = True  # load, capture graphs, smoke-generate (needs CUDA + tensorrt_llm)
    VERSION = 1

    def __post_init__(self):
        fraction, cap = self.free_gpu_memory_fraction, self.max_batch_size_cap
        check_each(
            (not 0 < fraction <= 1, f"free_gpu_memory_fraction must be in (0, 1], got {fraction}"),
            (cap < 1, f"max_batch_size_cap must be >= 1, got {cap}"),
        )


def llm_api_options(ckpt: Artifact, config: TrtllmConfig, concurrency: dict) -> dict:
    from qgate.quantize.schemes import stored_format

    kv = stored_format(ckpt.path)[1]
    if kv not in KV_DTYPES:
        raise ConfigError(
            f"TensorRT-LLM's PyTorch backend serves KV cache as auto or fp8, not {kv!r}",
            hint="quantize with --kv-cache fp8 for TensorRT-LLM, or serve int8 KV on another engine",
        )
    sizes, max_batch = graph_batch_sizes(concurrency, config.max_batch_size_cap)
    return {
        "max_batch_size": max_batch,
        "cuda_graph_config": {"batch_sizes": sizes, "enable_padding": True},
        "kv_cache_config": {"dtype": KV_DTYPES[kv], "free_gpu_memory_fraction": config.free_gpu_memory_fraction},
    }


def build_trtllm(ckpt: Artifact, config: TrtllmConfig, out: Path, profile: Artifact | None = None) -> Artifact:
    concurrency = profile_concurrency(profile)
    options = llm_api_options(ckpt, config, concurrency)
    if config.verify and (reason := _unavailable_reason()):  # before anything is written: no unverified bundle
        raise BackendUnavailable(
            f"TensorRT-LLM bundle not built: it cannot be verified on this host ({reason})",
            hint="build it on a CUDA host with `pip install tensorrt-llm`, or pass --no-verify to write the bundle "
            "unverified",
        )
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(ckpt.path, out / "checkpoint", ignore=shutil.ignore_patterns("qgate-artifact.json"))
    (out / "llm_api_options.yaml").write_text(yaml.safe_dump(options, sort_keys=False))
    (out / "SERVE.md").write_text(
        "# Serve this bundle\n\n```\ntrtllm-serve checkpoint --backend pytorch --extra_llm_api_options "
        "llm_api_options.yaml\n```\n\n"
        f"CUDA-graph batch sizes {options['cuda_graph_config']['batch_sizes']} come from observed concurrency "
        f"({concurrency.get('method')}: p50={concurrency.get('p50')}, p90={concurrency.get('p90')}, "
        f"p99={concurrency.get('p99')}).\n"
    )
    meta = ckpt.meta | {
        "backend": "trtllm",
        "checkpoint": ckpt.sha256,
        "checkpoint_path": str(ckpt.path),
        "concurrency": concurrency,
        "verified": False,
    }
    parents = (ckpt.sha256,) + ((profile.sha256,) if profile else ())
    art_config = {"engine": typed_config(config), "llm_api_options": options, "checkpoint": ckpt.config}
    if config.verify:
        meta |= verify_bundle(out, options)
    return Artifact.create("engine", out, art_config, parents, meta)


def verify_bundle(out: Path, options: dict) -> dict:
    """Load the bundle, replay each captured batch size once, and smoke-generate (needs CUDA and tensorrt_llm)."""
    from tensorrt_llm import LLM, SamplingParams  # noqa: PLC0415
    from tensorrt_llm.llmapi import CudaGraphConfig, KvCacheConfig  # noqa: PLC0415

    t0 = time.perf_counter()
    llm = LLM(
        model=str(out / "checkpoint"),
        max_batch_size=options["max_batch_size"],
        cuda_graph_config=CudaGraphConfig(**options["cuda_graph_config"]),
        kv_cache_config=KvCacheConfig(**options["kv_cache_config"]),
    )
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=8, temperature=0.0)
    warm = {}
    for b in options["cuda_graph_config"]["batch_sizes"]:  # each captured graph is replayed once
        t = time.perf_counter()
        outs = llm.generate(["Say hello."] * b, params)
        warm[b] = round(time.perf_counter() - t, 3)
        if not all(o.outputs[0].token_ids for o in outs):
            raise BackendUnavailable(f"TensorRT-LLM smoke generation at batch {b} produced no tokens")
    llm.shutdown()
    return {"verified": True, "load_seconds": round(load_s, 1), "warm_seconds_by_batch": warm}


def _unavailable_reason() -> str | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device on this host"
    except ImportError:
        return "torch is not installed"
    try:
        import tensorrt_llm  # noqa: F401
    except Exception as e:  # the placeholder wheels raise at import
        return f"tensorrt_llm does not import ({type(e).__name__}: {str(e)[:200]})"
    return None
