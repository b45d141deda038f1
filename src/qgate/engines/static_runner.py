"""The torch-int4 engine as a gate runner: the same interface as engines/runners.py, on the engine's own model.

    runner = StaticRunner(Path("runs/awq-int4"), torch.device("cuda"))
    logits = runner.logits_batch([[1, 2, 3], [4, 5]])     # teacher-forced, float32 numpy [T, V] per row
    scored = runner.continuation_logits([([1, 2], [[3], [4, 5]])])   # each context once, its continuations after it
    answers = runner.greedy_batch(prompts, 48)            # prefill, then decode steps replayed as CUDA graphs

On CUDA one decode graph per batch size in engine.json and per context bucket (powers of two from 256 slots up to
`max_seq_len`) is captured at load, all over one KV cache of `max_seq_len` slots: a decode step attends over its
bucket's slots, not the whole cache. A batch runs on the smallest captured size that holds it (spare rows compute
padding) and the smallest bucket that holds its prompt and answer. A batch no graph holds, and every batch on a CPU,
runs the same model eagerly. Before capture, the int4 weights' dequantized matrices are kept where they fit in
DENSE_SHARE of the free memory (StaticLlama.keep_dense): prefill and teacher-forced scoring read them instead of
dequantizing, and so do decode steps of KEPT_DENSE_ROWS rows or more, captured or not. Each int4 weight shape's
kernel is laid out as engine.json's `int4_splits` says (int4pack.split_k): the engine's build on a GPU times the
layouts at the captured batch sizes and records the fastest (engines/int4_choice.py). Decode steps compute attention
with the kernel engine.json's `decode_attention` names, chosen the same way (engines/decode_attention.py). Where
elementwise.COMPILED names the device, forwards run their elementwise work compiled (StaticLlama.compile). Where a
capture fails, the decode kernel gives way to "sdpa" first and the compiled work to eager functions next, with a
warning each, and `numerics` says what runs (engines/static_kernels.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from qgate.device import HostCopy, graph_seconds, to_device
from qgate.engines import decode_attention, elementwise, static_kernels
from qgate.engines.int4pack import Int4Weight
from qgate.engines.logits import as_logits, check_vocab, checkpoint_stops, head_blocks
from qgate.engines.padding import left_pad, pack_trees, right_pad, sequences_as_trees
from qgate.engines.static_llama import StaticLlama, segments_pay
from qgate.errors import ConfigError, in_one_line

WEIGHTS_FILE = "engine.safetensors"  # every tensor of an engine (engines/torch_int4.py names its layout)
SERVED_SUBDIR = "checkpoint"  # an engine's config, generation config and tokenizer files: what the contract reads
SERVED_FILES = ("config.json", "generation_config.json")
DENSE_SHARE = 0.5  # of the device's free memory after the KV cache, at most, for dequantized weights kept (keep_dense)
SEGMENTED = ("cpu",)  # devices where packed whole sequences attend by causal segment (StaticLlama.forward)


def load_model(engine_dir: Path, device: torch.device) -> tuple[StaticLlama, dict, dict]:
    """(model, engine.json, config.json) of a built engine, its weights placed on `device` and its int4 kernels laid
    out as engine.json's `int4_splits` says (chosen at build on a GPU: int4_choice.choose_splits)."""
    from safetensors.torch import load_file

    spec = json.loads((engine_dir / "engine.json").read_text())
    config = json.loads((engine_dir / SERVED_SUBDIR / "config.json").read_text())
    dtype = getattr(torch, spec["dtype"])
    if device.type == "cuda" and dtype != torch.bfloat16:
        raise ConfigError(
            f"{engine_dir}: engine.dtype {spec['dtype']} runs on the CPU only; torch's CUDA int4 kernel takes bfloat16",
            hint="rebuild the engine with engine.dtype bfloat16",
        )
    tensors = load_file(str(engine_dir / WEIGHTS_FILE))
    for p, kind in spec["layers"].items():
        if kind == "int4":
            tensors[p] = Int4Weight(
                tensors.pop(f"{p}.codes"), tensors.pop(f"{p}.scales_and_zeros"), spec["group_sizes"][p]
            )
    model = StaticLlama(config, tensors, dtype, device, spec.get("int4_splits"), f"{engine_dir}: the torch-int4 engine")
    return model.eval(), spec, config


