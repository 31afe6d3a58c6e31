"""Every Triton kernel of headmix compiled ahead of time for an H100 (sm_90) on a machine without a GPU.

Triton ships ``ptxas``, so ``triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda",
90, 32))`` runs on a CPU machine. For every kernel variant (:data:`VARIANTS`) and every configuration of the
autotune space (:func:`headmix.kernels.grouped_triton.tuning_space`, before any pruning) this records

* the shared memory per block against the H100's limit (:data:`H100_SHARED_PER_BLOCK`, 227 KB of the 228 KB
  per multiprocessor; a configuration above it fails with "out of resource" at launch),
* registers per thread and the spill stores / loads that ``ptxas -v`` reports for the PTX,
* whether the PTX uses the tensor cores (``wgmma``: Hopper's warpgroup MMA; ``mma``: the Ampere form; ``-``:
  neither, the dot became FMAs),

which catches what ``TRITON_INTERPRET=1`` cannot (out-of-resource, no tensor cores, spills).

    headmix bench hopper-aot [--dtypes bfloat16 float32] [--jobs 2] [--json out.json]
    python -m headmix.bench.hopper_aot [the same options]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

#: Shared memory one thread block may use on an H100 (227 KB; the multiprocessor has 228 KB).
H100_SHARED_PER_BLOCK = 227 * 1024
#: Registers of one multiprocessor (and so at most of one block) on an H100.
H100_REGISTERS_PER_BLOCK = 65536

#: kernel variant -> (kernel name, tuning-space kind, flags). ``mm``: the forward (MoA's map, fan-in k); ``mm_rowdot``:
#: the reduce's input gradient (gate scale and the row-dot of ``grad_gates``, BLOCK_N fixed by the caller);
#: ``wgrad``: the weight gradient (gate-scaled rows).
VARIANTS = {
    "mm": ("grouped_mm_kernel", "mm", {"FAN_IN": 8, "HAS_SCALE": False, "ROWDOT": False}),
    "mm_rowdot": ("grouped_mm_kernel", "mm_fixed_n", {"FAN_IN": 1, "HAS_SCALE": True, "ROWDOT": True}),
    "wgrad": ("grouped_wgrad_kernel", "wgrad", {"FAN_IN": 1, "HAS_SCALE": True}),
}
DTYPES = {"bfloat16": ("bf16", "ieee"), "float32": ("fp32", "tf32")}
#: The experts of the compiled problem (only ``E_PAD``, a power of two >= E, depends on it).
NUM_EXPERTS = 32


@dataclass
class Compiled:
    """One kernel variant and configuration compiled for sm_90."""

    variant: str
    dtype: str
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    shared_bytes: int
    registers: int
    spill_stores: int
    spill_loads: int
    tensor_cores: str  # "wgmma", "mma" or "-"
    seconds: float

    @property
    def fits(self) -> bool:
        """Launchable on an H100: shared memory and registers within one block's limits."""
        return (self.shared_bytes <= H100_SHARED_PER_BLOCK
                and self.registers * 32 * self.num_warps <= H100_REGISTERS_PER_BLOCK)


def fixed_tiles(dtype: str) -> dict:
    """BLOCK_N / BLOCK_K the launch code gives when the space does not vary them (``grouped_triton._config``
    at d_model 512, d_head 64)."""
    wide = dtype != "float32"
    return {"BLOCK_N": 128 if wide else 64, "BLOCK_K": 64 if wide else 32}


def jobs_for(dtypes: list[str], variants: list[str] | None = None) -> list[tuple[str, str, dict]]:
    """(variant, dtype, configuration) for every configuration of the autotune space."""
    from headmix.kernels.grouped_triton import tuning_space

    jobs = []
    for dtype in dtypes:
        for variant in variants or list(VARIANTS):
            kind = VARIANTS[variant][1]
            for config in tuning_space(kind == "mm", kind != "wgrad"):
                jobs.append((variant, dtype, config))
    return jobs


def _signature(kernel, dtype: str, variant: str, meta: dict):
    import triton.language as tl

    short, precision = DTYPES[dtype]
    pointers = {"A": short, "W": short, "Y": short, "SCALE": short, "H": short, "D": "fp32", "DY": short,
                "DW": short, "sort_order": "i64", "offsets": "i64"}
    constexprs = dict(VARIANTS[variant][2], **meta, ACC_TYPE=tl.float32, INPUT_PRECISION=precision, UPCAST=False)
    if kernel.__name__ == "grouped_mm_kernel":
        constexprs["E_PAD"] = NUM_EXPERTS
    signature = {name: ("constexpr" if name in constexprs else ("*" + pointers[name]) if name in pointers
                        else "i32") for name in kernel.arg_names}
    return signature, constexprs


