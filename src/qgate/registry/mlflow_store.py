"""Register gated artifacts in the MLflow Model Registry and promote them by alias.

    version = register(gate_report_art, candidate_art, model_name="smollm2-135m")
    promote("smollm2-135m", version, alias="production")   # refuses unless gated and intact

Tracking URI: $MLFLOW_TRACKING_URI if set, else an embedded SQLite store
(sqlite:///<store>/mlflow.db) with artifacts under <store>/artifacts. Artifact
directories are logged through MLflow's logged-model API and registered from
models:/<model_id>. Versions carry lineage and gate evidence as tags.
"""

from __future__ import annotations

import json
from datetime import UTC
from pathlib import Path

from qgate.artifact import Artifact
from qgate.errors import RegistryError
from qgate.registry.checks import check_version
from qgate.registry.client import DEFAULT_STORE, EXPERIMENT, PREVIOUS, refusals, tracking_uri
from qgate.registry.client import client as client_of
from qgate.registry.lease import Lease, registry_lock
from qgate.registry.names import check_names
from qgate.registry.tags import MODEL_DESCRIPTION, version_tags
from qgate.registry.transport import absent


def find_version(
    model_name: str,
    gate_sha256: str,
    candidate_sha256: str,
    store: Path | None = None,
    profile_sha256: str | None = None,
):
    """The version already registered for this gate report and candidate, if any: registering twice (a re-run after
    a kill between registering and recording it) returns the first version instead of making a duplicate."""

    found = _versions_of(client_of(store)[1], model_name, gate_sha256, candidate_sha256, profile_sha256)
    return found[0] if found else None


def _versions_of(client, model_name: str, gate_sha256: str, candidate_sha256: str, profile_sha256: str | None):
    """The versions registered for this gate report and candidate, oldest first. A server that cannot answer raises:
    reading that as "none" would register a duplicate."""
    import mlflow

    try:
        found = client.search_model_versions(
            f"name = '{model_name}' and tags.`qgate.gate_report_sha256` = '{gate_sha256}'"
        )
    except mlflow.exceptions.MlflowException as e:
        if not absent(e):
            raise
        return []
    found = [
        mv
        for mv in found
        if mv.tags.get("qgate.artifact_sha256") == candidate_sha256
        and (profile_sha256 is None or mv.tags.get("qgate.profile_sha256") == profile_sha256)
    ]
    return sorted(found, key=lambda mv: int(mv.version))


@refusals("register a model version")
def register(
    gate: Artifact,
    candidate: Artifact,
    model_name: str,
    store: Path | None = None,
    *,
    profile: Artifact | None = None,
    recipe: dict | None = None,
) -> str:
    """Log the candidate artifact and its gate report, register a new version, tag it. Returns the version.

    profile: the traffic profile the candidate was calibrated on, logged with the version so a drift job can compare
    today's traffic with it. recipe: how to rebuild the candidate (scheme, options, kv_cache, engine), kept as a tag.
    Every tag is set when the version is created, so a version never exists without its evidence. Idempotent: the
    same gate report and candidate give the version registered the first time.
    """
    check_names(model_name=model_name)
    if gate.kind != "gate-report":
        raise RegistryError(f"{gate.path}: --gate must be a gate-report artifact")
    if gate.meta.get("candidate") != candidate.sha256:
        raise RegistryError(
            f"{gate.path}: this gate report is for candidate {str(gate.meta.get('candidate'))[:12]}, "
            f"not {candidate.sha256[:12]} ({candidate.path})",
            hint="gate this candidate first",
        )
    gate.verify()  # a report edited after gating is not evidence
    candidate.verify()
    if profile is not None:
        profile.verify()
    stated = json.loads((gate.path / "report.json").read_text()).get("passed")
    if stated != gate.meta.get("passed"):
        raise RegistryError(
            f"{gate.path}: report.json says passed={stated}, its manifest passed={gate.meta.get('passed')}",
            hint="re-run the gate; do not edit gate reports",
        )
    _, client = client_of(store)
    with registry_lock(
        client, store or DEFAULT_STORE, model_name
    ) as lease:  # the existence check and the registration, as one step
        return _register(gate, candidate, model_name, store, profile, recipe, lease)


