# Every target sets up .venv itself (pinned versions from constraints.txt), so a fresh clone needs nothing else.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DATA   ?= data/stdlib
BPE    ?= data/stdlib-bpe
PYTEST_ARGS ?=
# Python writes the bytecode of what it imports, once, in every process a target starts. Installs here skip
# byte-compiling (--no-compile below), and CI's environment sets PYTHONDONTWRITEBYTECODE=1: with both, every
# process compiled torch, Ray, ... from source at each start (2026-11-29: `import torch` 7.1-8.6 s against 3.0 s,
# a Ray Train worker's imports 22 s against 8.4 s), and CI's default tier took 49 min against 22.
unexport PYTHONDONTWRITEBYTECODE
# the GPU targets need no setup: this checkout's venv where there is one, else the machine's python3 with torch
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)

.PHONY: setup demo finetune-demo test test-slow test-cluster test-under-load test-compat test-compat-torch test-gpu bench bench-cluster bench-gpu bench-stale lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned: an unpinned torch would pull several GB of CUDA packages on a CPU machine.
	# --no-compile: no .pyc for the thousands of modules nothing imports (Ray's dashboard, RLlib, ...); a module
	# is compiled when first imported (tests/unit/test_install.py's installs: 202 -> 140 s with it).
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -c constraints.txt -e '.[test,tracking,hf,s3,deepspeed,ft]'
	touch $(STAMP)

$(DATA)/manifest.json: | $(STAMP)
	$(VENV)/bin/raytrain data prepare --output $(DATA) --max-bytes 8000000

demo: $(STAMP) $(DATA)/manifest.json
	# population-based training: 4 trials x 2 Ray Train workers, then plots in runs/tune/pbt-demo/report/
	rm -rf runs/tune/pbt-demo
	$(VENV)/bin/raytrain tune examples/pbt-demo.yaml --set overrides.data.path=$(DATA)
	$(VENV)/bin/raytrain tune report runs/tune/pbt-demo

finetune-demo: $(STAMP)
	# PBT over a fine-tune of a Llama-form model that transformers makes and saves (examples/finetune-pbt.yaml)
	$(PY) examples/make_pretrained.py --output models/tiny-llama
	$(VENV)/bin/raytrain data prepare --tokenizer models/tiny-llama --output data/stdlib-tiny-llama --max-bytes 2000000
	rm -rf runs/tune/finetune-pbt
	$(VENV)/bin/raytrain tune examples/finetune-pbt.yaml --set overrides.model.init_from=$(CURDIR)/models/tiny-llama
	$(VENV)/bin/raytrain tune report runs/tune/finetune-pbt

# pytest's exit 5 ("no tests collected") is not a failure where PYTEST_ARGS chose the tests (a -k that selects
# none); without them a tier that collects nothing fails (CI would pass a tier that ran nothing)
# Two pytest processes (pytest-xdist): the Ray tests in turn on one, the gloo-rank tests in turn, the single-process
# tests around them (tests/conftest.py). One process left a core idle half the time: the default tier used 25 of
# its 56 core-minutes on 2 cores (2026-11-29). `XDIST=` runs a tier in one process.
XDIST ?= -n 2 --dist loadscope --no-loadscope-reorder
NO_TESTS_OK = { rc=$$?; [ $$rc -eq 5 ] && [ -n "$(strip $(PYTEST_ARGS))" ] || exit $$rc; }
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not cluster" $(XDIST) $(PYTEST_ARGS) || $(NO_TESTS_OK)

test-slow: $(STAMP)
	# the slow tier: larger Ray, PBT and multi-process cases (README: test tiers); the compat smoke set's slow
	# tests run once in CI, on the oldest Ray (make test-compat), and the cluster tier runs their properties on
	# this venv's Ray (a host killed then back: elastic; `ray job submit` from a client host)
	# then the tests that assert a wall-clock bound, with nothing beside them
	$(PY) -m pytest -q -m "slow and not cluster and not alone" $(addprefix --deselect ,$(COMPAT_SMOKE)) $(XDIST) $(PYTEST_ARGS) || $(NO_TESTS_OK)
	$(PY) -m pytest -q -m "slow and not cluster and alone" $(PYTEST_ARGS) || $(NO_TESTS_OK)

