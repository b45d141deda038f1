"""Repack compressed-tensors integer weights for torch's int4 weight-only kernels, without requantizing.

    layers = repack(state_dict, quantization_config)     # {prefix: Int4Weight}
    packed = device_pack(layers[p].codes, device)         # the device's tiled layout, built at load
    y = int4_mm(x, packed, layers[p].group_size, layers[p].scales_and_zeros)   # x [N, I] -> y [N, O]
    w4 = split_k(layers[p], 4)                            # the same weight as 4 blocks of I/4 inputs, stacked
    y = split_mm(x, device_pack(w4.codes, device), w4.group_size, w4.scales_and_zeros, 4)   # the same y
    y = split_sum(split_parts(x, device_pack(w4.codes, device), w4.group_size, w4.scales_and_zeros, 4))  # the same

torch's kernels (`aten._weight_int4pack_mm` on CUDA, `_weight_int4pack_mm_for_cpu` on the CPU) compute, per
group of `group_size` input columns,

    w = (q - 8) * scale + zero         q: unsigned 4-bit code, scale and zero: floats per (group, output row)

compressed-tensors stores w = (q - z) * scale with an integer zero point z (8 when symmetric). Folding z into
the float zero, zero = (8 - z) * scale, gives the same weight up to the rounding of `zero` to the activation
dtype: the integer codes and the scales are carried over unchanged. Shapes, for a Linear with O outputs, I inputs
and G = I / group_size groups:

  compressed-tensors                   portable (engine.safetensors)         device (built at load)
  weight_packed     [O, I/8] int32     codes            [O, I/2] uint8       CUDA: _convert_weight_to_int4pack
  weight_scale      [O, G]   float     scales_and_zeros [G, O, 2] float32    CPU:  _convert_weight_to_int4pack_for_cpu
  weight_zero_point [O/8, G] int32     (the even column in the high nibble)

torch's CUDA kernel runs one thread block per 8 outputs, each looping over all inputs, so a weight with few outputs
(4096 of them, for q/k/v and o of an 8B model) keeps the card's memory system partly idle at one row. `split_k`
re-lays a weight as s blocks of I/s inputs stacked along the outputs, [s*O, I/s]: the kernel then runs s times the
thread blocks over the same bytes. `split_mm` feeds x as s rows of I/s inputs (a view) and sums each block's product
with its own rows; those s rows share the kernel's 16-row tile with the one row they replace. The arithmetic differs
from the unsplit kernel's by rounding: each block's partial sum is rounded to x's dtype before the s are added.
`split_parts` stops before that sum, so a compiled function that reads the output can add the partials in its own
kernel (engines/elementwise.py) instead of a reduction kernel of their own.

Anything else is refused: 8-bit layers (torch has no group-wise int8 weight-only kernel, and serving them dense would
cost as many bytes as unquantized weights, with W8's rounding on top), FP8, activation quantization and group
activation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qgate.engines.gptq_layout import layer_bits, layer_codes, packed_layers
from qgate.errors import ConfigError

KERNEL_GROUPS = (32, 64, 128, 256)  # group sizes torch's int4 kernels take


@dataclass(frozen=True)
class Int4Weight:
    codes: torch.Tensor  # [O, I/2] uint8: codes 0..15, column 2j in the high nibble, 2j+1 in the low
    scales_and_zeros: torch.Tensor  # [G, O, 2] float32: (scale, folded zero)
    group_size: int


def check_scheme(qconfig: dict, where: str = "", w8_why: str | None = None) -> None:
    """ConfigError unless every quantized layer is a group-wise integer weight with float activations. where: what
    the message names first (the checkpoint's path). w8_why: why 8-bit weight-only layers in particular cannot be
    served, where the caller says more of them than that they are not 4-bit."""
    at = f"{where}: " if where else ""
    groups = qconfig.get("config_groups") or {}
    if qconfig.get("format") not in ("pack-quantized", "mixed-precision") or not groups:
        raise ConfigError(
            f"{at}the torch-int4 engine takes pack-quantized integer weights, this checkpoint is "
            f"{qconfig.get('format') or 'unquantized'}",
            hint="quantize with awq-w4a16 or gptq-w4a16; W8A16 and FP8 checkpoints run on the reference path",
        )
    for name, g in groups.items():
        w, a = g.get("weights") or {}, g.get("input_activations")
        if w8_why and not a and w.get("type") == "int" and w.get("num_bits") == 8:
            raise ConfigError(
                f"{at}quantization_config.config_groups.{name}: 8-bit layers, and {w8_why}",
                hint="gate a W8A16 checkpoint on the reference path (no engine); a search for this engine keeps "
                "its fallen-back layers unquantized (search.fallback_bits: 16)",
            )
        int4 = w.get("type") == "int" and w.get("num_bits") == 4 and w.get("strategy") == "group"
        if a or not int4 or w.get("actorder") == "group":
            raise ConfigError(
                f"{at}quantization_config.config_groups.{name}: the torch-int4 engine serves 4-bit group-wise int "
                f"weights with float activations and no group activation order, got weights={w}, "
                f"input_activations={a}",
                hint="use actorder static or null, and a W4A16 scheme",
            )


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[O, I] codes 0..15 -> [O, I/2] uint8, column 2j in the high nibble (the layout aten's CUDA packer reads)."""
    c = codes.to(torch.uint8)
    return (c[:, ::2] << 4) | c[:, 1::2]


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[O, I/2] uint8 -> [O, I] int32 codes."""
    hi, lo = (packed >> 4).to(torch.int32), (packed & 0xF).to(torch.int32)
    return torch.stack([hi, lo], -1).reshape(packed.shape[0], -1)


def repack(state: dict[str, torch.Tensor], qconfig: dict) -> tuple[dict[str, Int4Weight], dict[str, str]]:
    """Every quantized Linear of a compressed-tensors state dict: ({prefix: Int4Weight}, {prefix: "int4"}).
    Unquantized tensors are left to the caller."""
    check_scheme(qconfig)
    out: dict[str, Int4Weight] = {}
    kinds: dict[str, str] = {}
    for p in packed_layers(state)[0]:
        bits = layer_bits(state, p)
        codes, zeros, scale = layer_codes(state, p, bits)
        scale = scale.float()
        group = codes.shape[1] // scale.shape[1]
        if group not in KERNEL_GROUPS or codes.shape[1] % group or codes.shape[0] % 8:
            raise ConfigError(
                f"{p}: int4 weight [{codes.shape[0]}, {codes.shape[1]}] with group size {group}: torch's "
                f"int4 kernel needs a group size in {KERNEL_GROUPS} and a multiple of 8 outputs",
                hint="quantize with group_size 32..256, or gate this checkpoint on the reference path",
            )
        folded = (8 - zeros).float() * scale  # [O, G]
        sz = torch.stack([scale.T, folded.T], -1).contiguous()  # [G, O, 2]
        out[p], kinds[p] = Int4Weight(pack_nibbles(codes), sz, group), "int4"
    return out, kinds


def inner_k_tiles(in_features: int) -> int:
    """The widest k-tiling aten's CUDA packer accepts for this input width (it needs I % (tiles x 16) == 0)."""
    return next(t for t in (8, 4, 2) if in_features % (t * 16) == 0)


def device_pack(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Portable [O, I/2] uint8 codes -> the tiled layout of `device`'s int4 kernel."""
    if device.type == "cuda":
        u8 = codes.to(device)
        return torch.ops.aten._convert_weight_to_int4pack(u8, inner_k_tiles(codes.shape[1] * 2))
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(codes), 1)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, sz: torch.Tensor) -> torch.Tensor:
    """x [N, I] @ dequantized weight.T -> [N, O], in x's dtype (bf16 on CUDA)."""
    if x.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, sz)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, sz)


