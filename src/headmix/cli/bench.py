"""``headmix bench NAME``: the benchmarks, each a module of :mod:`headmix.bench` with ``add_arguments`` and ``run``."""

from __future__ import annotations

import argparse


def _modules():
    from ..bench import (attention, compute, decode, distill, expert_gemm_shapes, gpu_layers, gqa, gqe,
                         grouped_gemm_cpu, grouped_matmul, hopper_aot, kv_cache_bytes, models, moh_projections, mosa,
                         quick, serve, upcycle)

    return {"attention": (attention, "MoA and SwitchHead vs torch MHA: time, memory, decoding"),
            "models": (models, "whole-model training steps: MoA vs the MHA model of equal MACs"),
            "decode": (decode, "decoding tokens/s against the memory-bandwidth bound of the expert weights"),
            "gqa": (gqa, "grouped-query MHA vs torch SDPA enable_gqa, MoH per K/V group vs grouped MHA, gates and QK-norm"),
            "gqe": (gqe, "GQE (the paper's 16 experts on 8 K/V heads, top 1) vs GQA with 16 heads, eager and compiled"),
            "mosa": (mosa, "Mixture of Sparse Attention vs MHA of equal attention MACs: time, memory, KV cache"),
            "layers": (gpu_layers, "the GPU layer table: every attention kind, fwd+bwd, vs torch SDPA MHA"),
            "compute": (compute, "time beside compute: each routed kind vs its dense baseline at the study size, "
                                 "d_model 1024 and the GPU size: time, minimal MAC and ATen op ratios"),
            "quick": (quick, "the GPU check's model tables: a Llama training step or greedy decoding per kind"),
            "grouped": (grouped_matmul, "MoA's expert map + reduce per expert_impl vs two dense Linear"),
            "grouped-cpu": (grouped_gemm_cpu, "the CPU grouped GEMMs (sorted, grouped_cpp, the padded-bmm "
                                              "prototype) vs a dense GEMM of the same MACs, fwd+bwd"),
            "gemm-shapes": (expert_gemm_shapes, "the per-expert GEMMs of the sorted CPU kernels vs one dense GEMM"),
            "moh-projections": (moh_projections, "MoH's query and output projections: dense vs grouped"),
            "kv-cache": (kv_cache_bytes, "KV-cache bytes per token: MoA kv_heads=G vs MHA and HF GQA"),
            "serve": (serve, "vLLM serving headmix's GQA and routed kinds vs vLLM's own Llama on the same GQA weights: "
                             "prefill and decode, eager and compiled, beside the minimal MAC ratio"),
            "hopper-aot": (hopper_aot, "the Triton kernels compiled for an H100 without a GPU: shared memory, spills"),
            "upcycle": (upcycle, "dense -> MoH / pruned: conversion time and continued-training step vs dense"),
            "distill": (distill, "a distilled training step vs a plain one at a real vocabulary: peak memory, time")}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks, each against a baseline measured in the same run")
    what = p.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in _modules().items():
        module.add_arguments(what.add_parser(name, help=help_text, description=module.__doc__,
                                             formatter_class=argparse.RawDescriptionHelpFormatter))


#: The benchmarks that make the allocator setting themselves: ``compute`` keeps freed memory or leaves glibc's
#: setting as its ``--malloc`` says (so ``--malloc default`` measures without it).
OWN_ALLOCATOR_SETTING = ("compute",)


def run(args: argparse.Namespace) -> int:
    """Run benchmark ``args.bench``; every one but :data:`OWN_ALLOCATOR_SETTING` first keeps freed memory
    (:func:`headmix.keep_freed_memory`, as ``headmix train`` does: what a CPU step costs without page faults)."""
    if args.bench not in OWN_ALLOCATOR_SETTING:
        from ..process import keep_freed_memory

        keep_freed_memory()
    return _modules()[args.bench][0].run(args)
