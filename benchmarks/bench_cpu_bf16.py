"""The reference path in bfloat16 on this CPU: torch's own bf16 matmuls against float32 products of the bf16 values
(engines/bf16_products.py), with float32 as the yardstick, all in one run.

    .venv/bin/python benchmarks/bench_cpu_bf16.py [--model .qgate/demo/base] [--eval] [--long 4096 [--long-reps 3]]
    .venv/bin/python benchmarks/bench_cpu_bf16.py --model <a bf16 torch-int4 engine>

Run alone (two CPU-heavy processes slow torch 3-20x). Prints the host (CPU, whether it has AMX, torch
threads), then per numerics mode of TorchRunner:
  float32          gates.dtype float32
  bf16-torch       gates.dtype bfloat16 with torch's own bf16 matmuls (what a CPU with AMX runs)
  bf16-products    gates.dtype bfloat16 with each Linear multiplying in float32 (what qgate runs on a CPU without)
the seconds of a scoring forward (4 x 256 tokens of the demo's traffic, every position's logits, best of 3) and of a
greedy decode (batch 1, 32 new tokens), as ratios to float32, and each bf16 mode's KL p99 and top-1 agreement against
float32 on that forward. --eval also times the demo spec's eval (lm-eval tasks and perplexity documents, the gate's
scoring) in float32 and bf16-products: bf16-torch is left out there, since on a CPU without bf16 matmuls it takes
several times as long.

--model may be a bf16 torch-int4 engine (`qgate engine build --backend torch-int4`): its modes are bf16-torch and
bf16-products (its dense Linears, 8-bit weights and the head, multiplying in float32 from bf16_products.FLOAT32_ROWS
rows on), with bf16-torch as the yardstick, since the engine computes in the dtype it was built in.

--long N also scores the longest shipped long-context document cut at N tokens, as the long-context gate does
(gates/longctx.nll: one forward, logits in blocks), in bf16-torch, bf16-products and bf16-f32-attention: bf16-torch
with every attention call of more than one query run in float32 on the bf16 values and cast back (not a mode qgate
runs: torch's bf16 kernel rounds the softmax probabilities to bf16 before the product with V, as GPU flash attention
does, and the float32 call does not). Prints each mode's seconds against bf16-torch and its mean NLL's relative
difference from bf16-torch's. Each mode's figure is the best of --long-reps passes (3), the modes taking turns
within each round; every pass's seconds are printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from eval_counts import counted_eval  # beside this script

ROOT = Path(__file__).resolve().parents[1]
MODES = ("float32", "bf16-torch", "bf16-products")


def host() -> dict:
    import torch

    from qgate.device import native_bf16

    cpu = "?"
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {
        "cpu": cpu,
        "usable_cpus": len(os.sched_getaffinity(0)),
        "native_bf16": native_bf16(torch.device("cpu")),
        "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
        "torch": f"{torch.__version__}, {torch.get_num_threads()} threads, interop {torch.get_num_interop_threads()}",
    }


def is_engine(model: Path) -> bool:
    return (model / "engine.json").is_file()


def runner(model: Path, mode: str):
    """A TorchRunner, or the engine's runner, in `mode`; native_bf16 is set for the load only, so that the mode does
    not depend on this host."""
    import qgate.device
    from qgate.artifact import Artifact
    from qgate.engines.runners import TorchRunner, load_runner

    if mode == "float32":
        return TorchRunner(model, dtype="float32")
    saved = qgate.device.native_bf16
    qgate.device.native_bf16 = lambda device: mode == "bf16-torch"
    try:
        return load_runner(Artifact.load(model)) if is_engine(model) else TorchRunner(model, dtype="bfloat16")
    finally:
        qgate.device.native_bf16 = saved


def float32_attention():
    """device.planless_sdpa, which every attention call of the reference path goes through, wrapped so that a call of
    more than one bf16 query computes in float32 on the same values; returns the function that undoes it."""
    import torch

    import qgate.device

    plain = qgate.device.planless_sdpa

    def upcast(q, k, v, **kw):
        if q.dtype != torch.bfloat16 or q.shape[-2] == 1:
            return plain(q, k, v, **kw)
        mask = kw.get("attn_mask")
        if mask is not None and mask.is_floating_point():
            kw["attn_mask"] = mask.float()
        return plain(q.float(), k.float(), v.float(), **kw).to(q.dtype)

    qgate.device.planless_sdpa = upcast
    return lambda: setattr(qgate.device, "planless_sdpa", plain)


def long_document(model: Path, tokens: int, reps: int) -> list[dict]:
    """One long-context document of `tokens` tokens scored per mode (--long): the best of `reps` passes' seconds, every
    pass's, and the mean NLL of its tokens. The modes take turns within each round, so a drift of the host's speed
    over the run reaches all three alike."""
    import numpy as np

    from qgate.gates.longctx import DOCUMENTS, encode_documents, load_documents, nll
    from qgate.trust import load_tokenizer

    (seq,), _ = encode_documents(load_tokenizer(model), load_documents(DOCUMENTS), tokens, 1)
    modes = ("bf16-torch", "bf16-products", "bf16-f32-attention")
    runners = {m: runner(model, "bf16-torch" if m == "bf16-f32-attention" else m) for m in modes}
    passes: dict[str, list[float]] = {m: [] for m in modes}
    mean_nll = {}
    for rnd in range(reps + 1):  # round 0 warms every mode up on the first 256 tokens
        for mode in modes:
            undo = float32_attention() if mode == "bf16-f32-attention" else (lambda: None)
            try:
                t = time.perf_counter()
                per = nll(runners[mode], seq if rnd else seq[:256])
                if rnd:
                    passes[mode].append(time.perf_counter() - t)
                    mean_nll[mode] = float(np.mean(per[np.isfinite(per)]))
            finally:
                undo()
    out = [
        {"mode": m, "tokens": len(seq), "long_s": min(passes[m]), "long_s_passes": [round(x, 3) for x in passes[m]]}
        for m in modes
    ]
    for row in out:
        row["long_s_vs_bf16-torch"] = round(row["long_s"] / out[0]["long_s"], 3)
        row["mean_nll"] = mean_nll[row["mode"]]
        row["mean_nll_rel_diff"] = row["mean_nll"] / mean_nll[modes[0]] - 1
    return out


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def kl_rows(p, q):
    """KL(p || q) per position of two logits arrays [..., V], in float64."""
    import numpy as np

    lp, lq = (np.asarray(x, np.float64) for x in (p, q))
    lp, lq = (x - np.logaddexp.reduce(x, axis=-1, keepdims=True) for x in (lp, lq))
    return (np.exp(lp) * (lp - lq)).sum(-1)


def prompts(tokenizer, n: int, width: int) -> list[list[int]]:
    """n token sequences of `width` tokens, cut from the demo traffic's messages joined end to end (its records
    without messages, the malformed lines the demo's traffic holds on purpose, skipped)."""
    ids: list[int] = []
    with open(ROOT / "data/demo/traffic.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if isinstance(rec, dict) and isinstance(rec.get("messages"), list):
                ids += tokenizer.encode(" ".join(str(m.get("content", "")) for m in rec["messages"]))
            if len(ids) >= n * width:
                break
    return [ids[i * width : (i + 1) * width] for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / ".qgate/demo/base", help="a checkpoint directory")
    ap.add_argument("--eval", action="store_true", help="also time the demo's eval in float32 and bf16-products")
    ap.add_argument("--long", type=int, metavar="N", help="also score one long-context document of N tokens")
    ap.add_argument("--long-reps", type=int, default=3, metavar="R", help="--long's passes per mode, best kept (3)")
    args = ap.parse_args()
    import numpy as np

    print(json.dumps(host()), flush=True)
    modes = MODES[1:] if is_engine(args.model) else MODES
    if (args.eval or args.long) and is_engine(args.model):
        ap.error("--eval and --long time the reference path: give it a checkpoint")
    if args.long_reps < 1:
        ap.error(f"--long-reps {args.long_reps}: give at least 1 pass per mode")
    rows, logits = {}, {}
    for mode in modes:
        r = runner(args.model, mode)
        seqs = prompts(r.tokenizer, 4, 256)
        r.logits_batch(seqs[:1], keep_last=1)  # warm-up
        rows[mode] = {"forward_s": best(lambda r=r: logits.__setitem__(mode, r.logits_batch(seqs)), 3)}
        rows[mode]["decode_s"] = best(lambda r=r: r.greedy_batch([seqs[0][:64]], 32), 2)
        del r
    yardstick = modes[0]
    ref = np.stack(logits[yardstick])
    for mode in modes[1:]:
        x = np.stack(logits[mode])
        kl = kl_rows(ref, x)
        rows[mode][f"kl_p99_vs_{yardstick}"] = float(np.quantile(kl, 0.99))
        rows[mode][f"top1_vs_{yardstick}"] = float((x.argmax(-1) == ref.argmax(-1)).mean())
    if args.eval:
        from qgate.pipeline.spec import load_spec

        cfg = load_spec(ROOT / "pipelines/promote.yaml").gate_config().eval
        for mode in ("float32", "bf16-products"):
            rows[mode]["eval_s"] = counted_eval(runner(args.model, mode), cfg)["wall"]
    base = rows[yardstick]
    for mode, row in rows.items():
        ratios = {
            f"{k}_vs_{yardstick}": round(row[k] / base[k], 3) for k in ("forward_s", "decode_s", "eval_s") if k in row
        }
        print(json.dumps({"mode": mode, **{k: round(v, 6) for k, v in row.items()}, **ratios}), flush=True)
    t, p = rows["bf16-torch"], rows["bf16-products"]
    print(
        f"bf16-products vs bf16-torch: forward x{t['forward_s'] / p['forward_s']:.2f} faster, "
        f"decode x{t['decode_s'] / p['decode_s']:.2f}",
        flush=True,
    )
    for row in long_document(args.model, args.long, args.long_reps) if args.long else ():
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    sys.exit(main())
