"""Run one quantization scheme on a checkpoint with calibration data from real traffic.

    art = quantize(base_art, calib_art, AWQConfig(group_size=64), out=Path("runs/awq"), kv=None)

The model is checked (group sizes) before any calibration work starts. On a CUDA host the model loads in its
served dtype into host memory and llm-compressor's sequential pipeline runs each layer on the GPU; on a host
without CUDA it runs in float32 and llm-compressor's pinned-memory cache is switched off for the call only. Either way
the checkpoint is stored in the 16-bit format the model declares, if it declares one (stored_dtype).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from qgate.artifact import Artifact, typed_config
from qgate.calibrate.sample import split_prompts, split_rows
from qgate.chat import encode_messages
from qgate.errors import ConfigError, InputError
from qgate.quantize.schemes import FallbackConfig, KVCacheConfig, weight_format


@dataclass(frozen=True)
class CalibOptions:
    max_seq_length: int = 512  # calibration sequences are cut to this many tokens
    max_samples: int | None = None  # None: every calibration record
    seed: int = 0  # llm-compressor shuffles calibration samples with torch's global RNG: seeded here,
    # so the same inputs give byte-identical checkpoints (a killed run re-made exactly)
    VERSION = 1

    def __post_init__(self):
        if self.max_seq_length < 8:
            raise ConfigError(f"quantize.max_seq_length must be >= 8, got {self.max_seq_length}")


@contextlib.contextmanager
def cpu_safe_intermediates():
    """Pinning host memory needs a CUDA driver; without one, make llm-compressor's cache skip it."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.cuda.is_available():
        yield
        return
    saved = IntermediatesCache.__dict__["pin_memory"], IntermediatesCache.__dict__["_pin_intermediate"]
    IntermediatesCache.pin_memory = lambda self, *a, **k: None
    IntermediatesCache._pin_intermediate = classmethod(lambda cls, value: None)
    try:
        yield
    finally:
        IntermediatesCache.pin_memory, IntermediatesCache._pin_intermediate = saved


def load_dtype(path: Path):
    """The dtype a model is quantized in: float32 on a CPU; on a CUDA host its served dtype (bf16), in host memory,
    which llm-compressor's sequential pipeline onloads to the GPU one layer at a time, so a model larger than GPU
    memory quantizes from host memory. A float16 model too quantizes in float32 on a CPU: its calibration forwards are
    not what is served; its checkpoint is stored in float16 (stored_dtype), and the gates score it so."""
    import torch

    from qgate.device import compute_dtype, resolve_device

    device = resolve_device("auto")
    if device.type != "cuda":
        return torch.float32
    return compute_dtype(json.loads((Path(path) / "config.json").read_text()), device)


SIXTEEN_BIT = ("bfloat16", "float16")


def stored_dtype(path: Path | None):
    """The float format quantize stores a checkpoint of the model at `path` in (its scales, its unquantized layers and
    its config's dtype): the 16-bit format the model's config.json declares, so the checkpoint is served and gated in
    the baseline's format whichever host quantized it; else the format it is quantized in (load_dtype). None: a model
    that declares no 16-bit format, as a GGUF import writes (float32 on a CPU, bf16 on CUDA)."""
    import torch

    from qgate.device import compute_dtype, declared_dtype, resolve_device

    if path is None:
        return compute_dtype({}, resolve_device("auto"))
    declared = declared_dtype(json.loads((Path(path) / "config.json").read_text()))
    return getattr(torch, declared) if declared in SIXTEEN_BIT else load_dtype(path)


def stored_float_bits(path: Path | None = None) -> int:
    """Bits of the float format quantize stores a checkpoint's scales and unquantized layers in on this host
    (stored_dtype): 16 for a model that declares a 16-bit format, or quantized on CUDA; 32 for a float32 model
    quantized on a CPU."""
    import torch

    return torch.finfo(stored_dtype(path)).bits


def storage_key(path: Path) -> dict:
    """For the cache keys of checkpoints quantized from the model at `path`: the float format they are stored in
    (stored_dtype), which depends on the host; empty for float32, the format a key without it means."""
    from qgate.device import dtype_name

    name = dtype_name(stored_dtype(path))
    return {} if name == "float32" else {"stored": name}


def store_in(out: Path, dtype) -> None:
    """Rewrite the float32 tensors of the checkpoint saved at `out` (scales, unquantized layers) in `dtype`, and declare
    `dtype` in its config.json: the cast a server loading it in `dtype` makes. Codes, zero points and group indices
    stay as quantize chose them, and the checkpoint is what a CUDA host quantizing in `dtype` stores."""
    import os

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from qgate.device import dtype_name

    out = Path(out)
    total = 0
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            meta = st.metadata()
            tensors = {k: st.get_tensor(k) for k in st.keys()}
        tensors = {k: t.to(dtype) if t.dtype == torch.float32 else t for k, t in tensors.items()}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        tmp = f.with_name(f".{f.name}.tmp")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, f)
    index = out / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        doc.setdefault("metadata", {})["total_size"] = total
        index.write_text(json.dumps(doc, indent=2) + "\n")
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = dtype_name(dtype)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_host_model(path: Path, dtype=None):
    """The model at `path` in host memory, in `dtype` (load_dtype's by default), for llm-compressor or a search's
    sensitivity scan. BackendUnavailable first where its weights alone exceed the host's memory (device.check_fits):
    the kernel would kill the process part way through the load."""
    import torch

    from qgate.device import check_model_fits
    from qgate.trust import load_causal_lm

    dtype = dtype or load_dtype(path)
    check_model_fits(torch.device("cpu"), path, dtype, "model in host memory", hint="run on a host with more memory")
    return load_causal_lm(path, dtype=dtype)


