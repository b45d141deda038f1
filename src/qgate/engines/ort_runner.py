"""The built CPU engine as a gate runner: its ONNX graph on onnxruntime, batch 1, with its own KV cache.

runner = OrtRunner(engine_dir, tokenizer_dir)   # engines/cpu.py's runner for the onnxruntime-genai bundle
logits = runner.logits([1, 2, 3])               # float32 [T, V], as TorchRunner.logits
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from qgate.engines.logits import check_vocab


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
