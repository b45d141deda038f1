"""What a drift job needs from the registry, and what it leaves there.

    prod = production_evidence("smollm2-135m", "production", store, dest=Path("drift/production"))
    prod["artifact"], prod["profile"], prod["recipe"], prod["gated"]  # verified files and profile, recipe, gate numbers
    record_drift("smollm2-135m", prod["version"], Path("drift/report"), "drift", store)

Everything downloaded is checked against the sha256 tags set at registration before it is used.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from qgate.artifact import Artifact, sha256_tree
from qgate.errors import RegistryError
from qgate.registry.client import EXPERIMENT, client
from qgate.registry.mlflow_store import model_version


def _download(uri: str, dest: Path, expected: str | None, what: str) -> Path:
    import shutil

    import mlflow

    if dest.exists() and expected and sha256_tree(dest) == expected:
        return dest  # downloaded by an earlier (perhaps killed) run and intact
    shutil.rmtree(dest, ignore_errors=True)
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp)))
    actual = sha256_tree(local)
    if expected and actual != expected:
        raise RegistryError(
            f"{what} from {uri}: sha256 {actual[:12]} != registered {expected[:12]}",
            hint="the stored files changed after registration; re-register this version",
        )
    local.rename(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    return dest


def production_evidence(model_name: str, alias: str, store: Path | None, dest: Path) -> dict:
    """The version `alias` points at: its files (verified), its calibration profile (verified), recipe and gate
    numbers."""
    _, ml = client(store, create=False)
    mv = model_version(ml, model_name, None, alias, store)
    tags = mv.tags
    where = f"{model_name} v{mv.version} (@{alias})"
    if "qgate.profile_artifact" not in tags:
        raise RegistryError(
            f"{where} carries no calibration traffic profile, so drift cannot be measured against it",
            hint="register it again with this qgate (qgate run registers the profile), then promote that version",
        )
    dest = Path(dest) / f"v{mv.version}"
    art = Artifact.load(_download(mv.source, dest / "artifact", tags.get("qgate.artifact_sha256"), f"{where} files"))
    prof_dir = _download(
        tags["qgate.profile_artifact"], dest / "profile", tags.get("qgate.profile_sha256"), f"{where} profile"
    )
    recipe = json.loads(tags["qgate.recipe"]) if "qgate.recipe" in tags else None
    gated = {k[len("qgate.shadow.") :]: float(v) for k, v in tags.items() if k.startswith("qgate.shadow.")}
    return {
        "version": str(mv.version),
        "variant": tags.get("qgate.variant"),
        "artifact": art,
        "profile": json.loads((prof_dir / "profile.json").read_text()),
        "profile_sha256": tags.get("qgate.profile_sha256"),
        "recipe": recipe,
        "gated": gated,
        "tags": dict(tags),
        "calibration_sha256": tags.get("qgate.calibration_sha256"),
    }


def record_drift(model_name: str, version: str, report_dir: Path, verdict: str, store: Path | None) -> str:
    """Log the drift report as a run artifact and tag the version with the check's time, verdict and report URI."""
    mlflow, ml = client(store)
    exp = ml.get_experiment_by_name(EXPERIMENT)
    now = datetime.now(UTC).isoformat(timespec="seconds")
    with mlflow.start_run(
        experiment_id=exp.experiment_id,
        run_name=f"drift-check-v{version}",
        tags={"qgate.kind": "drift-check", "qgate.drift.verdict": verdict, "qgate.model_version": str(version)},
    ) as run:
        mlflow.log_artifacts(str(report_dir), artifact_path="drift-report")
        uri = f"runs:/{run.info.run_id}/drift-report/drift.html"
    for k, v in {
        "qgate.drift.last_check": now,
        "qgate.drift.verdict": verdict,
        "qgate.drift.report_artifact": uri,
    }.items():
        ml.set_model_version_tag(model_name, str(version), k, v)
    return uri
