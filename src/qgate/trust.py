"""What qgate loads from a model directory: safetensors weights, JSON and tokenizer files; never code, never pickles.

    check_loadable(Path("candidate/"))                         # InputError naming the file, before anything is loaded
    model = load_causal_lm(path, dtype=torch.float32)          # InputError if weights are missing

A candidate checkpoint arrives from whoever ran quantization, a registry or a bucket. Three ways such a directory
can run code or read outside itself, each refused here with the file that did it:
- pickled weights (`*.bin`, `*.pt`, `*.pth`, `*.pkl`, `*.ckpt`): unpickling runs code. Only `qgate model import
  --allow-pickle` reads them, with torch's `weights_only=True` loader, and writes safetensors;
- `auto_map` in `config.json` or `tokenizer_config.json`: Transformers would import Python shipped with the model.
  qgate always passes trust_remote_code off;
- a symlink that leaves the directory.
It also refuses, by its config.json, weights quantized in a format qgate does not read: qgate scores unquantized
checkpoints and compressed-tensors ones (READ_QUANT_METHODS), where Transformers would need another library (AutoGPTQ,
AutoAWQ, bitsandbytes) and fail part way into a gate.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from qgate.errors import InputError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
LOAD_KWARGS = {"trust_remote_code": False, "use_safetensors": True}
TOKENIZER_KWARGS = {"trust_remote_code": False}
_REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json", "processor_config.json")
# What a serving stack reads to turn text into ids and back, in any of the layouts Transformers saves or reads.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy `src`'s tokenizer files (TOKENIZER_FILES) into `dst` unchanged; returns their names. Saving a loaded
    tokenizer instead rewrites them (Transformers adds its loading arguments to tokenizer_config.json)."""
    import shutil

    names = [n for n in TOKENIZER_FILES if (Path(src) / n).is_file()]
    for n in names:
        shutil.copyfile(Path(src) / n, Path(dst) / n)
    return names


def load_tokenizer(path: Path):
    """AutoTokenizer.from_pretrained(path, **TOKENIZER_KWARGS), or an InputError naming the directory: a checkpoint
    has to carry the tokenizer it is served with (Transformers' own error, from deep inside, reads as a crash)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, **TOKENIZER_KWARGS)
    except (OSError, ValueError, TypeError, KeyError) as e:  # missing files, or files no tokenizer class can read
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(
            f"{path}: its tokenizer cannot be loaded ({first})",
            hint="a checkpoint carries the tokenizer it is served with: copy tokenizer.json, "
            "tokenizer_config.json and the chat template from the model it was made from",
        ) from e


def check_quant_method(path: Path) -> None:
    """InputError naming config.json's quant_method where its weights are quantized in a format other than
    READ_QUANT_METHODS: Transformers would load them only through another library, and not on every device."""
    f = Path(path) / "config.json"
    data = json.loads(f.read_text()) if f.is_file() else {}
    qc = data.get("quantization_config") if isinstance(data, dict) else None
    if qc is None:
        return
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in READ_QUANT_METHODS:
        raise InputError(
            f"{f}: quantization_config.quant_method is {method!r}; qgate reads unquantized checkpoints and "
            f"{', '.join(READ_QUANT_METHODS)} ones (what llm-compressor and `qgate quantize` write)",
            hint="gate a candidate quantized with `qgate quantize` or llm-compressor; import a baseline unquantized",
        )


def load_causal_lm(path: Path, **kwargs):
    """AutoModelForCausalLM.from_pretrained(path, **LOAD_KWARGS, **kwargs), refusing a checkpoint that lacks weights
    its architecture needs: Transformers initializes missing ones at random with only a warning, and a model that is
    partly random would be quantized, gated and served as if it were the checkpoint."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **LOAD_KWARGS, **kwargs)
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise InputError(
            f"{path}: the checkpoint lacks {len(missing)} weight(s) its config.json asks for "
            f"({', '.join(missing[:3])}{more}), which Transformers would initialize at random",
            hint="the checkpoint is incomplete or its tensor names do not match its architecture: export it "
            "again, and check that its safetensors index lists every shard",
        )
    return model


# compressed-tensors' quantization parameters beside a weight: decompression folds them into the dense weight
QUANTIZATION_LEAVES = frozenset(
    {
        "weight_scale",
        "weight_global_scale",
        "weight_zero_point",
        "weight_g_idx",
        "weight_shape",
        "input_scale",
        "input_global_scale",
        "input_zero_point",
        "output_scale",
        "k_scale",
        "v_scale",
    }
)


