#!/usr/bin/env bash
# Every open GPU figure in one unattended call (issue 44; the targets of issues 24, 26 and 27), for a lent
# machine with a short lease (a bare Python 3.12 with torch+CUDA and transformers; pydantic from .whl/, made
# here by ../shared/gpu/wheels.sh):
#
#   BUDGET_S=540 BENCH_GIT_COMMIT=$(git rev-parse HEAD) bash bench/gpu_check.sh      (writes under $OUT)
#   bash bench/gpu_check.sh --dry-run     every part on the CPU at tiny sizes, into a temporary $OUT (PYTHON=
#                                         picks the interpreter; tests/unit/test_bench_gpu_check.py, slow tier)
#
# Most telling first, each part capped so the whole stays within BUDGET_S seconds (default 540), each writing
# its JSON as soon as it ends: (1) bench/checkpoint.py --shape 1b: the 1.1B model's async and sync save
# blocking, the stage/write/checksum split, throughput saving every 100 steps, a resume to its first step in
# a fresh process (checkpoint.json: `1b` rows and checks beside the CPU rows; rewritten after each of its
# parts); (2) bench/gpu.py's seed-shape rows: the naive fp32 loop, all techniques at 8 chunks a call and at 1;
# (3) bench/moe.py's loop/grouped pair (moe.json, under `gpu`); (4) bench/gpu.py's 1.1B compile and
# transformers-peer rows; (5) the gpu test tier (tests.txt; --dry-run only collects it). Earlier results in
# bench/results/ are copied into $OUT first: bench/gpu.py keeps an earlier row it does not re-measure when the
# device is the same, and checkpoint.json / moe.json keep the CPU's rows. The dry run writes the same files
# under their dry-run names (checkpoint_dry_run.json, gpu-dry-run.json, moe-dry-run.json).
# Prints a summary (each JSON's checks, the log's tail); logs and JSON stay under $OUT (log.txt, tests.txt).
# The interpreter: PYTHON, else this checkout's .venv/bin/python, else python3 (as `make test-gpu`); one that
# cannot import torch (or, off the dry run, sees no CUDA device) stops the script before any part, with one line.
# A failed part does not stop the later ones (each is independent; the lease is short): the script exits 1, and
# its last line names every part that failed, with its rc (124/137: stopped by its cap), or says all passed. A
# part that ends 0 with a row it was to measure missing or in error (gpu.py and checkpoint.py go on) fails too,
# and so does one whose row this run did not write: the run's id (BENCH_RUN_ID, made here unless given) is on
# each row bench/gpu.py writes, and a row must carry it; a row of a writer that records no run id
# (checkpoint.py's, moe.py's) must differ from the one the copied earlier results held. gpu.py compares rows of one run only.
set -u
cd "$(dirname "$0")/.."
# Each part is a fresh process (resume_profile's resume one more): with PYTHONDONTWRITEBYTECODE set (this
# workplace's shells set it) and a venv without bytecode, each compiled torch from source at its start, which
# the resume row then counted (3.0 s of `compile` in bench/results/resume_profile_gpu.txt). The first part
# writes what it imports where it may; a read-only venv stays as it is.
unset PYTHONDONTWRITEBYTECODE
START=$(date +%s)
# the run's id, on every row bench/gpu.py writes in this run (its parts are one run): a row without it was kept
# from an earlier run, and `measured` refuses it
BENCH_RUN_ID=${BENCH_RUN_ID:-$(cat /proc/sys/kernel/random/uuid 2>/dev/null || echo "$START-$RANDOM$RANDOM")}
export BENCH_RUN_ID
DRY=""
[[ "${1:-}" == "--dry-run" ]] && DRY="--dry-run"
BUDGET_S=${BUDGET_S:-540}
PY=python3
[[ -x .venv/bin/python ]] && PY=.venv/bin/python
PY=${PYTHON:-$PY}
need="import torch"
[[ -z $DRY ]] && need="import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'"
if ! why=$($PY -c "$need" 2>&1); then
  echo "== FAILED before any part: $PY -c \"$need\": $(tail -n 1 <<<"$why")"
  exit 2
fi
if [[ -n $DRY ]]; then
  OUT=${OUT:-$(mktemp -d -t gpu-check-dry-XXXXXX)}
  CORPUS=bench/_work/gpu/corpus-tiny CORPUS_BYTES=300000 CKPT=checkpoint_dry_run GPU=gpu-dry-run MOE=moe-dry-run
