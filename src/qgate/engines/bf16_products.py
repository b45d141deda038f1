"""bfloat16 and float16 models on CPUs without matmuls in their format: each Linear's product computed in float32 on
its 16-bit values.

    if emulated(device, dtype):          # bf16 or fp16 on a CPU without its matmuls (device.native_bf16 / _fp16)
        float32_products(model, "<path>: the bfloat16 reference")   # every bf16 (fp16) nn.Linear: bf16 in, bf16
                                         # out, the product summed in float32

torch's bf16 matmul multiplies bf16 values, sums the products in float32 and rounds the sum to bf16. Only a CPU with
AMX tiles runs it faster than a float32 matmul of the same shape: without AVX512-BF16 it is several times slower,
and with AVX512-BF16 but no AMX slower too on the gates' forwards of many rows (benchmarks/RESULTS.md). The product
of two bf16 values is exact in float32, so a float32 matmul on the same bf16 values computes what torch's bf16 matmul
computes, up to the order of the float32 sums, and its output is rounded to bf16 as that one's is. The float32 copy
of each weight is made once, at the swap: 4 bytes per parameter beside the model's own bf16 weights, which stay as
they are, and the host's memory is checked for them all first (float32_copies).

float16 likewise: torch's CPU float16 matmul runs ~10x slower than float32 where oneDNN has no float16 kernels
(device.native_fp16), the product of two float16 values is exact in float32 too, and the output rounded to float16
is inf where it passes float16's range, as on a server that computes in float16.

The torch-int4 engine's dense Linears (the head, unquantized layers) multiply in float32 from
FLOAT32_ROWS rows on and keep torch's bf16 matmul below, where a few rows (decode steps) run faster in it than in
float32 on the same CPUs; its int4 kernel takes bf16 and runs fast on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FLOAT32_ROWS = 8  # rows from which an engine's dense bf16 Linear multiplies in float32 on such a CPU
HINT = "gate in float32 (gates.dtype: float32), or on a host with more memory or with AMX"
FP16_HINT = "gate on a host with more memory, or with AVX512-FP16 or AMX-FP16 (float16 matmuls need no copies)"


def emulated(device, dtype) -> bool:
    """Whether `dtype` is bf16 or fp16 on a CPU without matmuls in it (device.native_bf16, device.native_fp16), where
    Linears multiply in float32."""
    from qgate.device import native_bf16, native_fp16

    device = torch.device(device)
    if device.type != "cpu":
        return False
    return (dtype == torch.bfloat16 and not native_bf16(device)) or (dtype == torch.float16 and not native_fp16(device))


def float32_copies(linears: list, what: str, hint: str = HINT) -> None:
    """Give each module (a `weight` and a `bias` or None, on the CPU) float32 copies of them as plain attributes,
    weight32 and bias32, outside the state dict; first BackendUnavailable (device.check_fits) where the host's memory
    cannot hold them all: 4 bytes per parameter, which the kernel would otherwise kill the process part way through.
    `hint` says what to do instead for bf16 weights; float16 ones get FP16_HINT, whoever calls."""
    from qgate.device import check_fits

    if any(m.weight.dtype == torch.float16 for m in linears):
        hint = FP16_HINT
    need = sum(4 * (m.weight.numel() + (0 if m.bias is None else m.bias.numel())) for m in linears)
    check_fits(torch.device("cpu"), need, what, hint, takes="the float32 copies its matmuls need on this CPU take")
    for m in linears:
        m.weight32 = m.weight.detach().float()
        m.bias32 = None if m.bias is None else m.bias.detach().float()


class Float32ProductLinear(torch.nn.Linear):
    """An nn.Linear holding bf16 (fp16) weights whose forward multiplies in float32 (`float32_products` sets its
    copies)."""

    weight32: torch.Tensor
    bias32: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] bf16 (fp16) -> [..., out] the same
        return F.linear(x.float(), self.weight32, self.bias32).to(x.dtype)


def float32_products(model: torch.nn.Module, what: str = "the model") -> int:
    """Swap every bf16 and fp16 nn.Linear of `model` for a Float32ProductLinear in place; returns how many. Exactly
    nn.Linear: a subclass keeps its own forward. A forward set on the instance stays, and multiplies in float32 where
    it calls the class's, as compressed-tensors' quantized forward does (its activation quantization kept); one that
    calls nn.Linear.forward itself, as an offloading wrapper does, keeps torch's 16-bit matmul. The modules keep their
    parameters, so the state dict, tied weights and the embeddings are unchanged; the float32 copies are plain
    attributes, outside the state dict (float32_copies, which checks the host's memory first, naming `what`)."""
    half = (torch.bfloat16, torch.float16)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.dtype in half]
    float32_copies(linears, what)
    for m in linears:
        if getattr(vars(m).get("forward"), "__func__", None) is torch.nn.Linear.forward:
            del m.forward  # nn.Linear's own forward bound on the instance (left by removing a wrapper)
        m.__class__ = Float32ProductLinear
    return len(linears)
