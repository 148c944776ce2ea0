# One command sets up and runs the tests (`make test`), one the main job (`make demo`).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Real data for tests and benchmarks (not shipped; tests needing it are skipped without it).
# Override: make test HLM_DATA=/path/to/data
HLM_DATA ?= $(wildcard $(abspath ../shared/data))
export HLM_DATA
# A real single-node SLURM for the sweep tests (skipped with the reason when absent).
HLM_SLURM_TOOL ?= $(wildcard $(abspath ../shared/tools/local_slurm.sh))
export HLM_SLURM_TOOL

.PHONY: install test demo scaling-demo gpu-check bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: ==2.13.0 takes the local CPU wheel on CPU machines, the CUDA wheel elsewhere
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/pytest -q tests

# The main job: the Heart Language Model end to end (MIT-BIH from HLM_DATA, else downloaded, else synthetic).
demo: $(STAMP)
	$(VENV)/bin/hlmtune demo --out outputs/demo

# Every CUDA path for a few steps (needs a GPU; no downloads): gpu_check/report.md.
gpu-check: $(STAMP)
	$(VENV)/bin/hlmtune gpu-check --out gpu_check

scaling-demo: $(STAMP)
	$(VENV)/bin/hlmtune scaling-demo --out outputs/scaling-demo

bench: $(STAMP)
	$(PY) benchmarks/recipe_throughput.py
	# TRL + PEFT, the peer framework of peer_throughput.py: an optional extra, never a runtime dependency
	$(PY) -m pip install -q -e ".[dev,bench]"
	$(PY) benchmarks/peer_throughput.py
	$(PY) benchmarks/tokenize_throughput.py
	$(PY) benchmarks/rr_reference_throughput.py
	$(PY) benchmarks/beat_dataset_build.py
	$(PY) benchmarks/collector_overhead.py
	$(PY) benchmarks/dpo_shared_prompt.py
	$(PY) benchmarks/ecg_quality.py

clean:
	rm -rf $(VENV) outputs
