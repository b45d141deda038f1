"""Artifacts: a stage's output is built whole or not at all."""

from pathlib import Path

import pytest

from qgate.artifact import Artifact


def test_a_failed_build_leaves_the_previous_output_and_no_temporary(tmp_path):
    from qgate.artifact import build_atomically

    out = tmp_path / "out"
    first = build_atomically(
        out, lambda t: (t.mkdir(), (t / "f").write_text("v1"), Artifact.create("engine", t, {}))[-1]
    )

    def broken(t: Path):
        t.mkdir()
        (t / "f").write_text("half")
        raise RuntimeError("killed halfway")

    try:
        build_atomically(out, broken)
    except RuntimeError:
        pass
    assert (out / "f").read_text() == "v1" and Artifact.load(out).sha256 == first.sha256
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_output_path_holding_anything_but_a_qgate_output_is_refused_before_the_build(tmp_path):
    """A mistyped --out (the traffic log, a directory of partitions) must not be replaced and then removed."""
    from qgate.artifact import build_atomically
    from qgate.errors import InputError

    calls = []

    def build(t: Path):
        calls.append(t)
        t.mkdir()
        (t / "calib").mkdir()
        (t / "calib" / "data.jsonl").write_text("{}\n")
        return Artifact.create("calibration-set", t / "calib", {})

    log = tmp_path / "traffic.jsonl"
    log.write_text('{"prompt": "hi"}\n')
    parts = tmp_path / "logs"
    parts.mkdir()
    (parts / "a.jsonl").write_text('{"prompt": "hi"}\n')
    for out, what in ((log, "a file"), (parts, "a directory that no qgate stage wrote")):
        with pytest.raises(InputError, match=f"output path is {what}; it is left as it is"):
            build_atomically(out, build)
    assert log.read_text() == '{"prompt": "hi"}\n' and [p.name for p in parts.iterdir()] == ["a.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "traffic.jsonl"] and calls == []

    (tmp_path / "empty").mkdir()
    first = build_atomically(tmp_path / "empty", build)  # an empty directory, then a qgate output: replaced
    again = build_atomically(tmp_path / "empty", build)
    assert first.sha256 == again.sha256 and len(calls) == 2
    with pytest.raises(InputError, match=f"cannot write an output there: {log} is not a directory"):
        build_atomically(log / "out", build)


def test_a_killed_build_left_by_a_process_of_the_same_pid_does_not_block_the_next(tmp_path):
    """In a container each run's process often gets the same PID as the killed one's."""
    import os

    from qgate.artifact import build_atomically

    left = tmp_path / f".out.tmp-{os.getpid()}"
    left.mkdir()
    (left / "f").write_text("half")
    art = build_atomically(
        tmp_path / "out", lambda t: (t.mkdir(), (t / "f").write_text("v1"), Artifact.create("engine", t, {}))[-1]
    )
    assert (art.path / "f").read_text() == "v1" and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_loading_a_missing_path_says_it_is_missing_and_a_bare_directory_that_it_has_no_manifest(tmp_path):
    from qgate.errors import InputError

    with pytest.raises(InputError, match=r"nope: no such file or directory") as missing:
        Artifact.load(tmp_path / "nope")
    assert "manifest" not in str(missing.value)
    (tmp_path / "bare").mkdir()
    with pytest.raises(InputError, match=r"bare: no qgate manifest \(qgate-artifact.json\) found"):
        Artifact.load(tmp_path / "bare")
