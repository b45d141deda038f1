"""How qgate talks to a remote tracking server: MLflow's own retry settings, chosen, and one line when they run out.

    configure_http()          # before the first MlflowClient call to a server
    line = server_failure(e)  # "the MLflow tracking server at http://... failed /api/2.0/... after 5 retries (...)"

MLflow's REST client retries through urllib3: a refused or dropped connection, a read past the timeout, and answers
408, 429, 500, 502, 503 and 504, for every method. qgate sets that client's retry count, backoff and timeout unless
the environment already does, and writes no retry loop of its own. A retried POST that the server had already acted
on can create a second run, logged model or version; registration removes such duplicates before it returns
(mlflow_store.register).
"""

from __future__ import annotations

import os
import re

# MLflow reads these from the environment on every request; a user's own values win.
HTTP_SETTINGS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "5",  # MLflow's default is 7, with waits up to 64 s between tries
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",  # waits of 0, 2, 4, 8 and 16 s: about half a minute in all
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "1.0",  # up to 1 s more per wait, so parallel jobs do not retry in step
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "60",  # seconds without an answer before that try counts as failed
}


def configure_http() -> None:
    for k, v in HTTP_SETTINGS.items():
        os.environ.setdefault(k, v)


_ABSENT = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")  # what MLflow answers for a missing model or alias


def absent(e: Exception) -> bool:
    """Whether an MlflowException says the thing asked for does not exist, as opposed to the server failing to
    answer: only the first may be read as "none yet"."""
    return getattr(e, "error_code", "") in _ABSENT


_SERVER_CODES = ("INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED")


def server_failure(e: BaseException) -> str | None:
    """One line for a failure of the tracking server or the network that MLflow's client gave up on after its
    retries: the server, the call, the retries and the cause. None when `e` is anything else (a refusal, a missing
    model: their own messages say more)."""
    mod = type(e).__module__.split(".")[0]
    text = str(e)
    if mod == "mlflow":
        transport = "API request to" in text and re.search(r"failed with (timeout )?exception|error code 5\d\d", text)
        if not transport and getattr(e, "error_code", "") not in _SERVER_CODES:
            return None
    elif mod not in ("requests", "urllib3"):
        return None
    server = os.environ.get("MLFLOW_TRACKING_URI", "the tracking server")
    call = re.search(r"(/api/[\w./-]+|/ajax-api/[\w./-]+)", text)
    cause = re.search(r"Caused by (\w+\(.{0,120}?\))\)", text) or re.search(r"(Read timed out[^)]*)", text)
    why = cause.group(1) if cause else text.splitlines()[0][:200] if text else type(e).__name__
    tries = os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES", HTTP_SETTINGS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"])
    return (
        f"the MLflow tracking server at {server} failed {call.group(1) if call else 'a request'} after {tries} "
        f"retries ({why}); a re-run of the same command finishes what this one started. "
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES and MLFLOW_HTTP_REQUEST_TIMEOUT set the retries"
    )
