"""Serving-contract gate: the candidate must be served exactly like the baseline, apart from its weights.

    config = ContractConfig(allow=("generation_config.temperature",))
    results = contract_gate(candidate_art, baseline_art, shadow_rows, config)

Deny by default. Every key of every file a server reads to configure the model and its tokenizer is compared, nested
keys and list items included: config.json, generation_config.json, tokenizer.json, tokenizer_config.json,
special_tokens_map.json, added_tokens.json, vocab.json, merges.txt and tokenizer.model, on the files the candidate is
actually served with (a checkpoint's own directory; for the CPU engine its onnx/ folder, its genai_config.json and the
config.json of the checkpoint it was built from; the checkpoint inside a TRT-LLM bundle). A difference fails unless
quantization is allowed to change that key (ALLOWED, one reason each), it holds the same setting on both sides once
Transformers reads config.json and generation_config.json (gates/loaded_config.py: a key an older Transformers wrote
differently, a default written out on one side), or `gates.contract.allow` names it. Keys are
`facet.path`: config.json's context keys (rope, positions, windows) are `context_length.*`, its other keys
`architecture.*`; generation_config.json's `generation_config.*`; tokenizer.json's `tokenizer.*`,
tokenizer_config.json's `tokenizer.config.*`, the other tokenizer files' `tokenizer.<file stem>.*`. Each facet is one
check, whose observed value is the number of differences refused (which must be 0) and whose n is the number of keys
compared:
  tokenizer          the tokenizer files above, and the loaded tokenizer's vocabulary and special tokens
  chat_template      the template text the loaded tokenizer renders with (chat_template.jinja or inline)
  generation_config  generation_config.json (the CPU engine: genai_config.json's ids and search settings)
  context_length     config.json's context keys (the CPU engine: also genai_config.json's context_length)
  architecture       every other config.json key (the CPU engine: also genai_config.json's model shapes)
  prompt_rendering   every shadow prompt, rendered with the candidate's own tokenizer and template, must give
                     exactly the baseline's token ids
An allow entry names a difference key or a prefix of one ("chat_template", "generation_config.temperature",
"context_length.rope_parameters").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from qgate.artifact import Artifact, engine_checkpoint
from qgate.errors import ConfigError
from qgate.gates.file_diff import MISSING, SHOW, difference, file_diffs, leaves, read_json, same
from qgate.gates.loaded_config import effective_generation, loaded_config, mark_same_settings
from qgate.gates.result import GateResult
from qgate.gates.tokenizer_diff import loaded_tokenizer_diffs, rendering_diffs, template_diff, tool_rendering
from qgate.trust import TOKENIZER_FILES

FACETS = ("tokenizer", "chat_template", "generation_config", "context_length", "architecture", "prompt_rendering")

_NAMES = "where the model was loaded from or what it was called: a name, not behaviour"
_VERSION = "the version of the library that wrote the file"
_DTYPE = (
    "the dtype unquantized tensors are stored in: a numeric change, which the shadow, eval and long-context gates "
    "measure"
)
_LOADING = "how Transformers read the files when it saved them (its loading arguments), not how text is tokenized"
# Keys quantization is allowed to change, each with its reason. Everything else must be equal.
ALLOWED: dict[str, str] = {
    "architecture.quantization_config": "the quantization itself: how the weights are stored and computed, which the "
    "shadow, eval and long-context gates measure",
    "architecture.dtype": _DTYPE,
    "architecture.torch_dtype": _DTYPE,
    "architecture.transformers_version": _VERSION,
    "generation_config.transformers_version": _VERSION,
    "architecture._name_or_path": _NAMES,
    "architecture._model_name_or_path": _NAMES,
    "tokenizer.config.name_or_path": _NAMES,
    "tokenizer.config._name_or_path": _NAMES,
    "tokenizer.config.is_local": _LOADING,
    "tokenizer.config.local_files_only": _LOADING,
    "generation_config._from_model_config": "whether Transformers derived the file from config.json: bookkeeping; the "
    "values themselves are compared",
}
# Allowed only when the candidate's quantization_config quantizes the output head: it is then stored apart from the
# input embedding it was tied to (search.lm_head), and the config says so.
UNTIED_HEAD = (
    "architecture.tie_word_embeddings",
    "the output head is quantized (its quantization_config's targets match lm_head), so it is stored apart from the "
    "input embedding it was tied to; its values are what the shadow, eval and long-context gates measure",
)
# The CPU engine's genai_config.json: keys that configure onnxruntime-genai itself and have no counterpart in the
# baseline's files, each with its reason. Every other key must map to a baseline value and equal it.
ENGINE_RUNTIME: dict[str, str] = {
    "model.decoder.session_options": "onnxruntime's session settings (threads, providers, log id)",
    "model.decoder.filename": "the ONNX file's name",
    "model.decoder.inputs": "the ONNX graph's input names",
    "model.decoder.outputs": "the ONNX graph's output names",
    "search.max_length": "onnxruntime-genai's default length limit: a server sets it per request, and the model's own "
    "limit is compared as context_length",
    "search.past_present_share_buffer": "how the runtime lays out its KV buffers, not what it computes",
    "search.early_stopping": "a beam-search setting: with one beam (num_beams, compared) it has no effect",
}
CONTEXT_WORDS = ("rope", "position", "window", "context", "chunk")  # config.json keys that set how far the model sees
FILE_KEYS = {  # each of trust.TOKENIZER_FILES -> its key prefix; None: compared as the loaded tokenizer's chat template
    "tokenizer.json": "tokenizer",
    "tokenizer_config.json": "tokenizer.config",
    "special_tokens_map.json": "tokenizer.special_tokens_map",
    "added_tokens.json": "tokenizer.added_tokens_file",
    "vocab.json": "tokenizer.vocab_file",
    "merges.txt": "tokenizer.merges_file",
    "tokenizer.model": "tokenizer.model_file",
    "chat_template.jinja": None,
    "chat_template.json": None,
}
NOT_TOKENIZER_KEYS = ("chat_template",)  # tokenizer_config.json keys compared by another facet
GENAI_MODEL = {
    "context_length": ("context_length", "max_position_embeddings"),
    "type": ("architecture", "model_type"),
    "vocab_size": ("architecture", "vocab_size"),
    "decoder.hidden_size": ("architecture", "hidden_size"),
    "decoder.num_hidden_layers": ("architecture", "num_hidden_layers"),
    "decoder.num_attention_heads": ("architecture", "num_attention_heads"),
    "decoder.num_key_value_heads": ("architecture", "num_key_value_heads"),
    "decoder.head_size": ("architecture", "head_dim"),
}


@dataclass(frozen=True)
class ContractConfig:
    allow: tuple[str, ...] = ()  # difference keys (or prefixes) accepted beyond ALLOWED; each is listed in the report
    VERSION = 4

    def __post_init__(self):
        for a in self.allow:
            if not isinstance(a, str) or a.split(".")[0] not in FACETS:
                raise ConfigError(
                    f"gates.contract.allow: {a!r} does not start with a facet",
                    hint=f"facets: {', '.join(FACETS)}; e.g. 'generation_config.temperature'",
                )

    def accepts(self, key: str) -> bool:
        return _matches(key, self.allow)


def _matches(key: str, prefixes) -> str | None:
    return next((a for a in prefixes if key == a or key.startswith(a + ".") or key.startswith(a + "[")), None)


def served_files(art: Artifact) -> tuple[Path, dict | None]:
    """The directory holding the tokenizer and config the candidate is served with, and its genai_config (CPU
    engine)."""
    if art.kind == "engine" and art.meta.get("backend") == "cpu":
        from qgate.engines.cpu import ENGINE_SUBDIR

        d = art.path / ENGINE_SUBDIR
        return d, json.loads((d / "genai_config.json").read_text())
    if art.kind == "engine":
        return art.path / "checkpoint", None
    return art.path, None


def _config_prefix(top: str) -> tuple[str, str]:
    facet = "context_length" if any(w in top for w in CONTEXT_WORDS) else "architecture"
    return facet, facet


def _served_diffs(
    bdir: Path, cdir: Path, config_dir: Path | None, genai: dict | None
) -> dict[str, tuple[list[dict], int]]:
    """Per facet: every difference between the baseline's files and the candidate's, and the keys compared."""
    facets: dict[str, tuple[list[dict], int]] = {f: ([], 0) for f in FACETS}

    def add(pairs, n, facet_n: str):
        for facet, d in pairs:
            facets[facet][0].append(d)
        diffs, m = facets[facet_n]
        facets[facet_n] = (diffs, m + n)

    for file in TOKENIZER_FILES:
        if (prefix := FILE_KEYS[file]) is None:
            continue
        pairs, n = file_diffs(
            lambda _p, pre=prefix: ("tokenizer", pre),
            file,
            bdir / file,
            cdir / file,
            NOT_TOKENIZER_KEYS if file == "tokenizer_config.json" else (),
        )
        add(pairs, n, "tokenizer")
    if config_dir is None:  # the candidate's config.json could not be found: nothing to compare it with
        facets["architecture"][0].append(
            difference(
                "architecture",
                "",
                "config.json",
                "present",
                "not found: the engine's source checkpoint is not on disk or changed",
            )
        )
    else:
        where = "config.json" if config_dir == cdir else f"{config_dir / 'config.json'} (the engine's checkpoint)"
        pairs, _ = file_diffs(_config_prefix, where, bdir / "config.json", config_dir / "config.json")
        mark_same_settings([d for _, d in pairs], "config.json", bdir, config_dir)
        keys = [k.split(".")[0] for k, _ in leaves(read_json(bdir / "config.json"))]
        for facet in ("context_length", "architecture"):
            add([p for p in pairs if p[0] == facet], sum(_config_prefix(k)[0] == facet for k in keys), facet)
    if genai is None:
        pairs, n = file_diffs(
            lambda _p: ("generation_config", "generation_config"),
            "generation_config.json",
            bdir / "generation_config.json",
            cdir / "generation_config.json",
        )
        mark_same_settings([d for _, d in pairs], "generation_config.json", bdir, cdir)
        add(pairs, n, "generation_config")
    else:
        for facet, d in _genai_diffs(bdir, genai):
            facets[facet][0].append(d)
        diffs, m = facets["generation_config"]
        facets["generation_config"] = (diffs, m + sum(1 for _ in leaves(genai)))
    return facets


def _genai_diffs(bdir: Path, genai: dict) -> list[tuple[str, dict]]:
    """The CPU engine's genai_config.json against the baseline: model shapes and context length against config.json,
    token ids and search settings against its generation_config.json (Transformers' defaults where it sets none). The
    baseline's config.json is read as Transformers loads it where it can (loaded_config). A key with no counterpart
    must be one of ENGINE_RUNTIME's."""
    bc = loaded_config(bdir) or read_json(bdir / "config.json")
    if bc.get("head_dim") is None and bc.get("hidden_size") and bc.get("num_attention_heads"):
        # a config without head_dim (Qwen2's): its attention layers use hidden_size / num_attention_heads
        bc = bc | {"head_dim": bc["hidden_size"] // bc["num_attention_heads"]}
    gen = effective_generation(read_json(bdir / "generation_config.json"))
    out = []
    for path, value in leaves(genai):
        if _matches(path, ENGINE_RUNTIME):
            continue
        section, _, key = path.partition(".")
        if section == "model" and key in GENAI_MODEL:
            facet, name = GENAI_MODEL[key]
            base = bc.get(name, MISSING)
        elif section == "model" and key.endswith("token_id"):
            facet, name = "generation_config", key
            base = gen.get(key, bc.get(key, MISSING))
        elif section == "search" and key in gen:
            facet, name = "generation_config", key
            base = gen[key]
        else:
            out.append(
                (
                    "generation_config",
                    difference("generation_config", f"genai.{path}", "genai_config.json", MISSING, value)
                    | {"why": "no counterpart in the baseline's files"},
                )
            )
            continue
        if not same(base, value, name):
            out.append((facet, difference(facet, name, "genai_config.json", base, value)))
    return out


def summarize(diffs: list[dict]) -> list[dict]:
    """Differences for people: where more than SHOW share one parent key (a reshuffled vocabulary, a new merges
    list), one entry for the parent with their count and the first SHOW."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for d in diffs:
        groups.setdefault((d["file"], d.get("parent", d["key"])), []).append(d)
    out = []
    for (file, key), ds in groups.items():
        if len(ds) <= SHOW:
            out += ds
            continue
        first = ds[:SHOW]
        out.append(
            {
                "key": key,
                "file": file,
                "count": len(ds),
                "baseline": {d["key"][len(key) :].lstrip("."): d["baseline"] for d in first},
                "candidate": {d["key"][len(key) :].lstrip("."): d["candidate"] for d in first},
            }
        )
    return out


def contract_gate(
    candidate: Artifact, baseline: Artifact, rows: list[dict], cfg: ContractConfig, config_dir: Path | None = None
) -> list[GateResult]:
    """config_dir: the directory whose config.json the candidate runs with (default: its served directory; for the
    CPU engine, the checkpoint it was built from; None there when that checkpoint is gone). InputError when the
    baseline's own files disagree on its special tokens: it is then no reference to hold a candidate to."""
    from qgate import special_tokens
    from qgate.trust import check_loadable, load_tokenizer

    cdir, genai = served_files(candidate)
    bdir = baseline.path
    if genai is not None and config_dir is None:
        config_dir = getattr(engine_checkpoint(candidate), "path", None)
    check_loadable(cdir)
    btok, ctok = load_tokenizer(bdir), load_tokenizer(cdir)
    special_tokens.check(bdir, btok)
    cfg_dir = cdir if genai is None else config_dir
    facets = _served_diffs(bdir, cdir, cfg_dir, genai)
    head_quantized = cfg_dir is not None and quantizes_head(read_json(cfg_dir / "config.json"))
    tok_diffs, tok_n = facets["tokenizer"]
    facets["tokenizer"] = (loaded_tokenizer_diffs(btok, ctok) + tok_diffs, tok_n + len(btok.get_vocab()))
    facets["chat_template"] = (template_diff(btok, ctok), 1)
    facets["prompt_rendering"] = rendering_diffs(btok, ctok, rows)
    tools = tool_rendering(btok, rows)
    results = []
    for facet, (diffs, n) in facets.items():
        refused, accepted, allowed = [], [], []
        for d in diffs:
            if (why := _matches(d["key"], ALLOWED)) is not None:
                allowed.append(d | {"allowed_because": ALLOWED[why], "allowed_key": why})
            elif d.get("same_setting"):
                allowed.append(d | {"allowed_because": d["same_setting"], "allowed_key": d["key"]})
            elif head_quantized and d["key"] == UNTIED_HEAD[0] and (d["baseline"], d["candidate"]) == (True, False):
                allowed.append(d | {"allowed_because": UNTIED_HEAD[1], "allowed_key": UNTIED_HEAD[0]})
            elif cfg.accepts(d["key"]):
                accepted.append(d)
            else:
                refused.append(d)
        ev = {
            "served_from": str(cdir),
            "differences": summarize(refused),
            "accepted": summarize(accepted),
            "allowed": _allowed_summary(allowed),
            "compared_keys": n,
        }
        if facet == "prompt_rendering" and tools:
            ev["tools"] = tools
        results.append(GateResult.check("contract", facet, float(len(refused)), 0.0, False, max(n, 1), evidence=ev))
    return results


HEAD = ("lm_head", ("Linear", "Module"))  # the output head's module name, and the classes it is an instance of


def _names_head(targets) -> bool:
    """Whether a compressed-tensors target list matches the output head as compressed_tensors.utils.match does: by
    its module name, by a "re:" pattern matching that name from its start, or by a class it is an instance of."""
    name, classes = HEAD
    targets = [targets] if isinstance(targets, str) else targets or []
    return any(t == name or t in classes or _pattern_matches(t, name) for t in targets if isinstance(t, str))


def _pattern_matches(target: str, name: str) -> bool:
    """A "re:" target matching `name` from its start; a pattern that does not compile matches nothing (no
    compressed-tensors run could have written it)."""
    if not target.startswith("re:"):
        return False
    try:
        return re.match(target.removeprefix("re:"), name) is not None
    except re.error:
        return False


def quantizes_head(config: dict) -> bool:
    """Whether a checkpoint config's quantization_config quantizes lm_head: a config group's targets match it (its
    name, a pattern, or "Linear"), and its ignore list does not."""
    qc = config.get("quantization_config") or {}
    named = any(_names_head(g.get("targets")) for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict))
    return named and not _names_head(qc.get("ignore"))


def _allowed_summary(allowed: list[dict]) -> list[dict]:
    """One entry per ALLOWED key that let differences through: its reason and how many leaves differ under it."""
    out: dict[str, dict] = {}
    for d in allowed:
        e = out.setdefault(
            d["allowed_key"], {"key": d["allowed_key"], "file": d["file"], "why": d["allowed_because"], "count": 0}
        )
        e["count"] += 1
    return list(out.values())


def _short(v, width: int = 160) -> str:
    s = repr(v)
    return s if len(s) <= width else s[: width - 3] + "..."


def describe(diff: dict) -> str:
    """One line for the CLI and the report: the file, the key, both values (and how many when summarized)."""
    if "why" in diff and "baseline" not in diff:  # an allowed key
        return f"{diff['file']}: {diff['key']}: {diff['why']}"
    count = f" ({diff['count']} differences; the first {SHOW})" if diff.get("count", 0) > SHOW else ""
    sides = f"baseline {_short(diff['baseline'])} != candidate {_short(diff['candidate'])}"
    return f"{diff['file']}: {diff['key']}{count}: {sides}"
