"""Finish or remove what a killed registration left behind, before registering again.

    removed = remove_orphans(client, experiment_id, "smollm2", gate_sha256)   # ["logged model m-..", "run 1f.."]

Registration is a sequence of server calls: start a run and log the gate report, log the model, register the
version with its tags, write its description. A kill between them leaves a run or a logged model that no version
points at (removed here), or a version without its description (rewritten by the caller, which finds the version
by its gate report's sha256). A version never exists without its tags: they are set when it is created.
"""

from __future__ import annotations

from qgate.registry.transport import absent

GATE_TAG = "qgate.gate_report_sha256"


def remove_orphans(client, experiment_id: str, model_name: str, gate_sha256: str) -> list[str]:
    """Delete the logged models and runs made for this gate report that no registered version uses."""
    import mlflow

    used_models, used_runs = set(), set()
    try:
        for mv in client.search_model_versions(f"name = '{model_name}' and tags.`{GATE_TAG}` = '{gate_sha256}'"):
            used_models.add(mv.tags.get("qgate.model_id"))
            used_runs.add(mv.run_id)
    except mlflow.exceptions.MlflowException as e:  # the registered model does not exist yet
        if not absent(e):
            raise
    removed = []
    for lm in client.search_logged_models([experiment_id], filter_string=f"tags.`{GATE_TAG}` = '{gate_sha256}'"):
        if lm.model_id not in used_models:
            deleted(client.delete_logged_model, lm.model_id)
            removed.append(f"logged model {lm.model_id}")
        else:
            used_runs.add(lm.source_run_id)
    for run in client.search_runs([experiment_id], filter_string=f"tags.`{GATE_TAG}` = '{gate_sha256}'"):
        if run.info.run_id not in used_runs:
            deleted(client.delete_run, run.info.run_id)
            removed.append(f"run {run.info.run_id}")
    return removed


def deleted(delete, *args) -> None:
    """`delete(*args)`, where "it does not exist" counts as done: a delete the client retried after the server had
    acted on it is answered that way."""
    import mlflow

    try:
        delete(*args)
    except mlflow.exceptions.MlflowException as e:
        if not absent(e):
            raise
