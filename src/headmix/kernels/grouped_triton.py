"""Triton grouped matmul for the expert map / reduce (scattermoe style).

One primitive covers both MoA projections.  With slots ``s = n*k + j`` sorted
by expert (``routing.sort_order``), ``e(s)`` the expert of slot ``s`` and
``fan_in`` either ``k`` or 1:

    grouped_mm:  Y[s] = X[s // fan_in] @ W[e(s)]                  (slot order)

* map (MoA eq. 10): ``X = x`` (N, d_in), ``fan_in = k``, ``y = Y.view(N, k, d_out)``.
* reduce (MoA eq. 12 + 6): ``X = h.view(N*k, d_in)``, ``fan_in = 1``, then the
  gate-weighted sum ``y[n] = gates[n] @ Y.view(N, k, d_out)[n]`` is one ``bmm``
  (its autograd gives ``grad_gates``).

Kernels (each program handles ``BLOCK_M`` consecutive sorted slots of a single
expert, so it streams one expert's weight tile; rows are gathered from ``X``
and scattered to ``Y`` by slot id, nothing is permuted in memory):

* ``grouped_mm_kernel`` (in :mod:`._triton_kernels`): forward, and the input gradient
  ``dX_slot[s] = dY[s] @ W[e(s)]^T`` (the same kernel on the transposed weight
  view; for ``fan_in = k`` the k slot rows are then summed per token).
* ``grouped_wgrad_kernel``: ``dW[e] = sum_{s of e} X[s // fan_in]^T dY[s]``,
  one program per (expert, d_in tile, d_out tile, split) looping over its share
  of the expert's slots, whose bounds it reads from ``offsets`` on the device;
  when an expert's slots are split (:func:`wgrad_splits`, to fill a GPU when E is
  small) the partial sums are added afterwards.

The block table (``routing.block_expert`` / ``block_start``) has a static
length, so the grid is known without reading routing data back to the host.

Both are ``torch.library`` custom ops (``headmix::grouped_mm``,
``headmix::grouped_mm_wgrad``) with fake implementations and a registered
autograd formula, so ``torch.compile`` traces through them as opaque nodes.

Triton is imported lazily: this module imports without it, and the kernels are
defined on first use.  On CPU tensors the kernels only run under the Triton
interpreter, which must be switched on (``TRITON_INTERPRET=1``) before the
kernels are first defined; that is how the CPU tests exercise them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch
from torch import Tensor

from .routing_info import DEFAULT_BLOCK_M, ExpertRouting

__all__ = [
    "grouped_mm",
    "grouped_mm_wgrad",
    "triton_available",
    "triton_map",
    "triton_reduce",
]


def _probe_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


_HAS_TRITON = _probe_triton()


def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    return _HAS_TRITON


def interpret_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the Triton interpreter (needed for CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@functools.cache
def _kernels():
    """Import (and so define) the Triton kernels; TRITON_INTERPRET is read now."""
    import triton
    import triton.language as tl

    from . import _triton_kernels as k

    interpreted = not isinstance(k.grouped_mm_kernel, triton.runtime.JITFunction)
    return k.grouped_mm_kernel, k.grouped_wgrad_kernel, interpreted, tl


def kernels_interpreted() -> bool:
    """Whether the (already or now) defined kernels run in the Triton interpreter."""
    return _kernels()[2]


def can_run_on_cpu() -> bool:
    """Whether the kernels run (or, once defined, will run) in the interpreter."""
    if _kernels.cache_info().currsize:
        return kernels_interpreted()
    return interpret_enabled()


def _check_device(t: Tensor) -> None:
    if t.device.type == "cpu" and not kernels_interpreted():
        raise RuntimeError(
            "the Triton kernels got CPU tensors but were compiled for a GPU; set "
            "TRITON_INTERPRET=1 before headmix's Triton kernels are first used to run them on CPU"
        )


def _pow2_block(size: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, 1 << max(size - 1, 0).bit_length()))


def _config(dtype: torch.dtype, k_dim: int, n_dim: int, tl, device: torch.device) -> dict:
    if dtype == torch.float64:
        acc, precision = tl.float64, "ieee"
    else:
        acc = tl.float32
        precision = "tf32" if (dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32) else "ieee"
    wide = dtype in (torch.float16, torch.bfloat16)
    return {
        "BLOCK_K": _pow2_block(k_dim, 16, 64 if wide else 32),
        "BLOCK_N": _pow2_block(n_dim, 16, 128 if wide else 64),
        "ACC_TYPE": acc,
        "INPUT_PRECISION": precision,
        "UPCAST": device.type == "cpu" and dtype == torch.bfloat16,
    }


def _launch_opts(device: torch.device) -> dict:
    return {} if device.type == "cpu" else {"num_warps": 4, "num_stages": 3}


@torch.library.custom_op("headmix::grouped_mm", mutates_args=())
def grouped_mm(
    x: Tensor,
    weight: Tensor,
    sort_order: Tensor,
    block_expert: Tensor,
    block_start: Tensor,
    offsets: Tensor,
    fan_in: int,
    block_m: int,
) -> Tensor:
    """``Y[s] = x[s // fan_in] @ weight[e(s)]`` for the S = len(sort_order) slots, in slot order."""
    mm_kernel, _, _, tl = _kernels()
    _check_device(x)
    num_slots = sort_order.shape[0]
    num_experts, k_dim, n_dim = weight.shape
    y = x.new_empty(num_slots, n_dim)
    if num_slots == 0 or n_dim == 0:
        return y
    if k_dim == 0:
        return y.zero_()
    cfg = _config(x.dtype, k_dim, n_dim, tl, x.device)
    with _device_guard(x):
        grid = (block_expert.shape[0], triton_cdiv(n_dim, cfg["BLOCK_N"]))
        mm_kernel[grid](
            x, weight, y, sort_order, block_expert, block_start, offsets,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), weight.stride(2), y.stride(0), y.stride(1),
            num_experts, k_dim, n_dim,
            FAN_IN=fan_in, BLOCK_M=block_m, **cfg, **_launch_opts(x.device),
        )
    return y


