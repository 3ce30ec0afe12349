#!/usr/bin/env bash
# `make docs-check`: the docs' commands run for real, in short forms, in a fresh temporary folder (a few minutes
# on 2 cores): a small corpus, plan and cluster check, a run without Ray and its resume, report and export (and
# transformers loading it), torchrun, a run on a local Ray, a small PBT experiment and its report.
# tests/unit/test_docs.py checks every other command of README.md and docs/ by its --help, keys and paths.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
raytrain=$VENV/bin/raytrain
tmp=$(mktemp -d -t raytrain-docs-check-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
step() { echo "docs-check: $*"; "$@"; }

run=(examples/tiny-dense.yaml --no-progress --set "data.path=$tmp/data" --set schedule.warmup_steps=2)
step "$raytrain" --help > /dev/null
step "$raytrain" data prepare --output "$tmp/data" --max-bytes 2000000 --no-progress
step "$raytrain" plan examples/tiny-fsdp.yaml --world-size 2 --device-memory 16GiB
step "$raytrain" cluster check clusters/aws-gpu.yaml --run examples/tiny-fsdp.yaml --set scaling.use_gpu=true \
    --set scaling.num_workers=8 --set train.global_batch_size=64
for steps in 10 15; do  # a run, then the same command with more steps: it resumes
  step "$raytrain" train "${run[@]}" --no-ray --set "run_dir=$tmp/runs/tiny-dense" --set "train.steps=$steps" \
      --set checkpoint.every=5 --set train.eval_every=5
done
step "$raytrain" report "$tmp/runs/tiny-dense"
step "$raytrain" export "$tmp/runs/tiny-dense" "$tmp/exported/tiny-dense" --dtype bf16
step "$VENV/bin/python" -c "import sys, transformers as t; print(t.AutoModelForCausalLM.from_pretrained(sys.argv[1]).config.architectures)" \
    "$tmp/exported/tiny-dense"
step "$VENV/bin/torchrun" --nproc-per-node 2 -m trainers train examples/tiny-fsdp.yaml --no-progress \
    --set "data.path=$tmp/data" --set "run_dir=$tmp/runs/tiny-fsdp" --set train.steps=4 --set schedule.warmup_steps=1
step "$raytrain" train "${run[@]}" --set "run_dir=$tmp/runs/on-ray" --set scaling.num_workers=2 \
    --set parallel.engine=ddp --set train.micro_batch_size=8 --set train.steps=4
step "$raytrain" tune examples/pbt-demo.yaml --quiet --set "storage=$tmp/tune" --set population=2 \
    --set resources.workers=1 --set budget.steps=20 --set scheduler.interval=10 \
    --set "overrides.data.path=$tmp/data" --set overrides.schedule.warmup_steps=2
step "$raytrain" tune report "$tmp/tune/pbt-demo"
echo "docs-check: every command ran"
