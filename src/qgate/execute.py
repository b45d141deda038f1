"""The one seam where work is fanned out: the same function on the same arguments, serially or as Ray tasks.

    for result in map_ordered(scan_partition, [(p, cfg) for p in parts], engine="ray"):   # results in input order

`engine="serial"` (the default everywhere) calls the function in this process. `engine="ray"` runs each call as a Ray
task with the given resources (`{"num_cpus": 1, "num_gpus": 1, "memory": ...}` or custom resources) and yields the
results in input order as they complete, so the driver holds one result at a time. Ray starts locally unless
RAY_ADDRESS points at a cluster; an exception raised in a task is raised again here as itself, so a bad partition
reads the same under both engines.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from qgate.errors import BackendUnavailable, ConfigError

ENGINES = ("serial", "ray")


def check_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise ConfigError(f"unknown execution engine {engine!r}; choose one of {', '.join(ENGINES)}")
    return engine


def map_ordered(fn: Callable[..., Any], calls: Iterable[tuple], engine: str = "serial",
                resources: list[dict] | dict | None = None) -> Iterator[Any]:
    """fn(*args) for each args in calls, in order. resources: one dict for every task, or one per call."""
    calls = list(calls)
    if check_engine(engine) == "serial":
        for args in calls:
            yield fn(*args)
        return
    ray = ray_session()
    per_call = resources if isinstance(resources, list) else [resources or {}] * len(calls)
    task = ray.remote(fn)
    # Tasks are submitted in a window ahead of the one awaited: after a failure nothing more is submitted, and the
    # driver waits for the few already submitted instead of cancelling them (ray.cancel racing a finishing task
    # aborts the driver in Ray 2.60: "Tried to complete task that was not pending").
    window = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
    submitted: list = []
    try:
        for i in range(len(calls)):
            while len(submitted) < min(len(calls), i + window):
                args, res = calls[len(submitted)], per_call[len(submitted)]
                submitted.append(task.options(**_ray_options(res)).remote(*args))
            yield _get(ray, submitted[i])
    finally:
        ray.wait(submitted, num_returns=len(submitted), timeout=None)   # nothing left running behind the caller


def ray_session():
    """Ray, connected: to RAY_ADDRESS when set, else a local instance started for this process."""
    try:
        import ray
    except ImportError as e:
        raise BackendUnavailable("the Ray engine needs ray", hint="pip install -e '.[scale]' (scripts/setup.sh does)") from e
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS") or None
        ray.init(address=address, include_dashboard=False, logging_level="ERROR", log_to_driver=True,
                 configure_logging=True, ignore_reinit_error=True)
    return ray


def _ray_options(res: dict) -> dict:
    known = {"num_cpus", "num_gpus", "memory"}
    opts = {k: v for k, v in res.items() if k in known}
    custom = {k: v for k, v in res.items() if k not in known}
    return opts | ({"resources": custom} if custom else {})


def _get(ray, ref):
    from ray.exceptions import RayTaskError

    try:
        return ray.get(ref)
    except RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise
