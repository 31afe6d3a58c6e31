"""Sorted grouped matmul for CPU: one GEMM per expert, hand-written backward.

The slots (token n, choice j) are grouped by expert with the routing's
``sort_order`` (see :mod:`headmix.kernels.routing_info`).  Expert ``e`` then
owns the sorted rows ``offsets[e]:offsets[e+1]``; the row ranges are read on
the host (``counts.tolist()``, a host sync that costs nothing on CPU).

Consecutive experts are packed into *chunks* of at most ``chunk_rows`` sorted
rows (an expert with more rows gets a chunk of its own; experts are never
split).  Per chunk the kernels do one gather of the chunk's input rows, one
GEMM per expert of the chunk into a row slice of the chunk's output, and one
scatter of the chunk's output to its destination: ``index_copy_`` into the
slot-ordered output, or ``scatter_add_`` into the token-ordered one.  So the
number of gathers and scatters per call is ``~N*k / chunk_rows`` whatever
``E`` is, and only the GEMMs (one per expert and product) scale with ``E``:
the cost no longer grows with the number of experts at fixed ``N*k``.

Two further choices, both measured on the 2-core CPU (CHANGELOG.md, 2026-11-21):

* sums over a token's slots use ``scatter_add_`` with a row index expanded
  over the columns, which runs in parallel over the columns; ``index_add_``
  along dim 0 adds one row at a time on one thread;
* every temporary is a chunk-sized workspace (``chunk_rows x d``, at most
  :data:`CHUNK_BYTES`, reused by every chunk of a call) instead of an
  ``N*k x d`` sorted buffer: without the CLI's allocator setting, the page
  faults of fresh multi-10-MB CPU buffers cost as much as the GEMMs.

Forward and backward (MoA eq. 10, 12, 6; ``e = expert(s)``, ``n = token(s)``):

* map    ``y[s] = x[n] @ W[e]``
  ``grad_x[n] = sum_{s of n} grad_y[s] @ W[e]^T`` and
  ``grad_W[e] = sum_{s of e} x[n]^T grad_y[s]``
* reduce ``y[n] = sum_{s of n} g[s] * (h[s] @ W[e])``
  with ``u[s] = grad_y[n] @ W[e]^T``: ``grad_h[s] = g[s] * u[s]``,
  ``grad_g[s] = <u[s], h[s]>`` (a row-wise dot product, so the (N*k, d_out)
  per-slot outputs are never stored), and
  ``grad_W[e] = sum_{s of e} (g[s] h[s])^T grad_y[n]``.

Cost is ``O(N*k*d_in*d_out)`` plus ``O(E)`` GEMM calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .routing_info import ExpertRouting

__all__ = ["CHUNK_BYTES", "sorted_map", "sorted_reduce"]

#: Bytes of the widest chunk workspace: ``chunk_rows = CHUNK_BYTES // (max(d_in, d_out) * element size)``
#: (4096 rows at width 512 in float32). Below glibc's 32 MiB mmap threshold, so a freed workspace is
#: reused by the next call instead of being unmapped and faulted back in.
CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class _Chunk:
    """Sorted rows ``[start, stop)``, holding whole experts ``experts[i]`` at chunk-relative rows
    ``[bounds[i], bounds[i+1])``."""

    start: int
    stop: int
    experts: list[int]
    bounds: list[int]


def _chunks(offsets: list[int], chunk_rows: int) -> list[_Chunk]:
    """Pack consecutive non-empty experts into chunks of at most ``chunk_rows`` rows (an expert with
    more rows gets a chunk of its own)."""
    chunks: list[_Chunk] = []
    start, experts, bounds = offsets[0], [], [0]
    for e in range(len(offsets) - 1):
        lo, hi = offsets[e], offsets[e + 1]
        if hi == lo:
            continue
        if experts and hi - start > chunk_rows:
            chunks.append(_Chunk(start, lo, experts, bounds))
            start, experts, bounds = lo, [], [0]
        experts.append(e)
        bounds.append(hi - start)
    if experts:
        chunks.append(_Chunk(start, offsets[-1], experts, bounds))
    return chunks


def _chunk_rows(width: int, dtype: torch.dtype) -> int:
    return max(1, CHUNK_BYTES // (width * torch.empty((), dtype=dtype).element_size()))


def _workspace_rows(chunks: list[_Chunk]) -> int:
    return max((c.stop - c.start for c in chunks), default=0)


def _grouped_mm(a: Tensor, weight: Tensor, chunk: _Chunk, out: Tensor, transpose: bool = False) -> Tensor:
    """``out[rows of e] = a[rows of e] @ W[e]`` (``W[e]^T`` if ``transpose``) for the experts of ``chunk``."""
    b = chunk.bounds
    for i, e in enumerate(chunk.experts):
        w = weight[e].t() if transpose else weight[e]
        torch.mm(a[b[i]:b[i + 1]], w, out=out[b[i]:b[i + 1]])
    return out


def _weight_grad(a: Tensor, grad: Tensor, chunk: _Chunk, grad_w: Tensor) -> None:
    """``grad_W[e] = a[rows of e]^T @ grad[rows of e]`` for the experts of ``chunk``."""
    b = chunk.bounds
    for i, e in enumerate(chunk.experts):
        torch.mm(a[b[i]:b[i + 1]].t(), grad[b[i]:b[i + 1]], out=grad_w[e])


def _zero_unused(grad_w: Tensor, chunks: list[_Chunk]) -> None:
    used = torch.zeros(grad_w.shape[0], dtype=torch.bool)
    for c in chunks:
        used[c.experts] = True
    if not bool(used.all()):
        grad_w[~used.to(grad_w.device)] = 0


def _scatter_rows_add(out: Tensor, index: Tensor, rows: Tensor) -> None:
    """``out[index[i]] += rows[i]``, parallel over the columns (unlike ``index_add_`` along dim 0)."""
    out.scatter_add_(0, index.unsqueeze(1).expand(-1, rows.shape[1]), rows)


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` for 2-d a, b without the (rows, d) temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(a.shape[0])


def _sorted_map_forward(x: Tensor, weight: Tensor, sort_order: Tensor, sorted_token: Tensor, chunks: list[_Chunk],
                        top_k: int) -> Tensor:
    """MoA eq. 10, ``y[n, j] = x[n] @ W[expert_index[n, j]]``, grouped by expert: (N, k, d_out)."""
    num_tokens, (_, d_in, d_out) = x.shape[0], weight.shape
    y = x.new_empty(num_tokens * top_k, d_out)
    rows = _workspace_rows(chunks)
    x_buf, y_buf = x.new_empty(rows, d_in), x.new_empty(rows, d_out)
    for c in chunks:
        n = c.stop - c.start
        x_c = torch.index_select(x, 0, sorted_token[c.start:c.stop], out=x_buf[:n])
        y.index_copy_(0, sort_order[c.start:c.stop], _grouped_mm(x_c, weight, c, y_buf[:n]))
    return y.view(num_tokens, top_k, d_out)


def _sorted_map_backward(grad_y: Tensor, x: Tensor, weight: Tensor, sort_order: Tensor, sorted_token: Tensor,
                         chunks: list[_Chunk], need_x: bool, need_w: bool) -> tuple[Tensor | None, Tensor | None]:
    d_in, d_out = weight.shape[1], weight.shape[2]
    grad_y = grad_y.reshape(-1, d_out)
    grad_x = x.new_zeros(x.shape) if need_x else None
    grad_w = weight.new_empty(weight.shape) if need_w else None
    rows = _workspace_rows(chunks)
    gy_buf = x.new_empty(rows, d_out)
    gx_buf = x.new_empty(rows, d_in) if need_x else None
    x_buf = x.new_empty(rows, d_in) if need_w else None
    for c in chunks:
        n = c.stop - c.start
        token_c = sorted_token[c.start:c.stop]
        gy_c = torch.index_select(grad_y, 0, sort_order[c.start:c.stop], out=gy_buf[:n])
        if need_x:  # grad_x[n] += grad_y[s] @ W[e]^T
            _scatter_rows_add(grad_x, token_c, _grouped_mm(gy_c, weight, c, gx_buf[:n], transpose=True))
        if need_w:  # grad_W[e] = x[tokens of e]^T @ grad_y[slots of e]
            _weight_grad(torch.index_select(x, 0, token_c, out=x_buf[:n]), gy_c, c, grad_w)
    if need_w:
        _zero_unused(grad_w, chunks)
    return grad_x, grad_w


def _sorted_reduce_forward(h: Tensor, weight: Tensor, gates: Tensor, sort_order: Tensor, sorted_token: Tensor,
                           chunks: list[_Chunk]) -> Tensor:
    """MoA eq. 12 + 6, ``y[n] = sum_j g[n, j] * (h[n, j] @ W[expert_index[n, j]])``: (N, d_out)."""
    num_tokens, top_k, d_in = h.shape
    d_out = weight.shape[2]
    h_flat = h.reshape(num_tokens * top_k, d_in)
    g_flat = gates.reshape(num_tokens * top_k, 1)
    y = h.new_zeros(num_tokens, d_out)
    rows = _workspace_rows(chunks)
    h_buf, g_buf, y_buf = h.new_empty(rows, d_in), h.new_empty(rows, 1), h.new_empty(rows, d_out)
    for c in chunks:
        n = c.stop - c.start
        slot_c = sort_order[c.start:c.stop]
        # gate the d_in-wide input rather than the d_out-wide output: (g h) W = g (h W)
        gh_c = torch.index_select(h_flat, 0, slot_c, out=h_buf[:n])
        gh_c.mul_(torch.index_select(g_flat, 0, slot_c, out=g_buf[:n]))
        _scatter_rows_add(y, sorted_token[c.start:c.stop], _grouped_mm(gh_c, weight, c, y_buf[:n]))
    return y


def _sorted_reduce_backward(grad_y: Tensor, h: Tensor, weight: Tensor, gates: Tensor, sort_order: Tensor,
                            sorted_token: Tensor, chunks: list[_Chunk], need_h: bool, need_w: bool, need_g: bool):
    num_tokens, top_k, d_in = h.shape
    d_out = weight.shape[2]
    num_slots = num_tokens * top_k
    h_flat = h.reshape(num_slots, d_in)
    g_flat = gates.reshape(num_slots, 1)
    grad_y = grad_y.contiguous()
    # every slot belongs to exactly one chunk, so the loop writes every row
    grad_h = h.new_empty(num_slots, d_in) if need_h else None
    grad_g = gates.new_empty(num_slots) if need_g else None
    grad_w = weight.new_empty(weight.shape) if need_w else None
    rows = _workspace_rows(chunks)
    gy_buf, h_buf, g_buf = h.new_empty(rows, d_out), h.new_empty(rows, d_in), h.new_empty(rows, 1)
    u_buf = h.new_empty(rows, d_in) if (need_h or need_g) else None
    for c in chunks:
        n = c.stop - c.start
        slot_c = sort_order[c.start:c.stop]
        gy_c = torch.index_select(grad_y, 0, sorted_token[c.start:c.stop], out=gy_buf[:n])
        g_c = torch.index_select(g_flat, 0, slot_c, out=g_buf[:n])
        h_c = torch.index_select(h_flat, 0, slot_c, out=h_buf[:n])
        if need_h or need_g:
            u_c = _grouped_mm(gy_c, weight, c, u_buf[:n], transpose=True)  # dL/d(g h) for these slots
            if need_g:  # grad_g[s] = <grad_y[n] @ W[e]^T, h[s]>
                grad_g.index_copy_(0, slot_c, _rowdot(u_c, h_c))
            if need_h:  # grad_h[s] = g[s] * grad_y[n] @ W[e]^T
                grad_h.index_copy_(0, slot_c, u_c.mul_(g_c))
        if need_w:  # grad_W[e] = (g h)[slots of e]^T @ grad_y[tokens of e]
            _weight_grad(h_c.mul_(g_c), gy_c, c, grad_w)
    if need_w:
        _zero_unused(grad_w, chunks)
    if need_h:
        grad_h = grad_h.view(num_tokens, top_k, d_in)
    if need_g:
        grad_g = grad_g.view(num_tokens, top_k)
    return grad_h, grad_w, grad_g


def _check_chunk_rows(chunk_rows) -> None:
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be a positive int or None, got {chunk_rows!r}")


def _offset_chunks(offsets: Tensor, width: int, dtype: torch.dtype, chunk_rows: int | None) -> list[_Chunk]:
    """The chunks of the expert-sorted rows; reads ``offsets`` on the host (inside the custom ops only)."""
    return _chunks(offsets.tolist(), _chunk_rows(width, dtype) if chunk_rows is None else chunk_rows)


def _width(weight: Tensor) -> int:
    return max(weight.shape[1], weight.shape[2])


def _empty_if_none(t: Tensor | None, like: Tensor) -> Tensor:
    # custom ops return tensors: a gradient that was not asked for comes back empty
    return like.new_empty(0) if t is None else t


# The per-expert split reads the counts on the host (a data-dependent Python loop), so the four steps are
# torch.library custom ops: torch.compile sees one opaque node each (their fake implementations give the
# shapes), with no graph break. They run on CPU tensors (CUDA has the Triton kernels).
@torch.library.custom_op("headmix::sorted_map", mutates_args=())
def sorted_map_op(x: Tensor, weight: Tensor, sort_order: Tensor, offsets: Tensor, top_k: int,
                  chunk_rows: int | None = None) -> Tensor:
    """MoA eq. 10 on the expert-sorted slots: (N, d_in) -> (N, k, d_out)."""
    chunks = _offset_chunks(offsets, _width(weight), x.dtype, chunk_rows)
    return _sorted_map_forward(x, weight, sort_order, sort_order // top_k, chunks, top_k)


@sorted_map_op.register_fake
def _(x, weight, sort_order, offsets, top_k, chunk_rows=None):
    return x.new_empty(x.shape[0], top_k, weight.shape[2])


@torch.library.custom_op("headmix::sorted_map_backward", mutates_args=())
def sorted_map_backward_op(grad_y: Tensor, x: Tensor, weight: Tensor, sort_order: Tensor, offsets: Tensor,
                           top_k: int, chunk_rows: int | None, need_x: bool, need_w: bool) -> tuple[Tensor, Tensor]:
    """Gradients of :func:`sorted_map_op` with respect to ``x`` and ``weight`` (empty when not asked for)."""
    chunks = _offset_chunks(offsets, _width(weight), x.dtype, chunk_rows)
    grad_x, grad_w = _sorted_map_backward(grad_y, x, weight, sort_order, sort_order // top_k, chunks, need_x, need_w)
    return _empty_if_none(grad_x, x), _empty_if_none(grad_w, weight)


@sorted_map_backward_op.register_fake
def _(grad_y, x, weight, sort_order, offsets, top_k, chunk_rows, need_x, need_w):
    return x.new_empty(x.shape if need_x else (0,)), weight.new_empty(weight.shape if need_w else (0,))


def _map_setup_context(ctx, inputs, output):
    x, weight, sort_order, offsets, top_k, chunk_rows = inputs
    ctx.save_for_backward(x, weight, sort_order, offsets)
    ctx.top_k, ctx.chunk_rows = top_k, chunk_rows


def _map_backward(ctx, grad_y):
    x, weight, sort_order, offsets = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_x, grad_w = sorted_map_backward_op(grad_y, x, weight, sort_order, offsets, ctx.top_k, ctx.chunk_rows,
                                            need_x, need_w)
    return grad_x if need_x else None, grad_w if need_w else None, None, None, None, None


sorted_map_op.register_autograd(_map_backward, setup_context=_map_setup_context)


@torch.library.custom_op("headmix::sorted_reduce", mutates_args=())
def sorted_reduce_op(h: Tensor, weight: Tensor, gates: Tensor, sort_order: Tensor, offsets: Tensor,
                     chunk_rows: int | None = None) -> Tensor:
    """MoA eq. 12 + 6 on the expert-sorted slots: (N, k, d_in) -> (N, d_out)."""
    chunks = _offset_chunks(offsets, _width(weight), h.dtype, chunk_rows)
    return _sorted_reduce_forward(h, weight, gates, sort_order, sort_order // h.shape[1], chunks)


@sorted_reduce_op.register_fake
def _(h, weight, gates, sort_order, offsets, chunk_rows=None):
    return h.new_empty(h.shape[0], weight.shape[2])


@torch.library.custom_op("headmix::sorted_reduce_backward", mutates_args=())
def sorted_reduce_backward_op(grad_y: Tensor, h: Tensor, weight: Tensor, gates: Tensor, sort_order: Tensor,
                              offsets: Tensor, chunk_rows: int | None, need_h: bool, need_w: bool,
                              need_g: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`sorted_reduce_op` w.r.t. ``h``, ``weight`` and ``gates`` (empty when not asked for)."""
    chunks = _offset_chunks(offsets, _width(weight), h.dtype, chunk_rows)
    grads = _sorted_reduce_backward(grad_y, h, weight, gates, sort_order, sort_order // h.shape[1], chunks,
                                    need_h, need_w, need_g)
    return tuple(_empty_if_none(g, like) for g, like in zip(grads, (h, weight, gates)))


