#!/usr/bin/env bash
# The GPU checks of issues 26 and 27 in one unattended call, for a lent machine with a short lease (a bare
# Python 3.12 with torch+CUDA and transformers; pydantic from .whl/, made here by ../shared/gpu/wheels.sh):
#
#   BUDGET_S=590 BENCH_GIT_COMMIT=$(git rev-parse HEAD) bash bench/gpu_check.sh      (writes under $OUT)
#
# In order of what the issues' targets need, each part capped so the whole stays within BUDGET_S seconds:
# the gpu test tier; bench/chunk_calls.py (the chunked loss alone: eager, compiled a chunk a call, 8 a call);
# bench/gpu.py's 8 target rows, then the seed shape's one-chunk-a-call row (what 8 chunks a call pays in a
# step); bench/moe.py's loop/grouped pair. Earlier results in bench/results/ are copied into
# $OUT first: bench/gpu.py keeps an earlier row it does not re-measure when the device is the same.
# Prints a summary; logs and JSON stay under $OUT (log.txt, tests.txt, gpu.json, moe.json, *.png).
set -u
cd "$(dirname "$0")/.."
START=$(date +%s)
BUDGET_S=${BUDGET_S:-590}
OUT=${OUT:-bench/_work/gpu/check}
mkdir -p "$OUT"
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
cap() { local want=$1 l; l=$(left); (( l < want )) && want=$l; (( want < 1 )) && want=1; echo "$want"; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
cp bench/results/gpu.json bench/results/moe.json bench/results/chunk_calls.json "$OUT"/ 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$LOG" 2>&1

timeout -k 5 "$(cap 120)" python3 -m pytest -v -m gpu tests/gpu -p no:cacheprovider -rs --durations=0 \
  >"$OUT/tests.txt" 2>&1
echo "== tests rc=$? at $(( $(date +%s) - START )) s" >>"$OUT/tests.txt"

timeout -k 5 "$(cap 35)" python3 bench/chunk_calls.py --out "$OUT" >>"$LOG" 2>&1
echo "== chunk_calls.py rc=$? at $(( $(date +%s) - START )) s" >>"$LOG"

timeout -k 5 "$(cap 320)" python3 bench/gpu.py --out "$OUT" --row-timeout 90 --targets >>"$LOG" 2>&1
echo "== gpu.py --targets rc=$? at $(( $(date +%s) - START )) s" >>"$LOG"
timeout -k 5 "$(cap 35)" python3 bench/gpu.py --out "$OUT" --row-timeout 30 --rows seed/all-chunk-a-call >>"$LOG" 2>&1
echo "== gpu.py seed/all-chunk-a-call rc=$? at $(( $(date +%s) - START )) s" >>"$LOG"

timeout -k 5 "$(cap 80)" python3 bench/moe.py --device cuda --pairs 1 --data bench/_work/gpu/corpus --out "$OUT" \
  >>"$LOG" 2>&1
echo "== moe.py rc=$? at $(( $(date +%s) - START )) s" >>"$LOG"

grep -E "PASS|FAIL|ERROR|passed|failed|== " "$OUT/tests.txt" | tail -30
grep -vE "^\s*$|Warning|warn\(" "$LOG" | tail -40