# The oldest Ray in pyproject.toml's range (README: Ray versions): a second venv with the same pins as
# constraints.txt but that Ray (constraints-compat.txt), then on it the unit tests that reach Ray and a smoke set
# of the Ray tier. CI's budget (~8 min on 2 cores, venv included) leaves out the unit tests that never touch Ray
# (training in-process, models, data: ~9 min more); `make test-compat COMPAT_UNIT="tests/unit tests/test_architecture.py"`
# runs the whole unit tier there. Both lists are by node id: edit here when tests move.
COMPAT_VENV  ?= .venv-compat
COMPAT_PY    := $(COMPAT_VENV)/bin/python
COMPAT_STAMP := $(COMPAT_VENV)/.installed
# ray_compat's names; the launcher, console, hosts and cluster files; search/ (Tune); every module of
# raytrain_ext/ and search/ imported alone; no private name outside the compatibility modules
COMPAT_UNIT ?= \
	tests/unit/test_ray_compat.py tests/unit/test_launcher.py tests/unit/test_worker_logs.py tests/unit/test_cli.py \
	tests/unit/test_console_run.py tests/unit/test_hosts.py tests/unit/test_clusters.py tests/unit/test_cluster_storage.py \
	tests/unit/test_inplace.py tests/unit/test_slots.py tests/unit/test_search_console.py tests/unit/test_search_driver.py \
	tests/unit/test_search_lineage.py tests/unit/test_search_metric.py tests/unit/test_search_population.py \
	tests/unit/test_search_report_times.py tests/unit/test_search_space.py \
	"tests/test_architecture.py::test_each_module_imports_alone[raytrain_ext]" \
	"tests/test_architecture.py::test_each_module_imports_alone[search]" \
	tests/test_architecture.py::test_no_private_names_outside_compat_modules \
	tests/test_architecture.py::test_pending_private_names_are_still_used
# a 2-worker run with a worker SIGKILLed and resumed; elastic grow then shrink; PBT: a NaN member replaced by an
# exploit in place, the driver interrupted and the experiment resumed (`raytrain tune --resume`'s path);
# `ray job submit` of `raytrain train` to a `ray start --head` with token auth
COMPAT_SMOKE ?= \
	tests/ray/test_train_on_ray.py::test_sigkill_of_a_worker_resumes_from_last_checkpoint \
	tests/ray/test_elastic.py::test_grow_then_shrink_keeps_data_order_and_loss \
	tests/ray/test_pbt.py::test_interrupted_driver_resumes_with_the_population_from_the_lineage \
	tests/ray/test_job_submit.py::test_ray_job_submit_runs_raytrain_train

# Built over .venv: .venv's site-packages is on this venv's path after its own (a .pth), so pip installs here only
# what the pins make differ (Ray and what it alone needs) and leaves .venv's alone ("outside environment"): a
# minute instead of a second torch, DeepSpeed and transformers.
# $(call venv_over_main,VENV,PACKAGE,PINS): VENV with .venv's site-packages on its path after its own (a .pth),
# constraints.txt's pins but PACKAGE's, which the file PINS gives; pip installs there only what those make differ.
define venv_over_main
	rm -rf $(1) && python3 -m venv $(1)
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> "$$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_raytrain_main_venv.pth"
	grep -v '^$(2)==' constraints.txt | cat - $(3) > $(1)/constraints.txt
	$(1)/bin/python -m pip install -q --no-compile -c $(1)/constraints.txt -e '.[test,tracking,hf,s3,deepspeed,ft]'
endef

$(COMPAT_STAMP): pyproject.toml constraints.txt constraints-compat.txt | $(STAMP)
	$(call venv_over_main,$(COMPAT_VENV),ray,constraints-compat.txt)
	$(COMPAT_PY) -c "import ray, torch; print('test-compat: ray', ray.__version__, 'from', ray.__file__)"
	touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP)
	$(COMPAT_PY) -m pytest -q -m "not slow and not cluster" $(COMPAT_UNIT) $(PYTEST_ARGS) || $(NO_TESTS_OK)
	# the smoke set, whatever its marks (most of it is in the slow tier on the main venv)
	$(COMPAT_PY) -m pytest -q $(COMPAT_SMOKE) $(PYTEST_ARGS)

# The newest torch the package index serves (pyproject.toml's upper minor; constraints-torch.txt), the same way:
# a venv over .venv with that torch alone, then the whole unit tier and the Ray smoke set on it. Its CUDA build
# (5 GB of wheels, local) runs on CPU.
TORCH_VENV  ?= .venv-torch
TORCH_PY    := $(TORCH_VENV)/bin/python
TORCH_STAMP := $(TORCH_VENV)/.installed