def ptxas_report(ptx: str, arch: str = "sm_90a") -> tuple[int, int, int]:
    """(registers, spill stores, spill loads) of the PTX's kernel from ``ptxas -v`` (Triton's own ptxas)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as folder:
        src = os.path.join(folder, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", src, "-o", os.path.join(folder, "k.cubin")],
                             capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return int(regs.group(1)) if regs else 0, *(tuple(map(int, spills.groups())) if spills else (0, 0))


@functools.lru_cache(maxsize=1)  # one fresh copy per process, not one per compiled configuration
def _compilable_kernels():
    """headmix's Triton kernels as ``triton.jit`` functions. Kernels defined while ``TRITON_INTERPRET=1`` was set
    (the CPU tests define them so) are interpreter objects that cannot be compiled: then a fresh copy of the
    module is loaded with the variable unset for the duration of that import only."""
    import importlib.util

    from triton.runtime.jit import JITFunction

    from headmix.kernels import _triton_kernels

    if isinstance(getattr(_triton_kernels, VARIANTS["mm"][0]), JITFunction):
        return _triton_kernels
    spec = importlib.util.spec_from_file_location("_headmix_triton_kernels_compiled", _triton_kernels.__file__)
    module = importlib.util.module_from_spec(spec)
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        spec.loader.exec_module(module)
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    return module


def compile_one(job: tuple[str, str, dict]) -> Compiled:
    """Compile one (variant, dtype, configuration) for ``GPUTarget("cuda", 90, 32)``."""
    variant, dtype, config = job
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(_compilable_kernels(), VARIANTS[variant][0])
    meta = dict(fixed_tiles(dtype), **config["meta"])
    signature, constexprs = _signature(kernel, dtype, variant, meta)
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config["num_warps"], "num_stages": config["num_stages"],
                                       "enable_fp_fusion": True})  # what a GPU run compiles (Triton 3.9 default)
    seconds = time.perf_counter() - start
    ptx = compiled.asm["ptx"]
    regs, spill_stores, spill_loads = ptxas_report(ptx)
    cores = "wgmma" if "wgmma" in ptx else "mma" if re.search(r"\bmma\.", ptx) else "-"
    return Compiled(variant, dtype, meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"], config["num_warps"],
                    config["num_stages"], compiled.metadata.shared, regs, spill_stores, spill_loads, cores,
                    round(seconds, 2))


def compile_all(jobs: list[tuple[str, str, dict]], workers: int = 1) -> list[Compiled]:
    if workers <= 1:
        return [compile_one(j) for j in jobs]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(compile_one, jobs))


def table(rows: list[Compiled]) -> str:
    """Markdown table, one row per compiled configuration."""
    lines = ["| kernel | dtype | BLOCK_M x N x K | warps | stages | shared KB | fits 227 KB | regs | spills (st/ld B) "
             "| tensor cores |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.variant} | {r.dtype} | {r.block_m}x{r.block_n}x{r.block_k} | {r.num_warps} | "
                     f"{r.num_stages} | {r.shared_bytes / 1024:.0f} | {'yes' if r.fits else 'NO'} | {r.registers} | "
                     f"{r.spill_stores}/{r.spill_loads} | {r.tensor_cores} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--jobs", type=int, default=1, help="parallel compiler processes")
    p.add_argument("--json", help="also write the rows as JSON to this file")


def check_args(args: argparse.Namespace) -> None:
    from .timing import check_positive

    check_positive(args, "jobs")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ValueError("compiling the kernels needs Triton: pip install 'headmix[triton]'") from None


def main(argv: list[str] | None = None) -> int:
    """``python -m headmix.bench.hopper_aot [options]``: ``headmix bench hopper-aot`` (a bad option exits 2)."""
    from .timing import standalone_args

    return run(standalone_args(__doc__.split("\n\n")[0], add_arguments, check_args, argv))


def run(args: argparse.Namespace) -> int:
    check_args(args)
    jobs = jobs_for(args.dtypes, args.variants)
    start = time.perf_counter()
    rows = compile_all(jobs, args.jobs)
    print(table(rows))
    print(f"\n{len(rows)} configurations compiled for sm_90 in {time.perf_counter() - start:.0f} s; "
          f"{sum(not r.fits for r in rows)} do not fit an H100 block, {sum(r.spill_stores > 0 for r in rows)} spill, "
          f"{sum(r.tensor_cores != 'wgmma' for r in rows)} without wgmma")
    if args.json:
        from headmix.storage.files import atomic_write

        atomic_write(args.json, json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
