"""`qgate quantize`: one scheme, one checkpoint, compressed-tensors output."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qgate.cli.options import ModelDir, OutDir, flag, quiet_libraries, refuse_unused
from qgate.cli.output import checkpoint_line
from qgate.quantize.compress import CalibOptions
from qgate.quantize.schemes import SCHEMES

_D = CalibOptions()


def quantize_cmd(
    ctx: typer.Context,
    model: ModelDir,
    scheme: Annotated[str, typer.Option(help=f"One of: {', '.join(SCHEMES.names())}.")],
    out: OutDir,
    calib: Annotated[Path | None, typer.Option("--calib", help="Calibration-set artifact (calib split).")] = None,
    kv_cache: Annotated[str | None, typer.Option("--kv-cache", help="Quantize the KV cache too: fp8 or int8.")] = None,
    group_size: Annotated[
        int | None, typer.Option(help="Group size for W4A16/W8A16 (must divide layer widths).")
    ] = None,
    max_seq_length: Annotated[int, typer.Option(help="Calibration sequence length (tokens).")] = _D.max_seq_length,
) -> None:
    """Quantize a baseline checkpoint with llm-compressor."""
    quiet_libraries()
    from dataclasses import fields

    from qgate.artifact import Artifact, build_atomically
    from qgate.naming import build_config
    from qgate.quantize.compress import quantize
    from qgate.quantize.schemes import KVCacheConfig, scheme_config

    cls, fixed = SCHEMES.get(scheme)  # an unknown scheme fails here, with a suggestion
    refuse_unused(ctx, ["group_size"], [f.name for f in fields(cls) if f.name not in fixed], f"--scheme {scheme}")
    cfg = scheme_config(scheme, field_name=flag, group_size=group_size)
    opts = build_config(CalibOptions, {"max_seq_length": max_seq_length}, "quantize", field_name=flag)
    kv = (
        build_config(KVCacheConfig, {"dtype": kv_cache}, "kv_cache", field_name=lambda _: "--kv-cache")
        if kv_cache
        else None
    )
    base = Artifact.load(model, "checkpoint")
    cal = Artifact.load(calib, "calibration-set") if calib else None
    art = build_atomically(out, lambda tmp: quantize(base, cal, cfg, tmp, kv=kv, opts=opts))
    typer.echo(checkpoint_line(art))
