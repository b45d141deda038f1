"""Repack a mixed-precision compressed-tensors checkpoint (int4 and int8 group-wise layers) into the AutoGPTQ layout,
whose `dynamic` overrides give onnxruntime-genai's builder a bit width per layer.

    tensors, cfg, bits = to_gptq(state_dict, quantization_config)

Pure tensor code, no re-quantization: the integer codes, scales and zero points are carried over exactly. For a
Linear with out features O, in features I, G = I / group_size groups and P = 32 / bits codes per int32 word:

  compressed-tensors                        AutoGPTQ (v1)
  weight_packed     [O, I/P] int32          qweight [I/P, O] int32, packed along the input dimension
  weight_scale      [O, G]   float          scales  [G, O]   float16
  weight_zero_point [O/P, G] int32          qzeros  [G, O/P] int32, stored as zero - 1 (the builder adds 1 back)
  (codes offset by 2^(bits-1) when packed)  g_idx   [I]      int32 (i // group_size)
"""

from __future__ import annotations

import re

import torch

from qgate.errors import ConfigError


def unpack(packed: torch.Tensor, rows: int, cols: int, bits: int, packed_dim: int) -> torch.Tensor:
    """Little-endian unpacking of `bits`-wide codes from int32 words; unsigned codes as int32 [rows, cols]."""
    p = packed if packed_dim == 1 else packed.T  # [r, c/P]
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)  # [P]
    codes = (p.to(torch.int32).unsqueeze(-1) >> shifts) & (2**bits - 1)  # [r, c/P, P]
    codes = codes.reshape(p.shape[0], -1)
    out = codes if packed_dim == 1 else codes.T
    return out[:rows, :cols].contiguous()


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] codes -> [R/P, C] int32: P consecutive rows share a word, the first in the low bits."""
    per = 32 // bits
    r, c = codes.shape
    out = torch.zeros((r // per, c), dtype=torch.int32)
    for j in range(per):
        out |= (codes[j::per].to(torch.int32) & (2**bits - 1)) << (bits * j)  # int32 wraps at bit 31: intended
    return out


def pack_cols(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_rows(codes.T.contiguous(), bits).T.contiguous()


PACKED_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


def packed_layers(state: dict[str, torch.Tensor]) -> tuple[list[str], dict[str, torch.Tensor]]:
    """The pack-quantized Linears of a compressed-tensors state dict (their prefixes, sorted) and every other tensor."""
    layers = sorted(k[: -len(".weight_packed")] for k in state if k.endswith(".weight_packed"))
    parts = {f"{p}.{s}" for p in layers for s in PACKED_PARTS}
    return layers, {k: v for k, v in state.items() if k not in parts}


def layer_codes(state: dict, prefix: str, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed Linear's (codes [O, I], zero points [O, G], scales [O, G] as stored), codes and zero points
    unsigned; a symmetric layer's zero point is the offset code 2^(bits-1)."""
    o, i = (int(x) for x in state[f"{prefix}.weight_shape"].tolist())
    scale = state[f"{prefix}.weight_scale"]  # [O, G]
    codes = unpack(state[f"{prefix}.weight_packed"], o, i, bits, packed_dim=1)  # [O, I]
    if f"{prefix}.weight_zero_point" in state:
        zeros = unpack(state[f"{prefix}.weight_zero_point"], o, scale.shape[1], bits, packed_dim=0)  # [O, G]
    else:
        zeros = torch.full(scale.shape, 2 ** (bits - 1), dtype=torch.int32)
    return codes, zeros, scale


def layer_bits(state: dict, prefix: str) -> int:
    o, i = (int(x) for x in state[f"{prefix}.weight_shape"].tolist())
    cols = state[f"{prefix}.weight_packed"].shape[1]
    bits = 32 * cols // i
    if bits not in (4, 8) or cols * (32 // bits) != i:
        raise ConfigError(
            f"{prefix}: cannot infer a 4- or 8-bit packing from weight_packed "
            f"{tuple(state[f'{prefix}.weight_packed'].shape)} for a [{o}, {i}] weight"
        )
    return bits


def to_gptq(state: dict[str, torch.Tensor], qconfig: dict) -> tuple[dict[str, torch.Tensor], dict, dict[str, int]]:
    """(tensors, quantization_config for the builder, bits per layer). Each layer's group size is read off its
    scales; the most common bits and group size are the builder's defaults and `dynamic` overrides carry the rest."""
    weights = [g.get("weights") or {} for g in qconfig.get("config_groups", {}).values()]
    if not weights or any(
        w.get("strategy") != "group" or w.get("type") != "int" or w.get("actorder") == "group" for w in weights
    ):
        raise ConfigError(f"CPU engine needs group-wise int weights without g_idx, got {weights}")
    layers, out = packed_layers(state)
    bits_of: dict[str, int] = {}
    group_of: dict[str, int] = {}
    for p in layers:
        bits = bits_of[p] = layer_bits(state, p)
        codes, zeros, scale = layer_codes(state, p, bits)  # [O, I], [O, G], [O, G]
        i = codes.shape[1]
        group_size = group_of[p] = i // scale.shape[1]
        out[f"{p}.qweight"] = pack_rows(codes.T.contiguous(), bits)  # [I/P, O]
        out[f"{p}.qzeros"] = pack_cols((zeros.T - 1).contiguous(), bits)  # [G, O/P]
        out[f"{p}.scales"] = scale.T.contiguous().to(torch.float16)  # [G, O]
        out[f"{p}.g_idx"] = torch.arange(i, dtype=torch.int32) // group_size  # [I]

    def common(values: dict[str, int], default: int) -> int:
        vs = list(values.values())
        return max(sorted(set(vs)), key=vs.count) if vs else default

    base_bits, base_group = common(bits_of, 4), common(group_of, 128)
    dynamic = {}
    for p in layers:
        over = {
            k: v for k, v, b in (("bits", bits_of[p], base_bits), ("group_size", group_of[p], base_group)) if v != b
        }
        if over:
            dynamic[f"+:{re.escape(p)}\\."] = over
    cfg = {
        "quant_method": "gptq",
        "bits": base_bits,
        "group_size": base_group,
        "desc_act": False,
        "sym": False,
        "dynamic": dynamic,
        "modules_to_not_convert": list(qconfig.get("ignore", [])),
    }
    return out, cfg, bits_of
