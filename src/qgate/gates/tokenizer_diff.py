"""What two loaded tokenizers do differently: their vocabularies and special tokens, their chat templates, and how
each renders the same prompts, for the contract gate.

    diffs = loaded_tokenizer_diffs(btok, ctok) + template_diff(btok, ctok)
    diffs, n = rendering_diffs(btok, ctok, shadow_rows)   # n: the prompts rendered
    tools = tool_rendering(btok, shadow_rows)             # {"requests", "not_written", "call_start", ...} or None
"""

from __future__ import annotations

from qgate.chat import render
from qgate.gates.file_diff import SHOW, difference
from qgate.gates.tool_calls import call_start


def loaded_tokenizer_diffs(btok, ctok) -> list[dict]:
    """What the tokenizer files mean once loaded: the vocabulary (added tokens included) and the special tokens."""
    out = []
    bv, cv = btok.get_vocab(), ctok.get_vocab()
    moved = sorted((t for t in bv.keys() & cv.keys() if bv[t] != cv[t]), key=lambda t: bv[t])
    only = sorted(bv.keys() ^ cv.keys())
    if moved or only or len(bv) != len(cv):
        out.append(
            difference(
                "tokenizer",
                "vocab",
                "tokenizer (loaded)",
                {t: bv.get(t) for t in (moved + only)[:SHOW]},
                {t: cv.get(t) for t in (moved + only)[:SHOW]},
            )
            | {"count": len(moved) + len(only), "sizes": [len(bv), len(cv)]}
        )
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        b = (getattr(btok, attr), getattr(btok, f"{attr}_id"))
        c = (getattr(ctok, attr), getattr(ctok, f"{attr}_id"))
        if b != c:
            out.append(difference("tokenizer", f"special.{attr}", "tokenizer (loaded)", list(b), list(c)))
    return out


def template_diff(btok, ctok) -> list[dict]:
    b, c = btok.chat_template or "", ctok.chat_template or ""
    if b == c:
        return []
    bl, cl = b.splitlines(), c.splitlines()
    line = next((i for i, (x, y) in enumerate(zip(bl, cl, strict=False)) if x != y), min(len(bl), len(cl)))
    return [
        difference("chat_template", "", "chat_template.jinja", (bl + [""])[line], (cl + [""])[line])
        | {"first_line": line + 1}
    ]


def rendering_diffs(btok, ctok, rows: list[dict]) -> tuple[list[dict], int]:
    """Whole prompts, untruncated: what a server renders, whatever window the shadow gate later scores."""
    bad = []
    for i, row in enumerate(rows):
        b, c = (
            tok(render(tok, row["messages"], row.get("tools")), add_special_tokens=False)["input_ids"]
            for tok in (btok, ctok)
        )
        if b != c:
            at = next((j for j, (x, y) in enumerate(zip(b, c, strict=False)) if x != y), min(len(b), len(c)))
            bad.append(
                {
                    "prompt": i,
                    "position": at,
                    "baseline": b[at : at + 4],
                    "candidate": c[at : at + 4],
                    "baseline_text": btok.decode(b[at : at + 4]),
                    "candidate_text": ctok.decode(c[at : at + 4]),
                }
            )
    diffs = (
        [
            difference("prompt_rendering", "", "shadow prompts", bad[0]["baseline_text"], bad[0]["candidate_text"])
            | {"prompts_differing": len(bad), "first": bad[0], "examples": bad[1:SHOW]}
        ]
        if bad
        else []
    )
    return diffs, len(rows)


def tool_rendering(tok, rows: list[dict]) -> dict | None:
    """What the chat template does with the requests that offer tools (None when none does): `requests`, how many;
    `not_written`, how many render as they would without them (the model is served, and scored, without them); and
    `call_start`, what begins a tool call in the template (gates/tool_calls.py: a marker token, or the opening
    character of a JSON call, which `call_at_answer_start` then says), null where it has none."""
    tooled = [row for row in rows if row.get("tools")]
    if not tooled:
        return None
    start = call_start(tok)
    return {
        "requests": len(tooled),
        "not_written": sum(render(tok, r["messages"], r["tools"]) == render(tok, r["messages"]) for r in tooled),
        "call_start": start.text,
        "call_at_answer_start": start.first_only,
    }