def check_unquantized(base: Artifact, what: str) -> None:
    """InputError unless `base` is a full-precision baseline checkpoint, by its manifest and by its config.json (a
    quantized checkpoint imported before the manifest said so): quantization starts from unquantized weights, and a
    checkpoint another tool quantized is gated, not quantized again. what: the argument or key that named it."""
    from qgate.quantize.schemes import stored_description

    stored = stored_description(base.path) if base.kind == "checkpoint" else ""
    if base.kind == "checkpoint" and base.meta.get("scheme") == "baseline" and not stored:
        return
    got = f"quantized already ({stored})" if stored else f"a {base.kind} of scheme {base.meta.get('scheme')}"
    raise InputError(
        f"{base.path}: {what} must be a full-precision baseline checkpoint; this one is {got}",
        hint="quantize from the unquantized model (`qgate model import` it); a checkpoint quantized elsewhere is "
        "gated as it is: `qgate gate --candidate`",
    )


def load_calibration(calib: Artifact, tokenizer, opts: CalibOptions):
    from datasets import Dataset

    check_calibration_split(calib)
    rows = split_rows(calib)
    if opts.max_samples:
        rows = rows[: opts.max_samples]
    if not rows:
        raise InputError(f"{calib.path}: calibration set is empty")
    ids = [encode_messages(tokenizer, r["messages"], opts.max_seq_length, r.get("tools")) for r in rows]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})


