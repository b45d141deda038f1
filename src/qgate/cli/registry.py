"""`qgate register`, `qgate promote` and `qgate verify`: the MLflow Model Registry."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qgate.cli.options import ModelName, Store, quiet_libraries


def register_cmd(
    gate: Annotated[Path, typer.Option("--gate", help="Gate-report artifact for the candidate.")],
    candidate: Annotated[Path, typer.Option("--candidate", help="The gated checkpoint or engine artifact.")],
    model_name: ModelName,
    store: Store = None,
) -> None:
    """Register the candidate as a new model version with lineage and gate-evidence tags."""
    quiet_libraries()
    from qgate.artifact import Artifact
    from qgate.registry.mlflow_store import register, tracking_uri

    version = register(Artifact.load(gate, "gate-report"), Artifact.load(candidate), model_name, store)
    typer.echo(f"registered {model_name} version {version} in {tracking_uri(store)}")


def promote_cmd(
    model: Annotated[str, typer.Option("--model", help="Registered model name.")],
    version: Annotated[str, typer.Option("--version", help="Model version to promote.")],
    alias: Annotated[str, typer.Option("--alias", help="Alias to point at the version.")] = "production",
    store: Store = None,
) -> None:
    """Point an alias at a version; refuses (exit 2) unless its gate passed and its checksums match."""
    quiet_libraries()
    from qgate.registry.mlflow_store import promote

    info = promote(model, version, alias, store)
    prev = f" (previous-production -> v{info['previous']})" if info["previous"] and info["previous"] != info["version"] else ""
    typer.echo(f"{model}@{alias} -> v{version}{prev}  [{info['tracking_uri']}]")


def verify_cmd(
    model: Annotated[str, typer.Option("--model", help="Registered model name.")],
    alias: Annotated[str, typer.Option("--alias", help="Alias whose version to check.")] = "production",
    store: Store = None,
) -> None:
    """Check the version behind an alias before serving it: exit 2 unless its gate passed and its checksums match.

    Catches an alias moved outside qgate (the MLflow UI's alias editor, the REST API). Library form:
    `qgate.registry.mlflow_store.verify(model, alias)`.
    """
    quiet_libraries()
    from qgate.registry.mlflow_store import verify

    info = verify(model, alias, store)
    typer.echo(f"verified {model}@{alias} -> v{info['version']}: gate passed, sha256 {info['artifact_sha256'][:16]} matches "
               f"[{info['tracking_uri']}]")
