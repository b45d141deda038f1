"""Artifacts: a stage's output is built whole or not at all."""

from pathlib import Path

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
