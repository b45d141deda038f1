"""Score token ids on a model: the one interface every gate uses.

    runner = load_runner(artifact)        # checkpoint -> PyTorch reference; cpu engine -> onnxruntime
    logits = runner.logits([1, 2, 3])     # float32 [T, V]: teacher-forced next-token logits

Both runners take token ids from the checkpoint's Hugging Face tokenizer, so engines
are compared on identical inputs (onnxruntime-genai's own tokenizer adds no BOS).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from qgate.artifact import Artifact
from qgate.errors import BackendUnavailable, InputError


def dequantize_kwargs(path: Path) -> dict:
    """Decompress compressed-tensors weights once at load instead of on every forward (same numbers, faster)."""
    cfg = json.loads((Path(path) / "config.json").read_text()).get("quantization_config") or {}
    if cfg.get("quant_method") != "compressed-tensors":
        return {}
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}


class TorchRunner:
    """PyTorch eager reference path (float32 compute; compressed-tensors checkpoints are decompressed on load)."""

    kind = "torch-reference"

    def __init__(self, path: Path):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from qgate.trust import LOAD_KWARGS, TOKENIZER_KWARGS, check_loadable

        check_loadable(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path, **TOKENIZER_KWARGS)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **LOAD_KWARGS, **dequantize_kwargs(path)).eval()
        self.max_length = int(getattr(self.model.config, "max_position_embeddings", 2048))

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        import torch

        with torch.inference_mode():
            out = self.model(torch.tensor([list(ids)], dtype=torch.long)).logits[0]  # [T, V]
        return out.float().numpy()

    def logits_batch(self, seqs: Sequence[Sequence[int]], keep_last: int | None = None) -> list[np.ndarray]:
        """Left-padded batch with explicit position ids, so each row computes as if alone. keep_last: only the
        last k positions' logits (the vocabulary projection is the costly part of scoring short continuations)."""
        import torch

        width = max(len(s) for s in seqs)
        pad = self.tokenizer.pad_token_id or 0
        x = torch.tensor([[pad] * (width - len(s)) + list(s) for s in seqs], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        k = min(keep_last or width, width)
        with torch.inference_mode():
            out = self.model(x, attention_mask=mask, position_ids=pos, logits_to_keep=k).logits.float().numpy()  # [B, k, V]
        return [out[i, max(k - len(s), 0):] for i, s in enumerate(seqs)]

    def continuation_logits(self, groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]]) -> list[list[np.ndarray]]:
        """For each (context, continuations): per continuation, the logits [len(cont), V] that predict its tokens.

        The context runs once (left-padded batch, KV cache kept) and every continuation reuses its cache: a
        multiple-choice question costs one context pass, not one per choice. Contexts must be non-empty.
        """
        import torch

        pad = self.tokenizer.pad_token_id or 0
        cw = max(len(c) for c, _ in groups)
        x = torch.tensor([[pad] * (cw - len(c)) + list(c) for c, _ in groups], dtype=torch.long)
        cmask = torch.tensor([[0] * (cw - len(c)) + [1] * len(c) for c, _ in groups], dtype=torch.long)
        rows = [(g, list(k)) for g, (_, conts) in enumerate(groups) for k in conts]
        kw = max(len(k) for _, k in rows)
        with torch.inference_mode():
            out = self.model(x, attention_mask=cmask, position_ids=(cmask.cumsum(-1) - 1).clamp(min=0), use_cache=True,
                             logits_to_keep=1)
            first = out.logits[:, -1].float().numpy()                         # [G, V]: predicts each continuation's first token
            rest = None
            if kw > 1:   # continuations right-padded; causal attention keeps the padding out of the rows we read
                idx = torch.tensor([g for g, _ in rows])
                cache = out.past_key_values
                cache.reorder_cache(idx)                                      # [G, ...] -> [R, ...], one row per continuation
                y = torch.tensor([k + [pad] * (kw - len(k)) for _, k in rows], dtype=torch.long)
                kmask = torch.tensor([[1] * len(k) + [0] * (kw - len(k)) for _, k in rows], dtype=torch.long)
                pos = cmask.sum(-1)[idx, None] + torch.arange(kw)[None]       # [R, kw]
                rest = self.model(y, attention_mask=torch.cat([cmask[idx], kmask], -1), position_ids=pos,
                                  past_key_values=cache, logits_to_keep=kw).logits.float().numpy()   # [R, kw, V]
        res: list[list[np.ndarray]] = [[] for _ in groups]
        for r, (g, k) in enumerate(rows):
            res[g].append(first[g][None] if len(k) == 1 else np.concatenate([first[g][None], rest[r, :len(k) - 1]]))
        return res

    def greedy(self, ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation with the KV cache; stops at EOS."""
        import torch

        x = torch.tensor([list(ids)], dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                                      pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id)
        return out[0, x.shape[1]:].tolist()


class OrtRunner:
    """The built CPU engine's ONNX graph on onnxruntime: the same int4 kernels onnxruntime-genai serves with."""

    kind = "onnxruntime-cpu"

    def __init__(self, engine_dir: Path, tokenizer_dir: Path):
        import onnxruntime as ort
        from transformers import AutoTokenizer

        gcfg = json.loads((engine_dir / "genai_config.json").read_text())["model"]
        dec = gcfg["decoder"]
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(engine_dir / dec["filename"]), opts, providers=["CPUExecutionProvider"])
        from qgate.trust import TOKENIZER_KWARGS, check_loadable

        check_loadable(tokenizer_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, **TOKENIZER_KWARGS)
        self.layers, self.kv_heads, self.head = dec["num_hidden_layers"], dec["num_key_value_heads"], dec["head_size"]
        self.names = dec["inputs"]
        self.present = (dec["outputs"]["present_key_names"], dec["outputs"]["present_value_names"])
        self.max_length = int(gcfg.get("context_length", 2048))
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
        return logits[0].astype(np.float32), present

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        return self._run(ids, None, False)[0]

    def logits_batch(self, seqs: Sequence[Sequence[int]], keep_last: int | None = None) -> list[np.ndarray]:
        return [self.logits(s)[-(keep_last or len(s)):] for s in seqs]

    def continuation_logits(self, groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]]) -> list[list[np.ndarray]]:
        """As TorchRunner.continuation_logits: each context runs once, each continuation after its KV cache."""
        res = []
        for ctx, conts in groups:
            first, cache = self._run(ctx, None, True)
            res.append([first[-1:] if len(k) == 1 else np.concatenate([first[-1:], self._run(k[:-1], cache, False)[0]])
                        for k in conts])
        return res


def load_runner(art: Artifact):
    if art.kind == "checkpoint":
        return TorchRunner(art.path)
    if art.kind == "engine" and art.meta.get("backend") == "cpu":
        from qgate.engines.cpu import ENGINE_SUBDIR

        return OrtRunner(art.path / ENGINE_SUBDIR, art.path / ENGINE_SUBDIR)
    if art.kind == "engine":
        raise BackendUnavailable(f"{art.path}: gates cannot run a {art.meta.get('backend')} engine on this host",
                                 hint="gate the checkpoint on the reference path, or run the gate on a CUDA host")
    raise InputError(f"{art.path}: a {art.kind} artifact cannot be run as a model", hint="pass a checkpoint or an engine")
