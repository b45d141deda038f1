"""The house style, checked where CI runs: ruff's lint rules and its formatter, as configured in pyproject.toml, over
the code and the Python blocks of the Markdown docs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("src", "tests", "scripts", "benchmarks", "docs", "README.md")


def _ruff() -> str:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert found, "ruff is not installed: it is a dev dependency (pip install -e '.[dev]')"
    return found


def test_ruff_lint_is_clean():
    p = subprocess.run(
        [_ruff(), "check", "--output-format", "concise", *TREES], cwd=ROOT, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]


def test_ruff_format_is_clean():
    p = subprocess.run([_ruff(), "format", "--check", *TREES], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, "run `ruff format`: " + p.stdout[-4000:] + p.stderr[-2000:]


def test_the_spec_reference_is_generated_from_the_configs():
    """docs/spec.md lists every spec key with the default the code uses: regenerated, it must not change."""
    p = subprocess.run(
        [sys.executable, "scripts/spec_reference.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr


def test_docs_link_only_to_files_that_exist():
    """Every relative link in README.md and docs/*.md names a file of this checkout."""
    import re

    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
