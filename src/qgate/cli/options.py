"""Option types shared by the commands; defaults are read from the config classes, never repeated."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Annotated

import typer

OutDir = Annotated[Path, typer.Option("--out", "-o", help="Directory to write the artifact to.")]
ModelDir = Annotated[Path, typer.Option("--model", help="Baseline checkpoint artifact (from `qgate model import`).")]
Store = Annotated[
    Path | None, typer.Option("--store", help="Embedded MLflow store dir (ignored when MLFLOW_TRACKING_URI is set).")
]
ModelName = Annotated[str, typer.Option("--model-name", "--model", help="Registered model name.")]
Json = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print one JSON document on stdout (schema: docs/qgate-output.schema.json); human text goes to stderr.",
    ),
]
Junit = Annotated[Path | None, typer.Option("--junit", help="Write each gate check as a JUnit test case to this file.")]
Device = Annotated[
    str | None,
    typer.Option(
        "--device",
        help="Where the gates score models: auto (CUDA when present), "
        "cpu, cuda or cuda:N (default: the spec's gates.device, else auto).",
    ),
]
Executor = Annotated[
    str,
    typer.Option(
        "--executor",
        "--engine",  # the flag's earlier name, still accepted
        help="How traffic partitions are scanned: serial; processes (one local "
        "process per core); or ray (local Ray, or RAY_ADDRESS). A file "
        "too big for its share of the workers is read here and its blocks "
        "scanned by the workers. The same sets every way.",
    ),
]


def seconds(value: float) -> float:
    """Callback for a --wait flag: a duration in seconds, 0 or more (inf: no limit)."""
    if not value >= 0:  # NaN too
        raise typer.BadParameter(f"must be a number of seconds, 0 or more (inf: no limit); got {value}")
    return value


def flag(field: str) -> str:
    """The flag that sets a config field: max_seq_len -> --max-seq-len (build_config's field_name, in commands)."""
    return "--" + field.replace("_", "-")


def refuse_unused(ctx: typer.Context, params: Sequence[str], takes: Collection[str], chosen: str) -> None:
    """A usage error naming each of the command's `params` set on the command line that `chosen` (a `--backend
    cpu`) does not take, instead of ignoring it."""
    from typer._click.core import ParameterSource
    from typer._click.exceptions import UsageError

    shown = {q.name: "/".join(q.opts + q.secondary_opts) for q in ctx.command.params}  # --verify/--no-verify
    unused = [shown[p] for p in params if p not in takes and ctx.get_parameter_source(p) is not ParameterSource.DEFAULT]
    if unused:
        taken = [shown[p] for p in params if p in takes]
        raise UsageError(
            f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply to {chosen}"
            + (f"; it takes {', '.join(taken)}" if taken else ""),
            ctx,
        )


def quiet_libraries() -> None:
    """Keep the console for qgate's own progress: libraries log warnings and worse only."""
    import logging
    import os
    import sys
    import warnings

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault(
        "LLM_COMPRESSOR_LOG_LEVEL", "ERROR"
    )  # read at first import; its per-layer METRIC lines (level 38) too
    if not sys.stderr.isatty():  # no TTY: no carriage-return bars from libraries that call tqdm directly (GGUF import)
        from qgate.progress import silence_tqdm

        silence_tqdm()
    for name in ("transformers", "datasets", "lm_eval", "lm-eval", "mlflow", "alembic", "llmcompressor", "onnxruntime"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # what llm-compressor's tracing and sequential onloading make torch and transformers say on every quantize: nothing
    # a user can act on (qgate saves from onloaded modules; it does not trace with torch.export)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", "Attempting to save a model with offloaded modules", UserWarning)
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except ImportError:
        pass
