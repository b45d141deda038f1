#!/usr/bin/env bash
# A Python 3.12 virtual environment shaped like the GPU image, for `IMAGE_PY=... bash scripts/gpu_rehearse.sh`: the
# card's own torch build (2.11.0+cu130 from PyPI; it runs on a CPU, CUDA unavailable), transformers and the other
# versions the device tool's KINDS.md lists for that image, and the image packages that qgate's device call and the
# libraries it carries import. Nothing of qgate's own is installed: the rehearsal adds .whl/ and src/ as the card
# does. About 3 minutes and 5 GB (the CUDA libraries torch's wheel depends on). Prints the environment's Python.
#   bash scripts/image_venv.sh [DIR]        # DIR: default ~/.cache/qgate/image312; PY312: the python3.12 to use
set -euo pipefail
dir=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/qgate/image312}
py=${PY312:-$(command -v python3.12 || true)}
[ -n "$py" ] && "$py" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null \
  || { echo "image_venv: no Python 3.12 (the card's); set PY312 to one" >&2; exit 1; }
# Versions KINDS.md names for the image (its "pip list" row, read 2026-11-17); the rest of the list unpinned.
PINS="torch==2.11.0 transformers==5.17.0 tokenizers==0.23.2 safetensors==0.8.0 huggingface_hub==1.33.0
accelerate==1.15.0 numpy==2.5.2 triton==3.6.0 onnx==1.23.1 onnxruntime==1.30.0 sentencepiece==0.2.2 tiktoken==0.14.0"
IMAGE="scipy pyarrow pyyaml pandas matplotlib scikit-learn pytest hypothesis rich psutil requests tqdm jinja2 regex
xxhash aiohttp fsspec filelock packaging pillow typing-extensions networkx sympy sacrebleu nvidia-ml-py py-cpuinfo lxml
tabulate portalocker colorama"
[ -x "$dir/bin/python" ] || "$py" -m venv "$dir"
# shellcheck disable=SC2086
"$dir/bin/python" -m pip install -q --disable-pip-version-check $PINS $IMAGE 2>&1 | (grep -v "is ignored" || true)
"$dir/bin/python" -c "import sys, torch, transformers; print('image_venv:', sys.version.split()[0], torch.__version__,
  transformers.__version__, 'cuda', torch.cuda.is_available())" >&2
echo "$dir/bin/python"