@sorted_reduce_backward_op.register_fake
def _(grad_y, h, weight, gates, sort_order, offsets, chunk_rows, need_h, need_w, need_g):
    return tuple(t.new_empty(t.shape if need else (0,)) for t, need in ((h, need_h), (weight, need_w), (gates, need_g)))


def _reduce_setup_context(ctx, inputs, output):
    h, weight, gates, sort_order, offsets, chunk_rows = inputs
    ctx.save_for_backward(h, weight, gates, sort_order, offsets)
    ctx.chunk_rows = chunk_rows


def _reduce_backward(ctx, grad_y):
    h, weight, gates, sort_order, offsets = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    grads = sorted_reduce_backward_op(grad_y, h, weight, gates, sort_order, offsets, ctx.chunk_rows, *need)
    return *(g if n else None for g, n in zip(grads, need)), None, None, None


sorted_reduce_op.register_autograd(_reduce_backward, setup_context=_reduce_setup_context)


def sorted_map(x: Tensor, weight: Tensor, routing: ExpertRouting, *, chunk_rows: int | None = None) -> Tensor:
    """MoA eq. 10 by per-expert GEMMs on the expert-sorted slots (CPU fast path; custom op ``headmix::sorted_map``).

    ``chunk_rows``: sorted rows per chunk (default from :data:`CHUNK_BYTES`); for tests.
    """
    _check_chunk_rows(chunk_rows)
    return sorted_map_op(x, weight, routing.sort_order, routing.offsets, routing.top_k, chunk_rows)


