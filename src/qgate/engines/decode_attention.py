"""Which kernels compute a decode step's attention in the torch-int4 engine, and the choice among them at build.

    why = unavailable("triton", device, head_dim=128)         # None where that kernel runs here
    record = choose_kernel(model, rows=[1, 8], slots=[256, 512], seconds=lambda f: graph_seconds(f, device))

A decode step's attention starts from the fused q/k/v projection's output of one token per row and ends with the
attention output [B, H * D] that o_proj reads. Kernels, by the name engine.json's `decode_attention` records:
- "sdpa": RoPE and the cache writes in one elementwise function (elementwise.rope_into_cache), then torch's
  scaled_dot_product_attention, torch choosing its kernel: two launches or more per layer, the attention's
  parallel over rows and K/V heads only.
- "triton": engines/decode_triton.py, RoPE, cache writes and attention in one kernel, its programs split along
  the key slots (splits_for) and the splits merged in a second kernel. It reads the step's `valid` slots itself, so
  a step on it builds no additive mask (StaticLlama.forward builds that only for the "sdpa" kernels).
- "triton-b32": the same, over 32-key blocks in two pipeline stages (the loop's registers halved, twice the splits
  on a short context).
- "triton-one-pass": the same kernel with one program per row and K/V head, no merge kernel.
The engine's build on a GPU times each kernel that runs there in CUDA graphs at the captured batch sizes and context
buckets, checks it computes what "sdpa" does, and records the fastest (choose_kernel).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from qgate.device import Seconds
from qgate.errors import in_one_line


@dataclass(frozen=True)
class TritonLayout:
    """How one named Triton kernel runs engines/decode_triton.py's kernel."""

    split: bool  # programs split along the key slots (splits_for) and merged by a second kernel; else one pass
    block: int  # key slots per block of the kernel's loop (a power of two from 16 up)
    stages: int | None  # software-pipelining stages of that loop (Triton's num_stages); None: Triton's default


TRITON = {
    "triton": TritonLayout(split=True, block=64, stages=None),
    "triton-b32": TritonLayout(split=True, block=32, stages=2),
    "triton-one-pass": TritonLayout(split=False, block=64, stages=None),
}
KERNELS = ("sdpa", *TRITON)
DEFAULT = "sdpa"
BLOCK = 64  # key slots per block of the "triton" kernel's loop
PROGRAMS = 256  # programs the split Triton kernel aims for per step: about two per SM on an H100 or H200 (132)
MAX_SPLITS = 64  # splits per row and K/V head at most: the merge kernel unrolls its loop over them
SAVING = 0.05  # share of the "sdpa" kernels' time another kernel must save to be chosen (choose_kernel)
TOLERANCE = 0.02  # of the largest magnitude: another kernel's largest difference from "sdpa" (catches a wrong kernel)


