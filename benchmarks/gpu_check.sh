#!/usr/bin/env bash
# The GPU check in two parts, each within one 10-minute job on one H100, with NO network and no virtual
# environment: plain python3 with a CUDA build of PyTorch and Triton installed, headmix from src/.
#   part1 (at most 510 s = 8.5 min: tests 240 s + layers 270 s): the gpu-marked tests (tests/test_gpu.py and
#         grouped_mm on CUDA in tests/test_kernels_grouped_mm.py: the kernels against the float64 reference, no
#         host sync, flash attention, Inductor, bf16 training) and benchmarks/gpu_layers.py (one fwd+bwd per
#         layer at batch 16 x 2048, d_model 512, bf16, against torch MHA; the grouped projections for dense,
#         grouped_mm and triton);
#   part2 (at most 510 s = 8.5 min: models 180 s + decode 120 s + attention_moh 150 s + gqa 60 s): headmix
#         bench models (Llama-style training steps, eager and compiled), headmix bench decode (batch 1 and 8),
#         headmix bench attention with the MoH curve and headmix bench gqa (grouped MHA, the GQE curve, gates).
# The estimates are the sums of the steps' own time limits (headmix.bench.gpu_check.STEPS; a step that runs
# over is stopped and reported); the running times on an H100 are still to be measured at this commit.
# Usage: benchmarks/gpu_check.sh part1|part2 [--tiny] [--out DIR]   (default runs/gpu_check)
#   --tiny: tiny sizes on the CPU (what the test suite runs to check the plumbing).
# Each part writes DIR/<part>-<step>.log and DIR/<part>.json. After both parts:
#   python3 -m headmix.bench.gpu_check fold DIR     # the summaries into docs/performance.md, machine and commit
# PYTHON picks the interpreter (default python3).
set -uo pipefail
case "${1:-}" in
    part1|part2) ;;
    *) echo "usage: benchmarks/gpu_check.sh part1|part2 [--tiny] [--out DIR]" >&2; exit 2 ;;
esac
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m headmix.bench.gpu_check "$@"
