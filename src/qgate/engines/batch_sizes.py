"""The batch sizes a serving engine captures CUDA graphs for, from the traffic profile's observed concurrency.

    concurrency = profile_concurrency(profile_art)          # {"p50", "p90", "p99", "max", "method"}
    sizes, max_batch = graph_batch_sizes(concurrency, cap=256)

Every GPU backend (the TensorRT-LLM bundle, the torch-int4 engine) records the sizes this module gives.
"""

from __future__ import annotations

import json

from qgate.artifact import Artifact

DEFAULT_CONCURRENCY = {"method": "default (no traffic profile given)", "p50": 1, "p90": 4, "p99": 8, "max": 8}


def profile_concurrency(profile: Artifact | None) -> dict:
    """The traffic profile's in-flight request counts, or DEFAULT_CONCURRENCY without a profile."""
    if profile is None:
        return dict(DEFAULT_CONCURRENCY)
    return json.loads((profile.path / "profile.json").read_text())["concurrency"]


def graph_batch_sizes(concurrency: dict, cap: int) -> tuple[list[int], int]:
    """Powers of two up to the p99 in-flight count, plus the observed p50/p90/p99 themselves."""
    p99 = min(cap, max(1, int(concurrency.get("p99", 1))))
    sizes = {1, p99, min(cap, int(concurrency.get("p50", 1))), min(cap, int(concurrency.get("p90", 1)))}
    b = 1
    while b < p99:
        sizes.add(b)
        b *= 2
    max_batch = min(cap, max(p99, int(concurrency.get("max", p99))))
    return sorted(s for s in sizes if s >= 1), max_batch
