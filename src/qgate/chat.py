"""Turn chat messages into token ids the same way in every stage, and say which tokens came from traffic.

ids = encode_messages(tokenizer, [{"role": "user", "content": "hi"}], max_tokens=512)
ids, from_traffic, tokens = encode_with_sources(tokenizer, messages, max_tokens=512)   # tokens: before the cut
key = prompt_digest(messages)   # the same request in any sample of the traffic has the same key
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple


class Encoded(NamedTuple):
    ids: list[int]  # the rendered prompt's last max_tokens token ids
    from_traffic: list[bool]  # per id: whether it comes from a message's content rather than the chat template
    tokens: int  # the rendered prompt's whole length: more than len(ids) when it was cut


def render(tokenizer, messages: list[dict]) -> str:
    """The prompt text a serving stack would build: the model's chat template, or a plain fallback."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def encode_messages(tokenizer, messages: list[dict], max_tokens: int) -> list[int]:
    """Token ids of the rendered prompt, keeping the *end* (the latest turn) when too long."""
    ids = tokenizer(render(tokenizer, messages), add_special_tokens=False)["input_ids"]
    return ids[-max_tokens:]


def content_spans(text: str, messages: list[dict]) -> list[tuple[int, int]]:
    """Character spans of each message's content inside the rendered prompt, found in order.
    Everything outside them is the template's: role markers, default system prompt, separators."""
    spans, cursor = [], 0
    for m in messages:
        content = m.get("content") or ""
        at = text.find(content, cursor) if content else -1
        if at >= 0:
            spans.append((at, at + len(content)))
            cursor = at + len(content)
    return spans


def encode_with_sources(tokenizer, messages: list[dict], max_tokens: int) -> Encoded:
    """encode_messages, plus per token whether any of its characters come from a message's content (traffic)
    rather than from the chat template, and the length before the cut. Needs a fast tokenizer (character offsets)."""
    text = render(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = content_spans(text, messages)
    flags = [any(a < e and s < b for s, e in spans) for a, b in enc["offset_mapping"]]
    return Encoded(enc["input_ids"][-max_tokens:], flags[-max_tokens:], len(enc["input_ids"]))


def content_digest(turns: list[str]) -> bytes:
    """A request's content digest (the definition): its turns with every whitespace run as one space, the blank ones
    left out, joined by spaces, blake2b-128. Whitespace and how text is split into turns do not change it."""
    return hashlib.blake2b(" ".join(w for t in turns for w in t.split()).encode(), digest_size=16).digest()


def prompt_digest(messages: list[dict]) -> str:
    """A sampled request's key across samples: the first 8 bytes of its messages' content_digest, as hex (the digest
    `qgate calibrate sample` deduplicates by; collisions ~n^2 / 2^65)."""
    return content_digest([m.get("content") or "" for m in messages])[:8].hex()