def packed_shape(st, keys: set[str], prefix: str) -> tuple[int, ...]:
    """The dense shape of the packed weight at `prefix` in an open safetensors file: its `weight_shape` where the
    format stores one (pack-quantized), else the codes' own shape with two 4-bit codes to a byte (NVFP4 and MXFP4's
    `weight_packed` [O, I/2] uint8)."""
    if f"{prefix}.weight_shape" in keys:
        return tuple(int(d) for d in st.get_tensor(f"{prefix}.weight_shape").tolist())
    packed = st.get_slice(f"{prefix}.weight_packed")
    *rows, cols = packed.get_shape()
    return (*rows, cols * 8 * dtype_bytes(packed.get_dtype()) // 4)


SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a safetensors dtype name ("BF16", "I32", ...)."""
    try:
        return SAFETENSORS_DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown safetensors dtype {dtype!r}: known are {sorted(SAFETENSORS_DTYPE_BYTES)}") from None


def dense_params(path: Path) -> int:
    """Parameters of the model in `path` as it is loaded dense (a compressed-tensors checkpoint decompressed), from
    its safetensors headers: a packed weight counts the dense shape it stands for (packed_shape), and quantization
    parameters count nothing."""
    from safetensors import safe_open

    n = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            keys = set(st.keys())
            for k in keys:
                prefix, _, leaf = k.rpartition(".")
                if leaf == "weight_packed":
                    n += math.prod(packed_shape(st, keys, prefix))
                elif leaf not in QUANTIZATION_LEAVES:
                    n += math.prod(st.get_slice(k).get_shape())
    return n


def pickled_files(path: Path) -> list[Path]:
    return sorted(p for p in Path(path).rglob("*") if p.is_file() and p.name.endswith(PICKLE_SUFFIXES))


MAX_FILE_BYTES = {"tokenizer.json": 256 << 20, "tokenizer.model": 256 << 20}  # the biggest real ones: ~35 MB
MAX_METADATA_BYTES = 32 << 20  # any other tokenizer or config file: real ones are kilobytes to a few megabytes
READ_QUANT_METHODS = ("compressed-tensors",)  # config.json's quantization_config.quant_method values qgate reads


def check_loadable(path: Path, *, allow_pickle: bool = False) -> None:
    """InputError if loading `path` as a model or tokenizer could run code or read outside it, if a tokenizer or
    config file is larger than any real one (a tokenizer library parses it whole into memory), or if its weights are
    quantized in a format qgate does not read (check_quant_method)."""
    path = Path(path)
    root = path.resolve()
    for name in (*TOKENIZER_FILES, *_REMOTE_CODE_FILES, "generation_config.json"):
        f = path / name
        limit = MAX_FILE_BYTES.get(name, MAX_METADATA_BYTES)
        if f.is_file() and f.stat().st_size > limit:
            raise InputError(
                f"{f}: {f.stat().st_size:,} bytes, over the {limit >> 20} MiB qgate reads for a {name}",
                hint="real tokenizers and configs are far smaller: this file is broken or hostile; export it again",
            )
    for p in sorted(path.rglob("*")):
        if p.is_symlink() and not p.resolve().is_relative_to(root):
            raise InputError(
                f"{p}: symlink leaves the model directory (-> {p.resolve()})",
                hint="copy the file into the directory; qgate does not follow links out of an artifact",
            )
    for name in _REMOTE_CODE_FILES:
        f = path / name
        if not f.is_file():
            continue
        try:
            auto_map = json.loads(f.read_text()).get("auto_map")
        except (ValueError, AttributeError) as e:
            raise InputError(f"{f}: not a JSON object ({e})") from e
        if auto_map:
            raise InputError(
                f"{f}: 'auto_map' asks to run Python code shipped with the model ({json.dumps(auto_map)[:120]})",
                hint="qgate never sets trust_remote_code; use an architecture that Transformers ships",
            )
    check_quant_method(path)
    pickles = pickled_files(path)
    has_safetensors = any(path.rglob("*.safetensors"))
    if pickles and not allow_pickle and not has_safetensors:
        raise InputError(
            f"{path}: weights are pickle files ({', '.join(p.name for p in pickles[:4])}); unpickling can run code",
            hint="convert them to safetensors, or import once with `qgate model import --hf DIR --allow-pickle`, "
            "which reads them with torch's weights_only loader and writes safetensors",
        )
