"""Turn chat messages into token ids the same way in every stage, and say which tokens came from traffic.

ids = encode_messages(tokenizer, [{"role": "user", "content": "hi"}], max_tokens=512)
ids, from_traffic, tokens = encode_with_sources(tokenizer, messages, max_tokens=512, tools=row.get("tools"))
key = prompt_digest(messages, tools)   # the same request in any sample of the traffic has the same key
key = row_digest(row)                  # the same, of a split's row

A request is its messages (OpenAI chat format) and, for tool use, the `tools` it offered the model. A message may carry
`tool_calls` (an assistant's calls, `function.arguments` a JSON string as logged), `tool_call_id` (a tool result's
call) and `name`. The sampler handles a request as text turns: those fields travel as pseudo-turns of canonical JSON
(`request_turns`), so scrubbing, deduplication and word counts read them as they read text, and `request_from_turns`
gives the request back. A prompt is rendered as vLLM renders a request: `tools` passed to the chat template, each
tool call's arguments parsed to an object.
"""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

TOOLS_TURN = "tools"  # pseudo-role: the request's tools, first of its turns
FIELDS_TURN = "fields"  # pseudo-role: the tool fields of the message that follows it
TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")  # what a message carries besides its role and content


class Encoded(NamedTuple):
    ids: list[int]  # the rendered prompt's last max_tokens token ids
    from_traffic: list[bool]  # per id: whether it comes from a message's content rather than the chat template
    tokens: int  # the rendered prompt's whole length: more than len(ids) when it was cut


def canonical(value) -> str:
    """The one JSON text of a tool field: sorted keys, no spaces, non-ASCII as is (what scrubbing reads)."""
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"), allow_nan=False)


def request_turns(messages: list[dict], tools: list | None = None) -> list[tuple[str, str]]:
    """A request as (role, text) turns: its tools first, each message's tool fields just before it (so its last turn
    is its last message's content). A request without tool fields is its (role, content) pairs."""
    turns = [(TOOLS_TURN, canonical(tools))] if tools else []
    for m in messages:
        fields = {k: m[k] for k in TOOL_FIELDS if m.get(k) is not None}
        if fields:
            turns.append((FIELDS_TURN, canonical(fields)))
        turns.append((m["role"], m.get("content") or ""))
    return turns


def request_from_turns(turns: list[tuple[str, str]]) -> tuple[list[dict], list | None]:
    """(messages, tools) back from `request_turns`' turns, their texts scrubbed or not."""
    messages, tools, fields = [], None, {}
    for role, text in turns:
        if role == TOOLS_TURN:
            tools = json.loads(text)
        elif role == FIELDS_TURN:
            fields = json.loads(text)
        else:
            messages.append({"role": role, "content": text} | fields)
            fields = {}
    return messages, tools


def served_messages(messages: list[dict]) -> list[dict]:
    """The messages as vLLM hands them to a chat template: a tool call's `arguments` string parsed to an object (an
    empty one to {}; one that is not JSON stays a string), an empty `tool_calls` dropped."""
    out = []
    for m in messages:
        m = dict(m)
        if "tool_calls" in m and not m["tool_calls"]:
            del m["tool_calls"]
        elif m.get("tool_calls"):
            m["tool_calls"] = [_parsed_arguments(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _parsed_arguments(call: dict) -> dict:
    function = dict(call.get("function") or {})
    args = function.get("arguments")
    if not args:
        function["arguments"] = {}
    elif isinstance(args, str):
        try:
            function["arguments"] = json.loads(args)
        except ValueError:
            pass
    return call | {"function": function}


def render(tokenizer, messages: list[dict], tools: list | None = None) -> str:
    """The prompt text a serving stack would build: the model's chat template (given the request's tools), or a plain
    fallback that writes tools and tool calls as JSON lines."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            served_messages(messages), tools=tools or None, tokenize=False, add_generation_prompt=True
        )
    head = f"tools: {canonical(tools)}\n" if tools else ""
    return (
        head
        + "".join(
            f"{m['role']}: {m.get('content') or ''}\n"
            + (f"{m['role']}: {canonical(m['tool_calls'])}\n" if m.get("tool_calls") else "")
            for m in messages
        )
        + "assistant:"
    )


def encode_messages(tokenizer, messages: list[dict], max_tokens: int, tools: list | None = None) -> list[int]:
    """Token ids of the rendered prompt, keeping the *end* (the latest turn) when too long."""
    ids = tokenizer(render(tokenizer, messages, tools), add_special_tokens=False)["input_ids"]
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


def encode_with_sources(tokenizer, messages: list[dict], max_tokens: int, tools: list | None = None) -> Encoded:
    """encode_messages, plus per token whether any of its characters come from a message's content (traffic)
    rather than from the chat template, and the length before the cut. Needs a fast tokenizer (character offsets).
    Tools and tool calls count as the template's: a template writes them in its own JSON layout."""
    text = render(tokenizer, messages, tools)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = content_spans(text, messages)
    flags = [any(a < e and s < b for s, e in spans) for a, b in enc["offset_mapping"]]
    return Encoded(enc["input_ids"][-max_tokens:], flags[-max_tokens:], len(enc["input_ids"]))


def content_digest(turns: list[str]) -> bytes:
    """A request's content digest (the definition): its turns with every whitespace run as one space, the blank ones
    left out, joined by spaces, blake2b-128. Whitespace and how text is split into turns do not change it."""
    return hashlib.blake2b(" ".join(w for t in turns for w in t.split()).encode(), digest_size=16).digest()


def prompt_digest(messages: list[dict], tools: list | None = None) -> str:
    """A sampled request's key across samples: the first 8 bytes of the content_digest of its `request_turns`, as
    hex (the digest `qgate calibrate sample` deduplicates by; collisions ~n^2 / 2^65)."""
    return content_digest([text for _, text in request_turns(messages, tools)])[:8].hex()


def row_digest(row: dict) -> str:
    """prompt_digest of a sampled row (a split's record: its `messages`, and its `tools` where it offers any)."""
    return prompt_digest(row["messages"], row.get("tools"))
