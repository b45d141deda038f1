"""Serving-contract gate: the candidate must be served exactly like the baseline, apart from its weights.

    results = contract_gate(candidate_art, baseline_art, shadow_rows, ContractConfig(allow=("generation_config.temperature",)))

Compared on the files the candidate is actually served with (a checkpoint's own directory; the CPU
engine's onnx/ folder with genai_config.json; the checkpoint inside a TRT-LLM bundle):
  tokenizer          vocab ids, merges, normalizer/pre-tokenizer/post-processor/decoder, added and special tokens
  chat_template      the template text
  generation_config  eos/bos/pad ids and default sampling settings
  context_length     max positions (and rope scaling)
  architecture       model type and shapes
  prompt_rendering   every shadow prompt, rendered with the candidate's own tokenizer and template, must give
                     exactly the baseline's token ids
Each facet is one check: the number of differences not accepted by `allow`, which must be 0. An allow entry
names a difference key or a prefix of one ("chat_template", "generation_config.temperature", "tokenizer.vocab").
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from qgate.artifact import Artifact
from qgate.chat import render
from qgate.errors import ConfigError
from qgate.gates.result import GateResult

FACETS = ("tokenizer", "chat_template", "generation_config", "context_length", "architecture", "prompt_rendering")
ARCH_KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "vocab_size", "hidden_act", "rms_norm_eps", "rope_theta")
GENAI_ARCH = {"hidden_size": ("decoder", "hidden_size"), "num_hidden_layers": ("decoder", "num_hidden_layers"),
              "num_attention_heads": ("decoder", "num_attention_heads"), "num_key_value_heads": ("decoder", "num_key_value_heads"),
              "head_dim": ("decoder", "head_size"), "vocab_size": ("vocab_size",)}
GENAI_SEARCH = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
SHOW = 5   # examples kept per difference


@dataclass(frozen=True)
class ContractConfig:
    allow: tuple[str, ...] = ()    # difference keys (or prefixes) accepted; each is listed in the report
    VERSION = 1

    def __post_init__(self):
        for a in self.allow:
            if not isinstance(a, str) or a.split(".")[0] not in FACETS:
                raise ConfigError(f"gates.contract.allow: {a!r} does not start with a facet",
                                  hint=f"facets: {', '.join(FACETS)}; e.g. 'generation_config.temperature'")

    def accepts(self, key: str) -> bool:
        return any(key == a or key.startswith(a + ".") for a in self.allow)


def served_files(art: Artifact) -> tuple[Path, dict | None]:
    """The directory holding the tokenizer and config the candidate is served with, and its genai_config (CPU engine)."""
    if art.kind == "engine" and art.meta.get("backend") == "cpu":
        from qgate.engines.cpu import ENGINE_SUBDIR

        d = art.path / ENGINE_SUBDIR
        return d, json.loads((d / "genai_config.json").read_text())
    if art.kind == "engine":
        return art.path / "checkpoint", None
    return art.path, None


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _diff(facet: str, key: str, file: str, base, cand) -> dict:
    return {"key": f"{facet}.{key}" if key else facet, "file": file, "baseline": base, "candidate": cand}


def _tokenizer_diffs(btok, ctok, bdir: Path, cdir: Path) -> list[dict]:
    out = []
    bv, cv = btok.get_vocab(), ctok.get_vocab()
    moved = sorted((t for t in bv.keys() & cv.keys() if bv[t] != cv[t]), key=lambda t: bv[t])
    only = sorted(bv.keys() ^ cv.keys())
    if moved or only or len(bv) != len(cv):
        out.append(_diff("tokenizer", "vocab", "tokenizer.json", {t: bv.get(t) for t in (moved + only)[:SHOW]},
                         {t: cv.get(t) for t in (moved + only)[:SHOW]})
                   | {"count": len(moved) + len(only), "sizes": [len(bv), len(cv)]})
    bj, cj = _json(bdir / "tokenizer.json"), _json(cdir / "tokenizer.json")
    bm, cm = bj.get("model", {}).get("merges"), cj.get("model", {}).get("merges")
    if bm != cm:
        first = next((i for i, (a, b) in enumerate(zip(bm or [], cm or [], strict=False)) if a != b), min(len(bm or []), len(cm or [])))
        out.append(_diff("tokenizer", "merges", "tokenizer.json", (bm or [None] * (first + 1))[first:first + 1],
                         (cm or [None] * (first + 1))[first:first + 1]) | {"first_index": first})
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        if bj.get(part) != cj.get(part):
            out.append(_diff("tokenizer", part, "tokenizer.json", bj.get(part), cj.get(part)))
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        b = (getattr(btok, attr), getattr(btok, f"{attr}_id"))
        c = (getattr(ctok, attr), getattr(ctok, f"{attr}_id"))
        if b != c:
            out.append(_diff("tokenizer", f"special.{attr}", "tokenizer_config.json", list(b), list(c)))
    ba = {i: (t.content, t.special) for i, t in btok.added_tokens_decoder.items()}
    ca = {i: (t.content, t.special) for i, t in ctok.added_tokens_decoder.items()}
    if ba != ca:
        ids = sorted(i for i in ba.keys() | ca.keys() if ba.get(i) != ca.get(i))
        out.append(_diff("tokenizer", "added_tokens", "tokenizer.json", {i: ba.get(i) for i in ids[:SHOW]},
                         {i: ca.get(i) for i in ids[:SHOW]}))
    return out


def _template_diff(btok, ctok) -> list[dict]:
    b, c = btok.chat_template or "", ctok.chat_template or ""
    if b == c:
        return []
    bl, cl = b.splitlines(), c.splitlines()
    line = next((i for i, (x, y) in enumerate(zip(bl, cl, strict=False)) if x != y), min(len(bl), len(cl)))
    return [_diff("chat_template", "", "chat_template.jinja", (bl + [""])[line], (cl + [""])[line]) | {"first_line": line + 1}]


def _ids(v) -> list[int] | None:
    if v is None:
        return None
    return sorted(v) if isinstance(v, list) else [v]


def _generation_diffs(bdir: Path, cdir: Path, genai: dict | None) -> list[dict]:
    bg, bc = _json(bdir / "generation_config.json"), _json(bdir / "config.json")
    out = []
    if genai is None:
        cg = _json(cdir / "generation_config.json")
        for k in sorted((bg.keys() | cg.keys()) - {"transformers_version"}):
            b, c = bg.get(k), cg.get(k)
            if (k in TOKEN_IDS and _ids(b) != _ids(c)) or (k not in TOKEN_IDS and b != c):
                out.append(_diff("generation_config", k, "generation_config.json", b, c))
        return out
    model, search = genai["model"], genai.get("search", {})
    for k in TOKEN_IDS:
        b = bg.get(k, bc.get(k))
        if b is not None and _ids(b) != _ids(model.get(k)):
            out.append(_diff("generation_config", k, "genai_config.json", b, model.get(k)))
    for k in GENAI_SEARCH:
        if k in bg and k in search and bg[k] != search[k]:
            out.append(_diff("generation_config", k, "genai_config.json", bg[k], search[k]))
    return out


def _config_diffs(bdir: Path, cdir: Path, genai: dict | None) -> tuple[list[dict], list[dict]]:
    bc = _json(bdir / "config.json")
    ctx, arch = [], []
    if genai is None:
        cc = _json(cdir / "config.json")
        for k in ("max_position_embeddings", "rope_scaling"):
            if bc.get(k) != cc.get(k):
                ctx.append(_diff("context_length", k, "config.json", bc.get(k), cc.get(k)))
        for k in ARCH_KEYS:
            if bc.get(k) != cc.get(k):
                arch.append(_diff("architecture", k, "config.json", bc.get(k), cc.get(k)))
        return ctx, arch
    model = genai["model"]
    if bc.get("max_position_embeddings") != model.get("context_length"):
        ctx.append(_diff("context_length", "max_position_embeddings", "genai_config.json", bc.get("max_position_embeddings"),
                         model.get("context_length")))
    for k, path in GENAI_ARCH.items():
        v = model
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        if k in bc and v is not None and bc[k] != v:
            arch.append(_diff("architecture", k, "genai_config.json", bc[k], v))
    return ctx, arch


def _rendering_diffs(btok, ctok, rows: list[dict]) -> tuple[list[dict], int]:
    """Whole prompts, untruncated: what a server renders, whatever window the shadow gate later scores."""
    bad = []
    for i, row in enumerate(rows):
        b, c = (tok(render(tok, row["messages"]), add_special_tokens=False)["input_ids"] for tok in (btok, ctok))
        if b != c:
            at = next((j for j, (x, y) in enumerate(zip(b, c, strict=False)) if x != y), min(len(b), len(c)))
            bad.append({"prompt": i, "position": at, "baseline": b[at:at + 4], "candidate": c[at:at + 4],
                        "baseline_text": btok.decode(b[at:at + 4]), "candidate_text": ctok.decode(c[at:at + 4])})
    diffs = [_diff("prompt_rendering", "", "shadow prompts", bad[0]["baseline_text"], bad[0]["candidate_text"])
             | {"prompts_differing": len(bad), "first": bad[0], "examples": bad[1:SHOW]}] if bad else []
    return diffs, len(rows)


def contract_gate(candidate: Artifact, baseline: Artifact, rows: list[dict], cfg: ContractConfig) -> list[GateResult]:
    from qgate.trust import check_loadable, load_tokenizer

    cdir, genai = served_files(candidate)
    bdir = baseline.path
    check_loadable(cdir)
    btok, ctok = load_tokenizer(bdir), load_tokenizer(cdir)
    ctx, arch = _config_diffs(bdir, cdir, genai)
    rendered, n_prompts = _rendering_diffs(btok, ctok, rows)
    facets = {"tokenizer": (_tokenizer_diffs(btok, ctok, bdir, cdir), len(btok.get_vocab())),
              "chat_template": (_template_diff(btok, ctok), 1),
              "generation_config": (_generation_diffs(bdir, cdir, genai), 1),
              "context_length": (ctx, 1), "architecture": (arch, len(ARCH_KEYS)),
              "prompt_rendering": (rendered, n_prompts)}
    results = []
    for facet, (diffs, n) in facets.items():
        refused = [d for d in diffs if not cfg.accepts(d["key"])]
        accepted = [d for d in diffs if cfg.accepts(d["key"])]
        ev = {"served_from": str(cdir), "differences": refused, "accepted": accepted}
        results.append(GateResult.check("contract", facet, float(len(refused)), 0.0, False, n, evidence=ev))
    return results


def describe(diff: dict) -> str:
    """One line for the CLI and the report: the file, the key, both values."""
    return f"{diff['file']}: {diff['key']}: baseline {diff['baseline']!r} != candidate {diff['candidate']!r}"
