"""The torch-int4 engine's Linear: torch's packed int4 weight-only kernel on few rows, a dense GEMM on many.

lin = Linear(int4_weight, None, torch.bfloat16, torch.device("cuda"), split=2)   # int4pack.Int4Weight
y = lin(x)                  # [..., I] -> [..., O]
w = lin.dequantized()       # [O, I]: (q - 8) * scale + zero per group, as torch's int4 kernels define it
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from qgate.engines.bf16_products import FLOAT32_ROWS
from qgate.engines.int4pack import Int4Weight, device_pack, int4_shape, split_k, split_mm, split_parts, unsplit

DENSE_ROWS = {"cuda": 128}  # rows (tokens) from which an int4 Linear dequantizes and runs a dense GEMM, per device
KEPT_DENSE_ROWS = 16  # rows from which an int4 Linear whose dense matrix is kept (keep_dense) runs the dense GEMM


class Linear(nn.Module):
    """y = x W^T (+ b), W held as torch's packed int4 layout or as a dense matrix in the activation dtype.

    An int4 Linear runs torch's int4 kernel on few rows (decode steps). On a CUDA device, from DENSE_ROWS rows on
    (prefill, teacher-forced scoring) it dequantizes its codes to the activation dtype, w = (q - 8) * scale + zero
    rounded once, and runs a dense GEMM: the int4 kernel is built for matrix-vector products and reads its weights
    several times slower at large row counts. That dense matrix is computed per forward, or once where `keep_dense`
    kept it (the same numbers either way). A kept matrix costs no dequantizing, so it serves from KEPT_DENSE_ROWS
    rows on (decode steps of large batches), where the int4 kernel reads its packed weights slower than a dense GEMM
    reads the matrix four times their size. On a CPU every row count runs the int4 kernel. A dense bf16 Linear on a CPU
    without bf16 matmuls multiplies in float32 from FLOAT32_ROWS rows on (bf16_products.py). The int4 kernel's buffers
    are laid out as `split` blocks of the inputs (int4pack.split_k; 1: unsplit), which `resplit` changes."""

    def __init__(
        self, weight: Int4Weight | torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device, split: int = 1
    ):
        """split: an int4 weight's split_k factor (int4pack.py), how its kernel is laid out; the same weight."""
        super().__init__()
        if isinstance(weight, Int4Weight):
            self.group_size = weight.group_size
            self.out_features, self.in_features = weight.codes.shape[0], weight.codes.shape[1] * 2
            self.shape = int4_shape(weight)  # what engine.json's int4_splits names it by
            self.dense_rows = DENSE_ROWS.get(torch.device(device).type)
            self._lay_out(weight, split, device, dtype)
            self.weight = None
            self.dense: torch.Tensor | None = None  # dequantized() kept by keep_dense; not part of the state dict
        else:
            self.out_features = weight.shape[0]
            self.register_buffer("weight", weight.to(device, dtype))  # [O, I]
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype))
        # bf16 on a CPU without bf16 matmuls: float32 copies, outside the state dict (StaticLlama, bf16_products.py)
        self.weight32: torch.Tensor | None = None
        self.bias32: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., I] -> [..., O]
        rows = x.numel() // x.shape[-1]
        if self.weight is not None:
            if self.weight32 is not None and rows >= FLOAT32_ROWS:
                return F.linear(x.float(), self.weight32, self.bias32).to(x.dtype)
            return F.linear(x, self.weight, self.bias)
        if not self.int4_serves(rows):
            return F.linear(x, self.dense if self.dense is not None else self.dequantized(), self.bias)
        y = split_mm(x.reshape(-1, x.shape[-1]), self.packed, self.group_size, self.sz, self.split)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def parts(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x) for x [N, I], except where a split int4 kernel serves these rows and there is no bias: then
        its partials [N, s, s, O] unsummed (int4pack.split_parts), for an elementwise function that adds them in its
        own kernel (elementwise.rope, add_rms_norm and silu_mul, through int4pack.split_sum)."""
        if self.weight is None and self.split > 1 and self.bias is None and self.int4_serves(x.shape[0]):
            return split_parts(x, self.packed, self.group_size, self.sz, self.split)
        return self(x)

    def int4_serves(self, rows: int) -> bool:
        """Whether the int4 kernel serves `rows` rows; else the kept dense matrix does, or one dequantized now."""
        if self.dense is not None and rows >= min(KEPT_DENSE_ROWS, self.dense_rows):
            return False
        return self.dense_rows is None or rows < self.dense_rows

    def _lay_out(self, weight: Int4Weight, split: int, device, dtype: torch.dtype) -> None:
        """The kernel's buffers for `weight` laid out as split_k(weight, split)."""
        w = split_k(weight, split)
        self.split = split
        self.register_buffer("packed", device_pack(w.codes, device))
        self.register_buffer("sz", w.scales_and_zeros.to(device, dtype))  # [G/s, s*O, 2]
        # the portable codes (split like the kernel's), kept for dequantizing where the dense path runs
        self.register_buffer("codes", w.codes.to(device) if self.dense_rows else None)  # [s*O, I/(2s)] uint8

    def int4_weight(self) -> Int4Weight:
        """The int4 weight unsplit, from the portable codes (devices with a dense path keep them)."""
        if self.codes is None:
            raise RuntimeError(f"an int4 Linear on {self.packed.device.type} keeps only its kernel's packed codes")
        return unsplit(Int4Weight(self.codes, self.sz, self.group_size), self.split)

    def resplit(self, split: int) -> None:
        """Lay the kernel's buffers out as split_k(weight, split): the same weight, another kernel grid."""
        if split != self.split:
            self._lay_out(self.int4_weight(), split, self.packed.device, self.sz.dtype)

    def dequantized(self) -> torch.Tensor:
        """The int4 weight as a dense [O, I] matrix in the activation dtype: (q - 8) * scale + zero per group, as
        torch's int4 kernels define it, rounded once (addcmul computes in float32)."""
        w4 = self.int4_weight()
        c, sz = w4.codes, w4.scales_and_zeros
        o, g = c.shape[0], sz.shape[0]
        q = torch.stack((c >> 4, c & 0xF), -1).view(o, g, -1).to(sz.dtype) - 8  # [O, G, group]: exact
        scale, zero = sz.permute(1, 0, 2).contiguous().unbind(-1)  # [O, G] each
        return torch.addcmul(zero[..., None], q, scale[..., None]).view(o, -1)