def linear_size(ckpt_dir: Path, unquantized: tuple[str, ...] = ()) -> dict:
    """Bytes and effective bits per weight of the quantized Linear layers, plus the `unquantized` layers named
    (stored in full precision), read from the saved safetensors. A quantized Linear is one with a `weight_scale`, in
    any compressed-tensors format: pack-quantized (`weight_packed` codes, `weight_shape`), int-quantized or
    float-quantized (FP8: the `weight` tensor itself holds the codes). Its bytes are its codes, scales, zero points
    and group index; an FP8 per-channel Linear comes to 8 bits plus its scale's (32 or 16) per input width."""
    from safetensors import safe_open

    from qgate.trust import dtype_bytes, packed_shape

    parts = ("weight", "weight_packed", "weight_scale", "weight_global_scale", "weight_zero_point", "weight_g_idx")
    nbytes, params = 0, 0
    for f in sorted(Path(ckpt_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            keys = set(st.keys())
            for k in keys:
                prefix, _, leaf = k.rpartition(".")
                if leaf == "weight_scale":
                    if f"{prefix}.weight_packed" in keys:
                        params += math.prod(packed_shape(st, keys, prefix))
                    elif f"{prefix}.weight" in keys:
                        params += math.prod(st.get_slice(f"{prefix}.weight").get_shape())
                    else:
                        continue
                    for part in parts:
                        if f"{prefix}.{part}" in keys:
                            t = st.get_slice(f"{prefix}.{part}")
                            nbytes += math.prod(t.get_shape()) * dtype_bytes(t.get_dtype())
                elif leaf == "weight" and prefix in unquantized:
                    t = st.get_slice(k)
                    params += math.prod(t.get_shape())
                    nbytes += math.prod(t.get_shape()) * dtype_bytes(t.get_dtype())
    return {
        "linear_bytes": nbytes,
        "linear_params": params,
        "bits_per_weight": round(8 * nbytes / params, 4) if params else None,
    }


HELD_OUT = ("shadow", "search")  # the splits gates and searches score candidates on


def check_calibration_split(calib: Artifact | None) -> None:
    """Calibration data must be a calibration set's calib split: a held-out split fitted to would be scored later by
    a gate or a search as if the candidate had never seen it."""
    if calib is None:
        return
    if calib.kind != "calibration-set":
        raise InputError(f"{calib.path}: --calib must be a calibration-set artifact, found a {calib.kind}")
    if (split := calib.meta.get("split")) in HELD_OUT:
        raise InputError(
            f"{calib.path}: this is the {split} split, held out to score candidates on; a candidate calibrated on it "
            "would be gated on prompts it was fitted to",
            hint=f"pass the calib split that `qgate calibrate sample` wrote beside it ({calib.path.parent / 'calib'})",
        )


def quantize(
    base: Artifact,
    calib: Artifact | None,
    scheme,
    out: Path,
    kv: KVCacheConfig | None = None,
    opts: CalibOptions = CalibOptions(),
    fallback: FallbackConfig | None = None,
    smoothed: Artifact | None = None,
) -> Artifact:
    """fallback: layers kept at higher precision (chosen by `qgate search`); recorded in the manifest.
    smoothed: AWQ only, this baseline with AWQ's smoothing already folded in (quantize/smoothing.py): only the
    round-to-nearest step runs, on those weights, with no calibration data (seconds instead of AWQ's minutes)."""
    import torch
    from llmcompressor import oneshot

    check_unquantized(base, "--model")
    from qgate.quantize.schemes import BUILT, smooths

    if smoothed is not None and (not smooths(scheme, kv) or smoothed.meta.get("base_model") != base.sha256):
        raise InputError(
            f"{smoothed.path}: smoothed weights quantize only AWQ schemes without a KV-cache scheme, from the "
            "baseline they were smoothed from",
            hint="drop `smoothed` to run AWQ in full",
        )
    needs_data = (scheme.needs_calibration or kv is not None) and smoothed is None
    check_calibration_split(calib)
    if needs_data and calib is None:
        why = "this scheme calibrates on real prompts" if scheme.needs_calibration else "a KV-cache scheme calibrates"
        raise InputError(
            f"{why}, and no calibration set was given",
            hint="pass --calib with the calib split that `qgate calibrate sample` writes",
        )
    out = Path(out)
    from qgate.trust import check_loadable, copy_tokenizer_files, load_tokenizer

    source = smoothed or base
    check_loadable(source.path)
    tok = load_tokenizer(base.path)
    model = load_host_model(source.path, load_dtype(base.path))
    scheme.check_model(model)  # fail before spending minutes on calibration
    if smoothed is not None:
        recipe = scheme.rtn_modifiers(None, fallback)
    else:
        recipe = scheme.modifiers(kv, fallback) if fallback else scheme.modifiers(kv)
    if fallback:
        names = {n for n, _ in model.named_modules()}
        unknown = [x for x in fallback.names() if x not in names]
        if unknown:
            raise ConfigError(
                f"fallback layers not in the model: {unknown[:3]}",
                hint="names are module paths, e.g. model.layers.0.mlp.down_proj",
            )
    kwargs = {}
    if needs_data:
        ds = load_calibration(calib, tok, opts)
        kwargs = {"dataset": ds, "max_seq_length": opts.max_seq_length, "num_calibration_samples": len(ds)}
    t0 = time.perf_counter()
    torch.manual_seed(opts.seed)
    with cpu_safe_intermediates():
        oneshot(model=model, recipe=recipe, **kwargs)
    seconds = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, save_compressed=True)
    if (stored := stored_dtype(base.path)) != load_dtype(base.path):
        store_in(out, stored)
    copy_tokenizer_files(base.path, out)  # the baseline's own files, byte for byte: only the weights may change
    config = {"scheme": typed_config(scheme), "kv_cache": typed_config(kv) if kv else None, "calib": typed_config(opts)}
    if fallback:
        config["fallback"] = typed_config(fallback)
    size = linear_size(out, fallback.layers if fallback and fallback.bits == 16 else ())
    meta = {
        "scheme": scheme.name,
        "weight_format": weight_format(scheme, fallback),
        "kv_cache_dtype": kv.dtype if kv else None,
        "fallback_layers": list(fallback.layers) if fallback else [],
        "fallback_bits": fallback.bits if fallback else None,
        "fine_group_layers": list(fallback.fine) if fallback else [],
        "fine_group_size": fallback.fine_group_size if fallback and fallback.fine else None,
        "bits_per_weight": size["bits_per_weight"],
        "linear_bytes": size["linear_bytes"],
        "linear_params": size["linear_params"],
        "lm_head": "w8a16" if fallback and fallback.head else None,
        "calibration_samples": kwargs.get("num_calibration_samples", 0),
        "quantize_seconds": round(seconds, 1),
        "weights_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
        "base_model": base.sha256,
        "calibration_sha256": calib.sha256 if calib else None,
        "calibration_prompts": split_prompts(calib) if calib and needs_data else [],
    }
    parents = (base.sha256,) + ((calib.sha256,) if calib and needs_data else ())
    if smoothed is not None:  # the calibration data reached these weights through the smoothing
        meta |= {
            "smoothed_weights": smoothed.sha256,
            "calibration_sha256": smoothed.meta.get("calibration_sha256"),
            "built": BUILT,
        }
        del meta["calibration_prompts"]
        if "calibration_prompts" in smoothed.meta:
            meta["calibration_prompts"] = smoothed.meta["calibration_prompts"]
        elif calib is not None and calib.sha256 == smoothed.meta.get("calibration_sha256"):
            meta["calibration_prompts"] = split_prompts(calib)  # smoothed before the record, on this split
        config["smoothed"] = smoothed.sha256
        parents += (smoothed.sha256,)
    return Artifact.create("checkpoint", out, config, parents, meta)
