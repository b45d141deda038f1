"""A decode step's attention in one Triton kernel: RoPE on q and k, k and v into the cache, and attention over the
cache's slots, split across programs along the keys (flash-decoding), with a second kernel merging the splits.

    out = decode_attention(qkv, cos, sin, k_cache, v_cache, slot, valid, heads=32, kv_heads=8, splits=4, block=64)

Imported only where Triton is (engines/decode_attention.py loads it): this module imports triton at its top.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# a running maximum's start: finite, so a block whose keys are all masked adds exp(-inf) = 0
FLOOR = tl.constexpr(-1.0e30)


@triton.jit
def _partials(
    qkv,
    cos,
    sin,
    k_cache,
    v_cache,
    slot_ptr,
    valid,
    out,
    part_acc,
    part_ml,
    slots,
    s_qkv,
    s_cs,
    s_kb,
    s_kh,
    s_ks,
    s_vb,
    s_vh,
    s_vs,
    s_valid,
    s_out,
    scale,
    H: tl.constexpr,
    HKV: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    bh = tl.program_id(0)  # row b, K/V head h: b * HKV + h
    split = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)  # offsets in 64 bits: a large cache's row offset passes 2**31 elements
    h = bh % HKV
    d = tl.arange(0, D)
    half = (d + D // 2) % D  # rotate_half(x) * sin == x[half] * sin_signed
    g = tl.arange(0, GP)
    real = g < G  # GP >= 16 rows for tl.dot; the query heads of this K/V head are the first G
    slot = tl.load(slot_ptr)
    c = tl.load(cos + b * s_cs + d).to(tl.float32)
    s = tl.load(sin + b * s_cs + d).to(tl.float32)
    row = qkv + b * s_qkv
    qh = (h * G + g)[:, None] * D  # [GP, 1]
    q = tl.load(row + qh + d[None, :], mask=real[:, None], other=0.0).to(tl.float32)
    qr = tl.load(row + qh + half[None, :], mask=real[:, None], other=0.0).to(tl.float32)
    q = (q * c[None, :] + qr * s[None, :]).to(k_cache.dtype.element_ty)  # [GP, D], rounded once as the cache's
    ko = H * D + h * D
    k_new = tl.load(row + ko + d).to(tl.float32) * c + tl.load(row + ko + half).to(tl.float32) * s
    k_new = k_new.to(k_cache.dtype.element_ty)  # [D]
    v_new = tl.load(row + (H + HKV) * D + h * D + d).to(v_cache.dtype.element_ty)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, slots)
    kc = k_cache + b * s_kb + h * s_kh
    vc = v_cache + b * s_vb + h * s_vh
    mine = (slot >= start) & (slot < end) & (d < D)  # the one program whose keys hold the slot writes it
    tl.store(kc + slot * s_ks + d, k_new, mask=mine)
    tl.store(vc + slot * s_vs + d, v_new, mask=mine)
    m = tl.full([GP], FLOOR, tl.float32)
    lse = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    seen_row = valid + b * s_valid
    for j in range(0, CHUNK, BLOCK):
        keys = start + j + tl.arange(0, BLOCK)
        inside = keys < end
        k = tl.load(kc + keys[:, None] * s_ks + d[None, :], mask=inside[:, None], other=0.0)  # [BLOCK, D]
        v = tl.load(vc + keys[:, None] * s_vs + d[None, :], mask=inside[:, None], other=0.0)
        new = (keys == slot)[:, None]  # this step's key and value, from registers: no read after its own write
        k = tl.where(new, k_new[None, :], k)
        v = tl.where(new, v_new[None, :], v)
        # a key is seen where it holds a real token at or before the step's slot, and the step's own key always
        seen = tl.load(seen_row + keys, mask=inside, other=0) != 0
        seen = ((seen & (keys <= slot)) | (keys == slot)) & inside
        x = tl.dot(q, tl.trans(k)) * scale  # [GP, BLOCK] float32
        x = tl.where(real[:, None] & seen[None, :], x, float("-inf"))
        top = tl.maximum(m, tl.max(x, 1))
        p = tl.exp(x - top[:, None])
        alpha = tl.exp(m - top)
        lse = lse * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = top
    if ONE_PASS:
        o = acc / tl.where(real, lse, 1.0)[:, None]
        tl.store(out + b * s_out + qh + d[None, :], o.to(out.dtype.element_ty), mask=real[:, None])
    else:
        at = (bh * tl.num_programs(1) + split) * GP + g  # [GP]
        tl.store(part_acc + at[:, None] * D + d[None, :], acc, mask=real[:, None])
        tl.store(part_ml + at * 2, m, mask=real)
        tl.store(part_ml + at * 2 + 1, lse, mask=real)


@triton.jit
def _merge(
    part_acc,
    part_ml,
    out,
    splits,
    s_out,
    HKV: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
):
    bh = tl.program_id(0)
    b = (bh // HKV).to(tl.int64)
    h = bh % HKV
    d = tl.arange(0, D)
    g = tl.arange(0, GP)
    real = g < G
    m = tl.full([GP], FLOOR, tl.float32)
    lse = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for sp in tl.static_range(SPLITS):  # SPLITS: `splits` rounded up to a power of two; the rest add nothing
        at = (bh * splits + sp) * GP + g
        here = real & (sp < splits)
        ms = tl.load(part_ml + at * 2, mask=here, other=FLOOR)
        ls = tl.load(part_ml + at * 2 + 1, mask=here, other=0.0)
        a = tl.load(part_acc + at[:, None] * D + d[None, :], mask=here[:, None], other=0.0)
        top = tl.maximum(m, ms)
        alpha = tl.exp(m - top)
        beta = tl.exp(ms - top)
        lse = lse * alpha + ls * beta
        acc = acc * alpha[:, None] + a * beta[:, None]
        m = top
    o = acc / tl.where(real, lse, 1.0)[:, None]
    qh = (h * G + g)[:, None] * D
    tl.store(out + b * s_out + qh + d[None, :], o.to(out.dtype.element_ty), mask=real[:, None])


def decode_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    valid: torch.Tensor,
    heads: int,
    kv_heads: int,
    splits: int,
    block: int,
    stages: int | None = None,
) -> torch.Tensor:
    """One decode step's attention for rows of one token: qkv [B, (H + 2 Hkv) * D] (the fused projection's output),
    cos and sin [B, 1, D] (sin with its first half negated), caches [B, Hkv, >= S, D] written at `slot` ([1] long),
    valid [B, S] bool: which of the S slots attended hold a row's real tokens; each row sees those at or before the
    slot, and the slot. Returns [B, H * D], head h = kv head * G + g (G = H / Hkv query heads per K/V head).
    splits: programs per row and K/V head along the S slots, at most (1: no merge kernel), each over `block`-key
    blocks in `stages` software-pipelining stages (None: Triton's default). Each program's slots are a power of two,
    and the merge kernel is laid out for a power of two of splits, so any S compiles one of a few kernels, not one per
    S."""
    named = {"qkv": qkv, "cos": cos, "sin": sin, "k_cache": k_cache, "v_cache": v_cache, "valid": valid}
    strided = [k for k, t in named.items() if t.stride(-1) != 1]
    if strided:
        raise ValueError(f"decode_attention reads rows of contiguous elements: {', '.join(strided)} are strided")
    b, d = qkv.shape[0], cos.shape[-1]
    g, s = heads // kv_heads, valid.shape[-1]
    gp = max(16, triton.next_power_of_2(g))
    chunk = max(block, triton.next_power_of_2(triton.cdiv(s, splits)))
    splits = triton.cdiv(s, chunk)
    out = torch.empty(b, heads * d, dtype=k_cache.dtype, device=qkv.device)
    rows = b * kv_heads * splits * gp if splits > 1 else 1
    part_acc = torch.empty(rows, d, dtype=torch.float32, device=qkv.device)
    part_ml = torch.empty(rows, 2, dtype=torch.float32, device=qkv.device)
    kb, kh, ks, _ = k_cache.stride()
    vb, vh, vs, _ = v_cache.stride()
    _partials[(b * kv_heads, splits)](
        qkv, cos, sin, k_cache, v_cache, slot, valid, out, part_acc, part_ml,
        s, qkv.stride(0), cos.stride(0), kb, kh, ks, vb, vh, vs, valid.stride(0), out.stride(0), d**-0.5,
        H=heads, HKV=kv_heads, G=g, GP=gp, D=d, BLOCK=block, CHUNK=chunk, ONE_PASS=splits == 1,
        **({} if stages is None else {"num_stages": stages}),
    )  # fmt: skip
    if splits > 1:
        _merge[(b * kv_heads,)](
            part_acc, part_ml, out, splits, out.stride(0),
            HKV=kv_heads, G=g, GP=gp, D=d, SPLITS=triton.next_power_of_2(splits),
        )  # fmt: skip
    return out
