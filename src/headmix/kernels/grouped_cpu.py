"""Sorted grouped matmul for CPU: one GEMM per expert, hand-written backward.

The slots (token n, choice j) are grouped by expert with the routing's
``sort_order`` (see :mod:`headmix.kernels.routing_info`).  Expert ``e`` then
owns the run ``sort_order[offsets[e]:offsets[e+1]]``; the split into runs uses
``torch.split(..., counts.tolist())``, a host sync that costs nothing on CPU.

Per expert the kernels gather that expert's rows, run one GEMM with ``W[e]``
and scatter the result straight to its destination (``index_copy_`` into the
slot-ordered output for the map, ``index_add_`` into the token-ordered output
for the reduce).  Working expert by expert keeps every temporary at
``count_e x d`` instead of a ``N*k x d`` sorted buffer: on CPU the page faults
of such large fresh buffers cost as much as the GEMMs themselves.

Forward and backward (MoA eq. 10, 12, 6; ``e = expert(s)``, ``n = token(s)``):

* map    ``y[s] = x[n] @ W[e]``
  ``grad_x[n] = sum_{s of n} grad_y[s] @ W[e]^T`` and
  ``grad_W[e] = sum_{s of e} x[n]^T grad_y[s]``
* reduce ``y[n] = sum_{s of n} g[s] * (h[s] @ W[e])``
  with ``u[s] = grad_y[n] @ W[e]^T``: ``grad_h[s] = g[s] * u[s]``,
  ``grad_g[s] = <u[s], h[s]>`` (a row-wise dot product, so the (N*k, d_out)
  per-slot outputs are never stored), and
  ``grad_W[e] = sum_{s of e} (g[s] h[s])^T grad_y[n]``.

Cost is ``O(N*k*d_in*d_out)`` plus a Python loop of E short iterations.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .routing_info import ExpertRouting

__all__ = ["sorted_map", "sorted_reduce"]


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` for 2-d a, b without the (rows, d) temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(a.shape[0])


class _Workspace:
    """Row buffers sized for the largest expert, reused by every expert of one call.

    One allocation per buffer and call instead of one per expert and op: fresh
    multi-MB CPU allocations are returned to the OS on free and page-fault back
    in on the next use, which costs as much as the gathers themselves.
    """

    def __init__(self, like: Tensor, rows: int):
        self.like, self.rows = like, rows

    def __call__(self, cols: int) -> Tensor:
        return self.like.new_empty(self.rows, cols)


class _SortedMap(torch.autograd.Function):
    """MoA eq. 10, ``y[n, j] = x[n] @ W[expert_index[n, j]]``, grouped by expert."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, sort_order: Tensor, sorted_token: Tensor, counts: list[int], top_k: int):
        num_tokens, (_, d_in, d_out) = x.shape[0], weight.shape
        y = x.new_empty(num_tokens * top_k, d_out)
        ws = _Workspace(x, max(counts, default=0))
        x_buf, y_buf = ws(d_in), ws(d_out)
        for e, (slot_e, token_e) in enumerate(zip(sort_order.split(counts), sorted_token.split(counts))):
            rows = slot_e.shape[0]
            if rows:
                x_e = torch.index_select(x, 0, token_e, out=x_buf[:rows])
                y.index_copy_(0, slot_e, torch.mm(x_e, weight[e], out=y_buf[:rows]))
        ctx.save_for_backward(x, weight, sort_order, sorted_token)
        ctx.counts = counts
        return y.view(num_tokens, top_k, d_out)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: Tensor):
        x, weight, sort_order, sorted_token = ctx.saved_tensors
        counts = ctx.counts
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_in, d_out = weight.shape[1], weight.shape[2]
        grad_y = grad_y.reshape(-1, d_out)
        grad_x = x.new_zeros(x.shape) if need_x else None
        grad_w = weight.new_empty(weight.shape) if need_w else None
        ws = _Workspace(x, max(counts, default=0))
        gy_buf = ws(d_out)
        gx_buf = ws(d_in) if need_x else None
        x_buf = ws(d_in) if need_w else None
        for e, (slot_e, token_e) in enumerate(zip(sort_order.split(counts), sorted_token.split(counts))):
            rows = slot_e.shape[0]
            if not rows:
                if need_w:
                    grad_w[e].zero_()
                continue
            gy_e = torch.index_select(grad_y, 0, slot_e, out=gy_buf[:rows])
            if need_x:  # grad_x[n] += grad_y[s] @ W[e]^T
                grad_x.index_add_(0, token_e, torch.mm(gy_e, weight[e].t(), out=gx_buf[:rows]))
            if need_w:  # grad_W[e] = x[tokens of e]^T @ grad_y[slots of e]
                x_e = torch.index_select(x, 0, token_e, out=x_buf[:rows])
                torch.mm(x_e.t(), gy_e, out=grad_w[e])
        return grad_x, grad_w, None, None, None, None


