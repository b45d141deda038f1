"""Ratios measured in one run on the demo model (SmolLM2-135M-Instruct).

    qgate run pipelines/promote.yaml && .venv/bin/python benchmarks/bench_gates_engines.py

1. Shadow-gate cost: wall time of the shadow gate for a candidate (baseline cached, and cold)
   divided by the time of the candidate's forward passes alone over the same sequences.
2. CPU engine decode speed: onnxruntime-genai int4 (the AWQ engine the demo built) vs
   transformers eager float32 on the baseline, greedy decoding from the same token ids.
Both runtimes use their default thread counts (all cores); run on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def load(workdir: Path):
    from qgate.artifact import Artifact

    if not (workdir / "summary.json").exists():
        sys.exit(f"{workdir}: run the demo first: qgate run pipelines/promote.yaml")
    base = Artifact.load(workdir / "base")
    shadow = Artifact.load(workdir / "calib" / "shadow")
    engine = Artifact.load(workdir / "variants" / "awq-w4a16-cpu" / "engine")
    return base, shadow, engine


def bench_shadow(base, shadow, engine, prompts: int) -> dict:
    from qgate.engines.runners import load_runner
    from qgate.gates.shadow import ShadowConfig, baseline_reference, candidate_metrics

    cfg = ShadowConfig(max_prompts=prompts)
    cand = load_runner(engine)
    base_runner = load_runner(base)
    with tempfile.TemporaryDirectory() as cache:
        t = time.perf_counter()
        ref, _ = baseline_reference(lambda: base_runner, base, shadow, cfg, Path(cache))
        candidate_metrics(cand, ref, desc="bench: shadow (cold)")
        cold = time.perf_counter() - t
        t = time.perf_counter()
        ref, hit = baseline_reference(lambda: base_runner, base, shadow, cfg, Path(cache))
        candidate_metrics(cand, ref, desc="bench: shadow (cached)")
        warm = time.perf_counter() - t
        if not hit:
            sys.exit("baseline cache was not reused: the benchmark would time the wrong thing")
    start, fwd = 0, 0.0
    for n in ref["seq_lens"]:
        seq = ref["tokens"][start:start + n].tolist()
        t = time.perf_counter()
        cand.logits(seq)
        fwd += time.perf_counter() - t
        start += n
    return {"prompts": len(ref["seq_lens"]), "tokens": int(ref["seq_lens"].sum()), "candidate_forward_s": fwd,
            "shadow_gate_cached_s": warm, "shadow_gate_cold_s": cold,
            "ratio_cached": warm / fwd, "ratio_cold": cold / fwd}


def bench_decode(base, engine, shadow, prompts: int, new_tokens: int) -> dict:
    import onnxruntime_genai as og
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qgate.chat import encode_messages

    tok = AutoTokenizer.from_pretrained(base.path)
    rows = [json.loads(x) for x in (shadow.path / "data.jsonl").read_text().splitlines()][:prompts]
    ids = [encode_messages(tok, r["messages"], 256) for r in rows]
    hf = AutoModelForCausalLM.from_pretrained(base.path, dtype=torch.float32).eval()
    model = og.Model(str(engine.path / "onnx"))

    def run_hf():
        n = 0
        for x in ids:
            t = torch.tensor([x])
            with torch.inference_mode():
                out = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=tok.eos_token_id)
            n += out.shape[1] - t.shape[1]
        return n

    def run_ort():
        n = 0
        for x in ids:
            p = og.GeneratorParams(model)
            p.set_search_options(max_length=len(x) + new_tokens, min_length=len(x) + new_tokens, do_sample=False)
            g = og.Generator(model, p)
            g.append_tokens(np.asarray(x, np.int32))
            while not g.is_done():
                g.generate_next_token()
                n += 1
        return n

    res = {}
    for name, fn in (("transformers_fp32", run_hf), ("ort_genai_int4", run_ort)):
        fn()  # warm-up
        t = time.perf_counter()
        n = fn()
        res[name] = {"tokens": n, "seconds": time.perf_counter() - t, "tok_s": n / (time.perf_counter() - t)}
    res["speedup"] = res["ort_genai_int4"]["tok_s"] / res["transformers_fp32"]["tok_s"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=ROOT / ".qgate/demo")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    base, shadow, engine = load(args.workdir)
    s = bench_shadow(base, shadow, engine, args.prompts)
    d = bench_decode(base, engine, shadow, min(args.prompts, 8), args.new_tokens)
    print(f"shadow gate, {s['prompts']} prompts / {s['tokens']} tokens, candidate = int4 CPU engine:")
    print(f"  candidate forward only      {s['candidate_forward_s']:8.2f} s")
    print(f"  shadow gate, cached baseline{s['shadow_gate_cached_s']:8.2f} s   ratio {s['ratio_cached']:.2f}x")
    print(f"  shadow gate, cold baseline  {s['shadow_gate_cold_s']:8.2f} s   ratio {s['ratio_cold']:.2f}x")
    print(f"decode, greedy {args.new_tokens} new tokens x {min(args.prompts, 8)} prompts:")
    for k in ("transformers_fp32", "ort_genai_int4"):
        print(f"  {k:20s} {d[k]['tok_s']:8.1f} tok/s")
    print(f"  int4 CPU engine / transformers eager fp32 = {d['speedup']:.2f}x")
    import torch

    print(f"threads: torch {torch.get_num_threads()}, onnxruntime default (all cores)")
    print(json.dumps({"shadow": s, "decode": d}, default=float))


if __name__ == "__main__":
    main()