@grouped_mm.register_fake
def _(x, weight, sort_order, block_expert, block_start, offsets, fan_in, block_m):
    return x.new_empty(sort_order.shape[0], weight.shape[2])


#: The weight gradient aims for this many programs per GPU multiprocessor ...
WGRAD_PROGRAMS_PER_SM = 4
#: ... without giving a split fewer than this many ``block_m``-row blocks of slots on average.
WGRAD_MIN_BLOCKS_PER_SPLIT = 4


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def wgrad_splits(num_slots: int, num_experts: int, tiles: int, block_m: int, device: torch.device) -> int:
    """How many chunks to cut each expert's slots into for the weight gradient (host-side, no sync).

    One program per (expert, d_in tile, d_out tile) is few when E is small: E=8 with a 512 x 64 weight in
    64 x 64 tiles is 64 programs on a GPU of 132 multiprocessors, each looping over an eighth of all slots.
    Splitting every expert's slots into equal chunks multiplies the programs; the partial sums are then
    added up. The rule is a heuristic from the grid shape, not yet tuned by measurement on a GPU.
    """
    if device.type != "cuda":
        return 1
    want = triton_cdiv(WGRAD_PROGRAMS_PER_SM * _multiprocessors(device.index or 0), num_experts * tiles)
    most = num_slots // (num_experts * block_m * WGRAD_MIN_BLOCKS_PER_SPLIT)
    return max(1, min(want, most))


