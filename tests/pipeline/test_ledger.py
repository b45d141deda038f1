"""The stage ledger: an entry is used only when its artifact is intact and inside the workdir."""

import json
from pathlib import Path

from qgate.artifact import Artifact
from qgate.pipeline.ledger import Ledger


def _stage(r: Ledger, out: Path, calls: list) -> Artifact:
    def build(tmp: Path):
        calls.append(1)
        tmp.mkdir(parents=True)
        (tmp / "data.txt").write_text("payload")
        return Artifact.create("calibration-set", tmp, {"type": "T", "version": 1, "data": {}})

    return r.run("s", {"k": 1}, out, build)


def test_ledger_entries_are_verified_before_a_stage_is_skipped(tmp_path):
    lines, calls = [], []
    w = tmp_path / "w"
    r = Ledger(w, lines.append)
    art = _stage(r, w / "out", calls)
    _stage(Ledger(w, lines.append), w / "out", calls)
    assert len(calls) == 1  # unchanged: skipped
    (w / "out" / "data.txt").write_text("edited")  # edited after it was built
    again = _stage(Ledger(w, lines.append), w / "out", calls)
    assert len(calls) == 2 and again.sha256 == art.sha256
    assert any("changed since it was built" in x for x in lines)
    ledger = json.loads((w / "stages.json").read_text())
    ledger["s"]["paths"] = ["../../../etc"]  # path traversal
    (w / "stages.json").write_text(json.dumps(ledger))
    _stage(Ledger(w, lines.append), w / "out", calls)
    assert len(calls) == 3 and any("points outside the workdir" in x for x in lines)
    (w / "stages.json").write_text('{"s": {"key": ')  # a ledger cut short
    _stage(Ledger(w, lines.append), w / "out", calls)
    assert len(calls) == 4 and any("stages.json is unreadable" in x for x in lines)
    assert sorted(p.name for p in w.iterdir()) == ["out", "stages.json"]  # no temporary directories left
    assert json.loads((w / "out" / "qgate-artifact.json").read_text())["path"] == str((w / "out").absolute())
