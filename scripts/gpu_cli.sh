#!/usr/bin/env bash
# qgate's own commands, one after another, on a toy Llama built with random weights on the default device
# (benchmarks/gpu_scale.py's "tiny" shape, SmolLM2's tokenizer): calibrate on the demo's traffic, quantize (GPTQ
# W4A16), build the torch-int4 engine (CUDA graphs on a GPU) and gate it with pipelines/gpu.yaml's gates, scored on
# the same device (--device auto). What a GPU user types, through the CLI, where gpu_scale.py calls the functions.
# Each step prints its exit code; the script ends with the gate's verdict, where it scored and its exit code (0 PASS,
# 2 FAIL or blocked: both mean the commands worked; 1 or another code: they did not). gpu_session.sh runs it in the
# time its other steps leave.
#   bash scripts/gpu_cli.sh [WORKDIR]           # PY: the Python that runs qgate (python3)
set -uo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/gpu-cli}
PY=${PY:-python3}
rm -rf "$work" && mkdir -p "$work"
qgate() { "$PY" -c "import sys; from qgate.cli.main import entry; sys.argv[0] = 'qgate'; entry()" "$@"; }
step() {  # step NAME COMMAND...: run it, print its exit code, stop the script on an error
  local t=$SECONDS
  "${@:2}" >"$work/$1.log" 2>&1
  local rc=$?
  echo "cli: $1 rc $rc ($((SECONDS - t)) s)"
  if [ "$rc" != 0 ] && ! { [ "$1" = gate ] && [ "$rc" = 2 ]; }; then  # a gate's FAIL (2) is a verdict, not an error
    tail -15 "$work/$1.log"
    exit "$rc"
  fi
}
step model "$PY" -c "
import sys
from pathlib import Path
sys.path.insert(0, 'benchmarks')
from gpu_scale import build_model
from qgate.device import resolve_device
build_model('tiny', Path('.whl/tokenizer'), Path('$work/base'), resolve_device('auto'))
"
step calibrate qgate calibrate sample --traffic data/demo/traffic.jsonl --out "$work/calib" --calib-size 64 \
  --shadow-size 48 --seed 0
step quantize qgate quantize --model "$work/base" --scheme gptq-w4a16 --group-size 64 --calib "$work/calib/calib" \
  --max-seq-length 256 --out "$work/gptq"
step engine qgate engine build --backend torch-int4 --checkpoint "$work/gptq" --profile "$work/calib/profile" \
  --out "$work/engine"
step gate qgate gate --candidate "$work/engine" --baseline "$work/base" --shadow "$work/calib/shadow" \
  --spec pipelines/gpu.yaml --cache "$work/cache" --device auto --out "$work/gate"
"$PY" -c "
import json
r = json.load(open('$work/gate/report.json'))
print('cli: gate', r['verdict'], 'scored in', r['inputs']['numerics'], 'on', r['inputs']['scored_on'])
print('cli: timings', json.dumps(r['timings']))
"
