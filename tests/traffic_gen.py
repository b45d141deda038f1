"""Synthetic traffic logs for sampling and scale-out tests: requests with repeats, written as partitions."""

import gzip
import json
import random

ROUTES = ("chat", "code-assist", "summarize")


def make_records(n: int, seed: int = 0, dup_every: int = 7) -> list[bytes]:
    """n requests; every dup_every-th repeats an earlier prompt (sometimes under another route), as real logs do."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(400)]
    out, prompts = [], []
    for i in range(n):
        if prompts and i % dup_every == 0:
            text = rng.choice(prompts)
        else:
            text = " ".join(rng.choice(vocab) for _ in range(rng.randint(2, 60)))
            prompts.append(text)
        out.append(
            json.dumps(
                {
                    "ts": 1_700_000_000 + i * 0.2,
                    "latency_ms": 400 + rng.random() * 900,
                    "route": rng.choice(ROUTES),
                    "tenant": f"t{rng.randint(0, 30)}",
                    "messages": [{"role": "user", "content": text}],
                }
            ).encode()
        )
    return out


def write_parts(d, records: list[bytes], cuts: list[int]):
    d.mkdir(parents=True, exist_ok=True)
    bounds = [0, *sorted(cuts), len(records)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        body = b"\n".join(records[a:b]) + b"\n" if b > a else b""
        (d / f"part-{i:03d}.jsonl.gz").write_bytes(gzip.compress(body)) if i % 2 else (
            d / f"part-{i:03d}.jsonl"
        ).write_bytes(body)
    return d
