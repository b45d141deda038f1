"""Gate and engine speed on the demo model (SmolLM2-135M-Instruct), every figure a ratio measured in this run.

    .venv/bin/qgate run pipelines/promote.yaml && .venv/bin/python benchmarks/bench_gates_engines.py

Run it alone: two CPU-heavy processes on 2 cores distort each other badly.

1. Warm shadow gate / the candidate's forward-only time on the same tokens, in the same batches (int4 CPU engine and
   the W8A16 checkpoint on the reference path).
2. Cold baseline reference (greedy answers + top-k log-probs) / the baseline's teacher-forced scoring of the same
   tokens (its forward passes and the same top-k log-probs: what the reference would cost if its answers were
   given), and / the forward passes alone.
3. Decode-only tok/s (from the first new token on, benchmarks/bench_cpu_decode.py) of onnxruntime-genai int4 engines
   (lm_head fp32 / int8 / int4, accuracy level, threads set explicitly) / transformers eager fp32 decode-only, at
   batch 1 and batch 8, each engine with its shadow-gate KL p99 and top-1 against the baseline: the gate, not a
   guess, says whether a faster head is acceptable. Host, bandwidth and roofline: benchmarks/bench_cpu_decode.py.
4. Eval scoring items/s (the demo's task set) for the baseline and the int4 engine.
Pipeline wall time by stage: benchmarks/bench_pipeline.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_cpu_decode's decode loops


def load(workdir: Path):
    from qgate.artifact import Artifact

    if not (workdir / "summary.json").exists():
        sys.exit(f"{workdir}: run the demo first: .venv/bin/qgate run pipelines/promote.yaml")
    get = lambda *p: Artifact.load(workdir.joinpath(*p))  # noqa: E731
    return {
        "base": get("base"),
        "shadow": get("calib", "shadow"),
        "engine": get("variants", "awq-w4a16-cpu", "engine"),
        "awq_ckpt": get("variants", "awq-w4a16-cpu", "checkpoint"),
        "w8": get("variants", "gptq-w8a16", "checkpoint"),
    }


def forward_only(runner, seqs: list[list[int]]) -> float:
    """The runner's logits for every sequence, in the batches the gate uses, and nothing else."""
    from qgate.gates.scoring import length_batches

    t = time.perf_counter()
    for batch in length_batches([len(s) for s in seqs]):
        runner.logits_batch([seqs[i] for i in batch])
    return time.perf_counter() - t


def bench_shadow(arts: dict, cache: Path, repeats: int) -> dict:
    from qgate.engines.runners import load_runner
    from qgate.gates.passes import sequences, top_k_reference
    from qgate.gates.shadow import ShadowConfig, baseline_reference, candidate_metrics

    cfg = ShadowConfig()
    base = load_runner(arts["base"])
    colds, fwds, scores = [], [], []
    for i in range(repeats):  # cold every time (a fresh cache directory), interleaved with the teacher-forced passes
        t = time.perf_counter()
        ref, hit = baseline_reference(lambda: base, arts["base"], arts["shadow"], cfg, cache / f"cold-{i}")
        colds.append(time.perf_counter() - t)
        assert not hit
        fwds.append(forward_only(base, sequences(ref)))
        t = time.perf_counter()
        top_k_reference(base, sequences(ref), cfg.top_k, "bench: teacher-forced scoring")
        scores.append(time.perf_counter() - t)
    seqs = sequences(ref)
    out = {
        "prompts": len(seqs),
        "tokens": int(ref["seq_lens"].sum()),
        "answer_tokens": int(ref["seq_lens"].sum() - ref["prompt_lens"].sum()),
        "cold_reference_s": min(colds),
        "baseline_forward_s": min(fwds),
        "baseline_scoring_s": min(scores),
        "cold_ratios": sorted(c / f for c, f in zip(colds, fwds)),
        "cold_scoring_ratios": sorted(c / f for c, f in zip(colds, scores)),
    }
    out["cold_ratio"] = min(colds) / min(fwds)
    out["cold_scoring_ratio"] = min(colds) / min(scores)
    for name, art in (("int4 CPU engine", arts["engine"]), ("W8A16 reference path", arts["w8"])):
        cand = load_runner(art)
        forward_only(cand, seqs[:4])  # warm-up
        fwd, warm = [], []
        for _ in range(repeats):  # interleaved, so a slow spell of the machine hits both sides
            fwd.append(forward_only(cand, seqs))
            t = time.perf_counter()
            _, hit = baseline_reference(lambda: base, arts["base"], arts["shadow"], cfg, cache / "cold-0")
            candidate_metrics(cand, ref, desc=f"bench: shadow ({name})")
            warm.append(time.perf_counter() - t)
            assert hit, "baseline cache was not reused: the benchmark would time the wrong thing"
        ratios = sorted(w / f for w, f in zip(warm, fwd))
        out[name] = {
            "forward_s": min(fwd),
            "warm_gate_s": min(warm),
            "ratio": min(warm) / min(fwd),
            "ratio_median": float(np.median(ratios)),
            "ratios": ratios,
        }
    return out


