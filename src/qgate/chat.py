"""Turn chat messages into token ids the same way in every stage.

    ids = encode_messages(tokenizer, [{"role": "user", "content": "hi"}], max_tokens=512)
"""
from __future__ import annotations


def render(tokenizer, messages: list[dict]) -> str:
    """The prompt text a serving stack would build: the model's chat template, or a plain fallback."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def encode_messages(tokenizer, messages: list[dict], max_tokens: int) -> list[int]:
    """Token ids of the rendered prompt, keeping the *end* (the latest turn) when too long."""
    ids = tokenizer(render(tokenizer, messages), add_special_tokens=False)["input_ids"]
    return ids[-max_tokens:]
