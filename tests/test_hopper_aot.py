"""The Triton kernels compiled ahead of time for an H100 (sm_90) on this GPU-less machine
(:mod:`headmix.bench.hopper_aot`): the shared-memory bound the autotuner prunes with never underestimates
the compiler and drops exactly what cannot launch; one configuration compiled here (seconds), every one of
the space under ``-m slow`` (about 30 minutes on the shared 2-core machine)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from headmix.bench import hopper_aot
from headmix.kernels.grouped_triton import (
    HOPPER_SHARED_PER_BLOCK,
    prune_configs,
    prune_for_shared,
    shared_bytes_bound,
    tuning_space,
)

#: Compiled for sm_90 from the kernels of 9d22b9f (headmix bench hopper-aot): (variant, dtype, BLOCK_M, N, K, stages) ->
#: shared bytes. The float32 pipelines, the rowdot epilogue (larger than the pipeline), bfloat16 (below the bound).
COMPILED = {
    ("mm", "float32", 64, 64, 32, 3): 49152,
    ("mm", "float32", 128, 128, 64, 4): 262144,
    ("mm", "float32", 64, 128, 64, 4): 196608,
    ("mm_rowdot", "bfloat16", 128, 128, 32, 3): 65536,
    ("mm", "bfloat16", 128, 128, 64, 4): 32768,
}


def bound(variant, dtype, m, n, k, stages):
    size = 2 if dtype == "bfloat16" else 4
    return shared_bytes_bound(k, n, m, stages, size) if variant == "wgrad" else shared_bytes_bound(m, n, k, stages, size)


def test_bound_never_underestimates_and_is_exact_for_float32():
    for (variant, dtype, m, n, k, stages), shared in COMPILED.items():
        assert bound(variant, dtype, m, n, k, stages) >= shared
        if dtype == "float32":
            assert bound(variant, dtype, m, n, k, stages) == shared


def space(kind: str, dtype: str) -> list[dict]:
    fixed = hopper_aot.fixed_tiles(dtype)
    return [dict(c, meta=dict(fixed, **c["meta"])) for c in tuning_space(kind == "mm", kind != "wgrad")]


def test_prune_drops_exactly_what_cannot_launch_on_an_h100():
    configs = space("mm", "float32")
    dropped = [c for c, keep in zip(configs, prune_for_shared(configs, False, 4, HOPPER_SHARED_PER_BLOCK)) if not keep]
    assert sorted((c["meta"]["BLOCK_M"], c["meta"]["BLOCK_N"], c["meta"]["BLOCK_K"], c["num_stages"], c["num_warps"])
                  for c in dropped) == [(128, 128, 64, 4, 4), (128, 128, 64, 4, 8)]
    for kind, dtype, size in (("mm", "bfloat16", 2), ("mm_fixed_n", "float32", 4), ("wgrad", "float32", 4)):
        assert all(prune_for_shared(space(kind, dtype), kind == "wgrad", size, HOPPER_SHARED_PER_BLOCK)), kind


def test_autotuner_prune_uses_the_bound():
    configs = [triton.Config(c["meta"], num_warps=c["num_warps"], num_stages=c["num_stages"])
               for c in tuning_space(True, True)]
    kept = prune_configs("mm", configs, {"SLOTS_BUCKET": 1 << 15, "A": torch.empty(1)})
    assert len(configs) - len(kept) == 32 + 2  # the small row blocks (many slots) and the two too large
    assert all(c.kwargs["BLOCK_M"] >= 64 for c in kept)
    assert not any((c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages) == (128, 64, 4) and c.kwargs["BLOCK_M"] == 128
                   for c in kept)
    assert len(prune_configs("mm", configs, {"SLOTS_BUCKET": 1 << 15, "A": torch.empty(1, dtype=torch.bfloat16)})) == 32


def test_one_configuration_compiles_for_sm90():
    row = hopper_aot.compile_one(("mm", "float32", {"meta": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32},
                                                    "num_warps": 8, "num_stages": 3}))
    assert row.shared_bytes == COMPILED[("mm", "float32", 64, 64, 32, 3)]
    assert row.tensor_cores == "wgmma" and row.fits and 0 < row.registers <= 255
    assert "| mm | float32 | 64x64x32 | 8 | 3 | 48 | yes |" in hopper_aot.table([row])


@pytest.mark.slow
def test_every_configuration_compiles_for_sm90_within_the_bound():
    rows = hopper_aot.compile_all(hopper_aot.jobs_for(list(hopper_aot.DTYPES)), workers=2)
    print(hopper_aot.table(rows))
    for r in rows:
        b = bound(r.variant, r.dtype, r.block_m, r.block_n, r.block_k, r.num_stages)
        assert r.shared_bytes <= b, r
        assert (b <= HOPPER_SHARED_PER_BLOCK) == r.fits, r


def test_compiles_when_the_kernels_were_defined_under_the_interpreter():
    """The CPU tests define the kernels with ``TRITON_INTERPRET=1`` (tests/kernel_cases.py); compiling for sm_90 in
    such a process must still work, and leave the process's environment as it was."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = """
import os
os.environ["TRITON_INTERPRET"] = "1"
from headmix.kernels import _triton_kernels  # interpreter objects from here on
del os.environ["TRITON_INTERPRET"]
from headmix.bench import hopper_aot
row = hopper_aot.compile_one(("mm", "float32", {"meta": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32},
                                                "num_warps": 8, "num_stages": 3}))
assert row.tensor_cores == "wgmma" and "TRITON_INTERPRET" not in os.environ
print("ok")
"""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("variant", ["mm", "mm_rowdot", "wgrad"])
def test_untuned_bfloat16_launches_do_not_spill_on_sm90(variant):
    """Without autotuning (HEADMIX_TRITON_AUTOTUNE=0, the GPU check's quick part) a GPU launch takes the launch
    code's own tiles, warps and stages (MoA at d_model 512, heads of 64: K and N up to 512): none of them may spill
    registers on an H100 (with 4 warps and the forward's tiles, the row-dot and the weight gradient did, by up to
    3.6 KB)."""
    from headmix.kernels.grouped_triton import _launch_opts, untuned_tiles

    gpu = torch.device("cuda")  # a name only: nothing runs on it
    meta = untuned_tiles(variant, torch.bfloat16, 512, 512, gpu)
    row = hopper_aot.compile_one((variant, "bfloat16", {"meta": meta, **_launch_opts(gpu)}))
    assert (row.spill_stores, row.spill_loads) == (0, 0), row
    assert row.fits and row.tensor_cores == "wgmma"
