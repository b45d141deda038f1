"""Whether a built onnxruntime-genai engine computes positions and attention spans as its checkpoint does.

    written = write_checkpoint_tables(out / "onnx" / "model.onnx", config)   # None where the tables agreed
    problems, evidence = built_engine_problems(out / "onnx" / "model.onnx", config)   # [] where they agree

The builder sets RoPE and attention windows itself, per architecture, and can leave out what its class for that
architecture does not implement, with no error: onnxruntime-genai 0.18's Llama builder applies llama3 RoPE scaling
and no other (linear and YaRN are built as plain RoPE; write_checkpoint_tables writes the checkpoint's tables over
them where one table serves every length), and a checkpoint with a sliding window but no per-layer
`layer_types` (Mistral's) is built with every layer attending to its whole context unless its config is given them
(builder_layer_types). Two checks read what was built, against the checkpoint's config as Transformers loads it:
  rotary tables  the `cos_cache` and `sin_cache` initializers ([positions, rotary dim / 2]) against what the
                 checkpoint's own Transformers rotary module (`model.rotary_emb`) gives when asked for every position
                 the engine holds (so a RoPE whose frequencies depend on the length, dynamic, differs too), over the
                 first CHECKED positions;
  windows        each layer's attention node's `local_window_size` (-1: none) against the window Transformers applies
                 to that layer where it binds (static_llama.layer_windows, which the torch-int4 engine's check reads
                 too); a window as long as the context binds nothing on either side.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

CHECKED = 4096  # positions compared: float32 phases agree to ~1e-3 there; a scaling left out differs by ~0.1 at once
TOLERANCE = 1e-2  # largest |cos| or |sin| difference taken as the same table
ATTENTION_OPS = ("GroupQueryAttention", "PagedAttention")  # the builder's attention nodes, one per layer


def served_tables(graph, base: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """The engine's cos and sin caches (`graph`: its ONNX graph; `base`: the folder of its external data), float64
    [positions, rotary dim / 2], or None where it holds no such pair."""
    from onnx import numpy_helper

    found = {i.name: i for i in graph.initializer if i.name in ("cos_cache", "sin_cache")}
    if len(found) != 2:
        return None
    cos, sin = (numpy_helper.to_array(found[n], str(base)).astype(np.float64) for n in ("cos_cache", "sin_cache"))
    return cos, sin


def checkpoint_tables(c, positions: int) -> tuple[np.ndarray, np.ndarray] | None:
    """cos and sin of the checkpoint's own rotary module (`c`: its loaded config, static_llama.model_config) for
    positions 0..positions-1, float64 [positions, rotary dim], or None where its architecture has no single
    `model.rotary_emb`."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # the module tree only: no weights are allocated
        rotary = getattr(getattr(AutoModelForCausalLM.from_config(c), "model", None), "rotary_emb", None)
    if rotary is None:
        return None
    module = type(rotary)(config=c)  # on the CPU, its frequencies computed as the checkpoint's model computes them
    with torch.no_grad():
        cos, sin = module(torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None])
    return cos[0].double().numpy(), sin[0].double().numpy()


def rope_problem(graph, base: Path, c) -> tuple[str | None, dict]:
    """(why the engine's rotary tables are not the checkpoint's, or None; `rope_tables` "same", "differ" or why it
    was not checked, and the largest difference)."""
    from qgate.engines.static_llama import rope_type

    served = served_tables(graph, base)
    if served is None:
        return None, {"rope_tables": "not checked: the engine holds no cos_cache/sin_cache pair"}
    want = checkpoint_tables(c, served[0].shape[0])
    if want is None:
        return None, {"rope_tables": "not checked: the checkpoint's architecture has no model.rotary_emb"}
    n, half = min(CHECKED, served[0].shape[0]), served[0].shape[1]
    diffs = [np.abs(s[:n] - w[:n, :half]) for s, w in zip(served, want, strict=True)]
    worst = max(float(d.max()) for d in diffs)
    evidence = {"rope_tables": "same" if worst <= TOLERANCE else "differ", "rope_max_diff": round(worst, 6)}
    if worst <= TOLERANCE:
        return None, evidence
    at = int(np.unravel_index(np.argmax(np.maximum(*diffs)), diffs[0].shape)[0])
    return (
        f"its rotary tables are not the checkpoint's RoPE (rope_type {rope_type(c)!r}): cos or sin differ by up to "
        f"{worst:.3g} (at position {at}), so the engine would encode positions differently from the checkpoint",
        evidence,
    )


SWITCHED_ROPE = ("longrope",)  # two tables switched on the length, inside the graph: not readable as one table


