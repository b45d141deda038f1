"""The token a model emits to begin a tool call, read from its chat template: what the tool-call guards watch.

    ids = call_start_ids(tokenizer)   # e.g. [id of "<tool_call>"]; [] when the template marks no call with one

The template is asked to write one probe conversation twice: the assistant answering in prose, and the assistant
calling a probe tool. The call's marker is the first token of the call's part that is one of the tokenizer's added
tokens (atomic, never a piece of prose) and is not in the prose answer's part (a template's thinking block or turn
header is in both). Qwen's and Hermes' `<tool_call>` and Mistral's `[TOOL_CALLS]` are such markers. A template that
writes a call as plain text (Llama 3.1's JSON) or writes no calls has none, and gets no tool-call guards.
"""

from __future__ import annotations

from qgate.chat import render, served_messages

PROBE = "qgate_probe_tool"
_TOOLS = [
    {
        "type": "function",
        "function": {"name": PROBE, "description": "a probe", "parameters": {"type": "object", "properties": {}}},
    }
]
_ASK = [{"role": "user", "content": "which tool would you call?"}]
_CALL = {"id": "call_qgate0", "type": "function", "function": {"name": PROBE, "arguments": "{}"}}


def call_start_ids(tokenizer) -> list[int]:
    """The id of the token that begins a tool call in the tokenizer's chat template, as a one-item list; [] when the
    template writes no call, cannot write the probe, or begins a call with ordinary text."""
    import jinja2

    if not getattr(tokenizer, "chat_template", None):
        return []
    try:
        prompt = render(tokenizer, _ASK, _TOOLS)
        parts = [
            tokenizer.apply_chat_template(
                served_messages(_ASK + [answer]), tools=_TOOLS, tokenize=False, add_generation_prompt=False
            )
            for answer in (
                {"role": "assistant", "content": "", "tool_calls": [_CALL]},
                {"role": "assistant", "content": "qgate probe answer"},
            )
        ]
    except (jinja2.TemplateError, TypeError, ValueError, KeyError):  # a template that cannot write the probe
        return []
    if not all(p.startswith(prompt) for p in parts) or PROBE not in parts[0][len(prompt) :]:
        return []
    call, prose = (tokenizer(p[len(prompt) :], add_special_tokens=False)["input_ids"] for p in parts)
    added, prose = set(tokenizer.added_tokens_decoder), set(prose)
    return [t for t in call if t in added and t not in prose][:1]
