"""The one seam where work is fanned out: the same function on the same arguments, serially, in local processes or
as Ray tasks.

    for result in map_ordered(scan_partition, [(p, cfg) for p in parts], executor="ray"):   # results in input order

`executor="serial"` (the default everywhere) calls the function in this process. `executor="processes"` runs the calls
in one spawned process per core of this machine (no extra needed; CPU work only: it places no GPUs). `executor="ray"`
runs each call as a Ray task with the given resources (`{"num_cpus": 1, "num_gpus": 1, "memory": ...}` or custom
resources); Ray starts locally unless RAY_ADDRESS points at a cluster, whose nodes must have this machine's qgate
and dependencies: a worker that does not (`environment`) refuses the call before running it. Both yield the results
in input order as they complete, from a window of calls submitted ahead, so the driver holds a few results at a
time; an exception raised in a call is raised again here as itself, so a bad partition reads the same under every
executor.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from qgate.errors import BackendUnavailable, ConfigError, QgateError

EXECUTORS = ("serial", "processes", "ray")


def check_executor(executor: str, allowed: tuple[str, ...] = EXECUTORS) -> str:
    if executor not in allowed:
        raise ConfigError(f"unknown executor {executor!r}; choose one of {', '.join(allowed)}")
    return executor


def map_ordered(
    fn: Callable[..., Any],
    calls: Iterable[tuple],
    executor: str = "serial",
    resources: list[dict] | dict | None = None,
    stop_after: Callable[[Any], bool] | None = None,
) -> Iterator[Any]:
    """fn(*args) for each args in calls, in order. calls may be a lazy iterator: each is taken when it is submitted
    (a window ahead of the result awaited), so a long stream of calls is never held whole. resources: one dict for
    every task, or one per call (then calls is a list of the same length).
    stop_after: a result for which it is true ends the submitting, as an exception does, but the calls already
    submitted still run and their results are yielded (a caller that returns its failures as results loses none of
    the work in flight)."""
    stop = stop_after or (lambda _: False)
    if check_executor(executor) == "serial":
        for args in calls:
            yield (result := fn(*args))
            if stop(result):
                return
        return
    if executor == "processes":
        yield from _in_processes(fn, calls, resources, stop)
        return
    ray = ray_session()
    of_call = (lambda j: resources[j]) if isinstance(resources, list) else (lambda j: resources or {})
    here = environment()
    task = ray.remote(_checked)
    # Tasks are submitted in a window ahead of the one awaited: after a failure nothing more is submitted, and the
    # driver waits for the few already submitted instead of cancelling them (ray.cancel racing a finishing task
    # aborts the driver in Ray 2.60: "Tried to complete task that was not pending").
    window = 2 * workers("ray")
    submitted: list = []
    try:
        yield from _windowed(
            calls,
            window,
            lambda j, args: task.options(**_ray_options(of_call(j))).remote(here, fn, *args),
            lambda i, ref: _get(ray, ref),
            stop,
            submitted,
        )
    except KeyboardInterrupt:  # Ctrl-C: the tasks end with this driver's job; waiting for them could take hours
        submitted.clear()
        raise
    finally:
        pending = [ref for ref in submitted if ref is not None]
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=None)  # nothing left running behind the caller


def _windowed(
    calls: Iterable[tuple],
    window: int,
    submit: Callable[[int, tuple], Any],
    get: Callable[[int, Any], Any],
    stop: Callable[[Any], bool],
    submitted: list,
) -> Iterator[Any]:
    """The results of the calls in order, each call taken from `calls` and submitted (`submit(j, args)`: its handle,
    appended to `submitted`) up to `window` ahead of the one awaited (`get(i, handle)`). After a result `stop` flags
    nothing more is submitted, and the calls already submitted are still awaited and yielded. A yielded call's handle
    becomes None (its result is not held beside the next ones); the caller cleans up the others (an error leaves them
    as they are)."""
    todo = iter(calls)
    more, i = True, 0
    while True:
        while more and len(submitted) < i + window:
            args = next(todo, None)
            if args is None:
                more = False
            else:
                submitted.append(submit(len(submitted), args))
        if i == len(submitted):
            return
        result = get(i, submitted[i])
        submitted[i] = None
        more = more and not stop(result)
        yield result
        i += 1


LIBRARIES = ("torch", "transformers", "llmcompressor", "compressed-tensors", "onnxruntime-genai", "mlflow", "lm-eval")
# whose behaviour a gate verdict depends on: `qgate --version` and every gate report name their versions


def versions(names: tuple[str, ...]) -> dict[str, str]:
    """Each named distribution's installed version ("not installed" for one that is not)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def releases(names: tuple[str, ...]) -> dict[str, str]:
    """versions() without local build labels: torch 2.13.0+cpu and 2.13.0+cu128 are one release built for two kinds of
    hardware."""
    return {name: v.split("+", 1)[0] for name, v in versions(names).items()}


@functools.lru_cache(maxsize=4)
def environment(names: tuple[str, ...] | None = None) -> dict[str, str]:
    """What a result made in this process depends on: Python's version, the sha256 of qgate's source files, and the
    versions of the distributions named (by default qgate's own dependencies, extras left out), without their local
    build labels: a CPU driver's torch 2.13.0+cpu and a GPU node's 2.13.0+cu128 are one release built for two kinds of
    hardware, and the chains run on the nodes."""
    import re
    import sys
    from importlib.metadata import PackageNotFoundError, requires
    from pathlib import Path

    import qgate
    from qgate.artifact import sha256_tree

    if names is None:
        try:
            reqs = requires("qgate") or ()
        except PackageNotFoundError:  # run from a source tree: its source is still compared
            reqs = ()
        names = tuple(re.split(r"[\s;<>=!~\[(]", r, maxsplit=1)[0] for r in reqs if "extra ==" not in r)
    out = {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "qgate source": sha256_tree(Path(qgate.__file__).parent, suffix=".py")[:16],
    }
    return out | releases(names)