def _register(
    gate: Artifact,
    candidate: Artifact,
    model_name: str,
    store: Path | None,
    profile: Artifact | None,
    recipe: dict | None,
    lease: Lease,
) -> str:
    from qgate.gates.markdown import version_description
    from qgate.progress import console_err
    from qgate.registry.repair import remove_orphans

    mlflow, client = client_of(store)
    report = json.loads((gate.path / "report.json").read_text())
    existing = find_version(
        model_name, gate.sha256, candidate.sha256, store, profile.sha256 if profile is not None else None
    )
    if existing is not None:
        if not existing.description:  # killed between creating the version and describing it
            lease.check(f"describing {model_name} version {existing.version}")
            client.update_model_version(
                model_name,
                existing.version,
                description=version_description(report, candidate.meta, existing.tags["qgate.gate_report_artifact"]),
            )
        return str(existing.version)
    exp = client.get_experiment_by_name(EXPERIMENT)
    lease.check(f"registering a version of {model_name}")
    for what in remove_orphans(client, exp.experiment_id, model_name, gate.sha256):
        print(f"  ! removed {what}: left by a registration that was killed before it finished", file=console_err())
    verdict = report.get("verdict") or ("pass" if gate.meta["passed"] else "fail")
    variant = report["candidate"]["name"]
    with mlflow.start_run(
        experiment_id=exp.experiment_id,
        run_name=f"gate-{variant}",
        tags={"qgate.variant": variant, "qgate.verdict": verdict, "qgate.gate_report_sha256": gate.sha256},
    ) as run:
        mlflow.log_artifacts(str(gate.path), artifact_path="gate-report")
        for r in report["results"]:
            key = f"{r['gate']}.{r['metric']}".replace("/", "_")
            if r["observed"] == r["observed"]:  # not NaN
                mlflow.log_metric(key, float(r["observed"]))
        mlflow.log_param("candidate_sha256", candidate.sha256)
        if profile is not None:
            mlflow.log_artifacts(str(profile.path), artifact_path="traffic-profile")
        model = mlflow.initialize_logged_model(
            name=model_name,
            source_run_id=run.info.run_id,
            experiment_id=exp.experiment_id,
            tags={"qgate.kind": candidate.kind, "qgate.gate_report_sha256": gate.sha256},
        )
        client.log_model_artifacts(model.model_id, str(candidate.path))
        mlflow.finalize_logged_model(model.model_id, "READY")
        run_id = run.info.run_id
        tags = version_tags(gate, candidate, report, verdict, run_id, model.model_id, profile, recipe)
        lease.check(f"creating the {model_name} version of gate run {run_id}")
        mv = mlflow.register_model(f"models:/{model.model_id}", model_name, tags=tags)
    mv = _one_version(client, model_name, gate, candidate, profile, exp.experiment_id, lease) or mv
    client.update_model_version(
        model_name,
        mv.version,
        description=version_description(report, candidate.meta, tags["qgate.gate_report_artifact"]),
    )
    if not client.get_registered_model(model_name).description:
        client.update_registered_model(model_name, description=MODEL_DESCRIPTION)
    return str(mv.version)


