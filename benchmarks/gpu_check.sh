#!/usr/bin/env bash
# The GPU check, in parts that each fit one 10-minute job on one H100, with NO network and no virtual
# environment: plain python3 with a CUDA build of PyTorch (and Triton) installed, headmix from src/.
#   quick (at most 420 s = 7 min: layers 100 s + models 80 s + decode 160 s + gqe 80 s): bf16, every number
#         against a baseline measured in the same process: one fwd+bwd per attention kind at 16 x 2048, d_model
#         512, causal, against torch SDPA multi-head attention (wall ms, ratio, GPU-busy ms, kernels per step, peak
#         memory; HF JetMoeAttention as MoA's peer); a Llama-style training step per attention kind against MHA;
#         greedy decoding tokens/s at batch 1 and 8; the paper's GQE against GQA with all 16 query heads (fwd+bwd
#         at T 4096 and 8192, prefill at T 8192, eager and compiled, GPU-busy ms, kernels, a host-sync check).
#         Triton on its default configuration (no autotuning).
#   full1 (at most 450 s = 7.5 min: tests 240 s + grouped 150 s + gqa 60 s): the gpu-marked tests, the grouped
#         projections with Triton autotuning, headmix bench gqa (grouped MHA, the GQE curve, gates).
#   full2 (at most 450 s = 7.5 min: models_compiled 180 s + decode_graphs 120 s + attention_moh 150 s): compiled
#         training steps, decoding with the static cache and CUDA graphs, the MoA / MoH curves.
#   compute (at most 480 s = 8 min: compute_eager 180 s + compute_compiled 300 s): time beside compute, bf16,
#         d_model 2048, T 4096: each routed kind's GPU-busy time and kernels over its dense baseline's beside its
#         minimal MAC ratio, eager (with profiles of the rows furthest off) and compiled.
# The estimates are the sums of the steps' own time limits (headmix.bench.gpu_check.STEPS; a step that runs
# over is stopped and keeps the rows it printed).
# Usage: benchmarks/gpu_check.sh quick|full1|full2|compute [--tiny] [--out DIR]   (default runs/gpu_check)
#   --tiny: tiny sizes on the CPU (what the test suite runs to check the plumbing).
# Each part writes DIR/<part>-<step>.log (line by line, as rows are measured) and DIR/<part>.json (after each
# step). Then: python3 -m headmix.bench.gpu_check fold DIR   # the parts found in DIR into docs/performance.md
# PYTHON picks the interpreter (default python3).
set -uo pipefail
case "${1:-}" in
    quick|full1|full2|compute) ;;
    *) echo "usage: benchmarks/gpu_check.sh quick|full1|full2|compute [--tiny] [--out DIR]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
# An interpreter without PyTorch (the system python3 beside a .venv) stops here in one line, not a traceback.
if ! command -v "$python" >/dev/null; then
    echo "benchmarks/gpu_check.sh: no interpreter $python: give one that has torch, e.g. PYTHON=.venv/bin/python benchmarks/gpu_check.sh $1" >&2
    exit 2
fi
if ! "$python" -c "import torch" >/dev/null 2>&1; then
    echo "benchmarks/gpu_check.sh: $(command -v "$python") has no torch: give the interpreter that has it, e.g. PYTHON=.venv/bin/python benchmarks/gpu_check.sh $1" >&2
    exit 2
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$python" -m headmix.bench.gpu_check "$@"
