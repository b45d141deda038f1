"""How a model begins a tool call, read from its chat template: what the tool-call guards watch.

    start = call_start(tokenizer)   # start.text: the marker or the opening character, None when none is found
    ids = call_ids(tokenizer, start)  # the token ids that begin a call; decodes the vocabulary for a JSON call

The template is asked to write one probe conversation twice: the assistant answering in prose, and the assistant
calling a probe tool. Two ways of beginning a call are read from it:
- a marker: the first token of the call's part that is one of the tokenizer's added tokens (atomic, never a piece of
  prose) and is not in the prose answer's part (a template's thinking block or turn header is in both). Qwen's and
  Hermes' `<tool_call>` and Mistral's `[TOOL_CALLS]` are such markers; a call begins wherever one is emitted.
- a JSON call: a call's part that opens the answer with `{` or `[` and no marker (Llama 3.1's `{"name": ...}`, the
  pythonic `[f(x=1)]`). A server's parser for such a template (vLLM's llama3_json, pythonic) takes an answer for a
  call when its text begins with that character, so the call is decided at the answer's first token: the ids are
  every token whose text begins with it (`first_only`).
A template that writes a call otherwise (as ordinary words), or writes no calls, has neither and gets no tool-call
guards.
"""

from __future__ import annotations

from dataclasses import dataclass

from qgate.chat import render, served_messages

PROBE = "qgate_probe_tool"
OPENERS = "{["  # the first characters of a JSON or pythonic tool call
_TOOLS = [
    {
        "type": "function",
        "function": {"name": PROBE, "description": "a probe", "parameters": {"type": "object", "properties": {}}},
    }
]
_ASK = [{"role": "user", "content": "which tool would you call?"}]
_CALL = {"id": "call_qgate0", "type": "function", "function": {"name": PROBE, "arguments": "{}"}}


@dataclass(frozen=True)
class CallStart:
    text: str | None = None  # the marker token, or a JSON call's opening character; None where there is neither
    first_only: bool = False  # a JSON call: begun only at an answer's first token


def call_start(tokenizer) -> CallStart:
    """How a call begins in the tokenizer's chat template (the module's docstring); CallStart() when the template
    writes no call, cannot write the probe, or begins a call with ordinary words. Cheap: the tokenizer encodes two
    probe answers; `call_ids` turns the result into token ids."""
    import jinja2

    if not getattr(tokenizer, "chat_template", None):
        return CallStart()
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
        return CallStart()
    if not all(p.startswith(prompt) for p in parts) or PROBE not in parts[0][len(prompt) :]:
        return CallStart()
    call_text, prose_text = (p[len(prompt) :] for p in parts)
    call, prose = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in (call_text, prose_text))
    added, prose = set(tokenizer.added_tokens_decoder), set(prose)
    if marker := [t for t in call if t in added and t not in prose][:1]:
        return CallStart(tokenizer.convert_ids_to_tokens(marker[0]))
    opener = call_text[:1]
    if opener and opener in OPENERS and not prose_text.startswith(opener):
        return CallStart(opener, True)
    return CallStart()


def call_ids(tokenizer, start: CallStart) -> list[int]:
    """The token ids that begin a call as `start` says: the marker's id, or, for a JSON call, every token whose text
    begins with its opening character (the whole vocabulary is decoded: about a second at 128k tokens); [] for
    neither."""
    if start.text is None:
        return []
    if not start.first_only:
        return [tokenizer.convert_tokens_to_ids(start.text)]
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], clean_up_tokenization_spaces=False)
    return [i for i, t in enumerate(texts) if t.startswith(start.text)]
