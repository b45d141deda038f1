"""`qgate engine build`: a serving engine from a quantized checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qgate.cli.options import OutDir, quiet_libraries
from qgate.engines.cpu import CpuEngineConfig
from qgate.engines.torch_int4 import TorchInt4Config

app = typer.Typer(no_args_is_help=True, help="Serving engines.")


@app.command("build")
def build_cmd(
    checkpoint: Annotated[Path, typer.Option("--checkpoint", help="Quantized checkpoint artifact.")],
    backend: Annotated[
        str,
        typer.Option(
            help="cpu (onnxruntime-genai), torch-int4 (int4 kernels, CUDA graphs) or trtllm (TensorRT-LLM bundle)."
        ),
    ],
    out: OutDir,
    profile: Annotated[
        Path | None, typer.Option(help="Traffic-profile artifact (trtllm, torch-int4: CUDA-graph batch sizes).")
    ] = None,
    accuracy_level: Annotated[
        int, typer.Option(help="cpu: MatMulNBits accuracy level, 4 int8 activations, 1 exact.")
    ] = CpuEngineConfig().accuracy_level,
    lm_head: Annotated[
        str, typer.Option(help="cpu: lm_head precision, fp32, int8 or int4 (faster decode; gate it).")
    ] = CpuEngineConfig().lm_head,
    verify: Annotated[
        bool, typer.Option(help="trtllm, torch-int4: load, capture CUDA graphs and smoke-generate.")
    ] = True,
    max_seq_len: Annotated[
        int, typer.Option(help="torch-int4: KV slots of the captured decode graphs.")
    ] = TorchInt4Config().max_seq_len,
    dtype: Annotated[
        str, typer.Option(help="torch-int4: bfloat16, or float32 (CPU only, exact numerics).")
    ] = TorchInt4Config().dtype,
) -> None:
    """Build (cpu, torch-int4) or bundle and verify (trtllm) an engine."""
    quiet_libraries()
    from qgate.artifact import Artifact, build_atomically
    from qgate.engines.build import build_engine

    ckpt = Artifact.load(checkpoint, "checkpoint")
    prof = Artifact.load(profile, "traffic-profile") if profile else None
    options = {
        "cpu": {"accuracy_level": accuracy_level, "lm_head": lm_head},
        "torch-int4": {"verify": verify, "max_seq_len": max_seq_len, "dtype": dtype},
    }.get(backend, {"verify": verify})
    art = build_atomically(out, lambda tmp: build_engine(ckpt, backend, tmp, prof, **options))
    typer.echo(f"engine {art.path}  sha256 {art.sha256[:16]}  backend {art.meta.get('backend')}")
