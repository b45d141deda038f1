"""MLflow's own rules for a registered model's name, an alias and a version number, checked where a user gives them
(the spec at load, the registry commands' flags) rather than by the tracking server after a run's work is done.

    problems = name_problems(model_name="smollm2", alias="prod env")   # [ConfigError("alias: Invalid alias name ...")]
"""

from __future__ import annotations

from qgate.errors import BackendUnavailable, ConfigError, config_problems

_HINTS = {
    "model name": "a registered model's name may hold anything but '/' and ':', e.g. smollm2-135m-instruct",
    "alias": "an alias holds letters, digits, '_' and '-' (e.g. production, canary); MLflow keeps 'latest' and v<N>",
    "version": "a version is the number `qgate register` printed, e.g. 3",
}


def name_problems(
    *,
    model_name: str | None = None,
    alias: str | None = None,
    version: str | None = None,
    where: dict[str, str] | None = None,
) -> list[ConfigError]:
    """One ConfigError per value MLflow would refuse; `where` names each value's key path or flag (default: what it
    is, e.g. "alias"). No problems where MLflow is not importable: nothing can be registered there, and what registers
    refuses first (require_mlflow), while a command that never touches the registry (a gate) runs."""
    try:
        from mlflow.exceptions import MlflowException
        from mlflow.utils import validation as v
    except ImportError:
        return []

    rules = {
        "model name": (model_name, (v._validate_model_name,)),
        "alias": (alias, (v._validate_model_alias_name, v._validate_model_alias_name_reserved)),
        "version": (version, (v._validate_model_version,)),
    }
    problems = []
    for what, (value, checks) in rules.items():
        if value is None:
            continue
        try:
            for check in checks:
                check(value)
        except MlflowException as e:
            label = (where or {}).get(what, what)
            problems.append(ConfigError(f"{label}: {e.message}", hint=_HINTS[what]))
    return problems


def check_names(**values: str | None) -> None:
    """name_problems as one ConfigError (every problem listed), before a registry operation starts."""
    if problems := name_problems(**values):
        raise config_problems(problems)


def require_mlflow(what: str) -> None:
    """BackendUnavailable unless MLflow is importable: `what` (a registry command, a pipeline's register and promote
    stages, a drift job) needs it, and says so before any work."""
    try:
        import mlflow  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(
            f"{what} needs MLflow, which is not importable here ({e})",
            hint="install qgate with its dependencies (pip install -e .; mlflow is one of them)",
        ) from e
