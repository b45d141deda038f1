"""The CLI boundary: usage errors, aborts and exit codes, as a user in a shell sees them."""
import pytest
import typer

from qgate.cli import main as cli_main
from qgate.cli.main import main


@pytest.mark.parametrize("argv, message, see", [
    (["promote", "--model", "x"], "Missing option '--version'", "qgate promote --help"),
    (["promote", "--model", "x", "--version", "1", "--bogus"], "No such option: --bogus", "qgate promote --help"),
    (["nosuch"], "No such command 'nosuch'", "qgate --help"),
    (["calibrate", "sample", "--traffic", "t", "--out", "o", "--calib-size", "abc"], "Invalid value for '--calib-size'",
     "qgate calibrate sample --help"),
    (["gate"], "Missing option '--candidate'", "qgate gate --help"),
    (["run"], "Missing argument 'spec'", "qgate run --help"),
    (["verify", "--model", "m", "--alias"], "requires an argument", "qgate verify --help"),
])
def test_usage_errors_say_usage_error_and_where_to_look(argv, message, see, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    first, second = err.strip().splitlines()[:2]
    assert first.startswith("usage error: ") and message in first
    assert second.strip() == f"see: {see}"
    assert "internal error" not in err and "Traceback" not in err


def test_bare_group_prints_its_help_and_exits_1(capsys):
    assert main(["calibrate"]) == 1
    out = capsys.readouterr()
    assert "sample" in out.out + out.err and "internal error" not in out.err


def test_abort_and_interrupt_exit_130(monkeypatch, capsys):
    def boom(*a, **k):
        raise typer.Abort()

    monkeypatch.setattr(cli_main, "_dispatch", boom)
    assert main(["--help"]) == 130
    assert capsys.readouterr().err.strip() == "aborted"
