"""A Llama decoder for serving (Mistral's and Qwen2's too: ARCHITECTURES): int4 or dense Linears, a static KV cache,
and a decode step that CUDA graphs can capture.

    model = StaticLlama(config, tensors, dtype=torch.bfloat16, device=torch.device("cuda"))
    model.setup_cache(batch=8, length=2048)
    logits = model(tokens, positions, valid, slot=0)        # prefill: [B, T] -> [B, T, V] float32
    logits = model(next_ids, positions, valid, slot=t)      # one decode step after it

Pure tensor code in the shape of gpt-fast: no Python branch depends on tensor values, the cache is written in place
with `index_copy_`, and attention masks come from the `valid` buffer and slot indices, so one decode step holds no
host synchronization and replays as a CUDA graph. Rows are left-padded: row b's prompt occupies the last slots of
the prefill, `valid[b, s]` says slot s holds one of its tokens, and `positions` gives each token's RoPE position.
The work between the Linears runs through `model.ops` (engines/elementwise.py): eager functions, or their compiled
kernels after `model.compile()`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from qgate.device import dtype_name, planless_sdpa
from qgate.engines.bf16_products import emulated, float32_copies
from qgate.engines.decode_attention import triton_attend
from qgate.engines.elementwise import EAGER, Ops, compiled_ops, rms_norm
from qgate.engines.int4_linear import Linear
from qgate.engines.int4pack import Int4Weight, int4_shape
from qgate.errors import ConfigError

ARCHITECTURES = {  # config.json's architecture -> its model_type: decoders this engine computes exactly
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",  # Llama's decoder with a sliding window, refused where it binds
    "Qwen2ForCausalLM": "qwen2",  # Llama's decoder with biases on q, k and v (a Linear's bias, as any)
}
HINT = "gate on a host with more memory, or with AMX (bf16 matmuls: no float32 copies)"
STATIC_ROPE = ("default", "linear", "yarn", "llama3")  # RoPE types whose frequencies do not depend on the length


def model_config(config: dict):
    """config.json as its architecture's own transformers config class (its defaults, its RoPE parameters). The
    config.json dict is left as it was: Transformers standardizes RoPE settings in place."""
    import copy

    from transformers import AutoConfig

    rest = {k: copy.deepcopy(v) for k, v in config.items() if k not in ("model_type", "quantization_config")}
    return AutoConfig.for_model(config["model_type"], **rest)


def rope_type(c) -> str:
    """The RoPE type of a loaded config (model_config) as Transformers reads it: rope_parameters, or Transformers 4's
    rope_scaling, whose type may be under "type"; "default" where none is set."""
    return (getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}).get("rope_type", "default")


def layer_windows(c) -> list[int | None]:
    """Per layer of a loaded config (model_config), the sliding window Transformers applies to it where that window
    binds (shorter than max_position_embeddings), else None: on the layers `layer_types` marks sliding, or on every
    layer where the config has a window and no `layer_types` (Mistral's)."""
    window, types = getattr(c, "sliding_window", None), getattr(c, "layer_types", None)
    n = c.num_hidden_layers
    slides = [t == "sliding_attention" for t in types[:n]] if types else [window is not None] * n
    binds = window is not None and window < c.max_position_embeddings
    return [window if s and binds else None for s in slides]


def check_architecture(config: dict):
    """config.json as its model_config, or ConfigError unless this engine computes what the checkpoint's
    architecture computes: one of ARCHITECTURES, every layer attending to its whole context up to
    max_position_embeddings (a sliding window shorter than that would change what a long context's tokens see), a
    RoPE type of STATIC_ROPE and SiLU."""
    arch = config.get("architectures") or []
    if len(arch) != 1 or ARCHITECTURES.get(arch[0]) != config.get("model_type"):
        raise ConfigError(
            f"the torch-int4 engine implements {', '.join(ARCHITECTURES)}, this checkpoint is "
            f"{arch or config.get('model_type')} (model_type {config.get('model_type')!r})",
            hint="gate this checkpoint on the reference path",
        )
    c = model_config(config)
    if any(w is not None for w in layer_windows(c)):
        window = c.sliding_window
        raise ConfigError(
            f"config.json sliding_window {window}: the model attends over the last {window} tokens only, and the "
            f"torch-int4 engine attends over whole contexts (max_position_embeddings {c.max_position_embeddings})",
            hint="gate this checkpoint on the reference path",
        )
    if (rope := rope_type(c)) not in STATIC_ROPE:
        raise ConfigError(
            f"config.json rope_type {rope!r}: the torch-int4 engine serves {', '.join(STATIC_ROPE)}",
            hint="gate this checkpoint on the reference path",
        )
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"config.json hidden_act {config.get('hidden_act')!r}: the torch-int4 engine serves silu",
            hint="gate this checkpoint on the reference path",
        )
    return c


