"""bfloat16 models on CPUs without bfloat16 matmuls: each Linear's product computed in float32 on its bf16 values.

    if dtype == torch.bfloat16 and not native_bf16(device):
        float32_products(model)      # every bf16 nn.Linear: bf16 in, bf16 out, the product summed in float32

A CPU with AMX tiles or AVX512-BF16 multiplies bf16 values, sums the products in float32 and rounds the sum to bf16.
Elsewhere torch computes a bf16 matmul several times slower than a float32 one of the same shape. The product of two
bf16 values is exact in float32, so a float32 matmul on the same bf16 values computes what those CPUs compute, up to
the order of the float32 sums, and its output is rounded to bf16 as theirs is. The float32 copy of each weight is
made once, at the swap: 4 bytes per parameter beside the model's own bf16 weights, which stay as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Float32ProductLinear(torch.nn.Linear):
    """An nn.Linear holding bf16 weights whose forward multiplies in float32 (`float32_products` sets its copies)."""

    weight32: torch.Tensor
    bias32: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] bf16 -> [..., out] bf16
        return F.linear(x.float(), self.weight32, self.bias32).to(x.dtype)


def float32_products(model: torch.nn.Module) -> int:
    """Swap every bf16 nn.Linear of `model` for a Float32ProductLinear in place; returns how many. Exactly nn.Linear:
    a subclass keeps its own forward. A forward set on the instance stays, and multiplies in float32 where it calls
    the class's, as compressed-tensors' quantized forward does (its activation quantization kept); one that calls
    nn.Linear.forward itself, as an offloading wrapper does, keeps torch's bf16 matmul. The modules keep their
    parameters, so the state dict, tied weights and the embeddings are unchanged; the float32 copies are plain
    attributes, outside the state dict."""
    n = 0
    for m in model.modules():
        if type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16:
            if getattr(vars(m).get("forward"), "__func__", None) is torch.nn.Linear.forward:
                del m.forward  # nn.Linear's own forward bound on the instance (left by removing a wrapper)
            m.weight32 = m.weight.detach().float()
            m.bias32 = None if m.bias is None else m.bias.detach().float()
            m.__class__ = Float32ProductLinear
            n += 1
    return n
