"""The attention the reference path runs: transformers' SDPA without copying grouped-query K/V per query head.

    name = register_attention(torch.device("cuda"))           # ATTENTION_MASKED on an accelerator, ATTENTION on a CPU
    model = trust.load_causal_lm(path, attn_implementation=name)

Registered under qgate's own names in transformers' AttentionInterface and AttentionMaskInterface; the tensor
functions (gqa_sdpa, enable_gqa_sdpa, grouped_sdpa) take transformers' attention arguments.
"""

from __future__ import annotations

ATTENTION = "qgate_sdpa_gqa"
ATTENTION_MASKED = "qgate_sdpa_gqa_masked"  # the same on CUDA, with a mask always built (masked_sdpa_mask)


def gqa_sdpa(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    grouped: bool = True,
    **kwargs,
):
    """transformers' SDPA attention, except that grouped-query K/V are never copied per query head. transformers
    copies K/V once per query head whenever a mask is present; on a left-padded batch that copy of the whole KV cache
    per layer and decode step costs 10x the attention itself (benchmarks/bench_gates_engines.py). With a mask on
    CUDA, grouped_sdpa: a layout the memory-efficient kernel takes, which builds no plan per shape. Else K/V as they
    are, with enable_gqa (enable_gqa_sdpa), and without cuDNN's kernel, which would plan for each new length (a
    long document's, where no mask is built); with grouped=False (the call before grouped_sdpa, kept to compare the
    two), always that, with torch's choice of kernel."""
    if attention_mask is not None and attention_mask.shape[-1] != key.shape[-2]:
        attention_mask = attention_mask[..., : key.shape[-2]]
    masked = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
    if grouped and masked and query.is_cuda:
        return grouped_sdpa(query, key, value, attention_mask, scaling), None
    return enable_gqa_sdpa(module, query, key, value, attention_mask, scaling, is_causal, planless=grouped), None


def enable_gqa_sdpa(module, query, key, value, attention_mask, scaling=None, is_causal=None, planless=False):
    """Attention over K/V as stored, grouped queries by enable_gqa, with torch's choice of kernel, or with
    device.planless_sdpa's where `planless`. query [B, H, T, D]; key, value [B, Hkv, S, D]; attention_mask [B or 1,
    1 or H, T, S] or None. Returns [B, T, H, D]."""
    import torch

    from qgate.device import planless_sdpa

    groups = getattr(module, "num_key_value_groups", 1)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    sdpa = planless_sdpa if planless else torch.nn.functional.scaled_dot_product_attention
    out = sdpa(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=0.0,
        scale=scaling,
        is_causal=bool(query.shape[2] > 1 and attention_mask is None and causal),
        enable_gqa=groups > 1,
    )
    return out.transpose(1, 2).contiguous()


def grouped_sdpa(query, key, value, attention_mask, scaling=None):
    """enable_gqa_sdpa's products with each K/V head's G query heads as one head of G x T rows, the mask repeated per
    group, as the torch-int4 engine lays them out: a call the memory-efficient kernel takes (it takes a mask but not
    enable_gqa), through device.planless_sdpa. query [B, H, T, D]; key, value [B, Hkv, S, D]; attention_mask [B or 1,
    1, T, S], boolean or additive. Returns [B, T, H, D]."""
    from qgate.device import planless_sdpa

    b, h, t, d = query.shape
    hkv, s = key.shape[1], key.shape[-2]
    g = h // hkv
    mask = attention_mask.expand(b, 1, t, s)[:, :, None].expand(b, 1, g, t, s).reshape(b, 1, g * t, s)
    out = planless_sdpa(query.reshape(b, hkv, g * t, d), key, value, attn_mask=mask, scale=scaling)
    return out.unflatten(2, (g, t)).permute(0, 3, 1, 2, 4).reshape(b, t, h, d).contiguous()  # one copy, any strides


def masked_sdpa_mask(*args, **kwargs):
    """transformers' SDPA mask, built whatever the padding: to skip building it where attention is plainly causal,
    transformers reads the padding mask's values on the host, which waits for the device in every forward."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **(kwargs | {"allow_is_causal_skip": False, "allow_is_bidirectional_skip": False}))


def register_attention(device) -> str:
    """The attention implementation a model on `device` runs: gqa_sdpa, with transformers' SDPA mask on a CPU and
    masked_sdpa_mask on an accelerator, where a forward then holds no host synchronization."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for name, mask in ((ATTENTION, sdpa_mask), (ATTENTION_MASKED, masked_sdpa_mask)):
        AttentionInterface.register(name, gqa_sdpa)
        AttentionMaskInterface.register(name, mask)
    return ATTENTION if device.type == "cpu" else ATTENTION_MASKED
