"""Every attention kind headmix has, as one row each: the rows of the GPU check's layer, model-step and decoding
tables (:mod:`headmix.bench.gpu_layers`, :mod:`headmix.bench.quick`) and of the compile test.

Each row is an :class:`~headmix.models.AttentionConfig` for model width ``d_model`` and sequence length ``seq``
with heads of 64 at d_model 512 (8 heads), scaled with the width (``d_model / 64`` heads of 64 numbers; at
tiny widths heads of ``d_model / 8``). MoSA's sparse heads are solved so that its attention costs MHA's MACs at
``seq`` tokens (:func:`headmix.models.matching.matched_sparse_heads`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..models import AttentionConfig


@dataclass(frozen=True)
class Kind:
    """One attention kind: ``config(d_model, seq)``; ``needs`` "triton" (Triton kernels: CUDA, or the CPU
    interpreter) or "cuda" (CUDA only) or "" (anywhere)."""

    name: str
    config: Callable[[int, int], AttentionConfig]
    needs: str = ""


def heads_for(d_model: int) -> tuple[int, int]:
    """(heads, head size): heads of 64 numbers at widths of 512 and more, else 8 heads."""
    return (d_model // 64, 64) if d_model >= 512 else (8, d_model // 8)


def _mha(d_model: int, seq: int, **kw) -> AttentionConfig:
    heads, size = heads_for(d_model)
    return AttentionConfig(kind="mha", num_heads=heads, head_dim=size, **kw)


def _gqa(**kw) -> Callable[[int, int], AttentionConfig]:
    return lambda d, t: _mha(d, t, kv_heads=2, qk_norm=True, **kw)


def _moa(impl: str, kv_heads: int = 1) -> Callable[[int, int], AttentionConfig]:
    """MoA choosing MHA's number of query heads: ``heads / G`` of ``4 heads / G`` experts, ``G`` query heads each."""
    def config(d_model: int, seq: int) -> AttentionConfig:
        heads, size = heads_for(d_model)
        return AttentionConfig(kind="moa", num_experts=4 * heads // kv_heads, top_k=heads // kv_heads, head_dim=size,
                               expert_impl=impl, kv_heads=kv_heads)

    return config


def _moh(impl: str, **kw) -> Callable[[int, int], AttentionConfig]:
    def config(d_model: int, seq: int) -> AttentionConfig:
        heads, size = heads_for(d_model)
        return AttentionConfig(kind="moh", num_heads=heads, head_dim=size, moh_impl=impl, **kw)

    return config


def _gqe(d_model: int, seq: int) -> AttentionConfig:
    """GQE as its paper's main setting: MHA's heads as query-head experts, two per K/V head, top 1 per group."""
    heads, size = heads_for(d_model)
    return AttentionConfig(kind="gqe", num_experts=heads, kv_heads=heads // 2, top_k=1, head_dim=size)


def _switchhead(d_model: int, seq: int) -> AttentionConfig:
    # the SwitchHead paper's shape at d_model 512: 2 heads, 4 value/output experts each, top 2, heads of 171
    return AttentionConfig(kind="switchhead", num_heads=2, num_experts=4, top_k=2, head_dim=-(-d_model // 3))


def _talking_heads(d_model: int, seq: int) -> AttentionConfig:
    heads, size = heads_for(d_model)
    return AttentionConfig(kind="talking_heads", num_heads=heads, head_dim=size)


def _mosa(d_model: int, seq: int) -> AttentionConfig:
    from ..models.matching import matched_sparse_heads

    heads, size = heads_for(d_model)
    sparsity = min(8, max(1, seq // 2))
    sparse, _ = matched_sparse_heads(d_model, heads, seq, head_dim=size, sparsity=sparsity, dense_heads=2)
    return AttentionConfig(kind="mosa", num_sparse_heads=sparse, num_dense_heads=2, head_dim=size, sparsity=sparsity,
                           bias=False)


#: Every attention kind, the baseline (MHA) first.
KINDS: list[Kind] = [
    Kind("MHA", _mha),
    Kind("GQA kv2 QK-norm", _gqa()),
    Kind("GQA kv2 QK-norm headwise gate", _gqa(output_gate="headwise")),
    Kind("GQA kv2 QK-norm elementwise gate", _gqa(output_gate="elementwise")),
    Kind("MoA dense", _moa("dense")),
    Kind("MoA grouped_mm", _moa("grouped_mm")),
    Kind("MoA triton", _moa("triton"), needs="triton"),
    Kind("MoA kv2", _moa("auto", kv_heads=2)),
    Kind("MoH 2 shared top 3 dense", _moh("dense", num_shared_heads=2, top_k=3)),
    Kind("MoH 2 shared top 3 sparse", _moh("sparse", num_shared_heads=2, top_k=3)),
    # the shape the lm-en-contenders rows of MoH routed per K/V group ran before the paper's GQE replaced them
    # (its router gets no task-loss gradient: timed as that ablation)
    Kind("MoH per K/V group kv2 1 shared top 1 sparse", _moh("sparse", kv_heads=2, route_per_group=True,
                                                             num_shared_heads=1, top_k=1,
                                                             allow_router_without_task_gradient=True)),
    Kind("GQE (paper) top 1 of 2 per K/V head", _gqe),
    Kind("SwitchHead", _switchhead),
    Kind("Talking-Heads", _talking_heads),
    Kind("MoSA at MHA's MACs", _mosa),
]


def describe(att: AttentionConfig, d_model: int) -> str:
    """A short shape for a table: ``8x64``, ``8K32E64D``, ``2H4E2K head 171``, ``MoSA 11 sparse + 2 dense``."""
    size = att.resolved_head_dim(d_model)
    if att.kind == "moa":
        return f"{att.top_k}K{att.num_experts}E{size}D"
    if att.kind == "switchhead":
        return f"{att.num_heads}H{att.num_experts}E{att.top_k}K head {size}"
    if att.kind == "gqe":
        experts, kv, top_k = att.gqe_sizes()
        return f"{experts}E on {kv} K/V, top {top_k} per group, head {size}"
    if att.kind == "mosa":
        return f"{att.num_sparse_heads} sparse (1/{att.sparsity:g} of the tokens) + {att.num_dense_heads} dense x {size}"
    return f"{att.num_heads}x{size}"


def without_triton(kinds: list[Kind]) -> list[Kind]:
    """The kinds that run without the Triton kernels."""
    return [k for k in kinds if k.needs != "triton"]


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernels run on ``device``: compiled on CUDA, or in the interpreter on the CPU."""
    from ..kernels import grouped_triton

    return grouped_triton.triton_available() and (device.type == "cuda" or grouped_triton.can_run_on_cpu())
