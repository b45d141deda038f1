"""Recall and precision of the PII scrubber, per type, on a labeled set (data/pii/labeled.jsonl).

    scores = score(load_labeled(Path("data/pii/labeled.jsonl")), demo_prompts())   # {"email": {"recall": ..}, ..}

An injected value counts as found when it is gone from the scrubbed text and a placeholder of its own type appeared.
Placeholders beyond the injected values (and beyond what the untouched prompt already scrubs: real PII in the demo
traffic, reported apart) are false positives of their type. Hard-negative rows inject look-alikes only.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from qgate.calibrate.scrub import TYPES, scrub

DEMO_TRAFFIC = Path(__file__).resolve().parents[3] / "data" / "demo" / "traffic.jsonl"


def demo_prompts(path: Path = DEMO_TRAFFIC) -> list[str]:
    """The last user turn of every demo request, cut to 400 characters: the text PII is injected into."""
    from qgate.calibrate.reader import Request, read_traffic

    return [item.messages[-1][1][:400] for item in read_traffic(path) if isinstance(item, Request)]


def load_labeled(path: Path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def score(rows: list[dict], prompts: list[str]) -> dict:
    tp, fn, fp, misses = Counter(), Counter(), Counter(), []
    base_cache: dict[int, Counter] = {}
    for row in rows:
        base = base_cache.setdefault(row["prompt"], scrub(prompts[row["prompt"]])[1])
        clean, counts = scrub(row["text"])
        hits = Counter()
        for item in row["pii"]:
            t = item["type"]
            if item["value"] not in clean and counts[t] - base[t] - hits[t] >= 1:
                tp[t] += 1
                hits[t] += 1
            else:
                fn[t] += 1
                misses.append({"type": t, "value": item["value"], "scrubbed_as": dict(counts - base)})
        for t in TYPES:
            fp[t] += max(0, counts[t] - base[t] - hits[t])
    real = sum((scrub(p)[1] for p in prompts), Counter())
    per_type = {
        t: {
            "injected": tp[t] + fn[t],
            "found": tp[t],
            "false_positives": fp[t],
            "recall": tp[t] / (tp[t] + fn[t]) if tp[t] + fn[t] else None,
            "precision": tp[t] / (tp[t] + fp[t]) if tp[t] + fp[t] else None,
        }
        for t in TYPES
    }
    return {
        "types": per_type,
        "rows": len(rows),
        "negative_rows": sum(1 for r in rows if not r["pii"]),
        "misses": misses,
        "real_pii_in_demo_prompts": dict(real),
    }
