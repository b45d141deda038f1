"""A baseline whose own files agree on its special tokens: checked (and, from a GGUF source, fixed) at import.

    fixes = reconcile(Path("runs/base"), gguf_special_tokens(reader_fields))  # GGUF: the file's metadata decides
    check(Path("runs/base"))                                                     # any checkpoint: InputError on a clash

A serving stack stops generating on the tokenizer's eos or on generation_config.json's eos ids, pads with one of
them, and renders turns with the chat template. When those files disagree, a model is served differently depending
on which file a stack reads. The rules:
  eos          the tokenizer's eos is one of the generation config's eos ids;
  end of turn  the token the chat template writes after an assistant turn, when it is a special token, is one of
               those eos ids (otherwise generation runs past the end of its turn);
  bos, pad     the tokenizer's bos and pad, where both it and the generation config set one, are the same id.
A GGUF file's metadata (`tokenizer.ggml.*_token_id`) is the source its converted files are fixed from; an HF
directory's files are their own source, so a disagreement there is refused with what to edit.
"""

from __future__ import annotations

import json
from pathlib import Path

from qgate.errors import InputError

GGUF_IDS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "eot": "tokenizer.ggml.eot_token_id",
}
PROBE = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "qgate-probe-answer"}]


def gguf_special_tokens(path: Path) -> dict[str, int]:
    """The special token ids a GGUF file's metadata names (bos, eos, pad, unk, eot), by role."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    out = {}
    for role, key in GGUF_IDS.items():
        if key in fields:
            out[role] = int(fields[key].contents())
    return out


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _ids(v) -> list[int]:
    return [] if v is None else [int(x) for x in (v if isinstance(v, list) else [v])]


def end_of_turn(tok) -> tuple[str, int] | None:
    """The special token the chat template writes right after an assistant's words, as (token, id); None when the
    template writes no special token there (or has no template, or cannot render a two-turn chat)."""
    if not getattr(tok, "chat_template", None):
        return None
    try:
        text = tok.apply_chat_template(PROBE, tokenize=False)
    except Exception:  # noqa: BLE001 - a template may refuse this shape of chat; then there is no rule to apply
        return None
    at = text.find(PROBE[1]["content"])
    if at < 0:
        return None
    rest = text[at + len(PROBE[1]["content"]) :]
    specials = sorted(
        (t for t in tok.all_special_tokens + [a.content for a in tok.added_tokens_decoder.values() if a.special] if t),
        key=len,
        reverse=True,
    )
    head = rest.lstrip(" ")
    hit = next((t for t in specials if head.startswith(t)), None)
    return (hit, tok.convert_tokens_to_ids(hit)) if hit else None


def problems(d: Path, tok=None) -> list[str]:
    """What disagrees among a checkpoint's tokenizer, generation config and chat template (the rules above). tok: the
    checkpoint's tokenizer when the caller has loaded it already."""
    from qgate.trust import load_tokenizer

    tok = tok or load_tokenizer(d)
    gen, cfg = _json(d / "generation_config.json"), _json(d / "config.json")
    eos_ids = _ids(gen.get("eos_token_id", cfg.get("eos_token_id")))
    out = []
    if tok.eos_token_id is not None and eos_ids and tok.eos_token_id not in eos_ids:
        out.append(
            f"the tokenizer's eos {tok.eos_token!r} (id {tok.eos_token_id}) is not among generation_config.json's "
            f"eos ids {eos_ids}"
        )
    eot = end_of_turn(tok)
    if eot and eos_ids and eot[1] not in eos_ids:
        out.append(
            f"the chat template ends an assistant turn with {eot[0]!r} (id {eot[1]}), which is not among "
            f"generation_config.json's eos ids {eos_ids}: generation would not stop at the end of a turn"
        )
    for role in ("bos", "pad"):
        want = gen.get(f"{role}_token_id", cfg.get(f"{role}_token_id"))
        have = getattr(tok, f"{role}_token_id")
        if want is not None and have is not None and int(want) != int(have):
            out.append(
                f"the tokenizer's {role} {getattr(tok, f'{role}_token')!r} (id {have}) is not generation_config.json's "
                f"{role}_token_id {want}"
            )
    return out


def check(d: Path, tok=None) -> None:
    """InputError naming every disagreement among the checkpoint's special tokens."""
    found = problems(d, tok)
    if found:
        raise InputError(
            f"{d}: the baseline's files disagree on its special tokens: " + "; ".join(found),
            hint="fix tokenizer_config.json (eos_token, bos_token, pad_token) or generation_config.json "
            "(eos_token_id, a list when several tokens end generation) so they agree, then import again; "
            "a baseline imported by an older qgate is fixed by importing it again",
        )


def reconcile(d: Path, source: dict[str, int]) -> list[str]:
    """Make a converted checkpoint's tokenizer and generation config name the special tokens its source names
    (`source`: role -> id, from `gguf_special_tokens`); returns one line per change. The end-of-turn id (eot), when
    the source names one, is kept among the eos ids."""
    from qgate.trust import load_tokenizer

    tok = load_tokenizer(d)
    fixes = []
    tc_path = d / "tokenizer_config.json"
    tc = _json(tc_path)
    for role in ("bos", "eos", "pad", "unk"):
        if role not in source:
            continue
        want = tok.convert_ids_to_tokens(source[role])
        if getattr(tok, f"{role}_token") != want:
            fixes.append(
                f"tokenizer_config.json {role}_token: {getattr(tok, f'{role}_token')!r} -> {want!r} "
                f"(id {source[role]}, as the source's metadata says)"
            )
            tc[f"{role}_token"] = want
            if f"{role}_token_id" in tc:
                tc[f"{role}_token_id"] = source[role]
    if fixes:
        tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    eos = (
        [source["eos"]] + ([source["eot"]] if "eot" in source and source["eot"] != source["eos"] else [])
        if "eos" in source
        else []
    )
    for name in ("generation_config.json", "config.json"):
        path = d / name
        data = _json(path)
        if not data:
            continue
        changed = {}
        if eos and sorted(_ids(data.get("eos_token_id"))) != sorted(eos):
            changed["eos_token_id"] = eos if len(eos) > 1 else eos[0]
        for role in ("bos", "pad"):
            if role in source and data.get(f"{role}_token_id") != source[role]:
                changed[f"{role}_token_id"] = source[role]
        for k, v in changed.items():
            fixes.append(f"{name} {k}: {data.get(k)!r} -> {v!r} (as the source's metadata says)")
        if changed:
            path.write_text(json.dumps(data | changed, indent=2) + "\n")
    return fixes
