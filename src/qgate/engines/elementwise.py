"""The decoder's work between its Linears, as pure tensor functions over rows of tokens, and their compiled form.

    ops, why = compiled_ops(hidden=4096, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, device=cuda)
    x, h = ops.add_rms_norm(x, delta, weight, eps)          # residual add and the next RMSNorm, [N, H]

Eagerly, a layer runs 13 elementwise kernels besides its four Linears and attention (norms, RoPE, cache writes,
residual adds, SiLU). In a decode step each moves a few kilobytes, so each costs its launch, even inside a CUDA
graph; in a prefill each is a pass over memory. torch.compile (inductor) fuses each function here into one kernel.
`compiled_ops` compiles them, checks them against the eager functions on this device, and says why not where it
cannot. A Linear's output that these functions read may come as a split int4 kernel's partials
(int4pack.split_parts, [N, s, s, O]): they add them first, so compiled, the partials' sum costs no kernel of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.nn import functional as F  # noqa: N812

from qgate.engines.int4pack import split_sum
from qgate.errors import in_one_line

COMPILED = {"cuda": True}  # devices whose runners compile the elementwise work of every forward (compiled_ops)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in one kernel where torch has a fused one (CUDA): normalized and scaled in float32, rounded once to the
    activation dtype. transformers' LlamaRMSNorm rounds twice, after normalizing and after scaling, in eight kernels;
    the two differ by at most one rounding step of the activation dtype, which engine parity measures."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers computes it, x * cos + rotate_half(x) * sin, in four kernels: rotate_half(x) * sin equals
    roll(x, D/2) * sin_signed exactly, where sin_signed negates the first half of sin."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream x + delta and its RMSNorm, both [N, H]; delta [N, H], or split partials of it."""
    x = x + split_sum(delta)
    return x, rms_norm(x, weight, eps)


def rope(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, H, D], k and v [N, Hkv, D] from the projections' outputs side by side, qkv [N, (H + 2 Hkv) * D] or split
    partials of it; q and k rotated together (cos, sin [N, 1, D])."""
    qkv = split_sum(qkv)
    n, d = heads + kv_heads, cos.shape[-1]
    qk = rotate(qkv[:, : n * d].view(-1, n, d), cos, sin)
    return qk[:, :heads], qk[:, heads:], qkv[:, n * d :].view(-1, kv_heads, d)


def rope_into_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
) -> torch.Tensor:
    """A decode step's rope, one token per row (N = B): k and v written into the caches [B, Hkv, S, D] at `slot`
    [1]; returns q [B, H, 1, D]."""
    q, k, v = rope(qkv, cos, sin, heads, kv_heads)
    k_cache.index_copy_(2, slot, k[:, :, None])
    v_cache.index_copy_(2, slot, v[:, :, None])
    return q[:, :, None]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's product silu(gate) * up, [N, I]; gate and up [N, I], or split partials of them."""
    return F.silu(split_sum(gate)) * split_sum(up)


class Ops(NamedTuple):
    add_rms_norm: object
    rope: object
    rope_into_cache: object
    silu_mul: object


EAGER = Ops(add_rms_norm, rope, rope_into_cache, silu_mul)


def compiled_ops(
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    eps: float = 1e-5,
    splits: Sequence[int] = (),
    any_cache_rows: bool = True,
) -> tuple[Ops, str | None]:
    """EAGER's functions compiled by torch.compile for `device`, or EAGER and why not.

    Each is compiled with dynamic shapes and called here in inference mode on inputs laid out as the model's (rows
    of one token and of several, cache rows sliced from a larger cache, gate and up as views of one projection's
    output, the norm's weight and the caches made outside inference mode), at one row and at three (torch
    specializes a size of 1), with the model's RMSNorm epsilon `eps` (a constant of the compiled kernel), so later
    forwards and graph captures compile nothing more. splits:
    the split_k factors of the int4 kernels whose partials the functions read besides whole outputs; each is
    compiled with its partials' split dimensions static, so the sum unrolls into the function's own kernel. The
    compiled results must match the eager ones within 2% of their largest magnitude: one rounding step of bf16 is
    under 1%, so this catches a wrong kernel, not the rounding order, which engine parity measures. any_cache_rows:
    the caches' row count is left unbacked, so one graph serves caches of any rows, one included; where that does not
    compile, the functions are compiled again without it (a cache of other rows then compiles once more at first
    use), with a warning; where that fails too, EAGER and the first failure."""
    try:
        ops = Ops(*(torch.compile(f, dynamic=True, fullgraph=True) for f in EAGER))
        gen = torch.Generator(device=device).manual_seed(0)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

        def held(*shape: int) -> torch.Tensor:
            """A tensor the model holds (a norm's weight, a cache), made outside inference mode as the model's are:
            forwards run in inference mode, and a compiled function made for one kind of tensor recompiles for the
            other."""
            with torch.inference_mode(False):
                return randn(*shape)

        def output(n: int, width: int, s: int, chunks: int = 1) -> list[torch.Tensor]:
            """A Linear's output [n, width], or its split_k partials [n, s, s, width] with s held static, as
            `chunks` views along the outputs (a fused projection's parts)."""
            if s == 1:
                return list(randn(n, width).chunk(chunks, -1))
            y = randn(n * s, s * width).view(n, s, s, width)  # laid out as int4pack.split_parts leaves them
            parts = list(y.chunk(chunks, -1))
            for part in parts:
                torch._dynamo.mark_static(part, 1)
                torch._dynamo.mark_static(part, 2)
            return parts

        with torch.inference_mode():
            for n in (1, 3):
                for s in sorted({1, *splits}):
                    x, (delta,), w = randn(n, hidden), output(n, hidden, s), held(hidden)
                    (qkv,), cos, sin = (
                        output(n, (heads + 2 * kv_heads) * head_dim, s),
                        randn(n, 1, head_dim),
                        randn(n, 1, head_dim),
                    )
                    gate, up = output(n, 2 * hidden + 6, s, chunks=2)  # views, as a fused gate/up projection's
                    slot = torch.tensor([5], device=device)

                    def run(o: Ops) -> list[torch.Tensor]:
                        k, v = (held(n + 1, kv_heads, 11, head_dim).zero_() for _ in range(2))
                        for c in (k, v) if any_cache_rows else ():  # a cache's rows do not shape the kernel
                            torch._dynamo.decorators.mark_unbacked(c, 0)
                        q = o.rope_into_cache(qkv, cos, sin, heads, kv_heads, k[:n], v[:n], slot)
                        rotated = o.rope(qkv, cos, sin, heads, kv_heads)
                        return [*o.add_rms_norm(x, delta, w, eps), *rotated, q, k, v, o.silu_mul(gate, up)]

                    for got, want in zip(run(ops), run(EAGER), strict=True):
                        err = (got.float() - want.float()).abs().max().item()
                        if not err <= 0.02 * want.float().abs().max().item():
                            return EAGER, f"a compiled kernel differs from eager by {err:.3g}" + (
                                f" on split partials ({s} blocks)" if s > 1 else ""
                            )
    except Exception as e:  # noqa: BLE001 - any compiler failure leaves the eager functions, and says why
        why = f"torch.compile failed: {in_one_line(e)}"
        if any_cache_rows:
            ops, again = compiled_ops(hidden, heads, kv_heads, head_dim, dtype, device, eps, splits, False)
            if again is None:
                logging.getLogger("qgate").warning(
                    "the elementwise functions are compiled for caches of the rows they meet, not of any rows: %s", why
                )
                return ops, None
        return EAGER, why
    return ops, None
