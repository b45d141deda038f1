"""Which kernels a loaded torch-int4 model runs, and how each gives way where it cannot run.

    splits = choose_splits(model, device, sizes, seconds)   # {} and every kernel unsplit where timing fails
    compile_ops(model, device)                               # compiled elementwise work where it compiles
    serve_decode(model, device, "triton", engine_dir)        # engine.json's decode kernel, or "sdpa" with a warning
    numerics(model, device, "bfloat16")                      # "cuda-torch-int4-bfloat16-splitk-compiled"

A layout, a decode kernel or compiled elementwise work is a speed-up, never a need: where choosing or running one
fails, the model falls back to the plain kernel (unsplit int4, "sdpa" decode, eager elementwise work) with a warning
on the "qgate" logger that says why, and `numerics` says what runs. engines/static_runner.py calls these at load.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from qgate.device import Seconds
from qgate.engines import decode_attention, elementwise, int4_choice
from qgate.engines.static_llama import StaticLlama
from qgate.errors import ConfigError, in_one_line


def _warn(what: str, why: str) -> None:
    """One warning on the "qgate" logger: what now runs, and why."""
    logging.getLogger("qgate").warning("%s: %s", what, why)


def choose_splits(model: StaticLlama, device: torch.device, sizes: Sequence[int], seconds: Seconds) -> dict:
    """int4_choice.choose_splits at the batch sizes `sizes`: its record, with the model's kernels laid out so; where
    it fails, {} and every int4 kernel unsplit, with a warning."""
    try:
        fused = bool(elementwise.COMPILED.get(device.type))  # the sums then run inside compiled kernels
        return int4_choice.choose_splits(model, sizes, seconds, fused)
    except Exception as e:  # noqa: BLE001 - the unsplit kernels serve: a layout is a speed-up, not a need
        for m in model.modules():
            if getattr(m, "split", 1) > 1:
                m.resplit(1)
        _warn("the torch-int4 engine's int4 kernels stay unsplit: choosing their layouts failed", in_one_line(e))
        return {}


def compile_ops(model: StaticLlama, device: torch.device) -> None:
    """Forwards with compiled elementwise work where elementwise.COMPILED names the device, else left as they are."""
    if elementwise.COMPILED.get(device.type):
        why = model.compile()
        if why is not None:
            eager(model, why)


def eager(model: StaticLlama, why: str) -> None:
    """Forwards run their elementwise work eagerly from now on, with a warning saying why."""
    model.ops = elementwise.EAGER
    _warn("the torch-int4 engine runs its elementwise work eagerly", why)


def choose_decode(model: StaticLlama, sizes: Sequence[int], buckets: Sequence[int], seconds: Seconds) -> dict:
    """decode_attention.choose_kernel at `sizes` and every context bucket: its record, with the model's decode steps
    on the kernel it chose; where it fails, {} and the "sdpa" kernels, with a warning."""
    try:
        return decode_attention.choose_kernel(model, sizes, buckets, seconds)
    except Exception as e:  # noqa: BLE001 - "sdpa" serves: another kernel is a speed-up, not a need
        sdpa_decode(model, f"choosing a kernel failed: {in_one_line(e)}")
        return {}


def serve_decode(model: StaticLlama, device: torch.device, name: str, engine_dir: Path) -> None:
    """Decode steps run kernel `name` (engine.json's decode_attention) where it runs here; a kernel that runs on
    CUDA only gives way to "sdpa" on a CPU, and on CUDA with a warning. ConfigError for a name qgate lacks."""
    if name not in decode_attention.KERNELS:
        kernels = ", ".join(decode_attention.KERNELS)
        raise ConfigError(
            f"{engine_dir}/engine.json: decode_attention {name!r} is not one of {kernels}",
            hint="rebuild the engine with this qgate",
        )
    why = decode_attention.unavailable(name, device, model.head_dim)
    if why is None:
        model.decode_kernel = name
    elif device.type == "cuda":
        sdpa_decode(model, f"engine.json names {name!r}, and {why}")


def sdpa_decode(model: StaticLlama, why: str) -> None:
    """Decode steps run the "sdpa" kernels from now on, with a warning saying why."""
    model.decode_kernel = decode_attention.DEFAULT
    _warn("the torch-int4 engine's decode steps run the sdpa kernels", why)


def numerics(model: StaticLlama, device: torch.device, dtype: str) -> str:
    """What computes the model's logits: device, engine, dtype, then '-splitk' where an int4 kernel is split, the
    decode attention kernel where it is not "sdpa", and '-compiled' where the elementwise work is."""
    tags = [f"{device.type}-torch-int4-{dtype}"]
    tags += ["splitk"] if any(getattr(x, "split", 1) > 1 for x in model.modules()) else []
    tags += [model.decode_kernel] if model.decode_kernel != decode_attention.DEFAULT else []
    return "-".join(tags + (["compiled"] if model.ops is not elementwise.EAGER else []))
