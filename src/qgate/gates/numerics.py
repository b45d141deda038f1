"""The numerics a checkpoint is scored in on the reference path, and a model loaded once in them.

    runner = LazyRunner(baseline, device="auto", dtype="auto")
    ref_dir = runner.cache(cache_dir)   # cache_dir itself for float32 on the CPU, a subdirectory per numerics otherwise
    runner()                            # loads the model the first time, then returns the same runner
    runner.release()                    # frees it, and the device's cached memory with it

Anything computed from a model's scores is keyed by its numerics (`numerics_key`), so CPU and GPU references, or
float32 and bfloat16 ones, never stand in for each other.
"""

from __future__ import annotations

import json
from pathlib import Path

from qgate.artifact import Artifact

REFERENCE_OF_RECORD = "cpu-float32"  # the numerics whose cached work keeps the keys and paths it had before devices


def scoring_numerics(art: Artifact, device: str = "auto", dtype: str = "auto") -> str:
    """The numerics a checkpoint is scored in on the reference path ('cpu-float32', 'cpu-bfloat16', 'cuda-bfloat16'):
    part of the key of anything computed from its scores."""
    from qgate.device import compute_dtype, numerics, resolve_device

    dev = resolve_device(device)
    return numerics(dev, compute_dtype(json.loads((art.path / "config.json").read_text()), dev, dtype))


def numerics_key(art: Artifact, device: str = "auto", dtype: str = "auto") -> dict:
    """The part of a cache key that names the numerics scores were computed in: nothing for the reference of record,
    so keys made before other numerics existed stay valid."""
    tag = scoring_numerics(art, device, dtype)
    return {} if tag == REFERENCE_OF_RECORD else {"numerics": tag}


class LazyRunner:
    """Loads a model the first time it is needed, once, on a device; `release` frees it."""

    def __init__(self, art: Artifact, device: str = "auto", dtype: str = "auto"):
        self.art, self.device, self.dtype, self.runner, self._tag = art, device, dtype, None, None

    def __call__(self):
        from qgate.engines.runners import load_runner

        if self.runner is None:
            self.runner = load_runner(self.art, self.device, self.dtype)
        return self.runner

    def tag(self) -> str:
        if self._tag is None:
            self._tag = scoring_numerics(self.art, self.device, self.dtype)
        return self._tag

    def cache(self, cache_dir: Path) -> Path:
        """Where this model's cached reference work lives: `cache_dir` for float32 on the CPU (the reference of
        record), a subdirectory per device and dtype otherwise, so CPU and GPU references never mix."""
        return Path(cache_dir) if self.tag() == REFERENCE_OF_RECORD else Path(cache_dir) / self.tag()

    def release(self) -> None:
        from qgate.device import release

        if self.runner is not None:
            device = getattr(self.runner, "device", None)
            self.runner = None
            release(device)
