"""Whether a built onnxruntime-genai engine computes positions and attention spans as its checkpoint does.

    problems, evidence = built_engine_problems(out / "onnx" / "model.onnx", config)   # [] where they agree

The builder sets RoPE and attention windows itself, per architecture, and can leave out what its class for that
architecture does not implement, with no error: onnxruntime-genai 0.18's Llama builder applies llama3 RoPE scaling
and no other (linear and YaRN are built as plain RoPE), and a checkpoint with a sliding window but no per-layer
`layer_types` (Mistral's) is built with every layer attending to its whole context unless its config is given them
(builder_layer_types). Two checks read what was built:
  rotary tables  the `cos_cache` and `sin_cache` initializers ([positions, rotary dim / 2]) against what the
                 checkpoint's own Transformers rotary module (`model.rotary_emb`) gives when asked for every position
                 the engine holds (so a RoPE whose frequencies depend on the length, dynamic, differs too), over the
                 first CHECKED positions;
  windows        each layer's attention node's `local_window_size` (-1: none) against the window Transformers applies
                 to that layer (config.json `sliding_window`, on the layers `layer_types` marks sliding, or on every
                 layer where it has none), where that window is shorter than the context and so binds.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

CHECKED = 4096  # positions compared: float32 phases agree to ~1e-3 there; a scaling left out differs by ~0.1 at once
TOLERANCE = 1e-2  # largest |cos| or |sin| difference taken as the same table
ATTENTION_OPS = ("GroupQueryAttention", "PagedAttention")  # the builder's attention nodes, one per layer


def _graph(model_path: Path):
    import onnx

    return onnx.load(str(model_path), load_external_data=False).graph


def served_tables(model_path: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """The engine's cos and sin caches, float64 [positions, rotary dim / 2], or None where it holds no such pair."""
    from onnx import numpy_helper

    found = {i.name: i for i in _graph(model_path).initializer if i.name in ("cos_cache", "sin_cache")}
    if len(found) != 2:
        return None
    base = str(Path(model_path).parent)
    cos, sin = (numpy_helper.to_array(found[n], base).astype(np.float64) for n in ("cos_cache", "sin_cache"))
    return cos, sin


def checkpoint_tables(config: dict, positions: int) -> tuple[np.ndarray, np.ndarray] | None:
    """cos and sin of the checkpoint's own rotary module for positions 0..positions-1, float64 [positions, rotary
    dim], or None where its architecture has no single `model.rotary_emb`."""
    import torch
    from transformers import AutoModelForCausalLM

    from qgate.engines.static_llama import model_config

    c = model_config(config)
    with torch.device("meta"):  # the module tree only: no weights are allocated
        rotary = getattr(getattr(AutoModelForCausalLM.from_config(c), "model", None), "rotary_emb", None)
    if rotary is None:
        return None
    module = type(rotary)(config=c)  # on the CPU, its frequencies computed as the checkpoint's model computes them
    with torch.no_grad():
        cos, sin = module(torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None])
    return cos[0].double().numpy(), sin[0].double().numpy()


def rope_problem(model_path: Path, config: dict) -> tuple[str | None, dict]:
    """(why the engine's rotary tables are not the checkpoint's, or None; `rope_tables` "same", "differ" or why it
    was not checked, and the largest difference)."""
    from qgate.engines.static_llama import model_config

    served = served_tables(model_path)
    if served is None:
        return None, {"rope_tables": "not checked: the engine holds no cos_cache/sin_cache pair"}
    want = checkpoint_tables(config, served[0].shape[0])
    if want is None:
        return None, {"rope_tables": "not checked: the checkpoint's architecture has no model.rotary_emb"}
    n, half = min(CHECKED, served[0].shape[0]), served[0].shape[1]
    diffs = [np.abs(s[:n] - w[:n, :half]) for s, w in zip(served, want, strict=True)]
    worst = max(float(d.max()) for d in diffs)
    evidence = {"rope_tables": "same" if worst <= TOLERANCE else "differ", "rope_max_diff": round(worst, 6)}
    if worst <= TOLERANCE:
        return None, evidence
    at = int(np.unravel_index(np.argmax(np.maximum(*diffs)), diffs[0].shape)[0])
    rope = (getattr(model_config(config), "rope_parameters", None) or {}).get("rope_type", "default")
    return (
        f"its rotary tables are not the checkpoint's RoPE (rope_type {rope!r}): cos or sin differ by up to "
        f"{worst:.3g} (at position {at}), so the engine would encode positions differently from the checkpoint",
        evidence,
    )