def _one_version(client, model_name, gate, candidate, profile, experiment_id, lease):
    """After registering: the one version of this gate report and candidate. A request the client retried after the
    server had acted on it (an answer lost on the way back) can have created a second version, run or logged model;
    the later versions are deleted, then what no version uses, so the registry holds what a run without faults
    leaves. Returns the version kept, or None when the search does not list it yet."""
    from qgate.progress import console_err
    from qgate.registry.repair import deleted, remove_orphans

    found = _versions_of(client, model_name, gate.sha256, candidate.sha256, profile.sha256 if profile else None)
    for extra in found[1:]:
        lease.check(f"deleting duplicate version {extra.version} of {model_name}")
        deleted(client.delete_model_version, model_name, extra.version)
        print(
            f"  ! removed duplicate version {extra.version}: a retried request registered it twice", file=console_err()
        )
    for what in remove_orphans(client, experiment_id, model_name, gate.sha256):
        print(f"  ! removed duplicate {what}: a retried request created it twice", file=console_err())
    return found[0] if found else None


def model_version(client, model_name: str, version: str | None, alias: str | None, store: Path | None):
    """The MlflowClient version `version`, or the one `alias` points at; RegistryError naming the model's versions and
    aliases when there is none."""
    import mlflow

    try:
        if alias is not None:
            return client.get_model_version_by_alias(model_name, alias)
        return client.get_model_version(model_name, str(version))
    except mlflow.exceptions.MlflowException as e:
        if not absent(e):
            raise
        what = f"alias @{alias}" if alias is not None else f"version {version}"
        raise _version_not_found(client, model_name, what, store) from e


def _version_not_found(client, model_name: str, what: str, store: Path | None) -> RegistryError:
    """The model's version or alias (`what`) is not in the store: say which, and which versions and aliases are."""
    model = _registered_model(client, model_name, store)
    aliases = ", ".join(f"@{a} -> v{v}" for a, v in sorted(model.aliases.items())) or "none"
    latest = max((int(v.version) for v in model.latest_versions), default=None)
    return RegistryError(
        f"model {model_name!r} {what} not found in {tracking_uri(store, create=False)}",
        hint=f"its versions: {'none yet' if latest is None else f'1 to {latest}'} (less any deleted); "
        f"its aliases: {aliases}",
    )


def _registered_model(client, model_name: str, store: Path | None):
    """The registered model; a RegistryError naming the models the store holds when it is not one of them."""
    import mlflow

    try:
        return client.get_registered_model(model_name)
    except mlflow.exceptions.MlflowException as e:
        if not absent(e):
            raise
        raise _model_not_found(client, model_name, store) from e


def _model_not_found(client, model_name: str, store: Path | None) -> RegistryError:
    names = sorted(m.name for m in client.search_registered_models(max_results=20))
    return RegistryError(
        f"model {model_name!r} not found in {tracking_uri(store, create=False)}",
        hint=f"registered models there: {', '.join(names)}{' ...' if len(names) == 20 else ''}"
        if names
        else "nothing is registered there yet (`qgate register` or `qgate run` registers a version); or pass --store "
        "with the pipeline's registry.store directory, or set MLFLOW_TRACKING_URI",
    )


@refusals("move an alias")
def promote(model_name: str, version: str, alias: str = "production", store: Path | None = None) -> dict:
    """Point `alias` at `version` if its gate passed and its stored artifact still hashes to what was gated."""
    check_names(model_name=model_name, version=str(version), alias=alias)
    _, client = client_of(store, create=False)
    with registry_lock(
        client, store or DEFAULT_STORE, model_name
    ) as lease:  # read production, then move both aliases, as one step
        return _promote(client, model_name, version, alias, store, lease)


def _promote(client, model_name: str, version: str, alias: str, store: Path | None, lease: Lease) -> dict:
    import mlflow

    actual = check_version(model_version(client, model_name, version, None, store))
    previous = None
    try:
        previous = str(client.get_model_version_by_alias(model_name, alias).version)
    except mlflow.exceptions.MlflowException as e:
        if not absent(e):
            raise
    lease.check(f"moving @{alias} of {model_name} to version {version}")
    if previous is not None and previous != str(version) and alias == "production":
        client.set_registered_model_alias(model_name, PREVIOUS, previous)
    client.set_registered_model_alias(model_name, alias, str(version))
    return {
        "model": model_name,
        "version": str(version),
        "alias": alias,
        "previous": previous,
        "tracking_uri": tracking_uri(store, create=False),
        "artifact_sha256": actual,
    }