$(TORCH_STAMP): pyproject.toml constraints.txt constraints-torch.txt | $(STAMP)
	$(call venv_over_main,$(TORCH_VENV),torch,constraints-torch.txt)
	# Ray comes from .venv: its `ray` command too, run by this venv's python (the smoke set's `ray start`)
	sed '1s|.*|#!$(CURDIR)/$(TORCH_PY)|' $(VENV)/bin/ray > $(TORCH_VENV)/bin/ray && chmod +x $(TORCH_VENV)/bin/ray
	$(TORCH_PY) -c "import ray, torch; print('test-compat-torch: torch', torch.__version__, 'from', torch.__file__)"
	touch $(TORCH_STAMP)

test-compat-torch: $(TORCH_STAMP)
	$(TORCH_PY) -m pytest -q -m "not slow and not cluster" tests/unit tests/test_architecture.py $(XDIST) $(PYTEST_ARGS) || $(NO_TESTS_OK)
	$(TORCH_PY) -m pytest -q $(COMPAT_SMOKE) $(PYTEST_ARGS)

test-cluster: $(STAMP)
	# the cluster tier: test hosts from network namespaces on this machine (root; skipped with one line elsewhere)
	$(PY) -m pytest -q -m cluster tests/cluster $(PYTEST_ARGS) || $(NO_TESTS_OK)

test-gpu:
	# the gpu tier on one CUDA device (skipped without one); needs no Ray: any Python with torch and pytest
	$(GPU_PY) -m pytest -q -m gpu tests/gpu $(PYTEST_ARGS)

$(BPE)/manifest.json: | $(STAMP)
	# token ids for bench/lean.py's 50,257-token model: a BPE corpus (merges learnt here, no download)
	$(VENV)/bin/raytrain data prepare --tokenizer bpe --vocab-size 50257 --output $(BPE) --max-bytes 8000000

bench: $(STAMP) $(DATA)/manifest.json $(BPE)/manifest.json
	$(PY) bench/run.py --data $(DATA)
	$(PY) bench/lean.py --data $(BPE)
	$(PY) bench/chunk_calls.py
	$(PY) bench/zero_memory.py --data $(DATA)
	$(PY) bench/ray_recovery.py --data $(DATA)
	$(PY) bench/chaos.py --data $(DATA)
	$(PY) bench/plan_vs_measured.py --data $(DATA)
	$(PY) bench/pipeline.py --data $(DATA)
	$(PY) bench/moe.py --data $(DATA)
	$(PY) bench/pbt_toy.py
	$(PY) bench/pbt_vs_random.py --data $(DATA)
	$(PY) bench/pbt_overhead.py --data $(DATA)
	$(PY) bench/storage.py
	$(PY) bench/checkpoint.py --data $(DATA)
	$(PY) bench/no_ray.py --data $(DATA)
	$(PY) bench/data.py
	$(PY) bench/cli.py

bench-cluster: $(STAMP)
	# root: test hosts from network namespaces; bring-up, first step and recovery from a lost host; then per-step
	# fault tolerance beside the restart path, each beside its run without faults, on hosts with CPU quotas (~45 min)
	$(PY) bench/cluster.py
	$(PY) bench/ft.py --hosts

bench-gpu:
	# one GPU, unattended (~30 min on an H100; BENCH_ARGS=--model small for 24 GB): bench/results/gpu.{json,png},
	# then the MoE loop vs grouped pairs on it (bench/results/moe.json's gpu rows, moe-gpu.png)
	$(GPU_PY) bench/gpu.py $(BENCH_ARGS)
	$(GPU_PY) bench/moe.py --device cuda

bench-stale:
	# the results the docs quote whose measured code changed since their commit, or that lack provenance (commit,
	# dirty flag, versions, CPUs, load); fails when one the README quotes is (python's standard library only;
	# --all: every JSON under bench/results/)
	python3 bench/stale.py $(STALE_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs bench/_work .pytest_cache

# The docs: docs/configuration.md and the reference part of docs/cli.md, generated from the pydantic models and
# the argparse parsers (tests/unit/test_docs.py fails when they are out of date); docs-check also runs the docs'
# commands for real, in short forms (docs/check_commands.sh: a few minutes on 2 cores).
.PHONY: docs docs-check
docs: $(STAMP)
	$(PY) docs/gen_reference.py

docs-check: $(STAMP)
	$(PY) docs/gen_reference.py --check
	$(PY) -m pytest -q -p no:cacheprovider tests/unit/test_docs.py
	VENV=$(VENV) bash docs/check_commands.sh

test-under-load: $(STAMP)
	# the default tier twice beside two busy processes: catches tests that depend on an idle machine (~1 h on 2 cores)
	.ci/under_load 2