def unavailable(name: str, device: torch.device, head_dim: int) -> str | None:
    """None where kernel `name` runs on `device` for heads of head_dim, else why not. The Triton kernels run on CUDA
    with Triton installed (it comes with torch's CUDA wheels), or on a CPU under Triton's interpreter
    (TRITON_INTERPRET=1, as tests run them), for a head_dim that is a power of two from 16 up."""
    if name not in KERNELS:
        return f"{name!r} is not one of {', '.join(KERNELS)}"
    if name == "sdpa":
        return None
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the Triton kernels run on CUDA, not on {device.type}"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"the Triton kernels take a head_dim that is a power of two from 16 up, not {head_dim}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def splits_for(rows: int, kv_heads: int, slots: int, block: int = BLOCK) -> int:
    """Programs per row and K/V head along `slots` key slots: enough for PROGRAMS in all, at least `block` slots
    each, MAX_SPLITS at most."""
    return max(1, min(-(-slots // block), -(-PROGRAMS // (rows * kv_heads)), MAX_SPLITS))


def triton_attend(name: str, qkv, cos, sin, k_cache, v_cache, slot, valid, heads: int, kv_heads: int) -> torch.Tensor:
    """Kernel `name` (not "sdpa") on StaticLlama.decode_attend's arguments, `valid` [B, S] for the mask: [B, H * D]."""
    from qgate.engines.decode_triton import decode_attention

    lay = TRITON[name]
    splits = splits_for(qkv.shape[0], kv_heads, valid.shape[-1], lay.block) if lay.split else 1
    return decode_attention(
        qkv, cos, sin, k_cache, v_cache, slot, valid, heads, kv_heads, splits, lay.block, lay.stages
    )


def choose_kernel(model, rows: Sequence[int], slots: Sequence[int], seconds: Seconds) -> dict:
    """Set model.decode_kernel (StaticLlama) to the kernel whose decode-step attention, timed by seconds(f) (a CUDA
    graph's replay on a GPU) and summed over every batch size in `rows` and context bucket in `slots`, is the least,
    and at least SAVING below "sdpa"'s; a kernel is left out where it does not run here (unavailable), where it
    raises, or where on any of those shapes its output or cache writes differ from "sdpa"'s by more than TOLERANCE of
    their largest magnitude. The inputs are random, with each row's keys left-padded and the step's slot mid-bucket.
    Returns {"kernel", "us": {name: microseconds summed over the shapes}, "shapes": [[rows, slots], ...], "unavailable"
    and "rejected": {name: why}, where any}."""
    nq, nkv, d = model.heads, model.kv_heads, model.head_dim
    gen = torch.Generator(device=model.device).manual_seed(0)
    shapes = [(r, n) for r in sorted(set(rows)) for n in sorted(set(slots))]
    cases = []
    with torch.inference_mode():  # made as a forward makes them, so compiled functions compile nothing new
        for r, n in shapes:
            qkv = torch.randn(r, (nq + 2 * nkv) * d, generator=gen, device=model.device).to(model.dtype)
            pos = torch.arange(r, device=model.device)[:, None] + n // 2
            slot = torch.tensor([n // 2], device=model.device)
            keys = torch.arange(n, device=model.device)
            valid = (keys[None] >= torch.arange(r, device=model.device)[:, None] % 8) & (keys[None] <= slot)
            bias = model.attention_bias(valid, slot, r)  # [r, 1, G, n]
            with torch.inference_mode(False):  # as the model's caches are made, with rows to spare
                cache = torch.randn(2, r + 1, nkv, n, d, generator=gen, device=model.device).to(model.dtype)
            cases.append((qkv, model.cos[pos], model.sin[pos], cache, slot, valid, bias))

    def step(case) -> tuple[Callable[[], torch.Tensor], torch.Tensor, torch.Tensor]:
        """One call on the case's inputs, and the copy of its caches it writes (each kernel must write the slot): the
        caches' first rows, sliced from copies as a forward slices the model's."""
        qkv, cos, sin, cache, slot, valid, bias = case
        with torch.inference_mode(False):
            k_cache, v_cache = (c.clone()[: qkv.shape[0]] for c in cache)
        return lambda: model.decode_attend(qkv, cos, sin, k_cache, v_cache, slot, valid, lambda: bias), k_cache, v_cache

    def written(case) -> tuple[torch.Tensor, torch.Tensor]:
        """A call's output, and the slot's keys and values as it wrote them [2, B, Hkv, D]."""
        call, k_cache, v_cache = step(case)
        slot = case[4][0]
        return call(), torch.stack((k_cache[:, :, slot], v_cache[:, :, slot]))

    used = model.decode_kernel
    record: dict = {"us": {}, "shapes": [list(shape) for shape in shapes]}
    exact: list[list[torch.Tensor]] = []
    try:
        for name in KERNELS:
            why = unavailable(name, model.device, d)
            if why is not None:
                record.setdefault("unavailable", {})[name] = why
                continue
            model.decode_kernel = name
            try:
                with torch.inference_mode():  # as forwards run, so compiled functions meet what they were made for
                    got = [written(c) for c in cases]
                    exact = exact or got  # "sdpa", first
                    err = max(
                        float((y.float() - e.float()).abs().max() / e.float().abs().max().clamp(min=1e-30))
                        for g, e_ in zip(got, exact, strict=True)
                        for y, e in zip(g, e_, strict=True)
                    )
                    if not err <= TOLERANCE:
                        raise ValueError(f"differs from sdpa by {err:.3g} of its largest magnitude")
                    record["us"][name] = round(sum(seconds(step(c)[0]) for c in cases) * 1e6, 2)
            except Exception as e:  # noqa: BLE001 - a kernel that fails or errs is left out, and the record says why
                if name == DEFAULT:
                    raise
                record.setdefault("rejected", {})[name] = in_one_line(e)
    finally:
        model.decode_kernel = used
    us = record["us"]
    best = min(us, key=us.get)
    if us[best] > (1 - SAVING) * us[DEFAULT]:
        best = DEFAULT
    model.decode_kernel = record["kernel"] = best
    return record
