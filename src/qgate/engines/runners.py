"""Score token ids on a model: the one interface every gate uses.

    runner = load_runner(artifact)        # checkpoint -> PyTorch reference; cpu engine -> onnxruntime
    logits = runner.logits([1, 2, 3])     # float32 [T, V]: teacher-forced next-token logits

Both runners take token ids from the checkpoint's Hugging Face tokenizer, so engines
are compared on identical inputs (onnxruntime-genai's own tokenizer adds no BOS).
"""

from __future__ import annotations

import functools
import json
import logging
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from qgate.artifact import Artifact
from qgate.device import to_device
from qgate.engines.logits import as_logits, cat_rows, check_vocab, head_blocks, reduce_blocks
from qgate.engines.padding import left_pad, length_groups, pack_trees, right_pad, sequences_as_trees
from qgate.errors import BackendUnavailable, InputError


def dequantize_kwargs(path: Path) -> dict:
    """Decompress compressed-tensors weights once at load instead of on every forward (same numbers, faster)."""
    cfg = json.loads((Path(path) / "config.json").read_text()).get("quantization_config") or {}
    if cfg.get("quant_method") != "compressed-tensors":
        return {}
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}


ATTENTION = "qgate_sdpa_gqa"
ATTENTION_MASKED = "qgate_sdpa_gqa_masked"  # the same on CUDA, with a mask always built (_masked_sdpa_mask)
PACKED_CONTEXTS = {"cuda": True}  # devices where the reference packs the sequences it scores into rows
HEAD_PROBE = 8  # tokens of the forward that checks a model's head once (TorchRunner._head_vocab)
HEAD_TOLERANCE = 0.02  # of the largest logit: how far the head's own logits may be from the model's (_head_vocab)
COMPACT_BELOW = 0.75  # greedy_scored: drop finished answers from the decode batch once fewer than this share still run