def write_checkpoint_tables(model_path: Path, config: dict) -> dict | None:
    """Where the engine's rotary tables are not the checkpoint's and its RoPE is one of static_llama.STATIC_ROPE
    (one table serves every length, attention scaling included: YaRN's factor multiplies cos and sin), overwrite
    `cos_cache` and `sin_cache` in place with the checkpoint's own rotary module's values, in the engine's dtype and
    shape, and return what was done, for the artifact's metadata (config: the checkpoint's config.json). None where
    nothing was written: the tables agree, the engine holds none, or the RoPE depends on the length (dynamic), which
    rope_problem then reports where the tables differ."""
    import onnx
    from onnx import TensorProto, numpy_helper

    from qgate.engines.static_llama import STATIC_ROPE, model_config, rope_type

    c = model_config(config)  # config.json as Transformers loads it
    rope = rope_type(c)
    model = onnx.load(str(model_path), load_external_data=False)
    base = Path(model_path).parent
    served = served_tables(model.graph, base)
    if rope not in STATIC_ROPE or served is None:
        return None
    want = checkpoint_tables(c, served[0].shape[0])
    if want is None:
        return None
    half = served[0].shape[1]
    before = max(float(np.abs(s - w[:, :half]).max()) for s, w in zip(served, want, strict=True))
    if before <= TOLERANCE:
        return None
    inline = False
    for tensor in model.graph.initializer:
        if tensor.name not in ("cos_cache", "sin_cache"):
            continue
        table = want[0 if tensor.name == "cos_cache" else 1][:, :half]
        stored = numpy_helper.to_array(tensor, str(base)).dtype.newbyteorder("<")  # ONNX stores little-endian
        data = np.ascontiguousarray(table.astype(stored)).tobytes()
        if tensor.data_location == TensorProto.EXTERNAL:
            where = {e.key: e.value for e in tensor.external_data}
            if int(where.get("length", len(data))) != len(data):
                raise ValueError(f"{tensor.name}: {where.get('length')} bytes stored, {len(data)} computed")
            with open(base / where["location"], "r+b") as f:
                f.seek(int(where.get("offset", 0)))
                f.write(data)
        else:
            tensor.ClearField("float_data")
            tensor.raw_data, inline = data, True
    if inline:
        onnx.save(model, str(model_path))
    return {"rope_tables_written": f"the checkpoint's {rope} RoPE (the builder's differed by up to {before:.3g})"}


def builder_layer_types(config: dict) -> list[str] | None:
    """`layer_types` for the builder's copy of config.json where the checkpoint's sliding window applies to every
    layer without saying so per layer (Mistral's): the builder reads windows from `layer_types` alone. None where
    the config needs none (no window, or its own `layer_types`)."""
    from qgate.engines.static_llama import model_config

    if config.get("layer_types") or config.get("sliding_window") is None:
        return None
    c = model_config(config)  # Transformers may derive them (Qwen2's, from use_sliding_window and max_window_layers)
    types, n = getattr(c, "layer_types", None), c.num_hidden_layers
    if not types:
        return ["sliding_attention"] * n
    return ["sliding_attention" if t == "sliding_attention" else "full_attention" for t in types[:n]]


def served_windows(graph) -> dict[int, int | None]:
    """Per layer index, the window its attention node applies (None: the whole context)."""
    import onnx

    out = {}
    for node in graph.node:
        layer = re.search(r"layers\.(\d+)/", node.name)
        if node.op_type in ATTENTION_OPS and layer:
            size = next(
                (onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "local_window_size"), -1
            )
            out[int(layer.group(1))] = size if size > 0 else None
    return out


def window_problem(graph, c) -> tuple[str | None, dict]:
    """(why the engine's attention windows are not the checkpoint's (static_llama.layer_windows), or None;
    `attention_windows` "same" or why it was not checked)."""
    from qgate.engines.static_llama import layer_windows

    want, got, context = layer_windows(c), served_windows(graph), c.max_position_embeddings
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
        f"{span(got[i])}, where the checkpoint's attends over {span(want[i])} (sliding_window "
        f"{getattr(c, 'sliding_window', None)})",
        {"attention_windows": f"differ in {len(wrong)} layers"},
    )


def built_engine_problems(model_path: Path, config: dict) -> tuple[list[str], dict]:
    """Every way the built engine's positions or attention spans are not the checkpoint's (config: its config.json),
    and what was compared, for the artifact's metadata. The ONNX graph (without its external data) and the loaded
    config are read once, for both checks."""
    import onnx

    from qgate.engines.static_llama import model_config

    graph, c = onnx.load(str(model_path), load_external_data=False).graph, model_config(config)
    problems, evidence = [], {}
    for why, ev in (rope_problem(graph, Path(model_path).parent, c), window_problem(graph, c)):
        evidence |= ev
        problems += [why] if why else []
    return problems, evidence