else
  OUT=${OUT:-bench/_work/gpu/check}
  CORPUS=bench/_work/gpu/corpus CORPUS_BYTES=8000000 CKPT=checkpoint GPU=gpu MOE=moe
fi
mkdir -p "$OUT"
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
cap() { local want=$1 l; l=$(left); (( l < want )) && want=$l; (( want < 1 )) && want=1; echo "$want"; }
mark() { echo "== $1 rc=$2 at $(( $(date +%s) - START )) s" >>"$3"; }
FAILED=() RAN=0 LAST_RC=0
record() {  # record NAME RC: counted, and named in the last line when RC is not 0
  RAN=$(( RAN + 1 ))
  case $2 in
    0) ;;
    124|137) FAILED+=("$1 (rc $2, out of time)") ;;
    *) FAILED+=("$1 (rc $2)") ;;
  esac
}
part() {  # part NAME CAP_S FILE CMD...: CMD stopped at its cap (or what is left of BUDGET_S), its output into FILE
  local name=$1 want=$2 file=$3
  shift 3
  timeout -k 5 "$(cap "$want")" "$@" >>"$file" 2>&1
  LAST_RC=$?
  mark "$name" "$LAST_RC" "$file"
  record "$name" "$LAST_RC"
}
measured() {  # measured NAME JSON ROW...: a part that ended 0 fails when a row it was to measure has no figure,
  # or one this run did not write (a gpu.py row without this run's id; another writer's row as the copy held it)
  (( LAST_RC == 0 )) || return 0  # bench/gpu.py and checkpoint.py write the row's error in the JSON and go on
  local bad stamped=""
  [[ $(basename "$2") == "$GPU.json" ]] && stamped=1  # bench/gpu.py writes the run's id on each row
  bad=$($PY - "$1" "$2" "$BEFORE/$(basename "$2")" "$stamped" "${@:3}" 2>>"$LOG" <<'EOF'
import json, os, sys
from pathlib import Path
name, path, before_path, stamped, *wanted = sys.argv[1:]
run = os.environ["BENCH_RUN_ID"]

def rows_of(p):
    # gpu.py's rows by name, checkpoint.py's by shape/mode, moe.py's by name/path
    return {(f"{r['name']}/{r['path']}" if "path" in r else r["name"]) if "name" in r else f"{r['shape']}/{r['mode']}": r
            for r in json.loads(Path(p).read_text())["rows"]}

try:
    rows = rows_of(path)
except (OSError, ValueError, KeyError) as e:
    rows = {}
    print(f"== {name}: {path}: {type(e).__name__} {e}", file=sys.stderr)
try:
    before = rows_of(before_path)  # the earlier results copied into $OUT before any part ran
except (OSError, ValueError, KeyError):
    before = {}
for w in wanted:
    r = rows.get(w)
    why = "not in the JSON" if r is None else r.get("error") or r.get("resume_error")
    if not why and (stamped or "run_id" in r) and r.get("run_id") != run:
        why = (f"not written by this run: run {r.get('run_id') or 'not recorded'} (commit {r.get('git_commit')}), "
               f"this run is {run}")
    elif not why and not stamped and before.get(w) == r:
        why = "not written by this run: the row the earlier results held"
    if why:
        print(w)
        print(f"== {name}: row {w}: {why}", file=sys.stderr)
EOF
  )
  [[ -z $bad ]] || FAILED+=("$1 (rc 0, not measured: $(paste -sd, <<<"$bad"))")
}
if [[ -z $DRY ]] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  record "pip install .whl" $?
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
export BENCH_WORK=$PWD/bench/_work/gpu/ckpt  # the checkpoints on this machine's disk (not a tmpfs /tmp)
mkdir -p "$BENCH_WORK"
LOG=$OUT/log.txt
cp bench/results/checkpoint.json "$OUT/$CKPT.json" 2>/dev/null
cp bench/results/moe.json "$OUT/$MOE.json" 2>/dev/null
[[ -z $DRY ]] && cp bench/results/gpu.json "$OUT/" 2>/dev/null
BEFORE=$(mktemp -d -t gpu-check-before-XXXXXX)  # what `measured` tells this run's rows from
trap 'rm -rf "$BEFORE"' EXIT
cp "$OUT"/*.json "$BEFORE/" 2>/dev/null
if [[ -n $DRY ]]; then
  echo "dry run on the CPU of $(uname -n): tiny sizes, no GPU" >"$LOG"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$LOG" 2>&1
fi

# the corpus every part reads (bench/gpu.py's own, made once here)
part corpus "$BUDGET_S" "$LOG" $PY -c "import sys; from pathlib import Path; sys.path[:0] = ['bench', '.']; \
from corpus import prepared; prepared(None, Path('$CORPUS'), $CORPUS_BYTES, val_fraction=0.2)"

# (1) checkpoints of the 1.1B model: blocking <= 1 s, resume's first step <= 15 s, throughput >= 0.97
part "checkpoint.py --shape 1b" 240 "$LOG" $PY bench/checkpoint.py --device cuda --shape 1b --data "$CORPUS" \
  --out "$OUT" $DRY
measured "checkpoint.py --shape 1b" "$OUT/$CKPT.json" 1b/async 1b/sync
rm -rf "$BENCH_WORK"  # a part stopped by its cap leaves its checkpoints (13.2 GB each) behind

# (2) the seed shape: naive fp32 loop against all techniques (8 chunks a compiled call, and 1): >= 2x
part "gpu.py seed rows" 150 "$LOG" $PY bench/gpu.py --out "$OUT" --data "$CORPUS" --row-timeout 60 \
  --rows seed/naive-fp32,seed/all,seed/all-chunk-a-call $DRY
measured "gpu.py seed rows" "$OUT/$GPU.json" seed/naive-fp32 seed/all seed/all-chunk-a-call

# (3) MoE, loop/grouped pair: grouped MFU >= 35%
part moe.py 90 "$LOG" $PY bench/moe.py --device cuda --pairs 1 --data "$CORPUS" --out "$OUT" $DRY
measured moe.py "$OUT/$MOE.json" gpu-moe/loop gpu-moe/grouped

# (4) the 1.1B model compiled (MFU >= 50%) and the transformers peer
part "gpu.py 1.1B compile and peer rows" 190 "$LOG" $PY bench/gpu.py --out "$OUT" --data "$CORPUS" --row-timeout 90 \
  --rows big/bf16-compile,big/peer-hf-compile $DRY
measured "gpu.py 1.1B compile and peer rows" "$OUT/$GPU.json" big/bf16-compile big/peer-hf-compile

# (5) the gpu test tier, with what is left (the dry run only collects it: pytest's rc 5, none collected, fails)
: >"$OUT/tests.txt"
if [[ -n $DRY ]]; then
  part tests 120 "$OUT/tests.txt" $PY -m pytest --collect-only -q -m gpu tests/gpu -p no:cacheprovider
else
  part tests 120 "$OUT/tests.txt" $PY -m pytest -v -m gpu tests/gpu -p no:cacheprovider -rs --durations=0
fi

grep -E "PASS|FAIL|ERROR|passed|failed|collected|== " "$OUT/tests.txt" | tail -30
grep -vE "^\s*$|Warning|warn\(" "$LOG" | tail -40
# the summary (its rc is 1 when a JSON it reads is missing or unreadable)
timeout -k 5 60 $PY - "$OUT" "$CKPT" "$GPU" "$MOE" <<'EOF'
import json, sys
from pathlib import Path

out, ckpt, gpu, moe = Path(sys.argv[1]), *sys.argv[2:]
unread = []
def load(name):
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError) as e:
        print(f"{name}.json: {type(e).__name__}")
        unread.append(name)
        return {}
c, g, m = load(ckpt), load(gpu), load(moe).get("gpu", {})
print(f"checkpoint 1b parts done: {c.get('1b', {}).get('parts_done')}")
for label, checks in (("checkpoint 1b", c.get("1b", {}).get("checks", {})), ("gpu.py", g.get("checks", {}))):
    for key, v in checks.items():
        if v["value"] is None:  # gpu.py: rows of two runs
            print(f"{label} {key}: null (target {v.get('target', '-')}): {v.get('note')}")
        else:
            print(f"{label} {key}: {v['value']:.3f} (target {v.get('target', '-')}): {'met' if v['met'] else 'NOT met'}")
for r in m.get("rows", []):
    print(f"moe {r['name']} {r['path']}: MFU {r['mfu']:.1%}, {r['median_step_s'] * 1e3:.1f} ms a step")
print(f"moe targets met: {m.get('targets_met')}; device: {c.get('1b', {}).get('device_name')} / {g.get('device_name')}")
sys.exit(1 if unread else 0)
EOF
record summary $?

took="in $(( $(date +%s) - START )) s of BUDGET_S=$BUDGET_S; results under $OUT"
if (( ${#FAILED[@]} )); then
  fails=$(printf ', %s' "${FAILED[@]}")
  echo "== FAILED: ${fails:2} ($RAN parts; $took)"
  exit 1
fi
echo "== done $took: all $RAN parts passed"