FUSE = True  # q/k/v and gate/up as one wider Linear each where their weights allow (StaticLlama.__init__)
HANDS_PARTIALS = ("qkv", "o_proj", "gate_up", "down_proj")  # a layer's Linears whose forward reads Linear.parts
SEGMENT_CALL_PAIRS = 4096  # an attention call by segment costs about as much as this many query-key pairs of the mask


def segments_pay(segments: list[tuple[int, int, int]], rows: int, width: int) -> bool:
    """Whether attention by causal segments (forward's `segments`) computes less than the masked attention over
    [rows, width] rows: half of each segment's square, plus SEGMENT_CALL_PAIRS for each call, against every row's
    whole square."""
    return sum((b - a) ** 2 // 2 + SEGMENT_CALL_PAIRS for _, a, b in segments) < rows * width**2


def causal_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments) -> torch.Tensor:
    """Causal attention within each (row, first, end) segment of the T columns, one call each: q [B, H, T, D], k and
    v [B, Hkv, T, D]. Returns [B, H, T, D]; columns outside every segment (padding) are zeros. Each segment's length
    is a shape of its own, so the calls build no plan (planless_sdpa: flash attention on CUDA)."""
    out = q.new_zeros(q.shape)
    for r, a, b in segments:  # 4-d slices: a 3-d call takes a slower kernel on the CPU
        out[r : r + 1, :, a:b] = planless_sdpa(
            q[r : r + 1, :, a:b], k[r : r + 1, :, a:b], v[r : r + 1, :, a:b], is_causal=True, enable_gqa=True
        )
    return out