def _slides(config: dict) -> tuple[list[bool], int | None, int]:
    """(per layer, whether Transformers applies the sliding window to it; the window; the context length)."""
    from qgate.engines.static_llama import model_config

    c = model_config(config)
    window, types = getattr(c, "sliding_window", None), getattr(c, "layer_types", None)
    n = c.num_hidden_layers
    slides = [t == "sliding_attention" for t in types[:n]] if types else [window is not None] * n
    return slides, window, c.max_position_embeddings


def checkpoint_windows(config: dict) -> tuple[list[int | None], int]:
    """(per layer, the sliding window Transformers applies to it where that window binds (shorter than the context),
    else None; the context length)."""
    slides, window, context = _slides(config)
    binds = window is not None and window < context
    return [window if s and binds else None for s in slides], context


def builder_layer_types(config: dict) -> list[str] | None:
    """`layer_types` for the builder's copy of config.json where the checkpoint's sliding window applies to every
    layer without saying so per layer (Mistral's): the builder reads windows from `layer_types` alone. None where
    the config needs none (no window, or its own `layer_types`)."""
    if config.get("layer_types") or config.get("sliding_window") is None:
        return None
    slides, _, _ = _slides(config)
    return ["sliding_attention" if s else "full_attention" for s in slides]


def served_windows(model_path: Path) -> dict[int, int | None]:
    """Per layer index, the window its attention node applies (None: the whole context)."""
    import onnx

    out = {}
    for node in _graph(model_path).node:
        layer = re.search(r"layers\.(\d+)/", node.name)
        if node.op_type in ATTENTION_OPS and layer:
            size = next(
                (onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "local_window_size"), -1
            )
            out[int(layer.group(1))] = size if size > 0 else None
    return out


def window_problem(model_path: Path, config: dict) -> tuple[str | None, dict]:
    """(why the engine's attention windows are not the checkpoint's, or None; `attention_windows` "same" or why it
    was not checked)."""
    (want, context), got = checkpoint_windows(config), served_windows(model_path)
    if sorted(got) != list(range(len(want))):
        return None, {"attention_windows": f"not checked: {len(got)} attention nodes for {len(want)} layers"}
    got = {i: w if w is not None and w < context else None for i, w in got.items()}  # a window that binds nothing
    wrong = [i for i, w in enumerate(want) if got[i] != w]
    if not wrong:
        return None, {"attention_windows": "same"}
    i = wrong[0]
    span = lambda w: f"a window of {w} tokens" if w else "the whole context"  # noqa: E731
    return (
        f"{len(wrong)} of {len(want)} layers attend differently from the checkpoint's: layer {i} attends over "
        f"{span(got[i])}, where the checkpoint's attends over {span(want[i])} (config.json sliding_window "
        f"{config.get('sliding_window')})",
        {"attention_windows": f"differ in {len(wrong)} layers"},
    )


def built_engine_problems(model_path: Path, config: dict) -> tuple[list[str], dict]:
    """Every way the built engine's positions or attention spans are not the checkpoint's (config: its config.json),
    and what was compared, for the artifact's metadata."""
    problems, evidence = [], {}
    for check in (rope_problem, window_problem):
        why, ev = check(model_path, config)
        evidence |= ev
        problems += [why] if why else []
    return problems, evidence
