# The two commands of the README:
#   make demo   set up .venv and run the main job (MoA vs MHA at equal attention MACs, ~7 min on 2 CPU cores;
#               on a CUDA machine the GPU-sized demo, see README.md)
#   make test   set up .venv and run the test suite (~4 min on 2 CPU cores after a ~1.5 min install)
#
# TORCH picks the PyTorch build: the default pins the release we test with. On a machine without a GPU
# that resolves to a CPU wheel where one is provided locally (pip's find-links) or from PyPI; for another
# build, e.g. CUDA: make test TORCH="torch --index-url https://download.pytorch.org/whl/cu124".
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-slow bench gpu-check clean

# Where $(PYTHON) already has a PyTorch that sees a CUDA GPU, the venv uses it (--system-site-packages: the
# install below then skips torch) and `make demo` runs the GPU-sized demo; elsewhere nothing changes.
$(BIN)/python:
	if $(PYTHON) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then \
		$(PYTHON) -m venv --system-site-packages $(VENV); else $(PYTHON) -m venv $(VENV); fi

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e ".[test,triton]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/headmix demo --out runs/demo

test: setup
	$(BIN)/python -m pytest -q -n 2

test-slow: setup
	$(BIN)/python -m pytest -q -n 2 -m slow

bench: setup
	$(BIN)/headmix bench attention
	$(BIN)/headmix bench models
	$(BIN)/headmix bench decode

# On a machine with a CUDA GPU: the quick GPU check (every attention kind's layer, training step and decoding
# against its baseline, at most 6 minutes), with the machine's own python3 (CUDA PyTorch and Triton already
# installed; no venv, no network; headmix from src/). PYTHON=... picks another. The rest, one job each:
# benchmarks/gpu_check.sh full1 and full2.
gpu-check:
	PYTHON=$(PYTHON) benchmarks/gpu_check.sh quick

clean:
	rm -rf $(VENV) runs .pytest_cache
