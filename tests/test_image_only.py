"""scripts/image_only.py: the rehearsal of a device call hides what the GPU image lacks, and only that."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from image_only import hidden  # noqa: E402


def _kinds(path: Path, packages: str) -> Path:
    path.write_text(f"# kinds\n\n## Python packages\n\nimage 'cuda' holds these. Packages: {packages}.\n")
    return path


def test_hidden_is_what_neither_the_image_nor_the_wheels_hold(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "PyYAML-6.0-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"")
    names = hidden(_kinds(tmp_path / "KINDS.md", "numpy, scipy, typing_extensions"), wheels)
    assert "numpy" not in names and "scipy" not in names and "typing_extensions" not in names  # the image's
    assert "yaml" not in names  # PyYAML's module, from a carried wheel (names compared normalized)
    assert "torch" in names and "pytest" in names  # installed here, in neither
    assert "qgate" not in names
    with pytest.raises(SystemExit, match="not found: the GPU image's package list"):
        hidden(tmp_path / "absent.md", wheels)


def test_a_hidden_module_is_not_found_and_the_rest_import(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text((ROOT / "scripts/image_only.py").read_text())
    (tmp_path / "hidden.txt").write_text("yaml\n")
    code = (
        "import importlib.util, json\n"
        "print(importlib.util.find_spec('yaml'), importlib.util.find_spec('json') is not None)\n"
        "import yaml\n"
    )
    env = os.environ | {
        "PYTHONPATH": str(site),
        "QGATE_HIDDEN": str(tmp_path / "hidden.txt"),
        "QGATE_HIDDEN_LOG": str(tmp_path / "asked.log"),
    }
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert p.stdout.split() == ["None", "True"]
    assert p.returncode == 1 and "ModuleNotFoundError: No module named 'yaml'" in p.stderr
    assert set((tmp_path / "asked.log").read_text().split()) == {"yaml"}  # asked for, logged; json not
    without = subprocess.run([sys.executable, "-c", "import yaml"], env=env | {"QGATE_HIDDEN": ""})
    assert without.returncode == 0  # nothing hidden without the list
