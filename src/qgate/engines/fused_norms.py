"""RMSNorm as one kernel on the reference path: transformers' Llama norm, and every norm copied from it, through torch's
fused `rms_norm`.

    fuse_rms_norms(model)       # on CUDA: each module whose forward is LlamaRMSNorm's code; returns how many

transformers' LlamaRMSNorm, and the norms of the many model families that copy its code (Mistral, Qwen2, Qwen3,
...), runs eight kernels a call: the input to float32, its square, the mean, the epsilon, the rsqrt, the product,
back to the activation dtype, and the weight's product. In a scoring forward each is a pass over the activations,
four bytes wide for most of them. torch's `rms_norm` runs one kernel on CUDA, which normalizes and scales in float32
and rounds once, as serving engines' fused norms do (vLLM's, the torch-int4 engine's: elementwise.rms_norm);
transformers rounds after normalizing and again after scaling. The two differ by at most one rounding step of the
activation dtype. A norm whose weight is in another dtype than its input keeps transformers' code, which then
promotes the output to the weight's dtype. A model whose norm computes anything else (Gemma's 1 + weight, a norm
without a weight) is left as it is: only the code itself is matched, not a class name.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F  # noqa: N812

DEVICES = ("cuda",)  # device types whose reference runners fuse their norms: torch's rms_norm is one kernel there


def _code(f) -> tuple | None:
    """What a function computes, as far as its code object says: its bytecode, constants and the names it reads."""
    c = getattr(f, "__code__", None)
    return None if c is None else (c.co_code, c.co_consts, c.co_names, c.co_varnames)


@functools.cache
def _llama_code() -> tuple:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return _code(LlamaRMSNorm.forward)


@functools.cache
def _fused(cls: type) -> type:
    """`cls` with torch's fused rms_norm as its forward: a subclass, so isinstance checks and the state dict hold."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        if hidden_states.dtype != self.weight.dtype:
            return cls.forward(self, hidden_states)
        return F.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon)

    return type(cls.__name__, (cls,), {"forward": forward, "unfused": cls, "__module__": __name__})


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Swap each module of `model` whose class's forward is transformers' LlamaRMSNorm code for the fused form, in
    place; returns how many. A forward set on the instance stays."""
    n = 0
    for m in model.modules():
        cls = type(m)
        if "unfused" not in vars(cls) and "forward" not in vars(m) and _code(cls.forward) == _llama_code():
            m.__class__ = _fused(cls)
            n += 1
    return n


def unfuse_rms_norms(model: torch.nn.Module) -> int:
    """fuse_rms_norms undone: transformers' own forward back on each swapped module; returns how many."""
    n = 0
    for m in model.modules():
        if "unfused" in vars(type(m)):
            m.__class__ = type(m).unfused
            n += 1
    return n
