"""Whether a built onnxruntime-genai engine rotates positions as its checkpoint does.

    why, evidence = rope_mismatch(out / "onnx" / "model.onnx", config)   # why: None where they agree

The builder computes its rotary tables itself, per architecture, and can leave out a RoPE type its class for that
architecture does not implement: onnxruntime-genai 0.18's Llama builder applies llama3 scaling and nothing else, so a
Llama checkpoint with linear or YaRN scaling is built with plain RoPE, and no error says so. The tables it wrote
(initializers `cos_cache` and `sin_cache`, [positions, rotary dim / 2]) are compared, over their first CHECKED
positions, with what the checkpoint's own Transformers rotary module (`model.rotary_emb`) gives when asked for every
position the engine holds: a RoPE whose frequencies depend on the length (dynamic) then differs as well.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHECKED = 4096  # positions compared: float32 phases agree to ~1e-3 there; a scaling left out differs by ~0.1 at once
TOLERANCE = 1e-2  # largest |cos| or |sin| difference taken as the same table


def served_tables(model_path: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """The engine's cos and sin caches, float64 [positions, rotary dim / 2], or None where it holds no such pair."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_path), load_external_data=False)
    found = {i.name: i for i in model.graph.initializer if i.name in ("cos_cache", "sin_cache")}
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


def rope_mismatch(model_path: Path, config: dict) -> tuple[str | None, dict]:
    """(why the engine's rotary tables are not the checkpoint's, or None; what was compared, for the artifact's
    metadata: `rope_tables` "same", "differ" or why it was not checked, and the largest difference)."""
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
    from qgate.engines.static_llama import model_config

    at = int(np.unravel_index(np.argmax(np.maximum(*diffs)), diffs[0].shape)[0])
    rope = (getattr(model_config(config), "rope_parameters", None) or {}).get("rope_type", "default")
    return (
        f"onnxruntime-genai's builder wrote rotary tables that are not the checkpoint's RoPE (rope_type {rope!r}): "
        f"cos or sin differ by up to {worst:.3g} (at position {at}), so the engine would encode positions differently "
        "from the checkpoint",
        evidence,
    )