class StaticLlama(nn.Module):
    def __init__(
        self,
        config: dict,
        tensors: dict,
        dtype: torch.dtype,
        device: torch.device,
        splits: dict[str, int] | None = None,
        what: str = "the torch-int4 engine",
    ):
        """tensors: the checkpoint's state dict with every quantized Linear's prefix mapped to an Int4Weight or a dense
        float matrix (int4pack.repack) and every other tensor as saved. splits: the split_k factor per int4 weight
        shape (int4pack.int4_shape; int4_choice.choose_splits picks them), 1 where absent. In bf16 on a CPU without
        bf16 matmuls each dense Linear gets float32 copies of its weights (Linear.forward), once the host's memory is
        found to hold them (bf16_products.float32_copies; an error names the model `what`)."""
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        c = check_architecture(config)
        self.dtype, self.device, self.eps = dtype, device, c.rms_norm_eps
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.max_positions = c.max_position_embeddings

        def weight(p: str):
            """A Linear's weight: an Int4Weight or dense tensor under its prefix, or its `.weight` tensor."""
            return tensors.get(p, tensors.get(f"{p}.weight"))

        splits = dict(splits or {})
        shapes: set[str] = set()

        def linear(w: Int4Weight | torch.Tensor, bias: torch.Tensor | None) -> Linear:
            if not isinstance(w, Int4Weight):
                return Linear(w, bias, dtype, device)
            shape = int4_shape(w)
            shapes.add(shape)
            return Linear(w, bias, dtype, device, splits.get(shape, 1))

        def lin(p: str) -> Linear:
            w = weight(p)
            if w is None:
                raise ConfigError(f"checkpoint has no weight for {p}")
            return linear(w, tensors.get(f"{p}.bias"))

        def vec(k: str) -> torch.Tensor:
            return tensors[k].to(device, dtype)

        def fused(prefixes: list[str]) -> Linear | None:
            """One Linear computing these Linears' outputs side by side (one wider kernel instead of several), when
            their weights are all int4 with one group size or all dense; None otherwise."""
            ws = [weight(p) for p in prefixes]
            bs = [tensors.get(f"{p}.bias") for p in prefixes]
            if any(w is None for w in ws) or len({b is None for b in bs}) > 1:
                return None
            bias = None if bs[0] is None else torch.cat(bs)
            if all(isinstance(w, Int4Weight) for w in ws) and len({w.group_size for w in ws}) == 1:
                w = Int4Weight(
                    torch.cat([w.codes for w in ws]), torch.cat([w.scales_and_zeros for w in ws], 1), ws[0].group_size
                )
                return linear(w, bias)
            if all(isinstance(w, torch.Tensor) for w in ws):
                return linear(torch.cat(ws), bias)
            return None

        self.register_buffer("embed", tensors["model.embed_tokens.weight"].to(device, dtype))  # [V, H]
        self.layers = nn.ModuleList()
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}"
            layer = nn.ModuleDict()
            for m, groups in (
                ("self_attn", (("qkv", ("q_proj", "k_proj", "v_proj")), ("o_proj", ("o_proj",)))),
                ("mlp", (("gate_up", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",)))),
            ):
                for name, parts in groups:
                    one = fused([f"{p}.{m}.{n}" for n in parts]) if FUSE and len(parts) > 1 else None
                    if one is not None:
                        layer[name] = one
                    else:
                        layer.update({n: lin(f"{p}.{m}.{n}") for n in parts})
            layer.register_buffer("in_norm", vec(f"{p}.input_layernorm.weight"))
            layer.register_buffer("post_norm", vec(f"{p}.post_attention_layernorm.weight"))
            self.layers.append(layer)
        self.register_buffer("norm", vec("model.norm.weight"))
        head = (
            "lm_head" if ("lm_head" in tensors or "lm_head.weight" in tensors) and not c.tie_word_embeddings else None
        )
        self.lm_head = lin(head) if head else Linear(self.embed, None, dtype, device)  # tied: the same tensor
        if set(splits) - shapes:
            raise ConfigError(
                f"split layouts for int4 weights of shapes {sorted(set(splits) - shapes)}, which this model lacks "
                f"(its int4 shapes: {sorted(shapes) or 'none'})",
                hint="the engine's engine.json does not belong to its weights: rebuild the engine",
            )
        rope = LlamaRotaryEmbedding(c)  # transformers' own frequencies, for every RoPE type served
        pos = torch.arange(c.max_position_embeddings)[None]  # [1, P]
        cos, sin = rope(torch.empty(0, dtype=torch.float32), pos)  # [1, P, D] float32
        self.register_buffer("cos", cos[0].to(device, dtype))  # [P, D]
        half = cos.shape[-1] // 2
        self.register_buffer("sin", torch.cat((-sin[0, :, :half], sin[0, :, half:]), -1).to(device, dtype))  # signed
        if emulated(device, dtype):
            dense = [m for m in self.modules() if isinstance(m, Linear) and m.weight is not None]
            float32_copies(dense, f"{what} in {dtype_name(dtype)}", HINT)
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.ops: Ops = EAGER  # the elementwise work between Linears (compile)
        self.decode_kernel = "sdpa"  # which kernels compute a decode step's attention (decode_attention.KERNELS)

    def decode_attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot: torch.Tensor,
        valid: torch.Tensor,
        bias: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        """A decode step's attention, one token per row, by the kernel `decode_kernel` names (decode_attention.py):
        qkv [B, (H + 2 Hkv) * D] or split partials of it, cos and sin [B, 1, D], the caches [B, Hkv, >= S, D]
        written at `slot` [1]; valid as forward takes it, and bias() the additive mask [B, 1, G, S] forward builds
        from it, once, where a kernel asks for it. Returns [B, H * D]. The Triton kernels read a [B, S] `valid`
        themselves; split partials and a [B, 1, S] `valid` take the "sdpa" kernels."""
        if self.decode_kernel != "sdpa" and qkv.dim() == 2 and valid.dim() == 2:
            return triton_attend(
                self.decode_kernel, qkv, cos, sin, k_cache, v_cache, slot, valid, self.heads, self.kv_heads
            )
        mask = bias()
        b, s, nq, nkv, d = qkv.shape[0], mask.shape[-1], self.heads, self.kv_heads, self.head_dim
        q = self.ops.rope_into_cache(qkv, cos, sin, nq, nkv, k_cache, v_cache, slot)  # [B, H, 1, D]
        # torch's choice of kernel: a decode step's shapes are few (captured per batch size and context bucket)
        a = F.scaled_dot_product_attention(
            q.reshape(b, nkv, nq // nkv, d), k_cache[:, :, :s], v_cache[:, :, :s], attn_mask=mask
        )
        return a.reshape(b, nq * d)

    def attention_bias(self, valid: torch.Tensor, slots: torch.Tensor, rows: int) -> torch.Tensor:
        """The additive attention mask [rows, 1, G*T, S] for queries at `slots` [T] (G = H / Hkv query heads per K/V
        head, laid out as forward's attention takes them). valid as forward takes it: [B, S], where a key is seen when
        it holds a real token at or before the query's slot, and a query always sees its own slot (a padding query
        thus has a key, and computes finite values no real token reads); or [B or 1, T, S], which keys each query
        sees, as given. Additive, built once per forward: SDPA would convert a boolean mask again in every layer."""
        t, s, g = slots.shape[0], valid.shape[-1], self.heads // self.kv_heads
        if valid.dim() == 3:
            mask = valid
        else:
            keys = torch.arange(s, device=valid.device)  # [S]
            seen = (keys[None, :] <= slots[:, None])[None]
            mask = (valid[:, None, :] & seen) | (keys[None, :] == slots[:, None])[None]  # [B, T, S]
        mask = mask[:, None, None].expand(rows, 1, g, t, s).reshape(rows, 1, g * t, s)
        return torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))

    def compile(self) -> str | None:
        """Forwards run the elementwise work between Linears compiled (elementwise.compiled_ops); None, or why they
        run it eagerly. Call before capturing CUDA graphs."""
        splits = {m.split for m in self._handing_partials() if m.weight is None}
        self.ops, why = compiled_ops(
            self.embed.shape[1],
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.dtype,
            self.device,
            self.eps,
            sorted(splits),
        )
        return why

    def _handing_partials(self) -> list[Linear]:
        """The Linears whose output forward reads with Linear.parts: each layer's HANDS_PARTIALS it has."""
        return [layer[k] for layer in self.layers for k in HANDS_PARTIALS if k in layer]

    def keep_dense(self, max_bytes: int) -> int:
        """Keep the dequantized matrix of int4 Linears that run a dense GEMM at many rows, Linear by Linear in model
        order while they fit in `max_bytes`, so a prefill reads them instead of dequantizing every weight, and decode
        steps of KEPT_DENSE_ROWS rows or more run the dense GEMM; 0 drops them all. Returns the bytes kept. A CUDA
        graph captured afterwards reads the kept matrices: drop them only with such graphs."""
        kept = 0
        for m in self.modules():
            if isinstance(m, Linear) and m.weight is None:
                m.dense = None
                if m.dense_rows is not None:
                    size = m.codes.shape[0] * m.codes.shape[1] * 2 * m.sz.element_size()  # [O, I] in the act. dtype
                    if kept + size <= max_bytes:
                        m.dense, kept = m.dequantized(), kept + size
        return kept

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
        valid: torch.Tensor | None,
        slot: torch.Tensor | int | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        segments: list[tuple[int, int, int]] | None = None,
    ) -> torch.Tensor:
        """tokens, positions [B, T]; valid [B, S] bool: which key slots hold real tokens, these T included, each
        query seeing those at or before its own slot; or [B, T, S] bool: which keys each query sees, as given (a
        query must see at least one). slot: where these T tokens go in the cache (a 0-d long tensor when captured);
        None: no cache, S == T. Attention reads the first S slots of the cache, so a short context costs S slots, not
        the cache's length. logits_to_keep: the last k positions' logits, or a long tensor [M] of positions in the
        flattened [B * T]. segments, in place of valid (None) and without a cache: (row, first, end) column spans,
        each one sequence whose tokens see its earlier ones and nothing else (causal_segments); the columns outside
        them are padding, whose logits mean nothing. Returns float32 logits [B, T or k, V], or [M, V]."""
        b, t = tokens.shape
        h = self.hidden(tokens, positions, valid, slot, segments)  # [B * T, H]
        if isinstance(logits_to_keep, torch.Tensor):
            return self.lm_head(h[logits_to_keep]).float()
        h = h.view(b, t, -1)
        return self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h).float()

    def hidden(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor | None,
        slot: torch.Tensor | int | None = None,
        segments: list[tuple[int, int, int]] | None = None,
    ) -> torch.Tensor:
        """forward's last hidden states, normed, before the head: [B * T, H], flattened as the tokens [B, T]."""
        b, t = tokens.shape
        if (segments is None) == (valid is None) or (segments is not None and slot is not None):
            raise ValueError("forward takes either valid or segments, and segments only without a cache")
        s = t if valid is None else valid.shape[-1]
        x = F.embedding(tokens, self.embed).view(b * t, -1)  # [N, H], N = B * T
        cos, sin = (c[positions].view(b * t, 1, -1) for c in (self.cos, self.sin))  # [N, 1, D]
        slots = torch.arange(t, device=tokens.device)  # [T]: where these T go
        if slot is not None:
            slots = slot + slots
        g = self.heads // self.kv_heads
        biases: list[torch.Tensor] = []

        def bias() -> torch.Tensor:
            """attention_bias(valid, slots, b), built at this forward's first call: a step on a Triton decode kernel
            reads `valid` itself and never calls it."""
            if not biases:
                biases.append(self.attention_bias(valid, slots, b))
            return biases[0]

        nq, nkv, d, ops = self.heads, self.kv_heads, self.head_dim, self.ops
        h = rms_norm(x, self.layers[0].in_norm, self.eps)
        for i, layer in enumerate(self.layers):
            if "qkv" in layer:
                qkv = layer["qkv"].parts(h)  # [N, (H + 2 Hkv) * D], or split partials that rope sums
            else:
                qkv = torch.cat([layer[n](h) for n in ("q_proj", "k_proj", "v_proj")], -1)
            if t == 1 and slot is not None:  # a decode step
                a = self.decode_attend(qkv, cos, sin, self.k_cache[i][:b], self.v_cache[i][:b], slots, valid, bias)
            else:
                q, k, v = (z.view(b, t, -1, d).transpose(1, 2) for z in ops.rope(qkv, cos, sin, nq, nkv))
                if slot is not None:
                    self.k_cache[i][:b].index_copy_(2, slots, k)
                    self.v_cache[i][:b].index_copy_(2, slots, v)
                    k, v = self.k_cache[i][:b, :, :s], self.v_cache[i][:b, :, :s]  # [B, Hkv, S, D]
                if segments is not None:
                    a = causal_segments(q, k, v, segments)
                else:  # grouped-query attention as Hkv heads of G*T queries each: K/V are read as stored, never
                    # copied per head; these forwards' shapes are many, and a kernel that plans per shape would plan
                    # in each
                    a = planless_sdpa(q.reshape(b, nkv, g * t, d), k, v, attn_mask=bias())  # q: [B, H, T, D]
                a = a.reshape(b, nq, t, d).transpose(1, 2).reshape(b * t, -1)  # [N, H * D]
            x, h = ops.add_rms_norm(x, layer["o_proj"].parts(a), layer.post_norm, self.eps)
            if "gate_up" in layer:
                gate, up = layer["gate_up"].parts(h).chunk(2, -1)  # [N, I] each, or split partials that silu_mul sums
            else:
                gate, up = layer["gate_proj"](h), layer["up_proj"](h)
            norm = self.layers[i + 1].in_norm if i + 1 < len(self.layers) else self.norm
            x, h = ops.add_rms_norm(x, layer["down_proj"].parts(ops.silu_mul(gate, up)), norm, self.eps)
        return h
