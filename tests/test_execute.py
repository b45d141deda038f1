"""execute.py, the one seam between serial, local-process and Ray execution: order, errors, stop_after, Ctrl-C,
and workers that must run the driver's own code."""

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from qgate.errors import ConfigError, InputError, QgateError


def _slow_or_bad(i: int, marks: str, returned: bool = False):
    """Call 1 fails: raised, or `returned` as a result (as a variant chain returns its failure)."""
    import pathlib
    import time

    if i == 1:
        if returned:
            return ("failed", i)
        raise ValueError(f"bad partition {i}")
    time.sleep(0.3)
    (pathlib.Path(marks) / str(i)).write_text("done")
    return i


def test_a_failing_ray_task_raises_its_own_error_and_leaves_nothing_running(tmp_path):
    """A task's exception reaches the caller as itself; tasks already submitted are waited for, not cancelled (a
    cancel racing a finishing task aborted the whole driver in Ray 2.60), and later calls are never submitted."""
    import time

    ray_cloudpickle = pytest.importorskip("ray.cloudpickle")
    from qgate.execute import map_ordered

    ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    with pytest.raises(ValueError, match="bad partition 1"):
        list(map_ordered(_slow_or_bad, [(i, str(tmp_path)) for i in range(40)], executor="ray"))
    ran = sorted(p.name for p in tmp_path.iterdir())
    time.sleep(1.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ran  # nothing was left running behind the caller
    assert "0" in ran and len(ran) < 20  # the window was awaited; later calls never ran
    assert list(map_ordered(_slow_or_bad, [(0, str(tmp_path)), (2, str(tmp_path))], executor="ray")) == [
        0,
        2,
    ]  # driver alive


@pytest.mark.parametrize("executor", ["serial", "processes", "ray"])
def test_a_result_that_stops_the_submitting_loses_none_of_the_work_in_flight(tmp_path, executor):
    """stop_after: after a result it flags, no more calls are made, and the calls already running finish and are
    yielded, in order: a variant fan-out records every chain that finished beside a failed one."""

    from qgate.execute import map_ordered

    if executor == "ray":
        pytest.importorskip("ray.cloudpickle").register_pickle_by_value(sys.modules[__name__])
    got = list(
        map_ordered(
            _slow_or_bad,
            [(i, str(tmp_path), True) for i in range(40)],
            executor=executor,
            stop_after=lambda r: isinstance(r, tuple),
        )
    )
    assert got[:2] == [0, ("failed", 1)] and got[2:] == list(range(2, len(got))) and len(got) < 12
    if executor == "serial":
        assert len(got) == 2  # nothing else was running
    else:
        assert len(got) > 2  # the calls in flight were yielded, not dropped
    assert sorted(int(p.name) for p in tmp_path.iterdir()) == [0] + got[2:]  # and no call beyond them ran


_INTERRUPTED = """
import os, signal, tempfile, threading, time
from qgate.execute import map_ordered
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, however the test run was started
started = tempfile.mkdtemp()
def nap(i):
    open(os.path.join(started, str(i)), "w").close()
    time.sleep(120)
sent = None
def interrupt():  # Ctrl-C once a task runs and the driver waits on it: on a loaded host Ray takes seconds to get there
    global sent
    while not os.listdir(started):
        time.sleep(0.1)
    time.sleep(2)
    sent = time.perf_counter()
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=interrupt, daemon=True).start()
try:
    list(map_ordered(nap, [(0,), (1,)], "ray"))
    print("FINISHED without an interrupt")
except KeyboardInterrupt:
    print("INTERRUPTED after", round(time.perf_counter() - sent))
"""


def test_ctrl_c_during_a_ray_fan_out_returns_at_once(tmp_path):
    """A failed task makes the driver wait for the tasks in flight (their work is kept), but Ctrl-C does not: the
    tasks end with the driver's job, and a user who stops a run of hour-long chains gets the prompt back now."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", _INTERRUPTED], capture_output=True, text=True, timeout=300, env=env)
    took = re.search(r"INTERRUPTED after (\d+)", out.stdout)
    assert took and int(took[1]) < 60, out.stdout + out.stderr[-3000:]  # seconds after Ctrl-C; the tasks sleep 120 s


def _bad_input(i: int) -> int:
    import os

    if i == 2:
        raise InputError(f"part-{i}.jsonl:7: bad record", hint="fix the writer")
    if i == 9:
        os._exit(1)  # a worker killed mid-call (the OOM killer, a segfault in a native library)
    return i * i


def test_the_processes_executor_keeps_order_raises_each_error_as_itself_and_places_no_gpus(tmp_path):
    """Results in input order from worker processes; a worker's QgateError arrives with its hint; calls not yet
    started after a failure never run; GPU resources, and variant fan-out (which needs them), are refused."""
    from qgate.execute import map_ordered
    from qgate.pipeline.jobs import run_pipeline

    assert list(map_ordered(_bad_input, [(i,) for i in (3, 0, 1)], executor="processes")) == [9, 0, 1]
    with pytest.raises(InputError) as err:
        list(map_ordered(_bad_input, [(i,) for i in range(5)], executor="processes"))
    assert err.value.message == "part-2.jsonl:7: bad record" and err.value.hint == "fix the writer"
    with pytest.raises(ValueError, match="bad partition 1"):
        list(map_ordered(_slow_or_bad, [(i, str(tmp_path)) for i in range(40)], executor="processes"))
    ran = sorted(p.name for p in tmp_path.iterdir())
    assert "0" in ran and len(ran) < 10  # the window was awaited; later calls never ran
    with pytest.raises(
        QgateError, match="worker process of the processes executor died while running _bad_input"
    ) as died:
        list(map_ordered(_bad_input, [(i,) for i in (0, 9, 1)], executor="processes"))
    assert "serial executor" in died.value.hint and 'if __name__ == "__main__":' in died.value.hint
    with pytest.raises(ConfigError, match="cannot place num_gpus\n"):
        list(map_ordered(_bad_input, [(1,)], executor="processes", resources={"num_gpus": 1}))
    with pytest.raises(ConfigError, match="unknown executor 'processes'; choose one of serial, ray"):
        run_pipeline(None, executor="processes")


_OTHER_CODE = """
import sys
import ray
ray.init(runtime_env={"py_modules": [sys.argv[1]]}, include_dashboard=False, logging_level="ERROR")
from qgate.errors import ConfigError
from qgate.execute import map_ordered
try:
    print("RAN", list(map_ordered(sys.argv.append, [("ran on the worker",)], "ray")))
except ConfigError as e:
    print("REFUSED", e)
"""


def test_a_ray_worker_with_other_qgate_code_runs_nothing(tmp_path, monkeypatch):
    """Ray tasks run on whatever the cluster's nodes have installed: a worker whose qgate source (or a dependency's
    version) is not the driver's refuses the call before running it, so a scan or a variant chain is never made by
    code other than what the artifacts record. Here the workers import an edited copy of qgate (runtime_env), then a
    copy that fails to import at all, which Ray reports in its own words: qgate names the node and the fix."""
    import subprocess

    import qgate

    copy = tmp_path / "mods" / "qgate"
    shutil.copytree(Path(qgate.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "calibrate" / "words.py").write_text(
        (copy / "calibrate" / "words.py").read_text() + "\n# edited on the cluster\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run(
        [sys.executable, "-c", _OTHER_CODE, str(copy)], capture_output=True, text=True, timeout=600, env=env
    )
    assert "REFUSED a Ray worker on" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "qgate source" in out.stdout and "nothing was run there" in out.stdout and "RAN" not in out.stdout
    (copy / "__init__.py").write_text('raise ImportError("no module named qgate.calibrate (a broken install)")\n')
    out = subprocess.run(
        [sys.executable, "-c", _OTHER_CODE, str(copy)], capture_output=True, text=True, timeout=600, env=env
    )
    assert re.search(
        r"REFUSED a Ray worker on [0-9a-f.:]+ could not import qgate's code \(ImportError: no module named "
        r"qgate\.calibrate \(a broken install\)\); nothing was run there",
        out.stdout,
    ), out.stdout + out.stderr[-3000:]
    from importlib.metadata import version

    import qgate.execute
    from qgate.execute import environment, releases

    here = environment()  # releases, not builds
    assert here["torch"] == version("torch").split("+")[0] and here["pyarrow"] == version("pyarrow")
    # a +cpu build and a +cu128 one are one release; PyPI's CUDA wheels record none in their metadata
    monkeypatch.setattr(qgate.execute, "versions", lambda names: dict.fromkeys(names, "2.13.0+cpu"))
    assert releases(("torch", "pyarrow")) == {"torch": "2.13.0", "pyarrow": "2.13.0"}