@torch.library.custom_op("headmix::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(
    x: Tensor, grad_y: Tensor, sort_order: Tensor, offsets: Tensor, fan_in: int, block_m: int, num_splits: int = 0
) -> Tensor:
    """``dW[e] = sum_{s of expert e} x[s // fan_in]^T grad_y[s]``, shape (E, d_in, d_out).

    ``num_splits``: chunks per expert's slots, summed afterwards (0: :func:`wgrad_splits` decides).
    """
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0 chooses), got {num_splits}")
    _, wgrad_kernel, _, tl = _kernels()
    _check_device(x)
    num_experts = offsets.shape[0] - 1
    k_dim, n_dim = x.shape[1], grad_y.shape[1]
    dw = x.new_empty(num_experts, k_dim, n_dim)
    if dw.numel() == 0:
        return dw
    if sort_order.shape[0] == 0:
        return dw.zero_()
    cfg = _config(x.dtype, k_dim, n_dim, tl, x.device)
    tiles = (triton_cdiv(k_dim, cfg["BLOCK_K"]), triton_cdiv(n_dim, cfg["BLOCK_N"]))
    splits = num_splits or wgrad_splits(sort_order.shape[0], num_experts, tiles[0] * tiles[1], block_m, x.device)
    # partial sums are kept in the accumulator's precision
    out = dw if splits == 1 else x.new_empty(splits, num_experts, k_dim, n_dim, dtype=_partial_dtype(x.dtype))
    stride_split = 0 if splits == 1 else out.stride(0)
    with _device_guard(x):
        wgrad_kernel[(num_experts * splits, *tiles)](
            x, grad_y, out, sort_order, offsets,
            x.stride(0), x.stride(1), grad_y.stride(0), grad_y.stride(1),
            stride_split, out.stride(-3), out.stride(-2), out.stride(-1),
            k_dim, n_dim, splits,
            FAN_IN=fan_in, BLOCK_M=block_m, **cfg, **_launch_opts(x.device),
        )
    return dw if splits == 1 else out.sum(0).to(dw.dtype)


def _partial_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@grouped_mm_wgrad.register_fake
def _(x, grad_y, sort_order, offsets, fan_in, block_m, num_splits=0):
    return x.new_empty(offsets.shape[0] - 1, x.shape[1], grad_y.shape[1])


def _setup_context(ctx, inputs, output):
    x, weight, sort_order, block_expert, block_start, offsets, fan_in, block_m = inputs
    ctx.save_for_backward(x, weight, sort_order, block_expert, block_start, offsets)
    ctx.fan_in, ctx.block_m = fan_in, block_m


def _backward(ctx, grad_y):
    x, weight, sort_order, block_expert, block_start, offsets = ctx.saved_tensors
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        # dX_slot[s] = dY[s] @ W[e(s)]^T: the forward kernel on the transposed weight view
        grad_slot = grouped_mm(
            grad_y, weight.transpose(1, 2), sort_order, block_expert, block_start, offsets, 1, ctx.block_m
        )
        if ctx.fan_in == 1:
            grad_x = grad_slot
        else:
            grad_x = grad_slot.view(x.shape[0], ctx.fan_in, x.shape[1]).sum(1)
    if ctx.needs_input_grad[1]:
        grad_w = grouped_mm_wgrad(x, grad_y, sort_order, offsets, ctx.fan_in, ctx.block_m)
    return grad_x, grad_w, None, None, None, None, None, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)


def _device_guard(t: Tensor):
    """Launch on the tensor's GPU (Triton uses the current CUDA device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _blocks(routing: ExpertRouting) -> ExpertRouting:
    return routing if routing.block_m is not None else routing.with_blocks(DEFAULT_BLOCK_M)


def triton_map(x: Tensor, weight: Tensor, routing: ExpertRouting) -> Tensor:
    """MoA eq. 10 with the Triton grouped matmul: (N, d_in) -> (N, k, d_out)."""
    r = _blocks(routing)
    y = grouped_mm(x, weight, r.sort_order, r.block_expert, r.block_start, r.offsets, r.top_k, r.block_m)
    return y.view(x.shape[0], r.top_k, weight.shape[2])


def triton_reduce(h: Tensor, weight: Tensor, gates: Tensor, routing: ExpertRouting) -> Tensor:
    """MoA eq. 12 + 6 with the Triton grouped matmul: (N, k, d_in) -> (N, d_out)."""
    r = _blocks(routing)
    num_tokens, top_k, d_in = h.shape
    z = grouped_mm(
        h.reshape(num_tokens * top_k, d_in), weight, r.sort_order, r.block_expert, r.block_start, r.offsets, 1, r.block_m
    )
    # eq. 6: y[n] = sum_j gates[n, j] * z[n, j]
    return torch.bmm(gates.unsqueeze(1), z.view(num_tokens, top_k, weight.shape[2])).squeeze(1)
