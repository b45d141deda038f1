"""`qgate engine build`: a serving engine from a quantized checkpoint."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qgate.cli.options import OutDir, quiet_libraries
from qgate.engines.cpu import CpuEngineConfig

app = typer.Typer(no_args_is_help=True, help="Serving engines.")


@app.command("build")
def build_cmd(
    checkpoint: Annotated[Path, typer.Option("--checkpoint", help="Quantized checkpoint artifact.")],
    backend: Annotated[str, typer.Option(help="cpu (onnxruntime-genai) or trtllm (TensorRT-LLM bundle).")],
    out: OutDir,
    profile: Annotated[Path | None, typer.Option(help="Traffic-profile artifact (trtllm: CUDA-graph batch sizes).")] = None,
    accuracy_level: Annotated[int, typer.Option(help="cpu: MatMulNBits accuracy level, 4 int8 activations, 1 exact.")] = CpuEngineConfig().accuracy_level,
    lm_head: Annotated[str, typer.Option(help="cpu: lm_head precision, fp32, int8 or int4 (faster decode; gate it).")] = CpuEngineConfig().lm_head,
    verify: Annotated[bool, typer.Option(help="trtllm: load, capture CUDA graphs and smoke-generate.")] = True,
) -> None:
    """Build (cpu) or bundle and verify (trtllm) an engine."""
    quiet_libraries()
    from qgate.artifact import Artifact, build_atomically
    from qgate.engines.build import build_engine

    ckpt = Artifact.load(checkpoint, "checkpoint")
    prof = Artifact.load(profile, "traffic-profile") if profile else None
    options = {"accuracy_level": accuracy_level, "lm_head": lm_head} if backend == "cpu" else {"verify": verify}
    art = build_atomically(out, lambda tmp: build_engine(ckpt, backend, tmp, prof, **options))
    typer.echo(f"engine {art.path}  sha256 {art.sha256[:16]}  backend {art.meta.get('backend')}")
