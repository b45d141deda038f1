#!/usr/bin/env bash
# One call on a GPU machine (docs/gpu.md, "A session with a GPU machine"): install the wheels `scripts/gpu_wheels.sh`
# put in .whl/, run the 8B scale benchmark, then the gpu-marked tests in the time left, then qgate's own commands on a
# toy model (scripts/gpu_cli.sh) if 100 s are still left. Logs, scale.json and its picture (scale.png) go to $OUT.
# Exit code 1 when a step failed or ran out of time (the gate's FAIL on the toy is a verdict, not a failure).
#   bash scripts/gpu_session.sh [SECONDS [ARGS for benchmarks/gpu_scale.py...]]     # SECONDS: the whole budget (560)
set -uo pipefail
budget=${1:-560}
shift || true
start=$SECONDS
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  2>&1 | tail -3 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}   # after any path the caller set (a rehearsal's)
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TQDM_DISABLE=1 TOKENIZERS_PARALLELISM=false
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
  nproc
  python3 -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
  echo "compilers: $(command -v gcc cc nvcc | tr '\n' ' ')"
  free -g | head -2
  df -h /dev/shm /tmp | tail -2
} >"$OUT/host.txt" 2>&1
cat "$OUT/host.txt"
# the 8B run's checkpoints (~16 + 5.5 + 4.5 GB) in memory when /dev/shm has room, else on disk
shm=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
work=/tmp/scale
[ "${shm:-0}" -ge 40 ] && work=/dev/shm/scale
failed=0
tests=${GPU_TESTS:-1}   # GPU_TESTS=0: the scale run alone, with the whole budget
timeout $((budget - 150 * tests - 5)) python3 benchmarks/gpu_scale.py --tokenizer .whl/tokenizer --out "$work" \
  --json "$OUT/scale.json" "$@" 2>&1 | grep -v "it/s\]$" | tee "$OUT/scale.log" || { echo "scale run: rc $?"; failed=1; }
rm -rf "$work"
left=$((budget - (SECONDS - start)))
echo "tests: ${left} s left"
if [ "$tests" = 1 ] && [ "$left" -gt 20 ]; then
  timeout "$left" python3 -m pytest -q -m gpu tests/engines --durations=20 -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu-tests.log" | tail -30 || failed=1
elif [ "$tests" = 1 ]; then
  echo "tests: not run, no time left"
  failed=1
fi
left=$((budget - (SECONDS - start)))
if [ "$left" -gt 100 ]; then
  timeout "$left" bash scripts/gpu_cli.sh /tmp/gpu-cli 2>&1 | tee "$OUT/cli.log" || failed=1
  cp /tmp/gpu-cli/gate/report.json "$OUT/cli-gate-report.json" 2>/dev/null
fi
echo "total $((SECONDS - start)) s"
exit "$failed"