def _gqa_sdpa(
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


def _masked_sdpa_mask(*args, **kwargs):
    """transformers' SDPA mask, built whatever the padding: to skip building it where attention is plainly causal,
    transformers reads the padding mask's values on the host, which waits for the device in every forward."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **(kwargs | {"allow_is_causal_skip": False, "allow_is_bidirectional_skip": False}))


def _register_attention(device) -> str:
    """The attention implementation a model on `device` runs: _gqa_sdpa, with transformers' SDPA mask on a CPU and
    _masked_sdpa_mask on an accelerator, where a forward then holds no host synchronization."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for name, mask in ((ATTENTION, sdpa_mask), (ATTENTION_MASKED, _masked_sdpa_mask)):
        AttentionInterface.register(name, _gqa_sdpa)
        AttentionMaskInterface.register(name, mask)
    return ATTENTION if device.type == "cpu" else ATTENTION_MASKED


def _reserved_cache(cache, capacity: int):
    """The same cache, each layer's keys and values moved into a buffer reserved for `capacity` positions: a decode step
    then writes one position instead of copying the whole cache (DynamicLayer's torch.cat per layer and step)."""
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        def __init__(self, keys, values):
            super().__init__()
            n = keys.shape[-2]
            self.kbuf = keys.new_empty((*keys.shape[:2], capacity, keys.shape[-1]))
            self.vbuf = values.new_empty((*values.shape[:2], capacity, values.shape[-1]))
            self.kbuf[:, :, :n], self.vbuf[:, :, :n] = keys, values
            self.dtype, self.device, self.is_initialized, self.n = keys.dtype, keys.device, True, n
            self.keys, self.values = self.kbuf[:, :, :n], self.vbuf[:, :, :n]

        def update(self, key_states, value_states, *args, **kwargs):
            m = self.n + key_states.shape[-2]
            self.kbuf[:, :, self.n : m], self.vbuf[:, :, self.n : m] = key_states, value_states
            self.n = m
            self.keys, self.values = self.kbuf[:, :, :m], self.vbuf[:, :, :m]
            return self.keys, self.values

        def batch_select_indices(self, indices):
            self.kbuf, self.vbuf = self.kbuf[indices], self.vbuf[indices]
            self.keys, self.values = self.kbuf[:, :, : self.n], self.vbuf[:, :, : self.n]

    cache.layers = [ReservedLayer(layer.keys, layer.values) for layer in cache.layers]
    return cache


def _without_offloading(model) -> None:
    """compressed-tensors decompresses a checkpoint inside its offloading wrapper, which onloads each module's tensors
    and moves its inputs on every call, though the runner holds the whole model on one device. Removed, the tensors
    on that device; the quantized forwards (activation quantization) stay."""
    from compressed_tensors.offload import remove_dispatch

    remove_dispatch(model, onload_tensors=True)


@functools.cache
def _log_float32_products() -> None:
    """Once per process: a gate loads several models."""
    logging.getLogger("qgate").info(
        "bfloat16 on a CPU without AMX or AVX512-BF16: the reference path's matmuls run in float32 on its bf16 values "
        "(engines/bf16_products.py), with a float32 copy of each weight"
    )


class TorchRunner:
    """PyTorch eager reference path on a device (float32 on the CPU, the served dtype on CUDA; compressed-tensors
    checkpoints are decompressed on load). On CUDA its norms of transformers' Llama code run as one kernel each
    (engines/fused_norms.py)."""

    kind = "torch-reference"

    def __init__(self, path: Path, device: str = "cpu", dtype: str = "auto"):
        """device: auto, cpu, cuda or cuda:N; dtype: auto (float32 on the CPU, the served dtype on CUDA) or a name."""

        from qgate.device import (
            batch_tokens,
            check_model_fits,
            compute_dtype,
            forward_cost,
            numerics,
            resolve_device,
        )
        from qgate.engines import fused_norms
        from qgate.engines.bf16_products import emulated, float32_products
        from qgate.trust import check_loadable, load_causal_lm, load_tokenizer

        check_loadable(path)
        self.path = Path(path)
        self.device = resolve_device(device)
        config = json.loads((Path(path) / "config.json").read_text())
        self.dtype = compute_dtype(config, self.device, dtype)
        check_model_fits(self.device, path, self.dtype, "reference")
        self.tokenizer = load_tokenizer(path)
        placed = {"device_map": str(self.device)} if self.device.type == "cuda" else {}  # straight onto the GPU
        decompressed = dequantize_kwargs(path)
        with warnings.catch_warnings():  # that the passed config's `dequantize` replaces the checkpoint's: meant
            warnings.filterwarnings("ignore", "You passed `quantization_config`", UserWarning)
            self.model = load_causal_lm(
                path,
                dtype=self.dtype,
                attn_implementation=_register_attention(self.device),
                **decompressed,
                **placed,
            ).eval()
        check_vocab(path, self.tokenizer, self.model.get_input_embeddings().num_embeddings)
        if decompressed:
            _without_offloading(self.model)
        if emulated(self.device, self.dtype):
            float32_products(self.model, f"{path}: the bfloat16 reference")
            _log_float32_products()
        if self.device.type in fused_norms.DEVICES:
            fused_norms.fuse_rms_norms(self.model)
        self.max_length = int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.batch_tokens = batch_tokens(self.device, self.model.config.vocab_size, self.model.config.hidden_size)
        self.numerics = numerics(self.device, self.dtype)
        self.forward_cost = forward_cost(self.device)  # continuation_logits' length groups
        self._head_is_plain: bool | None = None  # _head_vocab, once known
        self._vocab = 0

    def _ids(self, data, dtype=None):
        """Host data (lists, numpy) as a tensor on this runner's device, copied without waiting for it."""
        return to_device(data, self.device, dtype)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        import torch

        with torch.inference_mode():
            out = self.model(self._ids([list(ids)], torch.long)).logits[0]  # [T, V]
        return as_logits(out)

    def logits_batch(self, seqs: Sequence[Sequence[int]], keep_last: int | None = None) -> list[np.ndarray]:
        """Left-padded batch with explicit position ids, so each row computes as if alone; where `packs_contexts`,
        the sequences packed several to a row instead (_packed_logits). keep_last: only the last k positions' logits
        (the vocabulary projection is the costly part of scoring short continuations)."""
        import torch

        if self.packs_contexts:
            with torch.inference_mode():
                return [g[0] for g in self._packed_logits(sequences_as_trees(seqs, keep_last), None, 0)]
        tok, real = left_pad(seqs, self.tokenizer.pad_token_id or 0)
        width = tok.shape[1]
        x, mask = self._ids(tok), self._ids(real, torch.long)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        k = min(keep_last or width, width)
        with torch.inference_mode():
            out = as_logits(self.model(x, attention_mask=mask, position_ids=pos, logits_to_keep=k).logits)  # [B, k, V]
        return [out[i, max(k - len(s), 0) :] for i, s in enumerate(seqs)]

    def logits_blocks(self, seq: Sequence[int]) -> Iterator:
        """logits(seq) as blocks of consecutive positions (engines/logits.head_blocks), from one forward that
        attends causally with no mask built: the decoder's last hidden states [T, H] are kept, never the [T, V]
        logits. A model whose logits are more than its output embedding of those states (a softcap, a scale:
        _head_vocab) gives logits(seq) as one block instead."""
        import torch

        ids = self._ids([list(seq)], torch.long)
        vocab = self._head_vocab(ids[:, :HEAD_PROBE])
        if vocab is None:
            yield self.logits(seq)  # one block: the model's own forward computes every position's logits
            return
        with torch.inference_mode(), self._unmasked():
            hidden = self.model.get_decoder()(input_ids=ids).last_hidden_state[0]  # [T, H]
        yield from head_blocks(self.model.get_output_embeddings(), hidden, vocab)

    def _head_vocab(self, probe) -> int | None:
        """The logits' width where they are the output embedding of the decoder's last hidden states, as
        logits_blocks computes them: on the last of a few tokens (probe [1, n]), the two differ by at most
        HEAD_TOLERANCE of the largest logit (bf16's rounding is 0.4%; a softcap or a scale moves them more). None
        where they are not, or where the model has no such decoder and embedding. Checked once."""
        import torch

        if self._head_is_plain is None:
            head = self.model.get_output_embeddings()
            with torch.inference_mode():
                full = self.model(probe, logits_to_keep=1).logits[0, -1].float()  # [V]
                try:
                    last = self.model.get_decoder()(input_ids=probe).last_hidden_state[0, -1:]  # [1, H]
                    own = head(last)[0].float() if head is not None else None
                except AttributeError:  # a decoder without last_hidden_state: get_decoder found none
                    own = None
                same = own is not None and own.shape == full.shape
                apart = float((full - own).abs().max()) if same else float("inf")
            self._head_is_plain = apart <= HEAD_TOLERANCE * float(full.abs().max())
            self._vocab = full.shape[-1]
            if not self._head_is_plain:
                logging.getLogger("qgate").info(
                    "%s: its logits are not its output embedding of its last hidden states (a softcap or a scale); "
                    "long documents are scored from all their logits at once",
                    self.path,
                )
        return self._vocab if self._head_is_plain else None

    @contextmanager
    def _unmasked(self):
        """The model attends as on a CPU (ATTENTION) meanwhile: without padding transformers then builds no mask
        and calls causal attention, where ATTENTION_MASKED builds a [T, T] mask, and grouped_sdpa G copies of it."""
        was = self.model.config._attn_implementation
        self.model.set_attn_implementation(ATTENTION)
        try:
            yield
        finally:
            self.model.set_attn_implementation(was)

    def continuation_logits(
        self, groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], prefix: Sequence[int] = ()
    ) -> list[list[np.ndarray]]:
        """For each (context, continuations): per continuation, the logits [len(cont), V] that predict its tokens,
        where every context follows `prefix`.

        The prefix runs once, each context once after the prefix's KV cache, and every continuation after its
        context: a multiple-choice question costs one context pass, not one per choice, and a task's shared
        instructions one pass per batch. Where `packs_contexts`, the contexts and their continuations are packed
        several to a row and run as one forward (_packed_logits); otherwise the contexts run left-padded to the
        longest and the continuations from their cache (_padded_logits). Contexts and continuations must be
        non-empty.
        """
        import torch

        with torch.inference_mode():
            cache = None
            if prefix:
                cache = self.model(
                    self._ids([list(prefix)], torch.long), use_cache=True, logits_to_keep=1
                ).past_key_values
            if self.packs_contexts:
                return self._packed_logits(groups, cache, len(prefix))
            return self._padded_logits(groups, cache, len(prefix))

    @property
    def packs_contexts(self) -> bool:
        """Whether logits_batch and continuation_logits pack their sequences several to a row: on devices
        PACKED_CONTEXTS names, for models whose every layer attends causally over the whole sequence (a packed row's
        attention mask is built here, and would not carry a sliding window or chunked attention)."""
        cfg = self.model.config
        full = all(t == "full_attention" for t in getattr(cfg, "layer_types", None) or ())
        local = getattr(cfg, "sliding_window", None) or getattr(cfg, "attention_chunk_size", None)
        return bool(PACKED_CONTEXTS.get(self.device.type)) and full and not local

    def _spread(self, cache, rows: int) -> None:
        """A cached prefix's KV cache [1, ...] made [rows, ...] in place, the prefix once per row; None: no prefix."""
        import torch

        if cache is not None:
            cache.reorder_cache(torch.zeros(rows, dtype=torch.long, device=self.device))

    def _packed_logits(self, groups, cache, p: int) -> list[list]:
        """Every context with its continuations after it, packed several to a row (padding.pack_trees), in one
        forward after `p` cached prefix positions; logits read only at the columns that predict a continuation's
        tokens. Each token sees the prefix, its own context and its own continuation's earlier tokens: the
        positions, attention and logits of the padded path, with far fewer positions and forwards."""
        trees = pack_trees(groups, p, self.tokenizer.pad_token_id or 0)
        n = len(trees.tokens)
        self._spread(cache, n)
        cols = np.unique(trees.at[:, 1])  # the columns any row reads
        out = self.model(
            self._ids(trees.tokens),
            attention_mask=trees.mask(p, self.device)[:, None],  # [n, 1, W, p + W]
            position_ids=self._ids(trees.positions),
            past_key_values=cache,
            use_cache=cache is not None,
            logits_to_keep=self._ids(cols),
        ).logits  # [n, len(cols), V]
        logits = as_logits(out[self._ids(trees.at[:, 0]), self._ids(np.searchsorted(cols, trees.at[:, 1]))])  # [M, V]
        return trees.per_continuation(logits)

    def _padded_logits(self, groups, cache, p: int) -> list[list]:
        """The contexts after `p` cached prefix positions as one left-padded forward, then the continuations, fed
        without their last token (nothing reads what it predicts), from a copy of their context's cache, right-padded
        within groups of similar length (`length_groups`): padding every choice to the longest one ran 4,095
        continuation positions where 323 were needed on general_knowledge's 518 choices (benchmarks/bench_eval.py)."""
        import copy

        import torch

        pad = self.tokenizer.pad_token_id or 0
        tok, real = left_pad([list(c) for c, _ in groups], pad)
        x, smask = self._ids(tok), self._ids(real, torch.long)
        # padding sits between prefix and context
        cmask = torch.cat([torch.ones(len(groups), p, dtype=torch.long, device=self.device), smask], -1)
        self._spread(cache, len(groups))
        out = self.model(
            x,
            attention_mask=cmask,
            position_ids=p + (smask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            past_key_values=cache,
            logits_to_keep=1,
        )
        first = as_logits(out.logits[:, -1])  # [G, V]: each context's next token
        at = p + smask.sum(-1)
        rows = [(g, list(k)) for g, (_, conts) in enumerate(groups) for k in conts]
        fed = [len(k) - 1 for _, k in rows]
        rest: dict[int, np.ndarray] = {}  # row -> [len(k) - 1, V]
        todo = length_groups([f for f in fed if f > 0], self.forward_cost)
        for j, (lo, hi) in enumerate(todo):
            rs = [r for r, f in enumerate(fed) if lo <= f <= hi]
            idx = self._ids([rows[r][0] for r in rs], torch.long)
            cached = out.past_key_values if j == len(todo) - 1 else copy.deepcopy(out.past_key_values)
            cached.reorder_cache(idx)  # [G, ...] -> [R, ...]: one row per continuation
            tok, real = right_pad([rows[r][1][:-1] for r in rs], pad)  # [R, hi]: hi is the group's longest
            y, kmask = self._ids(tok), self._ids(real, torch.long)
            pos = at[idx][:, None] + torch.arange(hi, device=self.device)[None]  # causal: padding after a row is unread
            logits = as_logits(
                self.model(
                    y,
                    attention_mask=torch.cat([cmask[idx], kmask], -1),
                    position_ids=pos,
                    past_key_values=cached,
                    logits_to_keep=hi,
                ).logits
            )  # [R, hi, V]
            rest.update((r, logits[i, : fed[r]]) for i, r in enumerate(rs))
        res: list[list] = [[] for _ in groups]
        for r, (g, k) in enumerate(rows):
            res[g].append(first[g][None] if len(k) == 1 else cat_rows([first[g][None], rest[r]]))
        return res

    def greedy(self, ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation with the KV cache; stops at EOS (included)."""
        return self.greedy_batch([ids], max_new_tokens)[0]

    def greedy_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations of several prompts at once: left-padded, with the attention mask (generate derives
        each row's position ids from it) and the KV cache. Each answer stops at its first EOS, which it includes."""
        import torch

        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        tok, real = left_pad(prompts, pad)
        width = tok.shape[1]
        x, mask = self._ids(tok), self._ids(real, torch.long)
        with torch.inference_mode():
            out = self.model.generate(
                x, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad
            )
        eos = self.model.generation_config.eos_token_id
        stops = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        answers = []
        for row in out[:, width:].tolist():
            end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            answers.append(row[:end])
        return answers

    def greedy_scored(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, reduce, prefill_tokens: int = 1024
    ) -> list[tuple[list[int], tuple]]:
        """Greedy answers and the logits of every position of prompt + answer that predicts a next token, reduced
        on the fly: reduce(logits [N, V]) -> a tuple of arrays with leading dimension N. Per prompt: (answer,
        the reduced arrays over its len(prompt) + len(answer) - 1 positions, in order).

        Left-padded prefills (prefill_tokens padded tokens each) return the prompt positions' logits (what
        teacher-forced scoring computes) and KV caches, joined so that every row decodes in the same steps; each
        decode step's logits pick the next token and are kept as that position's scores. So the
        answers cost the decode steps, not a second pass over the prompts. The answers are those of greedy_batch
        (the same forwards generate() runs); the logits equal teacher-forced ones up to float rounding, which the
        noise floor measures."""
        import numpy as np
        import torch
        from transformers import DynamicCache

        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        eos = self.model.generation_config.eos_token_id
        stops = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        width, rows = max(len(p) for p in prompts), len(prompts)
        mask = self._ids(left_pad(prompts, pad)[1], torch.long)
        pos = self._ids([[len(p) - 1] for p in prompts], torch.long)  # each row's last position
        answers: list[list[int]] = [[] for _ in prompts]
        parts: list[list[tuple]] = [[] for _ in prompts]
        with torch.inference_mode():
            keys, values, firsts = [], [], []
            a = 0
            # prefill in small left-padded batches of similar length (a [B, W, V] logits tensor is slow)
            while a < rows:
                b = a + 1
                while b < rows and (b + 1 - a) * max(len(p) for p in prompts[a : b + 1]) <= prefill_tokens:
                    b += 1
                chunk = prompts[a:b]
                tok, real = left_pad(chunk, pad)
                w = tok.shape[1]
                cm = self._ids(real, torch.long)
                out = self.model(
                    self._ids(tok),
                    attention_mask=cm,
                    position_ids=(cm.cumsum(-1) - 1).clamp(min=0),
                    use_cache=True,
                )
                blocks = [out.logits[i, w - len(p) :].float() for i, p in enumerate(chunk)]
                for i, r in enumerate(reduce_blocks(reduce, blocks)):
                    parts[a + i].append(r)
                del blocks
                firsts.append(out.logits[:, -1].argmax(-1))
                # left-pad the cache to the common width; the mask hides the padding
                layers = out.past_key_values.layers
                keys.append([torch.nn.functional.pad(layer.keys, (0, 0, width - w, 0)) for layer in layers])
                values.append([torch.nn.functional.pad(layer.values, (0, 0, width - w, 0)) for layer in layers])
                del out, layers
                a = b
            nxt = torch.cat(firsts)
            cache = _reserved_cache(
                DynamicCache(
                    ddp_cache_data=[
                        (torch.cat([k[li] for k in keys]), torch.cat([v[li] for v in values]))
                        for li in range(len(keys[0]))
                    ],
                    config=self.model.config,
                ),
                width + max_new_tokens,
            )
            del keys, values
            live = np.ones(rows, bool)  # per prompt
            active = np.arange(rows)  # the prompts still in the decode batch, in batch order
            for step in range(max_new_tokens):
                tokens = nxt.tolist()  # one copy to the host per step, not one per row
                for j, i in enumerate(active):
                    if live[i]:
                        answers[i].append(tokens[j])
                        live[i] = answers[i][-1] not in stops
                if step == max_new_tokens - 1 or not live.any():
                    break
                on = live[active]
                if on.mean() < COMPACT_BELOW:  # finished answers leave the batch: a decode step costs its rows
                    sel = self._ids(np.nonzero(on)[0])
                    for layer in cache.layers:
                        layer.batch_select_indices(sel)
                    mask, pos, nxt, active, on = mask[sel], pos[sel], nxt[sel], active[on], on[on]
                mask = torch.cat([mask, torch.ones(len(active), 1, dtype=torch.long, device=self.device)], -1)
                pos = pos + 1
                feed = torch.where(self._ids(on), nxt, torch.full_like(nxt, pad))[:, None]
                logits = (
                    self.model(feed, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
                    .logits[:, -1]
                    .float()
                )
                keep = np.nonzero(on)[0]
                reduced = reduce(logits[self._ids(keep)])
                for j, r in enumerate(keep):
                    parts[active[r]].append(tuple(a[j : j + 1] for a in reduced))
                nxt = logits.argmax(-1)
        return [
            (a, tuple(np.concatenate(cols) for cols in zip(*ps, strict=True)))
            for a, ps in zip(answers, parts, strict=True)
        ]


class OrtRunner:
    """The built CPU engine's ONNX graph on onnxruntime: the same int4 kernels onnxruntime-genai serves with."""

    kind = "onnxruntime-cpu"
    numerics = "cpu-onnxruntime"
    batch_tokens = None  # the gates' default
    packs_contexts = False  # continuation_logits runs each context and continuation on its own

    def __init__(self, engine_dir: Path, tokenizer_dir: Path):
        import onnxruntime as ort

        gcfg = json.loads((engine_dir / "genai_config.json").read_text())["model"]
        dec = gcfg["decoder"]
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(engine_dir / dec["filename"]), opts, providers=["CPUExecutionProvider"])
        from qgate.trust import check_loadable, load_tokenizer

        check_loadable(tokenizer_dir)
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.layers, self.kv_heads, self.head = dec["num_hidden_layers"], dec["num_key_value_heads"], dec["head_size"]
        self.names = dec["inputs"]
        self.present = (dec["outputs"]["present_key_names"], dec["outputs"]["present_value_names"])
        self.max_length = int(gcfg.get("context_length", 2048))
        if "vocab_size" in gcfg:
            check_vocab(engine_dir, self.tokenizer, int(gcfg["vocab_size"]))
        self._dtype = np.float16 if "float16" in self.session.get_inputs()[2].type else np.float32

    def _run(self, ids: Sequence[int], past: list[np.ndarray] | None, keep_cache: bool):
        """One sequence (batch 1) after an optional KV cache [2 * layers x [1, kv_heads, T, head]]."""
        x = np.asarray([list(ids)], dtype=np.int64)
        t = 0 if past is None else past[0].shape[2]
        feed = {self.names["input_ids"]: x, self.names["attention_mask"]: np.ones((1, t + x.shape[1]), dtype=np.int64)}
        empty = np.zeros((1, self.kv_heads, 0, self.head), dtype=self._dtype)
        for i in range(self.layers):
            feed[self.names["past_key_names"] % i] = empty if past is None else past[2 * i]
            feed[self.names["past_value_names"] % i] = empty if past is None else past[2 * i + 1]
        outs = ["logits"] + ([self.present[j % 2] % (j // 2) for j in range(2 * self.layers)] if keep_cache else [])
        logits, *present = self.session.run(outs, feed)
        return logits[0].astype(np.float32, copy=False), present

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        return self._run(ids, None, False)[0]

    def logits_batch(self, seqs: Sequence[Sequence[int]], keep_last: int | None = None) -> list[np.ndarray]:
        return [self.logits(s)[-(keep_last or len(s)) :] for s in seqs]

    def continuation_logits(
        self, groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], prefix: Sequence[int] = ()
    ) -> list[list[np.ndarray]]:
        """As TorchRunner.continuation_logits: the prefix runs once, each context after the prefix's KV cache, each
        continuation after its context's."""
        head = self._run(prefix, None, True)[1] if prefix else None
        res = []
        for ctx, conts in groups:
            first, cache = self._run(ctx, head, True)
            res.append(
                [
                    first[-1:] if len(k) == 1 else np.concatenate([first[-1:], self._run(k[:-1], cache, False)[0]])
                    for k in conts
                ]
            )
        return res


def load_runner(art: Artifact, device: str = "cpu", dtype: str = "auto"):
    """The runner that scores what `art` serves: a checkpoint on the PyTorch reference path on `device` (dtype: see
    TorchRunner), the CPU engine on onnxruntime, the torch-int4 engine on `device`."""
    if art.kind == "checkpoint":
        return TorchRunner(art.path, device, dtype)
    if art.kind == "engine":
        from qgate.engines.build import engine_runner

        runner = engine_runner(art, device, dtype)
        if runner is not None:
            return runner
        raise BackendUnavailable(
            f"{art.path}: gates cannot run a {art.meta.get('backend')} engine on this host",
            hint="gate the checkpoint on the reference path, or build a torch-int4 engine",
        )
    raise InputError(
        f"{art.path}: a {art.kind} artifact cannot be run as a model", hint="pass a checkpoint or an engine"
    )
