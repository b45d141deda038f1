"""`qgate engine build`: a serving engine from a quantized checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qgate.cli.options import OutDir, flag, quiet_libraries, refuse_unused
from qgate.engines.cpu import CpuEngineConfig
from qgate.engines.torch_int4 import TorchInt4Config

app = typer.Typer(no_args_is_help=True, help="Serving engines.")


PROFILED = ("trtllm", "torch-int4")  # the builders that read a traffic profile


@app.command("build")
def build_cmd(
    ctx: typer.Context,
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
    from qgate.engines.build import build_engine, config_fields, engine_config

    values = dict(accuracy_level=accuracy_level, lm_head=lm_head, verify=verify, max_seq_len=max_seq_len, dtype=dtype)
    takes = config_fields(backend)  # an unknown backend fails here, with a suggestion
    refuse_unused(
        ctx, ["profile", *values], takes + (("profile",) if backend in PROFILED else ()), f"--backend {backend}"
    )
    options = {k: v for k, v in values.items() if k in takes}
    engine_config(backend, field_name=flag, **options)  # bad values, named by their flags, before any loading
    ckpt = Artifact.load(checkpoint, "checkpoint")
    prof = Artifact.load(profile, "traffic-profile") if profile else None
    art = build_atomically(out, lambda tmp: build_engine(ckpt, backend, tmp, prof, **options))
    typer.echo(f"engine {art.path}  sha256 {art.sha256[:16]}  backend {art.meta.get('backend')}")
