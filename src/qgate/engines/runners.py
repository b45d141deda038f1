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
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from qgate.artifact import Artifact
from qgate.device import to_device
from qgate.engines.attention import ATTENTION, register_attention
from qgate.engines.logits import as_logits, cat_rows, check_vocab, head_blocks, stop_tokens
from qgate.engines.padding import left_pad, length_groups, pack_trees, right_pad, sequences_as_trees
from qgate.errors import BackendUnavailable, InputError


def dequantize_kwargs(path: Path) -> dict:
    """Decompress compressed-tensors weights once at load instead of on every forward (same numbers, faster)."""
    from qgate.quantize.schemes import quantization_config

    if quantization_config(path).get("quant_method") != "compressed-tensors":
        return {}
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}


PACKED_CONTEXTS = {"cuda": True}  # devices where the reference packs the sequences it scores into rows
HEAD_PROBE = 8  # tokens of the forward that checks a model's head once (TorchRunner._head_vocab)
HEAD_TOLERANCE = 0.02  # of the largest logit: how far the head's own logits may be from the model's (_head_vocab)


def _without_offloading(model) -> None:
    """compressed-tensors decompresses a checkpoint inside its offloading wrapper, which onloads each module's tensors
    and moves its inputs on every call, though the runner holds the whole model on one device. Removed, the tensors
    on that device; the quantized forwards (activation quantization) stay."""
    from compressed_tensors.offload import remove_dispatch

    remove_dispatch(model, onload_tensors=True)


def _in_dtype(model, dtype) -> None:
    """Decompressed Linears in the runner's compute dtype where theirs is narrower: compressed-tensors decompresses
    some formats (NVFP4, MXFP4) to bfloat16 whatever dtype the model loads in, and a float32 activation cannot meet a
    bfloat16 weight in a matmul. Only cast up, so the values are unchanged (a Linear a model keeps wider stays so)."""
    import torch

    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        for name in ("weight", "bias"):
            p = module._parameters.get(name)
            if p is not None and p.is_floating_point() and torch.finfo(p.dtype).bits < torch.finfo(dtype).bits:
                p.data = p.data.to(dtype)


def _online_transforms(model, path: Path) -> None:
    """The checkpoint's run-time rotations (quantize.schemes.online_transforms), attached as compressed-tensors
    attaches them when it makes the model: hooks on the Linears, and on attention for its query and keys. Its fused
    rotations are in the weights already."""
    from qgate.quantize.schemes import online_transforms

    if groups := online_transforms(path):
        from compressed_tensors.transform import TransformConfig, apply_transform_config

        apply_transform_config(model, TransformConfig.model_validate({"config_groups": groups}))


@functools.cache
def _log_float32_products(dtype: str) -> None:
    """Once per process and format: a gate loads several models."""
    logging.getLogger("qgate").info(
        f"{dtype} on a CPU without {dtype} matmuls in hardware: the reference path's matmuls run in float32 on its "
        f"{dtype} values (engines/bf16_products.py), with a float32 copy of each weight"
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
            dtype_name,
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
                attn_implementation=register_attention(self.device),
                **decompressed,
                **placed,
            ).eval()
        check_vocab(path, self.tokenizer, self.model.get_input_embeddings().num_embeddings)
        if decompressed:
            _without_offloading(self.model)
            _in_dtype(self.model, self.dtype)
            _online_transforms(self.model, path)
        if emulated(self.device, self.dtype):
            name = dtype_name(self.dtype)
            float32_products(self.model, f"{path}: the {name} reference")
            _log_float32_products(name)
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

    def _hooked_attention(self) -> bool:
        """Whether the model attends through compressed-tensors' hooked attention (run-time rotations of the query
        and keys, _online_transforms): the attention this runner chooses would leave them out."""
        hooked = sys.modules.get("compressed_tensors.modeling.attention")  # imported where a model could be hooked
        return bool(hooked) and self.model.config._attn_implementation == hooked.HOOKED_ATTENTION_NAME

    @contextmanager
    def _unmasked(self):
        """The model attends as on a CPU (ATTENTION) meanwhile: without padding transformers then builds no mask
        and calls causal attention, where ATTENTION_MASKED builds a [T, T] mask, and grouped_sdpa G copies of it."""
        was = self.model.config._attn_implementation
        if self._hooked_attention():  # run-time rotations of the query and keys: kept
            yield
            return
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
        attention mask is built here, and would not carry a sliding window or chunked attention), and not through
        compressed-tensors' hooked attention, whose key hooks wrap the KV cache a packed row splits."""
        cfg = self.model.config
        full = all(t == "full_attention" for t in getattr(cfg, "layer_types", None) or ())
        local = getattr(cfg, "sliding_window", None) or getattr(cfg, "attention_chunk_size", None)
        return bool(PACKED_CONTEXTS.get(self.device.type)) and full and not local and not self._hooked_attention()

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

    @property
    def _answer_pad(self) -> int:
        """The token greedy decoding pads its rows with: the tokenizer's pad token, else its EOS."""
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def greedy(self, ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation with the KV cache; stops at EOS (included)."""
        return self.greedy_batch([ids], max_new_tokens)[0]

    def greedy_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations of several prompts at once: left-padded, with the attention mask (generate derives
        each row's position ids from it) and the KV cache. Each answer stops at its first EOS, which it includes."""
        import torch

        pad = self._answer_pad
        tok, real = left_pad(prompts, pad)
        width = tok.shape[1]
        x, mask = self._ids(tok), self._ids(real, torch.long)
        with torch.inference_mode():
            out = self.model.generate(
                x, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad
            )
        stops = stop_tokens(self.model.generation_config.eos_token_id)
        answers = []
        for row in out[:, width:].tolist():
            end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            answers.append(row[:end])
        return answers

    def greedy_scored(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, reduce, prefill_tokens: int = 1024
    ) -> list[tuple[list[int], tuple]]:
        """Greedy answers and the logits of every position of prompt + answer that predicts a next token, reduced
        on the fly by reduce(logits [N, V]): scored_decode.greedy_scored on this runner's model. Per prompt: (answer,
        the reduced arrays over its len(prompt) + len(answer) - 1 positions, in order)."""
        from qgate.engines.scored_decode import greedy_scored

        return greedy_scored(self.model, self._answer_pad, self.device, prompts, max_new_tokens, reduce, prefill_tokens)


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
