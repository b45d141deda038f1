#!/usr/bin/env bash
# The device call's Python steps (scripts/gpu_session.sh) rehearsed on this CPU with only the modules the GPU image
# would have: every module that neither the image holds nor .whl/ carries is hidden (scripts/image_only.py), so an
# import that would fail on the card fails here. Then qgate's commands on the toy model (gpu_cli.sh), the scale run's
# tiny shape with --profile, and the gpu tests (they skip without CUDA; their modules still import). Each step's exit
# code is printed, then the hidden modules something asked for. Run `bash scripts/gpu_wheels.sh` first. By default
# the interpreter is this machine's .venv (Python 3.11, the CPU torch): what it checks is the module set. With
# IMAGE_PY, a Python shaped like the image (scripts/image_venv.sh: 3.12, the card's torch build), the call's own
# script runs as the call will, `python3` that Python, with the tiny shape (gpu_session.sh $BUDGET --shape tiny
# --no-dense --profile): its wheel install, paths, budget and exit code, and the versions, are checked; CUDA is not.
# BUDGET is the call's 560 s unless set: this CPU runs the tiny shape slower than the card runs the 8B one, so a
# rehearsal that runs out of time with every step's exit code 0 can be repeated with BUDGET=900.
#   bash scripts/gpu_rehearse.sh [OUT]      # KINDS: the image's package list (/work/.library/device/KINDS.md)
#   IMAGE_PY=$(bash scripts/image_venv.sh) bash scripts/gpu_rehearse.sh [OUT]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/gpu-rehearsal}
KINDS=${KINDS:-/work/.library/device/KINDS.md}
PY=${IMAGE_PY:-${PY:-.venv/bin/python}}
[ -f .whl/tokenizer/tokenizer.json ] || { echo "no .whl/tokenizer: run bash scripts/gpu_wheels.sh first" >&2; exit 1; }
rm -rf "$out" && mkdir -p "$out/site"
"$PY" scripts/image_only.py "$KINDS" .whl >"$out/hidden.txt" || exit 1
cp scripts/image_only.py "$out/site/sitecustomize.py"
echo "rehearsal: $("$PY" -c "import sys, torch; print('Python', sys.version.split()[0], 'torch', torch.__version__)")"
echo "rehearsal: $(wc -l <"$out/hidden.txt") modules hidden (in neither the image nor .whl/): $out/hidden.txt"
export PYTHONPATH=$out/site QGATE_HIDDEN=$out/hidden.txt QGATE_HIDDEN_LOG=$out/asked.log
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TQDM_DISABLE=1 TOKENIZERS_PARALLELISM=false
failed=0
run() {  # run NAME COMMAND...: its output to $out/NAME.log, its exit code printed
  local t=$SECONDS
  "${@:2}" >"$out/$1.log" 2>&1
  local rc=$?
  echo "rehearsal: $1 rc $rc ($((SECONDS - t)) s)"
  [ "$rc" = 0 ] || { tail -15 "$out/$1.log"; failed=1; }
}
if [ -n "${IMAGE_PY:-}" ]; then  # gpu_session.sh puts .whl/ and src/ before this path, as on the card
  run session env PATH="$(dirname "$PY"):$PATH" OUT="$out/session" bash scripts/gpu_session.sh "${BUDGET:-560}" \
    --shape tiny --no-dense --profile "$out/session"
  grep -hE "^(cli|tests): |^total |^[0-9]+ (passed|failed|skipped)" "$out/session.log" | sed 's/^/rehearsal:   /'
else
  run cli env PY="$PY" bash scripts/gpu_cli.sh "$out/cli"
  run scale "$PY" benchmarks/gpu_scale.py --shape tiny --tokenizer .whl/tokenizer --out "$out/scale" --no-dense \
    --json "$out/scale.json" --profile "$out"
  run gpu-tests "$PY" -m pytest -q -m gpu tests/engines -p no:cacheprovider
fi
echo "rehearsal: hidden modules asked for: $(sort "$out/asked.log" 2>/dev/null | uniq -c | awk '{printf "%s (%s) ", $2, $1}')"
exit "$failed"
