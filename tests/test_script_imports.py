"""Every name benchmarks/ and scripts/ import from qgate exists there: they run outside the default test run (on the
GPU card, in the device call's rehearsal), so a name moved inside qgate would otherwise break them unseen."""

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_qgate_name_a_benchmark_or_script_imports_exists():
    missing = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "qgate"):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}")
    assert not missing, "\n".join(missing)
