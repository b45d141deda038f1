"""Every `qgate <command> --flag` that the docs, scripts, specs and the code's own hints write names a flag of that
command, so a renamed or removed option cannot leave a line that teaches it."""

import re
from pathlib import Path

import typer

from qgate.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
WRITTEN = ("README.md", "docs", "benchmarks", "pipelines", "scripts", ".ci", "deploy", "src/qgate", "tests")
SUFFIXES = {".md", ".py", ".sh", ".yaml", ".yml", ".toml", ""}
# `qgate`, or a path ending in bin/qgate, then command words, then the rest of the shell line
COMMAND = re.compile(r"(?:^|[`\s\"'(])(?:[.\w/-]*bin/)?qgate ((?:[a-z][a-z-]* ?)+)([^`\n|;&)]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _files():
    for name in WRITTEN:
        top = ROOT / name
        for path in [top] if top.is_file() else sorted(top.rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts:
                yield path


def _command(root, words):
    """The deepest command the words name, and how many words named it."""
    cmd, used = root, 0
    for word in words:
        if not (hasattr(cmd, "commands") and word in cmd.commands):
            break
        cmd, used = cmd.commands[word], used + 1
    return cmd, used


def written_flags(text: str, root) -> list[tuple[int, str, str]]:
    """(line, command, flag) for every flag written after `qgate <command>` in text that the command lacks."""
    unknown = []
    for m in COMMAND.finditer(text):
        words = m.group(1).split()
        cmd, used = _command(root, words)
        if used == 0 or hasattr(cmd, "commands"):  # prose ("qgate runs ..."), or a group whose --help is meant
            continue
        opts = {"--help"}
        for param in cmd.params:
            opts.update(param.opts)
            opts.update(param.secondary_opts)
        for flag in FLAG.findall(" ".join(words[used:]) + " " + m.group(2)):
            if flag not in opts:
                unknown.append((text.count("\n", 0, m.start()) + 1, " ".join(words[:used]), flag))
    return unknown


def test_a_written_command_line_is_checked_against_the_cli():
    root = typer.main.get_command(app)
    text = "Run `qgate gate --candidate C --device cuda --devcie cuda`,\nthen qgate engine build --bakend torch-int4.\n"
    assert written_flags(text, root) == [(1, "gate", "--devcie"), (2, "engine build", "--bakend")]
    assert written_flags("qgate runs the stages; `.venv/bin/qgate run spec.yaml --wait 5`", root) == []


def test_every_flag_written_after_a_qgate_command_is_one_it_takes():
    root = typer.main.get_command(app)
    unknown = [
        f"{path.relative_to(ROOT)}:{line}: `qgate {command}` has no {flag}"
        for path in _files()
        if path.name != Path(__file__).name
        for line, command, flag in written_flags(path.read_text(errors="replace"), root)
    ]
    assert not unknown, "\n".join(unknown)
