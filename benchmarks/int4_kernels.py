"""The int4 kernels on the 8B shapes alone, without building a model: torch's kernel at each k-tiling and gemlite's.

    python benchmarks/int4_kernels.py --json /tmp/int4.json [--step-ms MS]     # on a CUDA host, ~1 min

The weights are random codes and scales of the 8B run's int4 shapes (benchmarks/gpu_scale.py: fused q/k/v, o_proj,
fused gate/up, down_proj; group 128), one Linear each as the torch-int4 engine holds it. Per shape: torch's kernel
at one row with inner_k_tiles 2/4/8, and gemlite's A16W4 kernels against torch's at 1 and 8 rows (gpu_scale._gemlite:
microseconds eagerly and captured in a CUDA graph, error against the dequantized product), each with its read rate.
--step-ms: a batch-1 decode step's captured time (scale.json's decode.batch1_step.graph_step_ms) to project with the
faster kernel per shape. Each shape's figures are written to --json as they come, so a time-limited run keeps them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gpu_scale  # beside this script

SHAPES = {
    "int4 6144x4096": (6144, 4096),
    "int4 4096x4096": (4096, 4096),
    "int4 28672x4096": (28672, 4096),
    "int4 4096x14336": (4096, 14336),
}
COUNT = 32  # Linears of each shape in the 8B model (one per layer)


def random_linear(out_features: int, in_features: int, group: int, device):
    """A torch-int4 engine Linear holding random int4 codes with small random scales and zeros, in bf16."""
    import torch

    from qgate.engines.int4_linear import Linear
    from qgate.engines.int4pack import Int4Weight

    g = torch.Generator().manual_seed(out_features * 7 + in_features)
    codes = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8, generator=g)
    sz = torch.stack(
        (
            torch.rand(in_features // group, out_features, generator=g) * 0.02 + 0.001,
            torch.randn(in_features // group, out_features, generator=g) * 0.01,
        ),
        -1,
    )
    return Linear(Int4Weight(codes, sz, group), None, torch.bfloat16, device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--step-ms", type=float, default=None)
    ap.add_argument("--group", type=int, default=128)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("int4_kernels: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    out: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "per_shape": {}}
    out["read_bandwidth_tb_s"] = gpu_scale.read_bandwidth(device, 4096, (14336, 49152)) / 1e12
    for name, (o, i) in SHAPES.items():
        m = random_linear(o, i, args.group, device)
        nbytes = m.packed.numel() * m.packed.element_size() + m.sz.numel() * m.sz.element_size()
        x = torch.randn(1, i, dtype=torch.bfloat16, device=device)
        row = {"count": COUNT, "bytes": nbytes}
        row["us_by_inner_k_tiles"] = gpu_scale._recorded(gpu_scale._tilings, m, x, device)
        row["gemlite"] = gpu_scale._recorded(gpu_scale._gemlite, m, device, (1, 8))
        for kernels in row["gemlite"].values() if isinstance(row["gemlite"], dict) else ():
            for k in kernels.values():
                if isinstance(k.get("graph_us"), float):
                    k["graph_read_tb_s"] = round(nbytes / k["graph_us"] / 1e6, 3)
        out["per_shape"][name] = row
        print(name, json.dumps(row), flush=True)
        del m
        torch.cuda.empty_cache()
        args.json.write_text(json.dumps(out, indent=1))
    if args.step_ms:
        out["step_with_faster_int4_kernel"] = gpu_scale._gemlite_projection(out["per_shape"], args.step_ms)
    args.json.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "per_shape"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
