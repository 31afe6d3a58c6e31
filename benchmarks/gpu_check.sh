#!/usr/bin/env bash
# What a machine with a CUDA GPU should run, in one command:
#   1. the gpu-marked tests (tests/test_gpu.py): the Triton kernels compiled for the GPU against the
#      float64 reference, MoA on CUDA, flash attention over the shared K/V head, Inductor, bf16 training;
#   2. `headmix bench attention` on CUDA in bf16 (targets: MoA <= 1.0x torch MHA with flash attention at
#      sequence 2048; E=64 <= 1.1x E=8);
#   3. benchmarks/grouped_matmul.py on CUDA (target: the grouped matmul >= 0.7 of a dense one of equal FLOPs).
# Usage: benchmarks/gpu_check.sh [OUT_DIR]   (default runs/gpu_check; the logs and tables go there)
# PYTHON picks the interpreter (default python3); it needs torch with CUDA, triton and headmix's
# dependencies. headmix itself is taken from src/, so no install is needed.
set -uo pipefail
out=${1:-runs/gpu_check}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
"$py" -m pytest -m gpu -p no:cacheprovider -v tests/test_gpu.py 2>&1 | tee "$out/tests.log" || status=1
"$py" -m headmix.cli.main bench attention --device cuda --batch-tokens 32768 --repeats 11 2>&1 \
    | tee "$out/bench_attention.md" || status=1
"$py" benchmarks/grouped_matmul.py --no-cpu --tokens 32768 2>&1 | tee "$out/grouped_matmul.md" || status=1
exit $status
