"""Which written differences in config.json and generation_config.json hold the same setting once Transformers reads
the files, for the contract gate.

    mark_same_settings(diffs, "config.json", base_dir, cand_dir)   # d["same_setting"]: why it is no real difference

Transformers 5 writes config.json differently from Transformers 4: `rope_theta` and `rope_scaling` move into
`rope_parameters`, `torch_dtype` becomes `dtype`, and defaults such as `head_dim` and `mlp_bias` are written out. A
baseline from a model hub, saved by Transformers 4, and a candidate saved by a tool on Transformers 5 (or the other
way round) therefore differ on paper in keys that load to the same values; qgate's own quantize keeps the baseline's
layout. A difference is the same setting only where the two loaded configs agree on the key itself, or on the key
Transformers moves it into (RENAMED); a key Transformers reads into something to_dict() leaves out
(`_attn_implementation`) stays a difference. In generation_config.json a key one side leaves unset (or null) holds
Transformers' default there, which may be the other side's value.
"""

from __future__ import annotations

import re
from pathlib import Path

from qgate.gates.file_diff import MISSING, read_json, same

# config.json keys Transformers moves into another key when it loads the file -> that key
RENAMED = {"rope_theta": "rope_parameters", "rope_scaling": "rope_parameters", "torch_dtype": "dtype"}


def top_key(key: str) -> str:
    """A difference's config key below its facet: 'context_length.rope_parameters.rope_theta' -> 'rope_parameters'."""
    return re.split(r"[.\[]", key.split(".", 1)[1] if "." in key else "", maxsplit=1)[0]


def loaded_config(d: Path) -> dict | None:
    """d/config.json as Transformers loads it (to_dict(): every setting of its config class, defaults and renamed keys
    included), or None where this Transformers cannot load it: its differences then count as written."""
    from transformers import AutoConfig

    if not (Path(d) / "config.json").is_file():
        return None
    try:
        return AutoConfig.from_pretrained(str(d), trust_remote_code=False).to_dict()
    except (ValueError, KeyError, TypeError, OSError):  # a model type this Transformers does not know, a bad value
        return None


def generation_defaults() -> dict:
    """Transformers' effective generation settings where a generation_config.json leaves one unset (it keeps them
    in a private method; none when that is gone, and every unset setting then counts as absent)."""
    from transformers import GenerationConfig

    get = getattr(GenerationConfig, "_get_default_generation_params", None)
    return dict(get()) if callable(get) else {}


def effective_generation(raw: dict) -> dict:
    """A generation_config.json's settings as generation runs them: its values, and Transformers' defaults where it
    leaves a key unset or null."""
    return generation_defaults() | {k: v for k, v in raw.items() if v is not None}


def mark_same_settings(diffs: list[dict], file: str, bdir: Path, cdir: Path) -> None:
    """Give each difference of `file` (config.json or generation_config.json, read from bdir and cdir) that holds the
    same setting on both sides once Transformers reads them a `same_setting` entry: why it is the same."""
    import transformers

    v = transformers.__version__
    if file == "generation_config.json":
        b, c = (effective_generation(read_json(d / file)) for d in (bdir, cdir))
        for d in diffs:
            if (key := top_key(d["key"])) and same(b.get(key, MISSING), c.get(key, MISSING), key):
                d["same_setting"] = f"the same setting once a key left unset or null takes Transformers {v}'s default"
        return
    b, c = loaded_config(bdir), loaded_config(cdir)
    if b is None or c is None:
        return
    for d in diffs:
        key = top_key(d["key"])
        target = RENAMED.get(key, key)
        if key and target in b and target in c and same(b[target], c[target], target):
            d["same_setting"] = (
                f"Transformers {v} reads it into {target}, which is the same on both sides once loaded"
                if target != key
                else f"written on one side only or differently, and the same once Transformers {v} loads config.json"
            )
