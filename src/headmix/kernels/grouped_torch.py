"""The expert map / reduce on PyTorch's grouped GEMM, ``torch.nn.functional.grouped_mm`` (``impl="grouped_mm"``).

MoA (Zhang et al. 2022, arXiv 2210.05144) eq. 10 (map), eq. 12 + 6 (reduce, gate-weighted sum) and
SwitchHead's gate-weighted values (arXiv 2312.07987), with the slots ``s = n k + j`` sorted by expert
(``routing.sort_order``, :mod:`.routing_info`):

* gather the slots' input rows in expert order (one ``index_select``),
* one ``grouped_mm`` over the sorted rows, expert ``e`` owning rows ``offsets[e]:offsets[e+1]`` (the
  routing's cumulative ``offsets[1:]`` as int32 on the device: nothing is read back to the host and every
  shape depends only on N, k, E),
* put the rows back in slot order (one ``index_copy``),
* reduce / weighted map only: the gate weighting and the sum over a token's (or a group's) slots in one
  batched mat-vec, ``y[n] = gates[n] @ Y[n]`` (``bmm`` of (N, 1, k) by (N, k, d_out)): the gates are never
  multiplied into an (N k, d_out) buffer of their own.

The backward is PyTorch's own formula for ``grouped_mm`` (the input gradient a grouped GEMM with the
transposed weights, the weight gradient a 2-d x 2-d grouped GEMM over the same offsets) and the autograd
of the gathers and of ``bmm``.

Layout rules of ``grouped_mm`` (torch 2.13, checked on the CPU path and in its meta function, which
``torch.compile`` uses on every device):

* dtype: bfloat16 on CUDA and under ``torch.compile`` (the meta function accepts nothing else; the CUDA
  kernel is CUTLASS on sm_90); the CPU's eager path also takes float32 and float16. float64 never.
* every operand's row stride a multiple of 16 bytes (8 bfloat16, 4 float32 values): ``d_in`` and
  ``d_out`` that are not are zero-padded here (a copy of x and W), so odd sizes work, at a cost;
* offsets int32, cumulative, on the operands' device; rows past ``offs[-1]`` are left uninitialised
  (here ``offs[-1] = N k``, every row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .routing_info import ExpertRouting

__all__ = ["check_grouped_mm_dtype", "grouped_mm_map", "grouped_mm_map_weighted", "grouped_mm_reduce"]

#: dtypes ``grouped_mm`` takes on the CPU's eager path; elsewhere (CUDA, ``torch.compile``) bfloat16 only.
EAGER_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Every row stride of ``grouped_mm``'s operands must be a multiple of this many bytes.
ALIGN_BYTES = 16


def check_grouped_mm_dtype(t: Tensor) -> None:
    """A one-line ValueError unless ``grouped_mm`` takes ``t``'s dtype on its device in this mode."""
    eager_cpu = t.device.type == "cpu" and not torch.compiler.is_compiling()
    allowed = EAGER_CPU_DTYPES if eager_cpu else (torch.bfloat16,)
    if t.dtype not in allowed:
        where = "on the CPU in eager mode" if eager_cpu else f"on {t.device.type} or under torch.compile"
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"impl='grouped_mm' needs a dtype in ({names}) {where}, got {t.dtype}")


def _padded(t: Tensor, dims: tuple[int, ...]) -> Tensor:
    """``t`` zero-padded at the end of ``dims`` to a multiple of 16 bytes, made row-major contiguous."""
    align = ALIGN_BYTES // t.element_size()
    pad = [0] * (2 * t.dim())
    for d in dims:
        pad[2 * (t.dim() - 1 - d % t.dim()) + 1] = -t.shape[d] % align
    return (F.pad(t, pad) if any(pad) else t).contiguous()


def _sorted_gemm(rows: Tensor, weight: Tensor, routing: ExpertRouting) -> Tensor:
    """``Y[i] = rows[i] @ weight[e]`` for the sorted rows ``i`` of expert ``e``: (N k, d_out)."""
    d_out = weight.shape[2]
    offsets = routing.offsets[1:].to(torch.int32)
    out = F.grouped_mm(_padded(rows, (1,)), _padded(weight, (1, 2)), offs=offsets)
    return out if out.shape[1] == d_out else out[:, :d_out]


def _slot_order(y_sorted: Tensor, routing: ExpertRouting) -> Tensor:
    """The sorted rows put back in slot order ``s = n k + j``."""
    return y_sorted.new_empty(y_sorted.shape).index_copy(0, routing.sort_order, y_sorted)


def grouped_mm_map(x: Tensor, weight: Tensor, routing: ExpertRouting) -> Tensor:
    """MoA eq. 10, ``y[n, j] = x[n] @ weight[expert_index[n, j]]``: (N, k, d_out)."""
    check_grouped_mm_dtype(x)
    n, k = routing.num_tokens, routing.top_k
    y = _sorted_gemm(x.index_select(0, routing.sorted_token), weight, routing)
    return _slot_order(y, routing).view(n, k, weight.shape[2])


def grouped_mm_map_weighted(x: Tensor, weight: Tensor, gates: Tensor, routing: ExpertRouting, groups: int) -> Tensor:
    """SwitchHead's values, ``y[n, g] = sum_{j of group g} gates[n, j] (x[n] @ weight[e(n, j)])``:
    (N, groups, d_out), the weighting and the sum in one ``bmm``."""
    n, k, d_out = routing.num_tokens, routing.top_k, weight.shape[2]
    y = grouped_mm_map(x, weight, routing).view(n * groups, k // groups, d_out)
    return torch.bmm(gates.reshape(n * groups, 1, k // groups), y).view(n, groups, d_out)


def grouped_mm_reduce(h: Tensor, weight: Tensor, gates: Tensor, routing: ExpertRouting) -> Tensor:
    """MoA eq. 12 + 6, ``y[n] = sum_j gates[n, j] (h[n, j] @ weight[expert_index[n, j]])``: (N, d_out),
    the weighting and the sum over ``j`` in one ``bmm``."""
    check_grouped_mm_dtype(h)
    n, k, d_out = routing.num_tokens, routing.top_k, weight.shape[2]
    rows = h.reshape(n * k, h.shape[-1]).index_select(0, routing.sort_order)
    y = _slot_order(_sorted_gemm(rows, weight, routing), routing).view(n, k, d_out)
    return torch.bmm(gates.view(n, 1, k), y).view(n, d_out)
