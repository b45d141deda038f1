"""The MLflow client qgate's registry operations run on, and where its store is.

    mlflow, ml = client(store)                   # $MLFLOW_TRACKING_URI, else the embedded SQLite store under `store`
    uri = tracking_uri(store, create=False)      # a read never makes a store: RegistryError when there is none

`refusals` turns a tracking server's refusal (no permission, bad credentials) into a RegistryError.
"""

from __future__ import annotations

import os
from pathlib import Path

from qgate.errors import RegistryError
from qgate.registry.names import require_mlflow
from qgate.registry.transport import configure_http

DEFAULT_STORE = Path(".qgate/mlflow")
EXPERIMENT = "qgate"
PREVIOUS = "previous-production"


def tracking_uri(store: Path | None = None, *, create: bool = True, spec_key: str | None = None) -> str:
    """$MLFLOW_TRACKING_URI, else the embedded SQLite store. Reads (`create=False`) never make a store:
    a missing one is a RegistryError naming the directory searched, and where it came from: --store, or `spec_key`
    when a spec named it."""
    uri = env_tracking_uri()
    if uri is not None:
        return uri
    where = Path(store or DEFAULT_STORE).resolve()
    if create:
        where.mkdir(parents=True, exist_ok=True)
    elif not (where / "mlflow.db").exists():
        origin = spec_key or ("--store" if store else f"the default {DEFAULT_STORE} under the current directory")
        raise RegistryError(
            f"no MLflow store at {where} (searched {origin})",
            hint=f"set {spec_key} to the store `qgate run` registered into, or set MLFLOW_TRACKING_URI"
            if spec_key
            else "pass --store with the pipeline's registry.store directory, or set MLFLOW_TRACKING_URI",
        )
    return f"sqlite:///{where / 'mlflow.db'}"


def env_tracking_uri() -> str | None:
    """$MLFLOW_TRACKING_URI, or None when unset. A local path or file: URI names MLflow's file store, which MLflow 3
    refuses unless MLFLOW_ALLOW_FILE_STORE is true: that is a RegistryError saying what to set instead (the
    sqlite:/// URI of a qgate store when the path holds one), raised before a run's stages rather than by its
    register stage."""
    from urllib.parse import urlparse

    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return None
    require_mlflow("the model registry")
    from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    from mlflow.utils.uri import get_uri_scheme

    # MLflow's own reading of a store URI (mlflow.tracking.registry): these names are stores, and a drive letter
    # (C:\...) is a path
    if uri in {"databricks", "databricks-uc", "uc"} or get_uri_scheme(uri) not in ("", "file"):
        return uri
    if MLFLOW_ALLOW_FILE_STORE.get():
        return uri
    parsed = urlparse(uri)
    path = Path(parsed.path if parsed.scheme == "file" else uri).resolve()
    db = path / "mlflow.db"
    raise RegistryError(
        f"MLFLOW_TRACKING_URI={uri} names an MLflow file store ({path}), which MLflow refuses",
        hint=f"that directory holds a qgate store: set MLFLOW_TRACKING_URI=sqlite:///{db}"
        if db.exists()
        else "set it to a tracking server's URL or to sqlite:///PATH/mlflow.db, or unset it to use registry.store "
        "(--store); MLFLOW_ALLOW_FILE_STORE=true makes MLflow take the file store",
    )


_DENIED = ("PERMISSION_DENIED", "UNAUTHENTICATED", "UNAUTHORIZED")


def refusals(what: str):
    """Decorator for registry operations: a tracking server's refusal (no permission, bad credentials) becomes a
    RegistryError (exit 1) saying who refused what and how to fix it, instead of a traceback."""
    import functools

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            import mlflow

            try:
                return fn(*args, **kwargs)
            except mlflow.exceptions.MlflowException as e:
                code = getattr(e, "error_code", "")
                if code not in _DENIED and "401" not in str(e) and "403" not in str(e):
                    raise
                user = os.environ.get("MLFLOW_TRACKING_USERNAME") or "(no MLFLOW_TRACKING_USERNAME)"
                where = os.environ.get("MLFLOW_TRACKING_URI") or "the tracking server"
                raise RegistryError(
                    f"{where} refused to {what} for user {user}: {code or 'HTTP 401/403'}: {getattr(e, 'message', e)}",
                    hint="ask an admin of the tracking server for EDIT (register) or MANAGE (aliases) permission; "
                    "credentials come from MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD",
                ) from None

        return inner

    return wrap


def client(store: Path | None, *, create: bool = True):
    """(mlflow, MlflowClient) on the tracking URI (tracking_uri), the embedded store made first where `create`, with
    the qgate experiment; MLflow's fluent API is pointed at the same URI."""
    import logging

    require_mlflow("the model registry")
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    import mlflow
    from mlflow import MlflowClient

    configure_http()
    uri = tracking_uri(store, create=create)
    embedded = uri.startswith("sqlite:///") and not os.environ.get("MLFLOW_TRACKING_URI")
    if embedded and create:
        with _init_lock(uri):  # one process creates the schema, and nobody sees it half made
            _create_embedded(Path(uri[len("sqlite:///") :]))
    ml = MlflowClient(uri, uri)
    if create and not embedded and ml.get_experiment_by_name(EXPERIMENT) is None:
        try:
            ml.create_experiment(EXPERIMENT)
        except mlflow.exceptions.MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":  # another process created it first: fine
                raise
    _set_uris(mlflow, uri)
    return mlflow, ml


def _create_embedded(db: Path) -> None:
    """A new embedded store is built as a temporary database (MLflow's schema migrations, the qgate experiment with
    its artifacts beside the database) and renamed into place: a process killed mid-migration leaves no store that
    every later run would fail on."""
    from mlflow import MlflowClient

    if db.exists():
        return
    for stale in db.parent.glob(f".{db.name}.tmp-*"):
        stale.unlink(missing_ok=True)
    tmp = db.with_name(f".{db.name}.tmp-{os.getpid()}")
    client = MlflowClient(f"sqlite:///{tmp}", f"sqlite:///{tmp}")
    client.create_experiment(EXPERIMENT, artifact_location=(db.parent / "artifacts").as_uri())
    os.replace(tmp, db)


def _init_lock(uri: str):
    """Two processes opening a new embedded store at once would both run MLflow's schema migrations, and one fails."""
    from filelock import FileLock

    locks = Path(uri[len("sqlite:///") :]).parent / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    return FileLock(str(locks / "init.lock"), timeout=600)


def _set_uris(mlflow, uri: str) -> None:
    """Point MLflow's fluent API at `uri` without leaving it in the environment: mlflow.set_tracking_uri also exports
    MLFLOW_TRACKING_URI (and set_registry_uri MLFLOW_REGISTRY_URI), which tracking_uri() would then take for the
    user's choice, so the first store a process touched would win over every later --store."""
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
