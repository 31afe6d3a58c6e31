#!/usr/bin/env bash
# What a machine with a CUDA GPU runs, in one command (make gpu-check), with NO network and no virtual
# environment: plain python3 with a CUDA build of PyTorch and Triton already installed, headmix from src/.
#   1. the gpu-marked tests (tests/test_gpu.py): the Triton kernels compiled for the GPU against the float64
#      reference, MoA / SwitchHead on CUDA, no host sync, flash attention, Inductor, bf16 training;
#   2. benchmarks/gpu_layers.py: the layer table of issue 19 (batch 16 x 2048, d_model 512, causal, bf16,
#      fwd+bwd: wall ms, x torch MHA, GPU-busy ms, kernels per step, peak memory; peers HF JetMoeAttention
#      and, when .peers/switchhead holds their source, the SwitchHead authors' cvmm layer) and the grouped
#      projections (map + reduce, N 32768, k 8) against two dense Linear of equal FLOPs;
#   3. headmix bench attention on CUDA (MoA against torch MHA over sequence lengths, E growth) and the MoH
#      curve (sparse vs dense MoH vs MHA against the fraction of active heads);
#   4. headmix bench models (whole Llama-style training step, eager and compiled, every variant vs MHA,
#      compile time) and headmix bench decode (tokens/s at batch 1 and 8, growing cache, preallocated cache,
#      CUDA graphs).
# Usage: benchmarks/gpu_check.sh [OUT_DIR]   (default runs/gpu_check; the logs and tables go there)
# PYTHON picks the interpreter (default python3). pytest is needed for step 1 only (skipped without it).
# At most about 16 minutes (the sum of the time limits); the running time on one H100 is to be measured: not
# yet run on a GPU at this commit.
set -uo pipefail
out=${1:-runs/gpu_check}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
"$py" -c "import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0)); sys.exit(0 if torch.cuda.is_available() else 1)" \
    2>&1 | tee "$out/machine.txt" || { echo "gpu-check: needs torch with CUDA and triton"; exit 1; }
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /' | tee -a "$out/machine.txt"
if "$py" -c "import pytest" 2>/dev/null; then
    # correctness with one kernel configuration: autotuning every test's sizes would take minutes
    HEADMIX_TRITON_AUTOTUNE=0 timeout 240 "$py" -m pytest -m gpu -p no:cacheprovider -q tests 2>&1 \
        | tee "$out/tests.log" || status=1
else
    echo "pytest not installed: GPU tests skipped" | tee "$out/tests.log"
fi
# the first run autotunes the Triton kernels (Triton keeps the choices in its cache: later runs do not)
timeout 300 "$py" benchmarks/gpu_layers.py 2>&1 | tee "$out/gpu_layers.md" || status=1
timeout 120 "$py" -m headmix.cli.main bench attention --device cuda --batch-tokens 32768 --repeats 5 --moh-curve \
    --moh-seq 2048 --moh-batch 16 2>&1 | tee "$out/bench_attention.md" || status=1
timeout 120 "$py" -m headmix.cli.main bench models --presets llama-mini-mha llama-mini-moa llama-mini-moh \
    llama-mini-switchhead --device cuda --compile --lm-batch 8 --lm-len 1024 --repeats 10 2>&1 \
    | tee "$out/bench_models.md" || status=1
timeout 90 "$py" -m headmix.cli.main bench decode --presets llama-mini-mha llama-mini-moa llama-mini-moh \
    llama-mini-switchhead --device cuda --batches 1 8 --prompt 128 --steps 64 --repeats 5 2>&1 \
    | tee "$out/bench_decode.md" || status=1
exit $status