def _prompts(arts: dict, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from qgate.chat import encode_messages

    tok = AutoTokenizer.from_pretrained(arts["base"].path)
    rows = [json.loads(x) for x in (arts["shadow"].path / "data.jsonl").read_text().splitlines()][:n]
    return [encode_messages(tok, r["messages"], 256) for r in rows]


def bench_decode(arts: dict, cache: Path, prompts: int, new: int) -> dict:
    from bench_cpu_decode import hf_decode, ort_decode

    from qgate.engines.cpu import CpuEngineConfig, build_cpu
    from qgate.gates.gating import GateConfig, shadow_check

    ps = _prompts(arts, prompts)
    res = {
        "transformers_fp32": {b: hf_decode(arts["base"].path, ps, new, b)["decode_tok_s"] for b in (1, 8)},
        "engines": [],
    }
    cores = len(os.sched_getaffinity(0))
    options = [("fp32", 4, cores), ("int8", 4, cores), ("int4", 4, cores), ("fp32", 1, cores), ("int8", 4, 1)]
    with tempfile.TemporaryDirectory() as tmp:
        built = {}
        for head, level, threads in options:
            key = (head, level)
            if key not in built:
                built[key] = build_cpu(
                    arts["awq_ckpt"], CpuEngineConfig(accuracy_level=level, lm_head=head), Path(tmp) / f"{head}-{level}"
                )
                gate = shadow_check(built[key], arts["base"], arts["shadow"], GateConfig(), cache)
                by = {r["metric"]: r for r in gate["results"]}
                built[key].meta["bench_gate"] = {
                    "verdict": gate["verdict"],
                    "kl_p99": by["kl_p99"]["observed"],
                    "top1": by["top1_agreement"]["observed"],
                }
            eng = built[key]
            row = {
                "lm_head": head,
                "accuracy_level": level,
                "threads": threads,
                "engine_mb": eng.meta["engine_bytes"] / 1e6,
                **eng.meta["bench_gate"],
            }
            for b in (1, 8):
                row[f"tok_s_b{b}"] = ort_decode(eng.path / "onnx", ps, new, b, threads)["decode_tok_s"]
                row[f"speedup_b{b}"] = row[f"tok_s_b{b}"] / res["transformers_fp32"][b]
            res["engines"].append(row)
    return res


def bench_eval(arts: dict) -> dict:
    from qgate.engines.runners import load_runner
    from qgate.gates.evalgate import EvalConfig, run_tasks

    cfg = EvalConfig()
    out = {}
    for name, art in (("baseline fp32", arts["base"]), ("int4 CPU engine", arts["engine"])):
        runner = load_runner(art)
        t = time.perf_counter()
        scores = run_tasks(runner, cfg)
        secs = time.perf_counter() - t
        items = sum(len(v["per_item"]) if v["kind"] == "mc" else len(v["ll"]) for v in scores.values())
        out[name] = {"seconds": secs, "items": items}
    return out


def main() -> None:

    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=ROOT / ".qgate/demo")
    ap.add_argument("--prompts", type=int, default=16, help="decode prompts")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--skip-eval", action="store_true")
    ap.add_argument(
        "--skip-decode", action="store_true", help="figures 1, 2 (and 4) only: the decode sweep builds engines"
    )
    ap.add_argument("--repeats", type=int, default=3, help="interleaved forward/gate pairs for the warm shadow ratio")
    args = ap.parse_args()
    arts = load(args.workdir)
    from bench_cpu_decode import host_line

    host = host_line({})
    print(
        f"host: {host['cpu']}, {host['usable_cpus']} usable CPUs, {' '.join(host['isa'])}; torch {host['torch']}; "
        f"onnxruntime {host['onnxruntime']} (default threads: all cores, unless stated)",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as cache:
        s = bench_shadow(arts, Path(cache), args.repeats)
        d = None if args.skip_decode else bench_decode(arts, Path(cache) / "cold-0", args.prompts, args.new_tokens)
    e = None if args.skip_eval else bench_eval(arts)
    print(f"\n1. warm shadow gate, {s['prompts']} prompts / {s['tokens']} tokens, baseline reference cached:")
    for name in ("int4 CPU engine", "W8A16 reference path"):
        r = s[name]
        print(
            f"   {name:22s} forward only {r['forward_s']:6.2f} s   gate {r['warm_gate_s']:6.2f} s   ratio "
            f"{r['ratio']:.2f}x"
            f" (best gate / best forward of {len(r['ratios'])} interleaved pairs; median pair {r['ratio_median']:.2f}x;"
            f" per pair {', '.join(f'{x:.2f}' for x in r['ratios'])})  (goal <= 1.10x)"
        )
    print(
        f"2. cold baseline reference ({s['answer_tokens']} greedy answer tokens + top-k log-probs): "
        f"{s['cold_reference_s']:.1f} s"
        f" / teacher-forced scoring (forward + top-k) {s['baseline_scoring_s']:.1f} s = {s['cold_scoring_ratio']:.2f}x"
        f" (per pair {', '.join(f'{x:.2f}' for x in s['cold_scoring_ratios'])})  (goal <= 2x);"
        f" / forward passes alone {s['baseline_forward_s']:.1f} s = {s['cold_ratio']:.2f}x"
        f" (per pair {', '.join(f'{x:.2f}' for x in s['cold_ratios'])}; best times of {len(s['cold_ratios'])} "
        "interleaved runs)"
    )
    if d:
        tf = d["transformers_fp32"]
        print(
            f"3. decode only, greedy {args.new_tokens} new tokens x {args.prompts} prompts; transformers eager fp32: "
            f"{tf[1]:.1f} tok/s at batch 1, {tf[8]:.1f} at batch 8"
        )
        print(
            "   lm_head  acc.level threads  engine MB   b1 tok/s  x fp32   b8 tok/s  x fp32   shadow gate: KL p99  "
            "top-1  verdict"
        )
        for r in d["engines"]:
            print(
                f"   {r['lm_head']:7s}  {r['accuracy_level']:9d} {r['threads']:7d}  {r['engine_mb']:9.1f}  "
                f"{r['tok_s_b1']:9.1f}  {r['speedup_b1']:5.2f}x  {r['tok_s_b8']:9.1f}  {r['speedup_b8']:5.2f}x  "
                f"{r['kl_p99']:18.4f}  {r['top1']:.3f}  {r['verdict']}"
            )
    if e:
        print("4. eval scoring (the demo's tasks):")
        for name, r in e.items():
            print(
                f"   {name:22s} {r['items']} items in {r['seconds']:.1f} s = {r['items'] / r['seconds']:.1f} items/s "
                f"(requests/s by strategy: benchmarks/bench_eval.py)"
            )
    print(json.dumps({"shadow": s, "decode": d, "eval": e}, default=float))


if __name__ == "__main__":
    main()
