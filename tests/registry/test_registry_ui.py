"""The registry UI as a person sees it: a real `mlflow server` and headless Chromium render a registered version's page.

The version page must show qgate's Markdown description (verdict heading, the checks table, lineage, the report's
runs:/ URI), rendered by MLflow's own UI, not just stored. (The README's docs/img/mlflow-version.png is the same page
for the demo's promoted version, taken with the same Chromium flags.)
"""

import shutil
import subprocess

import pytest
from servers import mlflow_server

from qgate.registry.mlflow_store import register

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: scripts/setup.sh installs it with apt-get")


def _chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            CHROMIUM,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            "--virtual-time-budget=20000",
            "--window-size=1400,1700",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_version_page_renders_the_gate_evidence(gated, w8_art, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ok, _ = gated
    store = tmp_path / "mlflow"
    version = register(ok, w8_art, "tiny-llm", store)
    with mlflow_server(tmp_path, db=store / "mlflow.db") as url:
        page = f"{url}/#/models/tiny-llm/versions/{version}"
        run = _chromium("--dump-dom", page)
        dom = run.stdout
        shot = tmp_path / "version.png"
        _chromium(f"--screenshot={shot}", page)
    assert "qgate gate:" in dom and "PASS" in dom, (
        dom[-1500:],
        run.stderr[-1500:],
    )  # the description's verdict heading, rendered
    assert "shadow.kl_mean" in dom and "95% CI" in dom  # its checks table
    assert "runs:/" in dom and "gate-report/report.html" in dom  # where the full report is
    assert "qgate.gate_verdict" in dom  # the tags people filter on
    from PIL import Image

    img = Image.open(shot).convert("L")
    assert img.size == (1400, 1700)
    dark = sum(1 for p in img.getdata() if p < 200) / (img.size[0] * img.size[1])
    assert dark > 0.01, f"screenshot is nearly blank ({dark:.2%} non-white pixels)"
