"""On a CPU: the torch-int4 engine's int4 Linear (torch's CPU int4 kernel) against a dense GEMM, per row count.

    .venv/bin/python benchmarks/bench_int4_cpu.py          # ~1 min on 2 cores; run alone

Random codes and scales (group 64) for SmolLM2-135M's MLP shapes and a 4096x4096 one, each held as
engines/int4_linear.Linear holds it on a CPU. Per row count: the int4 kernel's time, and the dense path's
(dequantize to bf16, then the GEMM) and the kept dense matrix's GEMM alone as ratios against it (above 1: the int4
kernel is faster). This is what decides whether a CPU's Linear should ever leave the int4 kernel (DENSE_ROWS).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from qgate.engines import int4_linear as il
from qgate.engines.int4pack import Int4Weight

SHAPES = ((1536, 576), (576, 1536), (4096, 4096))  # [out, in]
ROWS = (1, 16, 128, 512, 2048)


def seconds(f, n: int = 3) -> float:
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    il.DENSE_ROWS = {"cpu": 1 << 30}  # the int4 kernel serves every row count; the codes are kept to dequantize
    for o, i in SHAPES:
        w = Int4Weight(torch.randint(0, 256, (o, i // 2), dtype=torch.uint8), torch.randn(i // 64, o, 2) * 0.01, 64)
        lin = il.Linear(w, None, torch.bfloat16, torch.device("cpu"))
        kept = lin.dequantized()
        for rows in ROWS:
            x = torch.randn(rows, i, dtype=torch.bfloat16)
            with torch.inference_mode():
                int4 = seconds(lambda x=x: lin(x))
                dense = seconds(lambda x=x: F.linear(x, lin.dequantized()))
                gemm = seconds(lambda x=x: F.linear(x, kept))
            print(
                f"{o}x{i} rows {rows:5d}: int4 kernel {int4 * 1e3:8.2f} ms; dequantize + GEMM x{dense / int4:5.2f}, "
                f"kept matrix's GEMM x{gemm / int4:5.2f}"
            )


if __name__ == "__main__":
    main()