class _SortedReduce(torch.autograd.Function):
    """MoA eq. 12 + 6, ``y[n] = sum_j g[n, j] * (h[n, j] @ W[expert_index[n, j]])``."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, gates: Tensor, sort_order: Tensor, sorted_token: Tensor, counts: list[int]):
        num_tokens, top_k, d_in = h.shape
        d_out = weight.shape[2]
        h_flat = h.reshape(num_tokens * top_k, d_in)
        g_flat = gates.reshape(num_tokens * top_k, 1)
        y = h.new_zeros(num_tokens, d_out)
        ws = _Workspace(h, max(counts, default=0))
        h_buf, g_buf, y_buf = ws(d_in), ws(1), ws(d_out)
        for e, (slot_e, token_e) in enumerate(zip(sort_order.split(counts), sorted_token.split(counts))):
            rows = slot_e.shape[0]
            if rows:
                # gate the d_in-wide input rather than the d_out-wide output: (g h) W = g (h W)
                gh_e = torch.index_select(h_flat, 0, slot_e, out=h_buf[:rows])
                gh_e.mul_(torch.index_select(g_flat, 0, slot_e, out=g_buf[:rows]))
                y.index_add_(0, token_e, torch.mm(gh_e, weight[e], out=y_buf[:rows]))
        ctx.save_for_backward(h, weight, gates, sort_order, sorted_token)
        ctx.counts = counts
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: Tensor):
        h, weight, gates, sort_order, sorted_token = ctx.saved_tensors
        counts = ctx.counts
        need_h, need_w, need_g = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        num_tokens, top_k, d_in = h.shape
        d_out = weight.shape[2]
        num_slots = num_tokens * top_k
        h_flat = h.reshape(num_slots, d_in)
        g_flat = gates.reshape(num_slots, 1)
        # every slot belongs to exactly one expert, so the loop writes every row
        grad_h = h.new_empty(num_slots, d_in) if need_h else None
        grad_g = gates.new_empty(num_slots) if need_g else None
        grad_w = weight.new_empty(weight.shape) if need_w else None
        ws = _Workspace(h, max(counts, default=0))
        gy_buf, h_buf, g_buf = ws(d_out), ws(d_in), ws(1)
        u_buf = ws(d_in) if (need_h or need_g) else None
        for e, (slot_e, token_e) in enumerate(zip(sort_order.split(counts), sorted_token.split(counts))):
            rows = slot_e.shape[0]
            if not rows:
                if need_w:
                    grad_w[e].zero_()
                continue
            gy_e = torch.index_select(grad_y, 0, token_e, out=gy_buf[:rows])
            g_e = torch.index_select(g_flat, 0, slot_e, out=g_buf[:rows])
            h_e = torch.index_select(h_flat, 0, slot_e, out=h_buf[:rows])
            if need_h or need_g:
                u_e = torch.mm(gy_e, weight[e].t(), out=u_buf[:rows])  # dL/d(g h) for these slots
                if need_g:  # grad_g[s] = <grad_y[n] @ W[e]^T, h[s]>
                    grad_g.index_copy_(0, slot_e, _rowdot(u_e, h_e))
                if need_h:  # grad_h[s] = g[s] * grad_y[n] @ W[e]^T
                    grad_h.index_copy_(0, slot_e, u_e.mul_(g_e))
            if need_w:  # grad_W[e] = (g h)[slots of e]^T @ grad_y[tokens of e]
                torch.mm(h_e.mul_(g_e).t(), gy_e, out=grad_w[e])
        if need_h:
            grad_h = grad_h.view(num_tokens, top_k, d_in)
        if need_g:
            grad_g = grad_g.view(num_tokens, top_k)
        return grad_h, grad_w, grad_g, None, None, None


# The per-expert split needs counts on the host (a data-dependent Python loop):
# torch.compile runs these eagerly (a graph break) instead of tracing into them.
@torch.compiler.disable
def sorted_map(x: Tensor, weight: Tensor, routing: ExpertRouting) -> Tensor:
    """MoA eq. 10 by per-expert GEMMs on the expert-sorted slots (CPU fast path)."""
    return _SortedMap.apply(x, weight, routing.sort_order, routing.sorted_token, routing.counts_list(), routing.top_k)


@torch.compiler.disable
def sorted_reduce(h: Tensor, weight: Tensor, gates: Tensor, routing: ExpertRouting) -> Tensor:
    """MoA eq. 12 + 6 by per-expert GEMMs on the expert-sorted slots (CPU fast path)."""
    return _SortedReduce.apply(h, weight, gates, routing.sort_order, routing.sorted_token, routing.counts_list())
