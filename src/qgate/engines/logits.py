"""What every runner returns and checks, shared by the reference path (engines/runners.py) and the engines' runners.

logits = as_logits(model_output)      # numpy on a CPU, the tensor itself on an accelerator
per_block = reduce_blocks(reduce, [logits_a, logits_b])   # a row-wise reduction: one pass on a GPU
for block in head_blocks(model.lm_head, hidden, vocab): ...  # a long sequence's logits, never all at once
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

BLOCK_LOGITS = 2**25  # logits per block of head_blocks: 128 MB in float32


def stop_tokens(eos_token_id) -> set[int]:
    """The token ids that end a greedy answer: a generation config's eos_token_id, one id, a list of them, or None."""
    if eos_token_id is None:
        return set()
    return set(eos_token_id) if isinstance(eos_token_id, list) else {eos_token_id}


def checkpoint_stops(d: Path) -> set[int]:
    """stop_tokens of the checkpoint in directory d as Transformers loads them: its generation_config.json's
    eos_token_id where that file exists, else its config.json's."""
    gen = d / "generation_config.json"
    return stop_tokens(json.loads((gen if gen.exists() else d / "config.json").read_text()).get("eos_token_id"))


def as_logits(t):
    """float32 logits as a runner returns them: a numpy array (sharing the tensor's memory) on the CPU, the tensor
    itself on an accelerator, where gates/scoring.py reduces it without copying it to the host."""
    t = t.float()
    return t.numpy() if t.device.type == "cpu" else t


def head_blocks(head, hidden, vocab: int):
    """as_logits(head(hidden)) for hidden states [T, H], as blocks [n, vocab] of consecutive rows, at most
    BLOCK_LOGITS logits each (at least one row), computed one by one as they are read."""
    import torch

    rows = max(1, BLOCK_LOGITS // vocab)
    for a in range(0, len(hidden), rows):
        with torch.inference_mode():
            block = as_logits(head(hidden[a : a + rows]))
        yield block  # outside inference mode: the reader's code runs in its own mode


def cat_rows(parts: list):
    """np.concatenate or torch.cat, for logits as as_logits returns them."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    import torch

    return torch.cat(parts)


def reduce_blocks(reduce, blocks: list, *rows: list, join: bool | None = None) -> list[tuple]:
    """reduce(x [n, V], *row arrays [n, ...]) -> a tuple of arrays [n, ...], for each block of logits [n_i, V] (numpy
    or torch) with its rows of each list in `rows`; one tuple per block. join (default: whether the blocks are on an
    accelerator): reduce them in one pass over them concatenated, so the host waits for the device once, not once
    per block. Host blocks go one by one: joining them would copy every logit. reduce must be row-wise."""
    if not blocks:
        return []
    if join is None:
        join = getattr(getattr(blocks[0], "device", None), "type", "cpu") != "cpu"  # numpy's .device is "cpu"
    if not join:
        return [reduce(b, *(r[j] for r in rows)) for j, b in enumerate(blocks)]
    parts = reduce(cat_rows(blocks), *(np.concatenate(r) for r in rows))
    out, a = [], 0
    for b in blocks:
        out.append(tuple(p[a : a + len(b)] for p in parts))
        a += len(b)
    return out


def check_vocab(path: Path, tokenizer, rows: int) -> None:
    """InputError unless the model has a row for every id its tokenizer can produce: an id past the last row crashes
    the forward pass here, and a server on every request that contains it."""
    from qgate.errors import InputError

    if len(tokenizer) > rows:
        raise InputError(
            f"{path}: the model has {rows} token ids but its tokenizer {len(tokenizer)}: ids {rows} and up "
            "cannot be embedded",
            hint="the checkpoint's embeddings (vocab_size) were cut or its tokenizer "
            "replaced: export both from one model",
        )
