"""AWQ's smoothing once, as a float checkpoint; quantization points are then round-to-nearest on it, in seconds.

    smooth = smooth_awq(base_art, calib_art, AWQConfig(group_size=64), CalibOptions(), out=Path("cache/awq-smoothed"))
    ckpt = quantize(base_art, None, scheme, out, fallback=fb, smoothed=smooth)     # quantize/compress.py: RTN, no data

AWQ is two steps: a search for per-channel scales folded into the weights (the smoothing: a norm divided, the next
Linears multiplied, so the float model computes the same function), then group-wise round-to-nearest of the smoothed
weights with min-max scales. The first step needs calibration activations and is AWQ's whole cost; the second needs
no data. So a search over per-layer bit widths smooths once for the uniform scheme and builds each point by RTN on
those smoothed weights: the uniform point is AWQ's own checkpoint, byte for byte (tests/test_search.py). A point
whose fallback layers are W8 differs from AWQ run with that fallback only in the scales of the mappings those layers
balance: AWQ searches them for the bit width it will quantize to, W4 here. The search's report says how each point
was built, and benchmarks/bench_search.py measures the gap against quantizing each point for real.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from qgate.artifact import Artifact, typed_config

SMOOTHING_VERSION = 1


def smooth_awq(base: Artifact, calib: Artifact, scheme, opts, out: Path) -> Artifact:
    """The baseline with AWQ's smoothing for `scheme` (uniform, no fallback) folded into its float weights: a
    checkpoint that computes what the baseline computes, up to float rounding, and that RTN turns into AWQ's output."""
    import torch
    from llmcompressor import oneshot

    from qgate.calibrate.sample import split_prompts
    from qgate.quantize.compress import (
        check_unquantized,
        cpu_safe_intermediates,
        load_calibration,
        load_host_model,
    )
    from qgate.trust import check_loadable, copy_tokenizer_files, load_tokenizer

    check_unquantized(base, "smoothing's model")
    check_loadable(base.path)
    model = load_host_model(base.path)
    names = set(model.state_dict())
    scheme.check_model(model)
    ds = load_calibration(calib, load_tokenizer(base.path), opts)
    t0 = time.perf_counter()
    torch.manual_seed(opts.seed)
    with cpu_safe_intermediates():
        oneshot(
            model=model,
            recipe=scheme.modifiers(None),
            dataset=ds,
            max_seq_length=opts.max_seq_length,
            num_calibration_samples=len(ds),
        )
    seconds = time.perf_counter() - t0
    smoothed = {k: v for k, v in model.state_dict().items() if k in names}  # the quantization parameters left out
    del model
    clean = load_host_model(base.path)
    clean.load_state_dict(smoothed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    clean.save_pretrained(out)
    copy_tokenizer_files(base.path, out)
    config = {"smoothing": typed_config(scheme), "calib": typed_config(opts), "v": SMOOTHING_VERSION}
    meta = base.meta | {
        "scheme": "awq-smoothed",
        "smoothing_seconds": round(seconds, 1),
        "base_model": base.sha256,
        "calibration_sha256": calib.sha256,
        "calibration_prompts": split_prompts(calib),
    }
    return Artifact.create("checkpoint", out, config, (base.sha256, calib.sha256), meta)


def cached_smoothing(
    base: Artifact, calib: Artifact, scheme, opts, cache_dir: Path, echo: Callable[[str], None]
) -> Artifact:
    """AWQ's smoothing of the baseline for `scheme`, computed once per (baseline, calibration set, scheme, options) and
    kept in `cache_dir`: the uniform variant and every point of a search over it are built from it."""
    from qgate.artifact import MANIFEST, build_atomically, sha256_json

    key = sha256_json(
        {
            "base": base.sha256,
            "calib": calib.sha256,
            "scheme": typed_config(scheme),
            "opts": opts.__dict__,
            "v": SMOOTHING_VERSION,
        }
    )
    path = cache_dir / f"awq-smoothed-{key[:24]}"
    if (path / MANIFEST).exists():
        art = Artifact.load(path, "checkpoint")
        echo(f"    AWQ smoothing: cached ({art.meta['smoothing_seconds']}s when computed)")
        return art
    art = build_atomically(path, lambda tmp: smooth_awq(base, calib, scheme, opts, tmp))
    echo(
        f"    AWQ smoothing: computed once, {art.meta['smoothing_seconds']}s; this scheme's checkpoints are "
        "round-to-nearest on it"
    )
    return art