class StaticRunner:
    kind = "torch-int4"
    packs_contexts = True  # logits_batch and continuation_logits pack their sequences several to a row

    def __init__(
        self,
        engine_dir: Path,
        device: torch.device,
        graph_batch_sizes: Sequence[int] | None = None,
        choose_kernels: bool = False,
    ):
        """graph_batch_sizes: the decode batch sizes captured on CUDA; None: the engine's own (engine.json).
        choose_kernels: on CUDA, time each int4 weight shape's split_k layouts at those batch sizes and take the
        fastest (int4_choice.choose_splits; the choice is in `splits`), then the decode step's attention kernels at
        those batch sizes and every context bucket (decode_attention.choose_kernel; the choice is in
        `decode_choice`), for the engine's build to record; otherwise the layouts and the kernel engine.json names."""
        from qgate.device import batch_tokens, check_fits, forward_cost
        from qgate.trust import check_loadable, load_tokenizer

        engine_dir = Path(engine_dir)
        check_loadable(engine_dir)
        weights = engine_dir / WEIGHTS_FILE
        if weights.is_file():  # else load_model names what is missing
            check_fits(device, weights.stat().st_size, f"{engine_dir}: the torch-int4 engine")
        self.device = device
        self.model, self.spec, config = load_model(engine_dir, device)
        self.splits: dict[str, dict] = {}  # choose_splits' record, where it ran
        self.decode_choice: dict = {}  # decode_attention.choose_kernel's record, where it ran
        self.tokenizer = load_tokenizer(engine_dir / SERVED_SUBDIR)
        check_vocab(engine_dir, self.tokenizer, self.model.embed.shape[0])
        self.max_length = int(config.get("max_position_embeddings", 2048))
        self.forward_cost = forward_cost(device)
        self.stops = checkpoint_stops(engine_dir / SERVED_SUBDIR)
        self.pad = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id or 0
        )
        self.graphs: dict[tuple[int, int], tuple] = {}  # (batch size, context slots) -> (graph, its logits)
        self.served_rows: int | None = None  # rows decoded together when scoring as served (served_logits_batch)
        self.dense_bytes = 0  # dequantized weights kept (StaticLlama.keep_dense)
        sizes = graph_batch_sizes or self.spec["graph_batch_sizes"]
        seconds = lambda f: graph_seconds(f, device)  # noqa: E731 - a call timed on the device, for the choices below
        if device.type == "cuda":
            self._graph_inputs(max(sizes), self.spec["max_seq_len"])
            # kept before capture: the graphs of KEPT_DENSE_ROWS rows or more read the kept matrices
            self.dense_bytes = self.model.keep_dense(int(torch.cuda.mem_get_info(device)[0] * DENSE_SHARE))
            if choose_kernels:  # after keep_dense: a kept matrix takes the rows from KEPT_DENSE_ROWS on
                self.splits = static_kernels.choose_splits(self.model, device, sizes, seconds)
        static_kernels.compile_ops(self.model, device)  # before capture: a graph replays the kernels its capture ran
        if device.type == "cuda" and choose_kernels:  # after compile: "sdpa" runs the compiled rope_into_cache
            self.decode_choice = static_kernels.choose_decode(self.model, sizes, self.buckets, seconds)
        else:
            name = self.spec.get("decode_attention", decode_attention.DEFAULT)
            static_kernels.serve_decode(self.model, device, name, engine_dir)
        if device.type == "cuda":
            self.served_rows = max(sizes)
            while True:
                try:
                    self._capture(sizes)
                    break
                except Exception as e:  # noqa: BLE001 - what does not capture gives way, and the rest is recaptured
                    why = f"capturing them failed: {in_one_line(e)}"
                    if self.model.decode_kernel != decode_attention.DEFAULT:
                        static_kernels.sdpa_decode(self.model, why)
                    elif self.model.ops is not elementwise.EAGER:
                        static_kernels.eager(self.model, why)
                    else:
                        raise
                    self.graphs = {}
        self.batch_tokens = batch_tokens(device, self.model.embed.shape[0], config["hidden_size"])

    @property
    def numerics(self) -> str:
        """What computes this runner's logits (static_kernels.numerics)."""
        return static_kernels.numerics(self.model, self.device, self.spec["dtype"])

    def _graph_inputs(self, rows: int, slots: int) -> None:
        """The decode graphs' KV cache of `slots` slots for `rows` rows, their context buckets and static inputs."""
        m = self.model
        self.buckets = sorted({min(1 << k, slots) for k in range(8, max(slots, 256).bit_length() + 1)})
        m.setup_cache(rows, slots)
        self._graph_cache = (m.k_cache, m.v_cache)
        self.g_tok = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        self.g_pos = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        self.g_valid = torch.zeros(rows, slots, dtype=torch.bool, device=self.device)
        self.g_slot = torch.zeros((), dtype=torch.long, device=self.device)

    def _capture(self, sizes: Sequence[int]) -> None:
        """One CUDA graph of a decode step per (batch size, context bucket), over _graph_inputs' cache and buffers;
        the largest is captured first, and the others share its memory pool."""
        m = self.model
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for b, n in sorted(((b, n) for b in sizes for n in self.buckets), reverse=True):
                args = (self.g_tok[:b], self.g_pos[:b], self.g_valid[:b, :n], self.g_slot)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs requires
                    for _ in range(2):
                        m(*args)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = m(*args)  # [b, 1, V] float32
                self.graphs[b, n] = (graph, out)
        torch.cuda.synchronize(self.device)

    def _left_pad(self, seqs: Sequence[Sequence[int]], rows: int | None = None):
        """tokens, valid mask and RoPE positions [rows, W] for left-padded sequences (extra rows are all padding)."""
        tok, real = left_pad(seqs, self.pad, rows)
        tok, valid = to_device(tok, self.device), to_device(real, self.device)
        return tok, valid, (valid.long().cumsum(-1) - 1).clamp(min=0)

    def logits_batch(self, seqs: Sequence[Sequence[int]], keep_last: int | None = None) -> list:
        """Teacher-forced logits [len, V] per sequence (its last keep_last positions only, when given), each computed
        as if alone: the sequences packed several to a row (padding.sequences_as_trees), one forward."""
        return [g[0] for g in self._packed_logits(sequences_as_trees(seqs, keep_last), ())]

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        return self.logits_batch([ids])[0]

    def logits_blocks(self, seq: Sequence[int]) -> Iterator:
        """logits(seq) as blocks of consecutive positions (engines/logits.head_blocks), from one forward that
        attends as one causal segment on any device, with no mask built: the last hidden states [T, H] are kept,
        never the [T, V] logits."""
        t, dev = len(seq), self.device
        tok, pos = to_device([list(seq)], dev), to_device([list(range(t))], dev)
        with torch.inference_mode():
            hidden = self.model.hidden(tok, pos, None, segments=[(0, 0, t)])  # [T, H]
        yield from head_blocks(self.model.lm_head, hidden, self.model.lm_head.out_features)

    def continuation_logits(
        self, groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], prefix: Sequence[int] = ()
    ) -> list[list]:
        """As TorchRunner.continuation_logits: every context with its continuations after it, packed several to a
        row (_packed_logits)."""
        return self._packed_logits(groups, prefix)

    def _packed_logits(self, groups, prefix: Sequence[int]) -> list[list]:
        """The prefix once into a cache, then every context with its continuations after it, packed several to a row
        (padding.pack_trees) in one forward, the logits read only at the positions that predict a continuation's
        tokens. Each context is computed once, and each continuation sees the prefix, its context and itself, as it
        would alone. Where SEGMENTED names the device, there is no prefix, each group is one sequence and that
        computes less (static_llama.segments_pay), attention runs by causal segment instead of under the mask."""
        p, dev, m = len(prefix), self.device, self.model
        trees = pack_trees(groups, p, self.pad)
        n, w = trees.tokens.shape
        tok, pos = to_device(trees.tokens, dev), to_device(trees.positions, dev)
        at = to_device(trees.at[:, 0] * w + trees.at[:, 1], dev)  # in the flattened [n * W]
        segments = trees.segments() if dev.type in SEGMENTED and not p else None
        if segments is not None and not segments_pay(segments, n, w):
            segments = None
        if p:
            m.setup_cache(n, p + w)  # outside inference mode, as the decode caches are: the compiled functions' kind
        with torch.inference_mode():
            if p:
                ids = to_device([list(prefix)], dev)
                m(ids, to_device([list(range(p))], dev), torch.ones(1, p, dtype=torch.bool, device=dev), 0, 1)
                for cache in (*m.k_cache, *m.v_cache):  # the prefix's keys and values in every row
                    cache[1:, :, :p] = cache[:1, :, :p]
            try:
                valid = trees.mask(p, dev) if segments is None else None
                logits = as_logits(m(tok, pos, valid, p or None, logits_to_keep=at, segments=segments))  # [M, V]
            finally:
                if p:
                    m.k_cache, m.v_cache = [], []  # the scoring cache is freed; decoding sets up its own
        return trees.per_continuation(logits)

    def greedy(self, ids: Sequence[int], max_new_tokens: int) -> list[int]:
        return self.greedy_batch([ids], max_new_tokens)[0]

    def greedy_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy answers, each ending at its first stop token (included): one prefill into the static cache, then
        one decode step per token, replayed from a captured graph when one holds the batch. Each step's tokens come
        to the host while the next step runs (device.HostCopy), so on a GPU the host queues the next step before it
        reads a step's tokens and the device does not wait for it. Stops are thus seen a step late: the step after
        the last answer's stop runs, and its tokens are dropped."""
        answers: list[list[int]] = [[] for _ in prompts]
        if max_new_tokens < 1:
            return answers
        live = [True] * len(prompts)
        queued: list[HostCopy] = []  # the last step's tokens, on their way to the host

        def read() -> None:
            for r, t in enumerate(queued.pop().tolist()):
                if live[r]:
                    answers[r].append(t)
                    live[r] = t not in self.stops

        def take(step: int, logits: torch.Tensor) -> torch.Tensor | None:
            nxt = logits[:, -1].argmax(-1)  # [rows]
            copy = HostCopy(nxt[: len(prompts)])
            if queued:
                read()
            queued.append(copy)
            return nxt if any(live) else None

        self._decode(prompts, max_new_tokens - 1, 1, take)
        read()
        return answers

    def served_logits_batch(self, seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> list:
        """Teacher-forced logits [T, V] per sequence as the engine serves them: its first prompt_lens[i] positions
        from one prefill, every later position from one decode step fed the sequence's next token. On CUDA the two
        run different kernels (engines/static_llama.py), so this is what a gate scores an answer's positions with;
        logits_batch runs every position as prefill. The rows decode together in chunks of at most `served_rows`
        (on CUDA the largest captured batch size: the most the engine decodes at once for the traffic it was built
        for), so answers are scored by the captured graphs and the kernels that serve that traffic, not by the dense
        GEMM that many more rows would run."""
        n = self.served_rows or len(seqs)
        return [x for i in range(0, len(seqs), n) for x in self._served_chunk(seqs[i : i + n], prompt_lens[i : i + n])]

    def _served_chunk(self, seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> list:
        prompts = [list(s[:p]) for s, p in zip(seqs, prompt_lens, strict=True)]
        answers = [list(s[p:]) for s, p in zip(seqs, prompt_lens, strict=True)]
        steps = max(len(a) for a in answers)
        parts: list[torch.Tensor] = []
        feed: list[torch.Tensor] = []

        def take(step: int, logits: torch.Tensor) -> torch.Tensor | None:
            if step < 0:
                rows = logits.shape[0]
                feed.append(to_device(right_pad(answers, self.pad, rows)[0], self.device))  # [rows, steps]
            parts.append(logits if step < 0 else logits.clone())  # a graph's output is overwritten by its next replay
            return feed[0][:, step + 1] if step + 1 < steps else None

        width = self._decode(prompts, steps, 0, take)
        decoded = torch.cat(parts[1:], 1) if len(parts) > 1 else parts[0][:, :0]  # [rows, steps, V]
        return [
            as_logits(torch.cat([parts[0][i, width - len(p) :], decoded[i, : len(a)]]))
            for i, (p, a) in enumerate(zip(prompts, answers, strict=True))
        ]

    def _decode(self, prompts: Sequence[Sequence[int]], steps: int, keep: int, take) -> int:
        """Prefill `prompts` (left-padded) into the static cache, then up to `steps` decode steps. take(step, logits)
        gets the prefill's float32 logits (step -1: [rows, keep or the padded width, V]) and each step's ([rows, 1,
        V]), and returns the tokens [rows] the next step feeds, or None to stop. Rows past len(prompts) are padding of
        a captured graph's batch size. Returns the padded prompt width."""
        b, width = len(prompts), max(len(p) for p in prompts)
        need = width + steps + 1
        fits = [(s, n) for s, n in self.graphs if s >= b and n >= need]
        rows, n = min(fits) if fits else (b, need)
        m = self.model
        tok, valid_w, pos = self._left_pad(prompts, rows)
        if fits:
            m.k_cache, m.v_cache = self._graph_cache
            self.g_valid[:rows].zero_()
            valid = self.g_valid[:rows, :n]
        else:
            m.setup_cache(rows, need)
            valid = torch.zeros(rows, need, dtype=torch.bool, device=self.device)
        valid[:, :width] = valid_w
        lengths = valid_w.sum(-1, keepdim=True)  # [rows, 1]
        with torch.inference_mode():
            nxt = take(-1, m(tok, pos, valid, 0, logits_to_keep=keep))
            for step in range(steps):
                if nxt is None:
                    break
                slot = width + step
                valid[:, slot] = True
                if fits:
                    graph, out = self.graphs[rows, n]
                    self.g_tok[:rows].copy_(nxt[:, None])
                    self.g_pos[:rows].copy_(lengths + step)
                    self.g_slot.fill_(slot)
                    graph.replay()
                else:
                    out = m(nxt[:, None], lengths + step, valid, slot)
                nxt = take(step, out)
        return width


def load_runner(art, device: str = "cpu", dtype: str = "auto") -> StaticRunner:
    """The gates' runner for a built torch-int4 engine on `device`; the engine's own dtype applies, not `dtype`."""
    from qgate.device import resolve_device

    return StaticRunner(art.path, resolve_device(device))
