"""GPU engine from torch itself: int4 weight-only kernels, a static KV cache, decode steps captured as CUDA graphs.

    art = build_torch_int4(checkpoint_art, TorchInt4Config(), out=Path("runs/awq-int4"), profile=profile_art)
    runner = load_runner(art)        # engines.static_runner.StaticRunner: what the gate scores

A W4A16 compressed-tensors checkpoint is repacked without requantizing (engines/int4pack.py): its integer codes and
scales are kept, and GPTQ/AWQ integer zero points fold into the kernel's float zeros. Unquantized layers (a searched
checkpoint's fallback layers, or a whole unquantized checkpoint) are served as dense weights in `dtype`. Serves
Llama-architecture checkpoints (engines/static_llama.py) with a KV cache in `dtype`. Refused at spec load and at
build: 8-bit layers (torch has no group-wise int8 kernel, so they would be served dense: as many bytes as unquantized
ones, with W8's rounding on top), FP8 weights, activation quantization and quantized KV caches. The decode step is
captured as one CUDA graph per batch size the traffic profile's concurrency gives (engines/batch_sizes.py, the sizes
the TensorRT-LLM bundle records); on a CPU the same model runs eagerly on torch's CPU int4 kernel, which is how CI
checks its numerics.

Layout of `out`:
  engine.safetensors   dense tensors in `dtype`; per int4 Linear `<prefix>.codes` [O, I/2] uint8 and
                       `<prefix>.scales_and_zeros` [G, O, 2] float32
  engine.json          dtype, layer kinds, group sizes, graph batch sizes, KV slots, and (built on a GPU) the int4
                       kernels' layouts, `int4_splits` {"<O>x<I>/g<group>": split factor} (int4pack.split_k), and
                       the decode step's attention kernel, `decode_attention` (engines/decode_attention.py)
  checkpoint/          the config, generation config and tokenizer files it serves with (the contract reads these)
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from qgate.artifact import Artifact, typed_config
from qgate.engines.batch_sizes import graph_batch_sizes, profile_concurrency
from qgate.engines.build import DENSE_W8
from qgate.errors import InputError, check_each
from qgate.trust import copy_tokenizer_files

DTYPES = ("bfloat16", "float32")  # float32: CPU only, for checking the engine's numerics exactly
NO_INT8 = "the torch-int4 engine has no int8 kernel (torch has no group-wise int8 weight-only one)"


@dataclass(frozen=True)
class TorchInt4Config:
    dtype: str = "bfloat16"  # activations, dense weights and the KV cache (torch's CUDA int4 kernel takes bf16)
    max_seq_len: int = 4096  # KV slots of the captured decode graphs, capped at the model's context length
    max_batch_size_cap: int = 256
    verify: bool = True  # load, capture every batch size's graph (on CUDA), and decode a few tokens
    VERSION = 1

    def __post_init__(self):
        check_each(
            (self.dtype not in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"),
            (self.max_seq_len < 16, f"max_seq_len must be >= 16, got {self.max_seq_len}"),
            (self.max_batch_size_cap < 1, f"max_batch_size_cap must be >= 1, got {self.max_batch_size_cap}"),
        )


def refusal(scheme_name: str, scheme, kv_cache: str | None) -> str | None:
    """Why this engine cannot serve a variant of this scheme config and KV cache, or None: checked at spec load."""
    from qgate.quantize.schemes import weight_format as format_of

    weight_format, actorder = format_of(scheme), getattr(scheme, "actorder", None)
    if "w8a16" in weight_format.split("+"):
        return f"{NO_INT8}: {scheme_name}'s layers would be served as dense {TorchInt4Config.dtype}, {DENSE_W8}"
    if not all(part in ("w4a16", "unquantized") for part in weight_format.split("+")):
        return f"the torch-int4 engine serves 4-bit integer weights with float activations, not {weight_format}"
    if actorder == "group":
        return "the torch-int4 engine cannot serve GPTQ's group activation order (actorder: group)"
    if kv_cache:
        return f"the torch-int4 engine keeps its KV cache in the activation dtype, not {kv_cache}"
    return None


def cannot_hold(ckpt: Artifact) -> str | None:
    """Why this engine cannot serve this checkpoint's layout as it is stored (a searched mix with W8 layers), or
    None: the pipeline then gates the checkpoint on the reference path and says why."""
    fmt = ckpt.meta.get("weight_format") or ""
    if "w8a16" in fmt.split("+"):
        return f"its layout is {fmt}, and {NO_INT8}: its W8 layers would be served as dense weights"
    return None


def check_checkpoint(ckpt: Artifact) -> dict:
    """The checkpoint's config.json, or ConfigError naming what this engine cannot serve."""
    from qgate.engines.build import check_served_as_stored
    from qgate.engines.int4pack import check_scheme
    from qgate.engines.static_llama import check_architecture

    if ckpt.kind != "checkpoint":
        raise InputError(f"{ckpt.path}: engines are built from checkpoints, this is a {ckpt.kind}")
    cfg = json.loads((ckpt.path / "config.json").read_text())
    check_architecture(cfg)
    if qconfig := cfg.get("quantization_config"):
        check_scheme(qconfig, str(ckpt.path), f"{NO_INT8}: they would be served as dense weights, {DENSE_W8}")
    check_served_as_stored(ckpt, "torch-int4", "in the activation dtype")
    return cfg


