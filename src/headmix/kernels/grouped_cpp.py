"""A C++ grouped GEMM for the routed projections on the CPU (``impl="grouped_cpp"``), experts across cores.

MoA (Zhang et al. 2022, arXiv 2210.05144) eq. 10 (map), eq. 12 + 6 (reduce, gate-weighted sum) and
SwitchHead's gate-weighted values (arXiv 2312.07987) are one *slot pass* over the slots ``s = n k + j``
sorted by expert (``routing.sort_order``; expert ``e`` owns ``offsets[e]:offsets[e+1]``):

    ``dst[s // dst_div] += gate[s] * (src[s // src_div] @ W[e])``

* map: ``src = x`` (N rows, ``src_div = k``), one destination row per slot (``dst_div = 1``), no gates;
* reduce: ``src = h`` (N k rows, ``src_div = 1``; a stride-0 expanded (N, G, k/G, d) view is read as its
  N G distinct rows, ``src_div = k/G``), ``dst_div = k``, the gates;
* weighted map: ``src = x``, ``dst_div = k / groups``, the gates.

Its backward is the same pass through ``W[e]^T`` plus a weight gradient, with ``u[s] = grad_y[s // dst_div]
@ W[e]^T``: ``grad_src[s // src_div] += gate[s] u[s]``, ``grad_gate[s] = <u[s], src[s // src_div]>`` (in the
same pass: the per-slot outputs are never stored) and ``grad_W[e] = sum_{s of e} (gate[s] src[s //
src_div])^T grad_y[s // dst_div]``.

The kernel (``csrc/grouped_gemm.cpp``) gives each thread a run of whole experts of nearly equal row counts
(``at::parallel_for``), and each expert's GEMM runs whole on its thread: ATen's GEMM (MKL / oneDNN) runs
single-threaded inside the parallel region. Input rows are read where they are, a cache-sized tile at a time
(no gathered copy of all slots), and each tile's output rows are added, gated, straight into the tokens' rows
(no per-slot output buffer). Where slots of different threads share a destination row (reduce, weighted map,
the map's input gradient) every thread but the first adds into a private accumulator of the destination's
size, summed in a fixed order: no races, and the same result on every run at a given thread count.

The kernel is compiled on first use and cached (:mod:`.cpp_build`, with headmix's other C++ CPU kernels). Where
no compiler is found or the build fails, the Python ``sorted`` path (:mod:`.grouped_cpu`) runs instead and a
warning says so once. ``HEADMIX_CPU_KERNEL=python`` forces that path.

The pass and its backward are ``torch.library`` custom ops (``headmix::grouped_gemm``,
``headmix::grouped_gemm_backward``) with fake implementations, autograd and FLOP formulas, so
``torch.compile(fullgraph=True)`` sees one operation and ``FlopCounterMode`` counts ``2 N k d_in d_out`` per
GEMM.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from . import grouped_cpu
from .cpp_build import ENV_VAR, build_directory, cpp_kernel_available, cpp_ops as _ops
from .routing_info import ExpertRouting

__all__ = [
    "ENV_VAR", "build_directory", "cpp_kernel_available", "grouped_cpp_map", "grouped_cpp_map_weighted",
    "grouped_cpp_reduce",
]

# ---------------------------------------------------------------------------------------------- custom ops
@torch.library.custom_op("headmix::grouped_gemm", mutates_args=(), device_types="cpu")
def grouped_gemm_op(src: Tensor, weight: Tensor, gates: Tensor | None, sort_order: Tensor, offsets: Tensor,
                    src_div: int, dst_div: int) -> Tensor:
    """``y[s // dst_div] += gates[s] * (src[s // src_div] @ weight[e(s)])`` over the expert-sorted slots:
    (num_slots // dst_div, d_out)."""
    y, _ = _ops().slot_pass(src, src_div, weight, gates, sort_order, offsets, dst_div, True, None, 1)
    return y


@grouped_gemm_op.register_fake
def _(src, weight, gates, sort_order, offsets, src_div, dst_div):
    return src.new_empty(sort_order.shape[0] // dst_div, weight.shape[2])


@torch.library.custom_op("headmix::grouped_gemm_backward", mutates_args=(), device_types="cpu")
def grouped_gemm_backward_op(grad_y: Tensor, src: Tensor, weight: Tensor, gates: Tensor | None, sort_order: Tensor,
                             offsets: Tensor, src_div: int, dst_div: int, need_src: bool, need_w: bool,
                             need_g: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`grouped_gemm_op` with respect to ``src``, ``weight`` and ``gates`` (empty when not
    asked for)."""
    ops, grad_y = _ops(), grad_y.contiguous()
    grad_src, grad_w, grad_g = src.new_empty(0), src.new_empty(0), src.new_empty(0)  # distinct: no aliasing
    if need_src or need_g:
        grad_src, grad_g = ops.slot_pass(grad_y, dst_div, weight.transpose(1, 2), gates, sort_order, offsets, src_div,
                                         need_src, src if need_g else None, src_div)
    if need_w:
        grad_w = ops.weight_grad(src, src_div, gates, grad_y, dst_div, sort_order, offsets, weight.shape[0])
    return grad_src, grad_w, grad_g


@grouped_gemm_backward_op.register_fake
def _(grad_y, src, weight, gates, sort_order, offsets, src_div, dst_div, need_src, need_w, need_g):
    return (src.new_empty(src.shape if need_src else (0,)), weight.new_empty(weight.shape if need_w else (0,)),
            src.new_empty(sort_order.shape if need_g else (0,)))


def _setup_context(ctx, inputs, output):
    src, weight, gates, sort_order, offsets, src_div, dst_div = inputs
    ctx.save_for_backward(src, weight, gates, sort_order, offsets)
    ctx.src_div, ctx.dst_div = src_div, dst_div


def _backward(ctx, grad_y):
    src, weight, gates, sort_order, offsets = ctx.saved_tensors
    need_src, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_g = gates is not None and ctx.needs_input_grad[2]
    grad_src, grad_w, grad_g = grouped_gemm_backward_op(grad_y, src, weight, gates, sort_order, offsets, ctx.src_div,
                                                        ctx.dst_div, need_src, need_w, need_g)
    return (grad_src if need_src else None, grad_w if need_w else None, grad_g if need_g else None,
            None, None, None, None)


grouped_gemm_op.register_autograd(_backward, setup_context=_setup_context)


# FLOPs for FlopCounterMode: 2 per multiply-add, one (num_slots x d_in) @ (d_in x d_out) product per GEMM.
@register_flop_formula(torch.ops.headmix.grouped_gemm)
def _(src_shape, w_shape, gates_shape, order_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * order_shape[0] * w_shape[1] * w_shape[2]


@register_flop_formula(torch.ops.headmix.grouped_gemm_backward)
def _(gy_shape, src_shape, w_shape, gates_shape, order_shape, offsets_shape, src_div, dst_div, need_src, need_w,
      need_g, *args, out_shape=None, **kwargs) -> int:
    return (int(need_src or need_g) + int(need_w)) * 2 * order_shape[0] * w_shape[1] * w_shape[2]


# ------------------------------------------------------------------------------------------------ wrappers
def _check_cpu(t: Tensor) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"impl='grouped_cpp' runs on CPU tensors, got a tensor on {t.device}")


def _rows(t: Tensor) -> Tensor:
    """``t`` (2-d) with unit column stride (the kernel reads rows in place at any row stride)."""
    return t if t.stride(1) == 1 or t.shape[1] <= 1 else t.contiguous()


def _flat_gates(gates: Tensor) -> Tensor:
    return gates.reshape(-1)


def grouped_cpp_map(x: Tensor, weight: Tensor, routing: ExpertRouting) -> Tensor:
    """MoA eq. 10, ``y[n, j] = x[n] @ weight[expert_index[n, j]]``: (N, k, d_out)."""
    _check_cpu(x)
    if not cpp_kernel_available():
        return grouped_cpu.sorted_map(x, weight, routing)
    n, k = routing.num_tokens, routing.top_k
    y = grouped_gemm_op(_rows(x), weight, None, routing.sort_order, routing.offsets, k, 1)
    return y.view(n, k, weight.shape[2])


def grouped_cpp_map_weighted(x: Tensor, weight: Tensor, gates: Tensor, routing: ExpertRouting, groups: int) -> Tensor:
    """SwitchHead's values, ``y[n, g] = sum_{j of group g} gates[n, j] (x[n] @ weight[e(n, j)])``:
    (N, groups, d_out), the gating and the sum in the GEMM's pass."""
    _check_cpu(x)
    n, k, d_out = routing.num_tokens, routing.top_k, weight.shape[2]
    if not cpp_kernel_available():
        y = grouped_cpu.sorted_map(x, weight, routing)
        return (y * gates.unsqueeze(-1)).view(n, groups, k // groups, d_out).sum(2)
    y = grouped_gemm_op(_rows(x), weight, _flat_gates(gates), routing.sort_order, routing.offsets, k, k // groups)
    return y.view(n, groups, d_out)


def grouped_cpp_reduce(h: Tensor, weight: Tensor, gates: Tensor, routing: ExpertRouting) -> Tensor:
    """MoA eq. 12 + 6, ``y[n] = sum_j gates[n, j] (h[n, j] @ weight[expert_index[n, j]])``: (N, d_out).

    ``h`` is (N, k, d_in), or (N, G, k / G, d_in): a view expanded over its third dimension (stride 0) is read
    as its N G distinct rows, nothing copied.
    """
    _check_cpu(h)
    n, k = routing.num_tokens, routing.top_k
    d_in = h.shape[-1]
    if not cpp_kernel_available():
        return grouped_cpu.sorted_reduce(h.reshape(n, k, d_in), weight, gates, routing)
    if h.dim() == 4 and h.stride(2) == 0:
        src, src_div = h.select(2, 0).reshape(n * h.shape[1], d_in), h.shape[2]
    else:
        src, src_div = h.reshape(n * k, d_in), 1
    return grouped_gemm_op(_rows(src), weight, _flat_gates(gates), routing.sort_order, routing.offsets, src_div, k)
