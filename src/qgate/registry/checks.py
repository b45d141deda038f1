"""What a registered version must prove before it may serve: its gate passed, per its stored report, and its stored
files hash to what was gated.

    sha256 = check_version(client.get_model_version("smollm2-135m", "7"))   # PromotionRefused (exit 2) otherwise
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from qgate.artifact import sha256_tree
from qgate.errors import PromotionRefused


def check_version(mv) -> str:
    """The served-artifact contract: its gate passed and its stored files still hash to what was gated.
    Returns the sha256; raises PromotionRefused (exit 2) otherwise."""
    import mlflow

    name, version, tags = mv.name, mv.version, mv.tags
    if tags.get("qgate.gate_passed") != "true":
        raise PromotionRefused(
            f"{name} v{version}: gate did not pass (failed: "
            f"{tags.get('qgate.gate_failed_checks', 'no qgate gate evidence')})",
            hint=f"see {tags.get('qgate.gate_report_artifact', 'its gate report')}; only a version whose gate passed "
            "may serve",
        )
    expected = tags.get("qgate.artifact_sha256")
    with tempfile.TemporaryDirectory() as tmp:
        _check_stored_report(mv, Path(tmp) / "report")
        local = mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(Path(tmp) / "model"))
        actual = sha256_tree(Path(local))
    if actual != expected:
        raise PromotionRefused(
            f"{name} v{version}: stored artifact sha256 {actual[:12]} != gated {str(expected)[:12]}",
            hint="the registered files changed after gating; re-gate and re-register",
        )
    return actual


def _check_stored_report(mv, dst: Path) -> None:
    """Tags can be edited by anyone with write access (the UI has a tag editor); the gate report stored with the
    version's run is the evidence. It must hash to the registered sha256, say passed, and name this artifact."""
    import mlflow

    name, version, tags = mv.name, mv.version, mv.tags
    uri = tags.get("qgate.gate_report_artifact", "")
    if not uri.startswith("runs:/") or not uri.endswith("/report.html"):
        raise PromotionRefused(
            f"{name} v{version}: no stored gate report (tag qgate.gate_report_artifact is {uri or 'missing'})",
            hint="register versions with qgate register / qgate run, which store the report with them",
        )
    dst.mkdir(parents=True)
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri.removesuffix("/report.html"), dst_path=str(dst)))
    actual = sha256_tree(local)
    if actual != tags.get("qgate.gate_report_sha256"):
        raise PromotionRefused(
            f"{name} v{version}: stored gate report sha256 {actual[:12]} != registered "
            f"{str(tags.get('qgate.gate_report_sha256'))[:12]}",
            hint="the gate report was changed after registration; re-gate and re-register",
        )
    report = json.loads((local / "report.json").read_text())
    if report.get("passed") is not True:
        raise PromotionRefused(
            f"{name} v{version}: its stored gate report says {report.get('verdict')}, although its tags say passed",
            hint="the version's tags were edited; only a version whose gate passed may serve",
        )
    if report.get("candidate", {}).get("sha256") != tags.get("qgate.artifact_sha256"):
        raise PromotionRefused(
            f"{name} v{version}: its stored gate report is for another artifact "
            f"({str(report.get('candidate', {}).get('sha256'))[:12]})",
            hint="re-gate this version's artifact",
        )
