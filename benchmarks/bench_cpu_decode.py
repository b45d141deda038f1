"""CPU decode figures that reproduce: prefill apart from decode, the host named, decode against the memory roofline.

    .venv/bin/qgate run pipelines/promote.yaml && .venv/bin/python benchmarks/bench_cpu_decode.py

Run it alone: two CPU-heavy processes on 2 cores distort each other badly. It reads the demo's int4 CPU engine
(awq-w4a16-cpu) and baseline from --workdir and prints:

- a host line: CPU model, cores, the ISA flags MatMulNBits' kernels depend on (AVX2, AVX-512 VNNI, AVX-VNNI, AMX),
  torch's and onnxruntime's versions and thread settings, and the engine's accuracy level (4: int8 compute in
  MatMulNBits, which uses VNNI or AMX where the CPU has them);
- the memory read bandwidth measured here (a 1 GiB float32 array summed by torch on every core, best of 5);
- the bytes one decode step reads: every initializer of the engine's ONNX graph, less all but one row of the
  embedding table and the RoPE caches, plus the KV cache at the mean context;
- per setting (onnxruntime threads, batch, prompt length): prefill tokens/s, decode tokens/s from the first new
  token on (the first generate_next_token after append_tokens only samples; each later call runs one decode step),
  decode x bytes per token / bandwidth, and the old figure (new tokens / total time, prefill included);
- transformers eager fp32 on the same prompts, decode-only (a KV-cached loop, timed from the first new token on).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def host_line(engine_cfg: dict) -> dict:
    import onnxruntime
    import onnxruntime_genai
    import torch

    cpu, flags = platform.processor() or "?", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and cpu in ("?", "x86_64", ""):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "isa": [f for f in FLAGS if f in flags],
        "torch": f"{torch.__version__}, {torch.get_num_threads()} threads",
        "onnxruntime": onnxruntime.__version__,
        "onnxruntime_genai": onnxruntime_genai.__version__,
        "engine_session_options": engine_cfg.get("session_options") or {},
        "accuracy_level": engine_cfg.get("accuracy_level"),
        "lm_head": engine_cfg.get("lm_head"),
    }


def read_bandwidth() -> float:
    """Bytes per second torch reads a 1 GiB float32 array at, summing it on every core: best of 5."""
    import torch

    a = torch.ones(256 * 1024 * 1024)
    a.sum()
    best = min(_timed(a.sum) for _ in range(5))
    return a.numel() * 4 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bytes_per_token(onnx_dir: Path, context: float) -> dict:
    """Bytes one decode step reads: the graph's initializers, with the embedding table (read by its Gather on
    input_ids) and the cos/sin caches counted as one row each, plus K and V of `context` positions (fp32)."""
    import onnx

    model = onnx.load(str(onnx_dir / "model.onnx"), load_external_data=False)
    g = model.graph
    gathered = {
        n.input[0] for n in g.node if n.op_type in ("Gather", "GatherBlockQuantized") and "input_ids" in n.input
    }
    gathered |= {"cos_cache", "sin_cache"}
    total, weights = 0, 0
    for t in g.initializer:
        ext = {e.key: e.value for e in t.external_data}
        n = int(ext["length"]) if "length" in ext else len(t.raw_data)
        weights += n
        total += n // t.dims[0] if t.name in gathered and t.dims else n
    cfg = json.loads((onnx_dir / "genai_config.json").read_text())["model"]["decoder"]
    kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_size"] * 4 * context
    return {"weights_file_bytes": weights, "weights_read": total, "kv_read": int(kv), "total": int(total + kv)}


def ort_decode(onnx_dir: Path, prompts: list[list[int]], new: int, batch: int, threads: int | None) -> dict:
    """Prefill and decode rates of onnxruntime-genai on `prompts` (left-padded batches), best of two passes."""
    import onnxruntime_genai as og

    config = og.Config(str(onnx_dir))
    if threads:
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)

    def run() -> dict:
        pre_s = dec_s = 0.0
        pre_tok = dec_tok = 0
        t_all = time.perf_counter()
        for a in range(0, len(prompts), batch):
            chunk = prompts[a : a + batch]
            width = max(map(len, chunk))
            p = og.GeneratorParams(model)
            p.set_search_options(max_length=width + new, min_length=width + new, do_sample=False, batch_size=len(chunk))
            gen = og.Generator(model, p)
            t0 = time.perf_counter()
            gen.append_tokens(np.asarray([[2] * (width - len(x)) + x for x in chunk], np.int32))  # pad id 2, left
            gen.generate_next_token()  # samples the first new token from the prefill's logits
            t1 = time.perf_counter()
            steps = 0
            while not gen.is_done():
                gen.generate_next_token()
                steps += 1
            t2 = time.perf_counter()
            pre_s, pre_tok = pre_s + t1 - t0, pre_tok + sum(map(len, chunk))
            dec_s, dec_tok = dec_s + t2 - t1, dec_tok + steps * len(chunk)
        total = time.perf_counter() - t_all
        return {
            "prefill_tok_s": pre_tok / pre_s,
            "decode_tok_s": dec_tok / dec_s,
            "new_tok_s_with_prefill": (dec_tok + len(prompts)) / total,
        }

    run()  # warm-up
    a, b = run(), run()
    return a if a["decode_tok_s"] >= b["decode_tok_s"] else b


def hf_decode(base: Path, prompts: list[list[int]], new: int, batch: int) -> dict:
    """transformers eager fp32: a KV-cached greedy loop, decode timed from the first new token on."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()

    def run() -> dict:
        pre_s = dec_s = 0.0
        pre_tok = dec_tok = 0
        for a in range(0, len(prompts), batch):
            chunk = prompts[a : a + batch]
            width = max(map(len, chunk))
            x = torch.tensor([[2] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = model(x, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                t1 = time.perf_counter()
                cache, last = out.past_key_values, pos[:, -1:]
                for _ in range(new - 1):
                    mask = torch.cat([mask, torch.ones(len(chunk), 1, dtype=mask.dtype)], -1)
                    last = last + 1
                    out = model(nxt, attention_mask=mask, position_ids=last, past_key_values=cache, use_cache=True)
                    cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                t2 = time.perf_counter()
            pre_s, pre_tok = pre_s + t1 - t0, pre_tok + sum(map(len, chunk))
            dec_s, dec_tok = dec_s + t2 - t1, dec_tok + (new - 1) * len(chunk)
        return {"prefill_tok_s": pre_tok / pre_s, "decode_tok_s": dec_tok / dec_s}

    run()
    a, b = run(), run()
    return a if a["decode_tok_s"] >= b["decode_tok_s"] else b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / ".qgate/demo")
    ap.add_argument("--variant", default="awq-w4a16-cpu")
    ap.add_argument("--prompts", type=int, default=16, help="shadow prompts decoded")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from qgate.chat import encode_messages

    onnx_dir = args.workdir / "variants" / args.variant / "engine" / "onnx"
    base = args.workdir / "base"
    if not (onnx_dir / "genai_config.json").exists():
        raise SystemExit(f"{onnx_dir}: run the demo first: .venv/bin/qgate run pipelines/promote.yaml")
    built = json.loads((onnx_dir.parent / "qgate-artifact.json").read_text())
    engine_cfg = json.loads((onnx_dir / "genai_config.json").read_text())["model"]["decoder"]
    engine_cfg["accuracy_level"] = built["config"]["engine"]["data"].get("accuracy_level")
    engine_cfg["lm_head"] = built["config"]["engine"]["data"].get("lm_head")
    host = host_line(engine_cfg)
    print("host: " + "; ".join(f"{k} {v}" for k, v in host.items()), flush=True)
    bw = read_bandwidth()
    print(f"memory read bandwidth: {bw / 1e9:.1f} GB/s (torch sum of 1 GiB, {host['torch']})", flush=True)

    tok = AutoTokenizer.from_pretrained(base)
    rows = [json.loads(x) for x in (args.workdir / "calib" / "shadow" / "data.jsonl").read_text().splitlines()]
    shadow = [encode_messages(tok, r["messages"], 256) for r in rows[: args.prompts]]
    filler = tok.encode(" ".join(["the lighthouse keeper wrote a long letter home"] * 200))
    lengths = {"shadow": shadow, "16 tokens": [filler[:16]] * 4, "1024 tokens": [filler[:1024]] * 4}
    cores = host["usable_cpus"]
    rows_out = []
    ref = {b: hf_decode(base, shadow, args.new_tokens, b) for b in (1, 8)}
    print(
        f"transformers eager fp32, shadow prompts: decode {ref[1]['decode_tok_s']:.1f} tok/s at batch 1, "
        f"{ref[8]['decode_tok_s']:.1f} at batch 8 (prefill {ref[1]['prefill_tok_s']:.0f} tok/s)",
        flush=True,
    )
    settings = [("shadow", 1, None), ("shadow", 1, cores), ("shadow", 1, 1), ("shadow", 8, None), ("shadow", 8, cores)]
    settings += [("16 tokens", 1, None), ("16 tokens", 1, cores), ("1024 tokens", 1, None), ("1024 tokens", 1, cores)]
    print(
        "prompts       batch threads  prefill tok/s  decode tok/s  roofline  x eager fp32 decode  new tok/s incl. "
        "prefill"
    )
    for name, batch, threads in settings:
        ps = lengths[name]
        r = ort_decode(onnx_dir, ps, args.new_tokens, batch, threads)
        ctx = float(np.mean([len(p) for p in ps])) + args.new_tokens / 2
        bpt = bytes_per_token(onnx_dir, ctx)
        r |= {
            "prompts": name,
            "batch": batch,
            "threads": threads or "default",
            "bytes_per_token": bpt,
            "roofline": r["decode_tok_s"] / batch * bpt["total"] / bw,
        }
        if name == "shadow":
            r["vs_eager_fp32_decode"] = r["decode_tok_s"] / ref[batch]["decode_tok_s"]
        rows_out.append(r)
        vs = f"{r['vs_eager_fp32_decode']:.2f}x" if "vs_eager_fp32_decode" in r else "-"
        print(
            f"{name:13s} {batch:5d} {r['threads']!s:>7s}  {r['prefill_tok_s']:13.0f}  {r['decode_tok_s']:12.1f}  "
            f"{r['roofline']:8.2f}  {vs:>19s}  {r['new_tok_s_with_prefill']:23.1f}",
            flush=True,
        )
    bpt = rows_out[0]["bytes_per_token"]
    print(
        f"bytes per decode token (shadow prompts): {bpt['weights_read'] / 1e6:.1f} MB of weights (file "
        f"{bpt['weights_file_bytes'] / 1e6:.1f} MB: the embedding table is read one row per token) + "
        f"{bpt['kv_read'] / 1e6:.1f} MB of KV cache; roofline = decode tok/s per row x bytes / bandwidth"
    )
    out = {"host": host, "read_bandwidth": bw, "transformers_fp32": ref, "engine": rows_out}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