def sorted_reduce(h: Tensor, weight: Tensor, gates: Tensor, routing: ExpertRouting, *,
                  chunk_rows: int | None = None) -> Tensor:
    """MoA eq. 12 + 6 by per-expert GEMMs on the expert-sorted slots (CPU fast path; custom op
    ``headmix::sorted_reduce``).

    ``chunk_rows``: sorted rows per chunk (default from :data:`CHUNK_BYTES`); for tests.
    """
    _check_chunk_rows(chunk_rows)
    return sorted_reduce_op(h, weight, gates, routing.sort_order, routing.offsets, chunk_rows)


# FLOPs for torch.utils.flop_counter.FlopCounterMode (headmix's MAC counts measure with it): 2 per multiply-add,
# one (S x d_in) @ (d_in x d_out) product per GEMM, S = N*k slots.
def _gemm_flops(num_slots: int, weight_shape) -> int:
    return 2 * num_slots * weight_shape[1] * weight_shape[2]


@register_flop_formula(torch.ops.headmix.sorted_map)
def _(x_shape, w_shape, order_shape, *args, out_shape=None, **kwargs) -> int:
    return _gemm_flops(order_shape[0], w_shape)


@register_flop_formula(torch.ops.headmix.sorted_map_backward)
def _(gy_shape, x_shape, w_shape, order_shape, offsets_shape, top_k, chunk_rows, need_x, need_w, *args,
      out_shape=None, **kwargs) -> int:
    return (int(need_x) + int(need_w)) * _gemm_flops(order_shape[0], w_shape)


@register_flop_formula(torch.ops.headmix.sorted_reduce)
def _(h_shape, w_shape, g_shape, order_shape, *args, out_shape=None, **kwargs) -> int:
    return _gemm_flops(order_shape[0], w_shape)


@register_flop_formula(torch.ops.headmix.sorted_reduce_backward)
def _(gy_shape, h_shape, w_shape, g_shape, order_shape, offsets_shape, chunk_rows, need_h, need_w, need_g, *args,
      out_shape=None, **kwargs) -> int:
    return (int(need_h or need_g) + int(need_w)) * _gemm_flops(order_shape[0], w_shape)

