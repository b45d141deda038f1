"""Sampler throughput on tool-using traffic, as ratios measured in this run: logs of the same records where none, a
third, or every request is a tool round trip (the request's tools, the assistant's call, the tool's result).

    .venv/bin/python benchmarks/bench_tool_traffic.py [--records 100000]

Run it alone: two CPU-heavy processes on 2 cores distort each other badly. A tool-using record is read by the row
path (`reader.parse_record`, orjson and Python per record) rather than the columnar one, and carries its tools and
call as JSON turns, which the sampler scrubs, hashes and counts words of like text. Each log is written as gzip JSONL
partitions from the demo traffic's real records (bench_sampler.write_log); each measurement runs in a child process of
its own: a serial `sample_traffic`, and a raw orjson parse of the same files as the reference.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_sampler import demo_records, measure, write_log  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} for the user's account",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    }
    for name in ("search_orders", "get_weather", "send_mail")
]


def with_tools(plain: Path, out: Path, every: int) -> Path:
    """The plain log with every `every`-th record made a tool round trip after its user turn."""
    out.mkdir(parents=True, exist_ok=True)
    i = 0
    for part in sorted(plain.iterdir()):
        with gzip.open(part, "rt") as src, gzip.open(out / part.name, "wt", compresslevel=1) as dst:
            for line in src:
                rec = json.loads(line)
                if i % every == 0:
                    args = json.dumps({"query": rec["messages"][-1]["content"][:60], "limit": 5})
                    call = {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {"name": "search_orders", "arguments": args},
                    }
                    rec["messages"] += [
                        {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": f"call_{i}", "content": f'{{"orders": [{i % 97}, {i % 89}]}}'},
                    ]
                    rec["tools"] = TOOLS
                dst.write(json.dumps(rec) + "\n")
                i += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=100_000)
    args = ap.parse_args()
    print(f"host: {os.cpu_count()} cores; torch not used; records per log: {args.records:,}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        plain = write_log(tmp / "plain", args.records, 4, demo_records())
        logs = {
            "no tool use": plain,
            "a third": with_tools(plain, tmp / "third", 3),
            "all": with_tools(plain, tmp / "all", 1),
        }
        base = None
        print(
            f"{'log':14s} {'sampler rec/s':>14s} {'orjson rec/s':>13s} {'sampler/orjson':>15s} "
            f"{'vs no tool use':>15s} {'MB raw':>7s} {'raw MB/s':>9s}"
        )
        for name, where in logs.items():
            s = measure("serial", where, tmp / f"out-{name}")
            o = measure("orjson", where, tmp / f"orj-{name}")
            rate, ref = s["records"] / s["seconds"], o["records"] / o["seconds"]
            base = base or rate
            mb = sum(len(gzip.decompress(p.read_bytes())) for p in where.iterdir()) / 1e6
            print(
                f"{name:14s} {rate:14,.0f} {ref:13,.0f} {rate / ref:15.2f} {rate / base:15.2f} {mb:7.1f} "
                f"{mb / s['seconds']:9.1f}"
            )


if __name__ == "__main__":
    main()
