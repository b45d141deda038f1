"""What every runner returns and checks, shared by the reference path (engines/runners.py) and the engines' runners.

logits = as_logits(model_output)      # numpy on a CPU, the tensor itself on an accelerator
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def as_logits(t):
    """float32 logits as a runner returns them: a numpy array (sharing the tensor's memory) on the CPU, the tensor
    itself on an accelerator, where gates/scoring.py reduces it without copying it to the host."""
    t = t.float()
    return t.numpy() if t.device.type == "cpu" else t


def cat_rows(parts: list):
    """np.concatenate or torch.cat, for logits as as_logits returns them."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    import torch

    return torch.cat(parts)


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
