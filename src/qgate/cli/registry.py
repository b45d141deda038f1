"""`qgate register`, `promote`, `verify`, `status` and `rollback`: the MLflow Model Registry."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qgate.cli.options import Json, ModelName, Store, quiet_libraries
from qgate.cli.output import AliasRow, Output, PromoteDoc, RegisterDoc, StatusDoc, VerifyDoc, columns, step_summary


def register_cmd(
    gate: Annotated[Path, typer.Option("--gate", help="Gate-report artifact for the candidate.")],
    candidate: Annotated[Path, typer.Option("--candidate", help="The gated checkpoint or engine artifact.")],
    model_name: ModelName,
    store: Store = None,
    json_out: Json = False,
) -> None:
    """Register the candidate as a model version with lineage and gate-evidence tags and a Markdown description
    (idempotent: the same gate report and candidate give the same version)."""
    quiet_libraries()
    from qgate.artifact import Artifact
    from qgate.registry.client import tracking_uri
    from qgate.registry.mlflow_store import register

    o = Output(json_out)
    report = Artifact.load(gate, "gate-report")
    version = register(report, Artifact.load(candidate, ("checkpoint", "engine")), model_name, store)
    o.say(f"registered {model_name} version {version} in {tracking_uri(store)}")
    o.emit(
        RegisterDoc(
            exit_code=0,
            model=model_name,
            version=version,
            verdict=report.meta["verdict"],
            tracking_uri=tracking_uri(store),
        )
    )


def promote_cmd(
    model: Annotated[str, typer.Option("--model", help="Registered model name.")],
    version: Annotated[str, typer.Option("--version", help="Model version to promote.")],
    alias: Annotated[str, typer.Option("--alias", help="Alias to point at the version.")] = "production",
    store: Store = None,
    json_out: Json = False,
) -> None:
    """Point an alias at a version; refuses (exit 2) unless its gate passed and its checksums match."""
    quiet_libraries()
    from qgate.registry.mlflow_store import promote

    o = Output(json_out)
    info = promote(model, version, alias, store)
    prev = (
        f" (previous-production -> v{info['previous']})"
        if info["previous"] and info["previous"] != info["version"]
        else ""
    )
    o.say(f"{model}@{alias} -> v{version}{prev}  [{info['tracking_uri']}]")
    step_summary(f"qgate promoted `{model}` v{version} @{alias}{prev}")
    o.emit(promote_doc(info))


def promote_doc(info: dict, command: str = "promote") -> PromoteDoc:
    return PromoteDoc(
        command=command,
        exit_code=0,
        model=info["model"],
        version=str(info["version"]),
        alias=info["alias"],
        previous=None if info["previous"] is None else str(info["previous"]),
        tracking_uri=info["tracking_uri"],
        artifact_sha256=info["artifact_sha256"],
    )


def status_cmd(
    model: Annotated[str, typer.Option("--model", help="Registered model name.")],
    store: Store = None,
    json_out: Json = False,
) -> None:
    """Which versions hold `production` and `previous-production`, their verdicts, drift checks and evidence links."""
    quiet_libraries()
    from qgate.registry.mlflow_store import status

    rows = [AliasRow(**r) for r in status(model, store)]
    o = Output(json_out)
    o.say(model)
    for line in columns(
        ("alias", "version", "verdict", "variant", "scheme", "runtime", "created", "last drift check", "gate report"),
        [
            (r.alias, r.version or "-", r.verdict, r.variant, r.scheme, r.backend, r.created, r.drift, r.gate_report)
            for r in rows
        ],
    ):
        o.say(line)
    o.emit(StatusDoc(exit_code=0, model=model, aliases=rows))


def rollback_cmd(
    model: Annotated[str, typer.Option("--model", help="Registered model name.")],
    store: Store = None,
    json_out: Json = False,
) -> None:
    """Point `production` back at `previous-production`, after re-verifying that version's gate and checksums.
    The two aliases swap, so a second rollback undoes the first."""
    quiet_libraries()
    from qgate.registry.mlflow_store import rollback

    o = Output(json_out)
    info = rollback(model, store)
    o.say(
        f"rolled back {model}@production -> v{info['version']} (previous-production -> v{info['previous']})  "
        f"[{info['tracking_uri']}]"
    )
    step_summary(f"qgate rolled back `{model}` @production to v{info['version']}")
    o.emit(promote_doc(info, "rollback"))


def verify_cmd(
    model: Annotated[str, typer.Option("--model", help="Registered model name.")],
    alias: Annotated[str, typer.Option("--alias", help="Alias whose version to check.")] = "production",
    store: Store = None,
    json_out: Json = False,
) -> None:
    """Check the version behind an alias before serving it: exit 2 unless its gate passed and its checksums match.

    Catches an alias moved outside qgate (the MLflow UI's alias editor, the REST API). Library form:
    `qgate.registry.mlflow_store.verify(model, alias)`.
    """
    quiet_libraries()
    from qgate.registry.mlflow_store import verify

    o = Output(json_out)
    info = verify(model, alias, store)
    o.say(
        f"verified {model}@{alias} -> v{info['version']}: gate passed, sha256 {info['artifact_sha256'][:16]} matches "
        f"[{info['tracking_uri']}]"
    )
    o.emit(VerifyDoc(exit_code=0, **info))
