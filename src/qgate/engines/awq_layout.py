"""Repack compressed-tensors `pack-quantized` int4 weights into the AutoAWQ GEMM layout.

    tensors, cfg = to_awq(state_dict, quantization_config)

Pure tensor code, no re-quantization: the integer codes, scales and zero points are
carried over exactly, so the engine computes what the checkpoint says. Shapes, for a
Linear with out features O, in features I and G = I / group_size groups:

  compressed-tensors                    AutoAWQ (what onnxruntime-genai's builder repacks)
  weight_packed     [O, I/8] int32      qweight [I, O/8] int32, nibble order 0,2,4,6,1,3,5,7
  weight_scale      [O, G]   float      scales  [G, O]   float16
  weight_zero_point [O/8, G] int32      qzeros  [G, O/8] int32, same nibble order
  (signed codes, offset +8 when packed)  (unsigned codes 0..15)
"""

from __future__ import annotations

import torch

from qgate.engines.gptq_layout import layer_codes, packed_layers
from qgate.errors import ConfigError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] codes 0..15 -> [R, C/8] int32 with AWQ's interleaved nibble order."""
    r, c = codes.shape
    grouped = codes.to(torch.int32).reshape(r, c // 8, 8)[:, :, list(AWQ_ORDER)]  # [R, C/8, 8]
    shifted = grouped << torch.arange(0, 32, 4, dtype=torch.int32)  # int32 wraps at bit 31: intended
    out = torch.zeros((r, c // 8), dtype=torch.int32)
    for k in range(8):
        out |= shifted[:, :, k]
    return out


def to_awq(state: dict[str, torch.Tensor], qconfig: dict) -> tuple[dict[str, torch.Tensor], dict]:
    groups = qconfig.get("config_groups", {})
    weights = [g.get("weights") or {} for g in groups.values()]
    if qconfig.get("format") != "pack-quantized" or not weights:
        raise ConfigError(
            f"CPU engine needs a pack-quantized int4 checkpoint, got format {qconfig.get('format')!r}",
            hint="quantize with awq-w4a16 or gptq-w4a16; other schemes run on the reference path",
        )
    w = weights[0]
    if (
        any(x != w for x in weights)
        or w.get("num_bits") != 4
        or w.get("strategy") != "group"
        or w.get("actorder") == "group"
    ):
        raise ConfigError(
            f"CPU engine supports one group-wise int4 weight scheme without g_idx, got {weights}",
            hint="use awq-w4a16, or gptq-w4a16 with actorder static/null",
        )
    layers, out = packed_layers(state)
    for p in layers:
        codes, zeros, scale = layer_codes(state, p, 4)  # [O, I], [O, G], [O, G]
        out[f"{p}.qweight"] = pack_awq(codes.T.contiguous())  # [I, O/8]
        out[f"{p}.qzeros"] = pack_awq(zeros.T.contiguous())  # [G, O/8]
        out[f"{p}.scales"] = scale.T.contiguous().to(torch.float16)  # [G, O]
    awq_cfg = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": w["group_size"],
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": list(qconfig.get("ignore", [])),
    }
    return out, awq_cfg


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse view for tests: AWQ tensors -> float weight [O, I]."""
    inv = [AWQ_ORDER.index(k) for k in range(8)]

    def unpack(t):  # [R, C/8] -> [R, C]
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        codes = (t.unsqueeze(-1) >> shifts) & 0xF  # [R, C/8, 8] in AWQ order
        return codes[:, :, inv].reshape(t.shape[0], -1)

    q, z = unpack(qweight), unpack(qzeros)  # [I, O], [G, O]
    zf = z.repeat_interleave(group_size, dim=0)  # [I, O]
    sf = scales.float().repeat_interleave(group_size, dim=0)  # [I, O]
    return ((q - zf).float() * sf).T.contiguous()
