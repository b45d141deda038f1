"""Every `qgate <command> --flag` that the docs, scripts, specs and the code's own hints write names a flag of that
command, so a renamed or removed option cannot leave a line that teaches it."""

import re
from pathlib import Path

from qgate.cli.main import named_command

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


def written_flags(text: str) -> list[tuple[int, str, str]]:
    """(line, command, flag) for every flag written after `qgate <command>` in text that the command lacks."""
    unknown = []
    for m in COMMAND.finditer(text):
        words = m.group(1).split()
        cmd, named = named_command(words)
        if not named or hasattr(cmd, "commands"):  # prose ("qgate runs ..."), or a group whose --help is meant
            continue
        opts = {"--help"}
        for param in cmd.params:
            opts.update(param.opts)
            opts.update(param.secondary_opts)
        for flag in FLAG.findall(" ".join(words[len(named) :]) + " " + m.group(2)):
            if flag not in opts:
                unknown.append((text.count("\n", 0, m.start()) + 1, " ".join(named), flag))
    return unknown


def test_a_written_command_line_is_checked_against_the_cli():
    text = "Run `qgate gate --candidate C --device cuda --devcie cuda`,\nthen qgate engine build --bakend torch-int4.\n"
    assert written_flags(text) == [(1, "gate", "--devcie"), (2, "engine build", "--bakend")]
    assert written_flags("qgate runs the stages; `.venv/bin/qgate run spec.yaml --wait 5`") == []


def test_every_flag_written_after_a_qgate_command_is_one_it_takes():
    unknown = [
        f"{path.relative_to(ROOT)}:{line}: `qgate {command}` has no {flag}"
        for path in _files()
        if path.name != Path(__file__).name
        for line, command, flag in written_flags(path.read_text(errors="replace"))
    ]
    assert not unknown, "\n".join(unknown)