def _checked(expected: dict[str, str], fn: Callable[..., Any], *args) -> Any:
    """fn(*args) in a Ray worker whose environment is the caller's (`environment`), else nothing run: a chain or a
    scan made by other code or other library versions is not what the gates judged and the artifacts record."""
    import socket

    got = environment(tuple(k for k in expected if k not in ("python", "qgate source")))
    diff = [f"{k} {got[k]} there, {v} here" for k, v in expected.items() if got.get(k) != v]
    if diff:
        raise ConfigError(
            f"a Ray worker on {socket.gethostname()} runs other code than this machine: {'; '.join(diff)}; "
            f"nothing was run there",
            hint=_SAME_CODE,
        )
    return fn(*args)


_SAME_CODE = (
    "give the cluster's nodes the driver's qgate and dependencies (one container image for both, or the same "
    "`pip install`), then run again"
)
_NO_IMPORT = "failed to import on the worker"  # Ray's words (2.x) when a worker cannot unpickle the task's function


def _in_processes(
    fn: Callable[..., Any], calls: Iterable[tuple], resources, stop: Callable[[Any], bool]
) -> Iterator[Any]:
    """The calls in spawned worker processes, one per core (a forked child would inherit the reading threads and
    locks of this one). After a failure nothing more is submitted, calls not yet started are cancelled, and the
    running ones are waited for before the error is raised."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    for res in resources if isinstance(resources, list) else [resources or {}]:
        if set(res) - {"num_cpus", "memory"}:
            raise ConfigError(
                f"the processes executor runs CPU work on this machine only; it cannot place "
                f"{', '.join(sorted(set(res) - {'num_cpus', 'memory'}))}",
                hint="use the ray executor for tasks that need GPUs or custom resources",
            )
    procs = local_cores() if not isinstance(calls, list) else max(1, min(len(calls), local_cores()))
    window = 2 * procs

    def get(i: int, future) -> Any:
        try:
            return future.result()
        except BrokenProcessPool as e:
            of = f" of {len(calls)}" if isinstance(calls, list) else ""
            raise QgateError(
                f"a worker process of the processes executor died while running {getattr(fn, '__name__', fn)} "
                f"(call {i + 1}{of}): killed, or out of memory",
                hint="re-run with the serial executor to see the failure in this process; a script that "
                'calls qgate with this executor needs an `if __name__ == "__main__":` guard (each '
                "worker imports the script, and one without it starts the job again)",
            ) from e

    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
        submitted: list = []
        try:
            yield from _windowed(calls, window, lambda j, args: pool.submit(fn, *args), get, stop, submitted)
        finally:
            for f in submitted:
                if f is not None:
                    f.cancel()


def local_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def workers(executor: str) -> int:
    """How many calls `map_ordered` runs at once on this executor: 1 serially, a process per core of this machine, or
    the CPUs of the Ray cluster (connecting to it)."""
    if check_executor(executor) == "serial":
        return 1
    if executor == "processes":
        return local_cores()
    return max(1, int(ray_session().cluster_resources().get("CPU", 1)))


def ray_session():
    """Ray, connected: to RAY_ADDRESS when set, else a local instance started for this process."""
    try:
        import ray
    except ImportError as e:
        raise BackendUnavailable(
            "the Ray executor needs ray", hint="pip install -e '.[scale]' (scripts/setup.sh does)"
        ) from e
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS") or None
        ray.init(
            address=address,
            include_dashboard=False,
            logging_level="ERROR",
            log_to_driver=True,
            configure_logging=True,
            ignore_reinit_error=True,
        )
    return ray


def unplaceable(resources: list[dict]) -> tuple[list[tuple[int, dict]], dict, bool]:
    """([(index, what the task asks of one node)] for each task that no alive node of the Ray cluster can hold now,
    the largest node's resources, whether that cluster is a local instance with no autoscaler to add nodes: there
    such a task would wait forever). A task asks for one CPU unless it says otherwise, as Ray's tasks do."""
    ray = ray_session()
    nodes = [
        {k: v for k, v in n["Resources"].items() if not k.startswith(("node:", "object_store_memory"))}
        for n in ray.nodes()
        if n.get("Alive")
    ]
    names = {"num_cpus": "CPU", "num_gpus": "GPU"}
    out = []
    for i, res in enumerate(resources):
        need = {"CPU": 1.0} | {names.get(k, k): float(v) for k, v in res.items() if v}
        if not any(all(node.get(k, 0.0) >= v for k, v in need.items()) for node in nodes):
            out.append((i, need))
    largest = max(nodes, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0)), default={})
    return out, largest, not os.environ.get("RAY_ADDRESS")


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
        if isinstance(cause, RuntimeError) and _NO_IMPORT in str(cause):  # a node without (a working) qgate
            import re

            why = [line for line in str(cause).splitlines() if line.strip()][-1]
            node = re.search(r"\bip=([^\s,)]+)", str(e))  # Ray names the worker "ray::fn() (pid=..., ip=...)"
            raise ConfigError(
                f"a Ray worker on {node[1] if node else 'a cluster node'} could not import qgate's code ({why}); "
                f"nothing was run there",
                hint=_SAME_CODE,
            ) from None
        if isinstance(cause, Exception):
            raise cause from None
        raise