def build_torch_int4(ckpt: Artifact, config: TorchInt4Config, out: Path, profile: Artifact | None = None) -> Artifact:
    import torch
    from safetensors.torch import load_file, save_file

    from qgate.engines.gptq_layout import packed_layers
    from qgate.engines.int4pack import repack
    from qgate.engines.static_runner import SERVED_FILES, SERVED_SUBDIR, WEIGHTS_FILE

    cfg = check_checkpoint(ckpt)
    t0 = time.perf_counter()
    state: dict = {}
    for f in sorted(ckpt.path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    layers, kinds = repack(state, cfg["quantization_config"]) if cfg.get("quantization_config") else ({}, {})
    dtype = getattr(torch, config.dtype)
    tensors: dict[str, torch.Tensor] = {}
    for p, w in layers.items():
        tensors[f"{p}.codes"], tensors[f"{p}.scales_and_zeros"] = w.codes, w.scales_and_zeros
    for k, v in packed_layers(state)[1].items():
        tensors[k] = v.to(dtype) if v.is_floating_point() else v
    concurrency = profile_concurrency(profile)
    sizes, max_batch = graph_batch_sizes(concurrency, config.max_batch_size_cap)
    spec = {
        "format": 1,
        "dtype": config.dtype,
        "max_seq_len": min(config.max_seq_len, int(cfg.get("max_position_embeddings", 2048))),
        "graph_batch_sizes": sizes,
        "max_batch_size": max_batch,
        "layers": kinds,
        "group_sizes": {p: w.group_size for p, w in layers.items()},
    }
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    (out / SERVED_SUBDIR).mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / "engine.json").write_text(json.dumps(spec, indent=2))
    for name in SERVED_FILES:
        if (ckpt.path / name).is_file():
            shutil.copyfile(ckpt.path / name, out / SERVED_SUBDIR / name)
    copy_tokenizer_files(ckpt.path, out / SERVED_SUBDIR)
    counts = {k: list(kinds.values()).count(k) for k in sorted(set(kinds.values()))}
    meta = ckpt.meta | {
        "backend": "torch-int4",
        "runtime": f"torch {torch.__version__}",
        "checkpoint": ckpt.sha256,
        "checkpoint_path": str(ckpt.path),
        "concurrency": concurrency,
        "graph_batch_sizes": sizes,
        "layer_kinds": counts,
        "engine_bytes": (out / WEIGHTS_FILE).stat().st_size,
        "build_seconds": round(time.perf_counter() - t0, 1),
        "verified": False,
    }
    if config.verify:
        meta |= verify_engine(out)
    parents = (ckpt.sha256,) + ((profile.sha256,) if profile else ())
    return Artifact.create("engine", out, {"engine": typed_config(config), "checkpoint": ckpt.config}, parents, meta)


def verify_engine(out: Path) -> dict:
    """Load the engine on this host's device, capture its graphs (CUDA), and decode 4 tokens at every captured batch
    size (batch 1 on a CPU); InputError if a row produces no token. On CUDA the load first picks each int4 weight
    shape's kernel layout and the decode step's attention kernel by timing them (StaticRunner's choose_kernels), and
    engine.json records them as `int4_splits` and `decode_attention`; the timings go to the artifact's metadata."""
    from qgate.device import resolve_device
    from qgate.engines.static_runner import StaticRunner

    t0 = time.perf_counter()
    runner = StaticRunner(out, resolve_device("auto"), choose_kernels=True)
    load_s = time.perf_counter() - t0
    # the int4 kernels' layouts and the decode attention kernel this device serves fastest: every later load uses them
    spec = runner.spec | ({"int4_splits": {k: v["split"] for k, v in runner.splits.items()}} if runner.splits else {})
    spec |= {"decode_attention": runner.decode_choice["kernel"]} if runner.decode_choice else {}
    if spec != runner.spec:
        (out / "engine.json").write_text(json.dumps(spec, indent=2))
    prompt = runner.tokenizer.encode("Say hello.")
    sizes = sorted({b for b, _ in runner.graphs}) or [1]
    for b in sizes:
        answers = runner.greedy_batch([prompt] * b, 4)
        if not all(answers):
            raise InputError(f"{out}: the torch-int4 engine's smoke decode at batch {b} produced no tokens")
    return (
        {
            "verified": True,
            "verified_on": str(runner.device),
            "load_seconds": round(load_s, 2),
            "captured_batch_sizes": sizes,
            "captured_graphs": len(runner.graphs),
            "numerics": runner.numerics,
        }
        | ({"int4_splits": runner.splits} if runner.splits else {})
        | ({"decode_attention": runner.decode_choice} if runner.decode_choice else {})
    )