@refusals("move an alias")
def rollback(model_name: str, store: Path | None = None) -> dict:
    """Point `production` at `previous-production` after re-checking it (check_version), and `previous-production` at
    the version production held, so a second rollback undoes the first."""
    check_names(model_name=model_name)
    _, client = client_of(store, create=False)
    with registry_lock(client, store or DEFAULT_STORE, model_name) as lease:
        return _rollback(client, model_name, store, lease)


def _rollback(client, model_name: str, store: Path | None, lease: Lease) -> dict:
    import mlflow

    try:
        target = client.get_model_version_by_alias(model_name, PREVIOUS)
    except mlflow.exceptions.MlflowException as e:
        if not absent(e):
            raise
        _registered_model(client, model_name, store)
        raise RegistryError(
            f"model {model_name!r} has no @{PREVIOUS} to roll back to in {tracking_uri(store, create=False)}",
            hint="promote a version by hand: qgate promote --model NAME --version N",
        ) from e
    actual = check_version(target)
    try:
        current = str(client.get_model_version_by_alias(model_name, "production").version)
    except mlflow.exceptions.MlflowException as e:
        if not absent(e):
            raise
        current = None
    lease.check(f"moving @production of {model_name} back to version {target.version}")
    client.set_registered_model_alias(model_name, "production", str(target.version))
    if current is not None and current != str(target.version):
        client.set_registered_model_alias(model_name, PREVIOUS, current)
    return {
        "model": model_name,
        "version": str(target.version),
        "alias": "production",
        "previous": current,
        "tracking_uri": tracking_uri(store, create=False),
        "artifact_sha256": actual,
    }


def status(model_name: str, store: Path | None = None) -> list[dict]:
    """Every alias of the model with its version's verdict, recipe, drift check and evidence link."""

    check_names(model_name=model_name)
    _, client = client_of(store, create=False)
    aliases = dict(_registered_model(client, model_name, store).aliases)
    order = ["production", PREVIOUS] + sorted(a for a in aliases if a not in ("production", PREVIOUS))
    rows = []
    for alias in order:
        version = aliases.get(alias)
        mv = client.get_model_version(model_name, str(version)) if version is not None else None
        tags = mv.tags if mv is not None else {}
        drift = tags.get("qgate.drift.verdict")
        rows.append(
            {
                "alias": alias,
                "version": None if version is None else str(version),
                "verdict": tags.get("qgate.gate_verdict", "-"),
                "variant": tags.get("qgate.variant", "-"),
                "scheme": tags.get("qgate.scheme", "-"),
                "backend": tags.get("qgate.backend", "-"),
                "created": "-" if mv is None else _when(mv.creation_timestamp),
                "drift": f"{drift} at {tags.get('qgate.drift.last_check')}" if drift else "-",
                "gate_report": tags.get("qgate.gate_report_artifact", "-"),
                "artifact_sha256": tags.get("qgate.artifact_sha256"),
            }
        )
    return rows


def _when(ms: int | None) -> str:
    from datetime import datetime

    return "-" if not ms else datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M UTC")


def verify(model_name: str, alias: str = "production", store: Path | None = None) -> dict:
    """Re-check the version an alias points at, however the alias got there (qgate, the MLflow UI, the API).

    Serving code calls this before loading: PromotionRefused if that version's gate did not pass or its files
    changed; RegistryError if the model, alias or store does not exist.
    """
    check_names(model_name=model_name, alias=alias)
    _, client = client_of(store, create=False)
    mv = model_version(client, model_name, None, alias, store)
    actual = check_version(mv)
    return {
        "model": model_name,
        "alias": alias,
        "version": str(mv.version),
        "artifact_sha256": actual,
        "tracking_uri": tracking_uri(store, create=False),
        "source": mv.source,
    }
