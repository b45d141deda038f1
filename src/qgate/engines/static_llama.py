"""A Llama decoder for serving: int4 or dense Linears, a static KV cache, and a decode step that CUDA graphs can capture.

    model = StaticLlama(config, tensors, dtype=torch.bfloat16, device=torch.device("cuda"))
    model.setup_cache(batch=8, length=2048)
    logits = model(tokens, positions, valid, slot=0)        # prefill: [B, T] -> [B, T, V] float32
    logits = model(next_ids, positions, valid, slot=t)      # one decode step after it

Pure tensor code in the shape of gpt-fast: no Python branch depends on tensor values, the cache is written in place
with `index_copy_`, and attention masks come from the `valid` buffer and slot indices, so one decode step holds no
host synchronization and replays as a CUDA graph. Rows are left-padded: row b's prompt occupies the last slots of
the prefill, `valid[b, s]` says slot s holds one of its tokens, and `positions` gives each token's RoPE position.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from qgate.engines.int4pack import Int4Weight, device_pack, int4_mm
from qgate.errors import ConfigError

ARCHITECTURES = ("LlamaForCausalLM",)
STATIC_ROPE = ("default", "linear", "llama3")  # RoPE types whose frequencies do not depend on the sequence length


def check_architecture(config: dict) -> None:
    """ConfigError unless this engine computes what the checkpoint's architecture computes."""
    arch = config.get("architectures") or []
    if arch != list(ARCHITECTURES[:1]) or config.get("model_type") != "llama":
        raise ConfigError(
            f"the torch-int4 engine implements {', '.join(ARCHITECTURES)}, this checkpoint is "
            f"{arch or config.get('model_type')}",
            hint="gate this checkpoint on the reference path",
        )
    rope = (config.get("rope_parameters") or config.get("rope_scaling") or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        raise ConfigError(
            f"config.json rope_type {rope!r}: the torch-int4 engine serves {', '.join(STATIC_ROPE)}",
            hint="gate this checkpoint on the reference path",
        )
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json hidden_act {config.get('hidden_act')!r}: the torch-int4 engine serves silu")


class Linear(nn.Module):
    """y = x W^T (+ b), W held as torch's packed int4 layout or as a dense matrix in the activation dtype."""

    def __init__(self, weight: Int4Weight | torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device):
        super().__init__()
        if isinstance(weight, Int4Weight):
            self.group_size = weight.group_size
            self.out_features = weight.codes.shape[0]
            self.register_buffer("packed", device_pack(weight.codes, device))
            self.register_buffer("sz", weight.scales_and_zeros.to(device, dtype))  # [G, O, 2]
            self.weight = None
        else:
            self.out_features = weight.shape[0]
            self.register_buffer("weight", weight.to(device, dtype))  # [O, I]
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., I] -> [..., O]
        if self.weight is not None:
            return F.linear(x, self.weight, self.bias)
        y = int4_mm(x.reshape(-1, x.shape[-1]), self.packed, self.group_size, self.sz).reshape(
            *x.shape[:-1], self.out_features
        )
        return y if self.bias is None else y + self.bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalized in float32, scaled in the activation dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class StaticLlama(nn.Module):
    def __init__(self, config: dict, tensors: dict, dtype: torch.dtype, device: torch.device):
        """tensors: the checkpoint's state dict with every quantized Linear's prefix mapped to an Int4Weight or a dense
        float matrix (int4pack.repack) and every other tensor as saved."""
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        check_architecture(config)
        c = LlamaConfig(**{k: v for k, v in config.items() if k != "quantization_config"})
        self.dtype, self.device, self.eps = dtype, device, c.rms_norm_eps
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.max_positions = c.max_position_embeddings

        def lin(p: str) -> Linear:
            w = tensors.get(p, tensors.get(f"{p}.weight"))
            if w is None:
                raise ConfigError(f"checkpoint has no weight for {p}")
            return Linear(w, tensors.get(f"{p}.bias"), dtype, device)

        def vec(k: str) -> torch.Tensor:
            return tensors[k].to(device, dtype)

        self.register_buffer("embed", tensors["model.embed_tokens.weight"].to(device, dtype))  # [V, H]
        self.layers = nn.ModuleList()
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}"
            layer = nn.ModuleDict(
                {
                    n: lin(f"{p}.{m}.{n}")
                    for m, names in (
                        ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                        ("mlp", ("gate_proj", "up_proj", "down_proj")),
                    )
                    for n in names
                }
            )
            layer.register_buffer("in_norm", vec(f"{p}.input_layernorm.weight"))
            layer.register_buffer("post_norm", vec(f"{p}.post_attention_layernorm.weight"))
            self.layers.append(layer)
        self.register_buffer("norm", vec("model.norm.weight"))
        head = (
            "lm_head" if ("lm_head" in tensors or "lm_head.weight" in tensors) and not c.tie_word_embeddings else None
        )
        self.lm_head = lin(head) if head else Linear(self.embed, None, dtype, device)  # tied: the same tensor
        rope = LlamaRotaryEmbedding(c)  # transformers' own frequencies, for every RoPE type served
        pos = torch.arange(c.max_position_embeddings)[None]  # [1, P]
        cos, sin = rope(torch.empty(0, dtype=torch.float32), pos)  # [1, P, D] float32
        self.register_buffer("cos", cos[0].to(device, dtype))  # [P, D]
        self.register_buffer("sin", sin[0].to(device, dtype))
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []

    def setup_cache(self, batch: int, length: int) -> None:
        """A zeroed cache of `length` slots for `batch` rows (a cache of this size already there is reused)."""
        shape = (batch, self.kv_heads, length, self.head_dim)
        if self.k_cache and self.k_cache[0].shape == shape:
            return
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        slot: torch.Tensor | int | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """tokens, positions [B, T]; valid [B, S] bool: which key slots hold real tokens, these T included.
        slot: where these T tokens go in the cache (a 0-d long tensor when captured); None: no cache, S == T.
        Attention reads the first S slots of the cache, so a short context costs S slots, not the cache's length.
        Returns float32 logits [B, T or logits_to_keep, V]."""
        b, t = tokens.shape
        s = valid.shape[1]
        x = F.embedding(tokens, self.embed)  # [B, T, H]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [B, 1, T, D]
        if slot is None:
            slots = torch.arange(t, device=tokens.device)
            keys = slots
        else:
            slots = slot + torch.arange(t, device=tokens.device)  # [T]
            keys = torch.arange(s, device=tokens.device)  # [S]
        # a key is seen when it holds a real token at or before the query's slot; a padding query sees itself, so
        # every row of the softmax has a key and padding computes finite values that no real token reads
        mask = (valid[:, None, :] & (keys[None, :] <= slots[:, None])[None]) | (keys[None, :] == slots[:, None])[
            None
        ]  # [B, T, S]
        g = self.heads // self.kv_heads
        mask = mask[:, None, None].expand(b, 1, g, t, mask.shape[-1]).reshape(b, 1, g * t, -1)  # [B, 1, G*T, S]
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.in_norm, self.eps)
            q = layer["q_proj"](h).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
            k = layer["k_proj"](h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
            v = layer["v_proj"](h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            if slot is not None:
                self.k_cache[i][:b].index_copy_(2, slots, k)
                self.v_cache[i][:b].index_copy_(2, slots, v)
                k, v = self.k_cache[i][:b, :, :s], self.v_cache[i][:b, :, :s]  # [B, Hkv, S, D]
            # grouped-query attention as Hkv heads of G*T queries each: K/V are read as stored, never copied per head
            a = F.scaled_dot_product_attention(q.reshape(b, self.kv_heads, g * t, self.head_dim), k, v, attn_mask=mask)
            a = a.reshape(b, self.heads, t, self.head_dim)  # [B, H, T, D]
            x = x + layer["o_proj"](a.transpose(1, 2).reshape(b, t, -1))
            h = rms_norm(x, layer.post_norm, self.eps)
            x = x + layer["down_proj"](F.silu(layer["gate_proj"](h)) * layer["up_proj"](h))
        x = rms_norm(x[:, -logits_to_keep:] if logits_to_keep else x, self.norm, self.eps)
        return self.lm_head(x).float()
