"""PII scrubbing, measured: recall and precision per type on real demo prompts with injected PII and hard negatives.

    .venv/bin/python benchmarks/bench_pii.py            # data/pii/labeled.jsonl (scripts/make_pii_set.py)

Goal (issue 8): recall >= 99% per structured type, precision >= 95%. Also prints the scrubber's throughput on the
demo traffic against reading the same prompts, in one run. Not scrubbed: names, postal addresses (see scrub.py).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from qgate.calibrate.scrub import scrub  # noqa: E402
from qgate.calibrate.scrub_eval import demo_prompts, load_labeled, score  # noqa: E402


def main() -> None:
    print(f"machine: {os.cpu_count()} cores; pure Python, one thread")
    rows = load_labeled(ROOT / "data/pii/labeled.jsonl")
    prompts = demo_prompts()
    t = time.perf_counter()
    s = score(rows, prompts)
    secs = time.perf_counter() - t
    print(f"labeled set: {s['rows']} rows ({s['negative_rows']} with hard negatives only), scored in {secs:.1f}s\n")
    print(f"{'type':12s} {'injected':>8s} {'found':>6s} {'false+':>6s} {'recall':>8s} {'precision':>9s}  goal")
    ok = True
    for t_, v in s["types"].items():
        good = v["recall"] is not None and v["recall"] >= 0.99 and (v["precision"] or 0) >= 0.95
        ok &= good
        print(
            f"{t_:12s} {v['injected']:8d} {v['found']:6d} {v['false_positives']:6d} {v['recall']:8.2%} "
            f"{v['precision']:9.2%}  {'met' if good else 'NOT met'}"
        )
    print(f"\nmissed: {[(m['type'], m['value']) for m in s['misses']]}")
    print(f"real PII already in the demo prompts (scrubbed, not counted): {s['real_pii_in_demo_prompts']}")
    texts = [r["text"] for r in rows]
    t = time.perf_counter()
    n = sum(len(x) for x in texts)
    read = time.perf_counter() - t
    t = time.perf_counter()
    for x in texts:
        scrub(x)
    sc = time.perf_counter() - t
    print(
        f"throughput: {len(texts) / sc:,.0f} prompts/s ({n / sc / 1e6:.2f} MB/s of text); reading them alone "
        f"{read * 1e3:.1f} ms"
    )
    print("all goals met" if ok else "some goals NOT met")


if __name__ == "__main__":
    main()