def int4_shape(w: Int4Weight) -> str:
    """An int4 weight's shape as engine.json's `int4_splits` names it: '<outputs>x<inputs>/g<group size>'."""
    return f"{w.codes.shape[0]}x{w.codes.shape[1] * 2}/g{w.group_size}"


def split_factors(in_features: int, group_size: int, candidates=(1, 2, 4, 8)) -> tuple[int, ...]:
    """The split_k factors a weight of this input width takes: each block's I/s inputs whole groups, and a multiple
    of 32 (the narrowest k-tiling the CUDA packer takes)."""
    return tuple(s for s in candidates if in_features % s == 0 and (in_features // s) % max(group_size, 32) == 0)


def split_k(w: Int4Weight, s: int) -> Int4Weight:
    """The weight [O, I] as s blocks of I/s inputs stacked along the outputs: [s*O, I/s], block j holding inputs
    j*I/s .. (j+1)*I/s - 1 of every output (codes and the scales and zeros of their groups, unchanged)."""
    o, half = w.codes.shape
    if s not in split_factors(half * 2, w.group_size):
        raise ConfigError(
            f"an int4 weight [{o}, {half * 2}] with group size {w.group_size} cannot be split in {s}",
            hint=f"use one of {split_factors(half * 2, w.group_size)}",
        )
    if s == 1:
        return w
    g = w.scales_and_zeros.shape[0]
    codes = w.codes.reshape(o, s, half // s).transpose(0, 1).reshape(s * o, half // s)
    sz = w.scales_and_zeros.reshape(s, g // s, o, 2).transpose(0, 1).reshape(g // s, s * o, 2)
    return Int4Weight(codes.contiguous(), sz.contiguous(), w.group_size)


def unsplit(w: Int4Weight, s: int) -> Int4Weight:
    """split_k's inverse: the [O, I] weight of a split one."""
    if s == 1:
        return w
    so, h = w.codes.shape
    g = w.scales_and_zeros.shape[0]
    codes = w.codes.reshape(s, so // s, h).transpose(0, 1).reshape(so // s, s * h)
    sz = w.scales_and_zeros.reshape(g, s, so // s, 2).transpose(0, 1).reshape(s * g, so // s, 2)
    return Int4Weight(codes.contiguous(), sz.contiguous(), w.group_size)


def split_parts(x: torch.Tensor, packed: torch.Tensor, group_size: int, sz: torch.Tensor, s: int) -> torch.Tensor:
    """int4_mm with a split_k weight (s > 1), before the sum: x [N, I] -> partials [N, s, s, O], where [n, i, j]
    is block j's product with row n's inputs of block i. split_sum adds the s that count (i == j)."""
    n, i = x.shape
    y = int4_mm(x.reshape(n * s, i // s), packed, group_size, sz)  # [N*s, s*O]: every block times every row
    return y.view(n, s, s, -1)


def split_sum(y: torch.Tensor) -> torch.Tensor:
    """A Linear's output [N, O] as it is, or split_parts' partials [N, s, s, O] summed to it: one small reduction,
    or none inside a compiled function that reads them (engines/elementwise.py), where s <= 8 unrolls into loads."""
    return y if y.dim() == 2 else y.diagonal(0, 1, 2).sum(-1)  # [N, O, s] -> [N, O]


def split_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, sz: torch.Tensor, s: int) -> torch.Tensor:
    """int4_mm with a split_k weight: x [N, I] -> [N, O], block j's product with x's inputs of block j, summed."""
    if s == 1:
        return int4_mm(x, packed, group_size, sz)
    return split_sum(split_parts(x, packed, group_size, sz, s))
