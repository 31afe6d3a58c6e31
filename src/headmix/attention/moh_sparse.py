"""Attention of MoH's routed heads computed only where a token selected the head (sparse MoH).

In MoH (Jin et al. 2024) token ``t`` uses the shared heads and its ``k`` selected routed heads; every other
head gets the weight 0 (eq. 5-6). A routed head's query for token ``t`` still attends to every key of that
head (its K/V are computed for all tokens, since any later query may pick the head), so the work that can be
skipped is the unselected heads' queries, attention rows and output projections. This module computes the
attention rows of the selected (token, head) slots only.

A slot ``s = n k + j`` is token ``n = b T + t`` with its ``j``-th selected routed head ``r``. Two layouts:

- ``heads`` (training, prefill): the slots are grouped by (batch row, head), ordered by position inside a
  group, and padded to the largest group ``c``: queries ``(B, R, c, d)`` against the routed heads' own keys
  ``(B, R, S, d)`` in one attention call, with each row's mask read at its original position. With a
  plain causal mask the rows are split into position chunks, and a chunk attends only to the keys up to its
  last position, which recovers most of the causal half that a full row would waste.
- ``slots`` (one query per batch row, i.e. cached decoding): each slot is its own attention row against
  its head's keys, gathered from the cache; only the selected heads' slices of the cache are read.

Both give exactly what dense MoH gives for the selected heads (the unselected heads contribute 0 there).
Group sizes come from device offsets (a sort and a ``searchsorted``, no ``bincount``). In eager execution on
the CPU the largest group ``c`` and the causal chunks' key bounds are read back to the host; where that would
be a host sync (any other device, or under ``torch.compile``: :func:`static_shapes`) every group is padded
to the static capacity ``c = T`` (a token selects a head at most once) and the causal mask is applied to
whole rows, so no shape depends on the routing: the path compiles with ``fullgraph=True`` and can be
captured in a CUDA graph, at the cost of an attention as large as dense MoH's routed heads' (the routed
projections stay sparse).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import scaled_dot_product

#: Rows per causal chunk of the ``heads`` layout: fewer chunks waste more of the causal half, more chunks
#: add attention calls. ``headmix bench attention --moh-curve`` (CPU, fp32, sequence 512) chose it.
CAUSAL_CHUNK_ROWS = 64


def static_shapes(t: Tensor) -> bool:
    """Whether the ``heads`` layout must keep routing-independent shapes (no host sync): on every device but
    the CPU, and under ``torch.compile``."""
    return t.device.type != "cpu" or torch.compiler.is_compiling()


def routed_heads_attention(q: Tensor, k: Tensor, v: Tensor, index: Tensor, batch: int, tgt: int, *,
                           bias: Tensor | None, empty_rows: Tensor | None, causal: bool, dropout: float,
                           routed_heads: int | None = None) -> Tensor:
    """Attention outputs ``(N, k, d_v)`` of the selected routed heads.

    ``q`` ``(N, k, d)``: each slot's query (rotated already); ``k``/``v`` ``(B, G, S, d)``: the routed heads'
    keys and values, routed head ``r`` reading K/V head ``r // (R / G)`` (grouped-query attention; ``G = R``
    by default, ``routed_heads`` gives ``R`` when ``G < R``); ``index`` ``(N, k)``: the routed head of each
    slot (distinct per token); ``bias`` and ``empty_rows``: :func:`~headmix.attention.base.attention_bias`'s
    masks, broadcastable to ``(B, R, T, S)`` and ``(B, R, T, 1)`` (head dimension 1 or ``R``), or None;
    ``causal``: the only mask is a plain causal one over ``T == S`` (then ``bias`` is None).
    """
    n, top_k, _ = q.shape
    heads = k.shape[1] if routed_heads is None else routed_heads
    slots = n * top_k
    token = torch.arange(n, device=q.device).repeat_interleave(top_k)
    b, t, r = token // tgt, token % tgt, index.reshape(-1)
    if tgt == 1:
        return _slots_layout(q.reshape(slots, 1, 1, -1), k, v, b, t, r, bias, empty_rows, causal,
                             dropout, heads).view(n, top_k, -1)
    group = b * heads + r
    order = torch.argsort(group * tgt + t)
    group_sorted = group[order]
    static = static_shapes(q)
    # group g owns the sorted slots starts[g]:starts[g + 1] (device offsets, as expert_routing's)
    starts = torch.searchsorted(group_sorted, torch.arange(batch * heads + 1, device=q.device, dtype=group.dtype))
    width = tgt if static else int((starts[1:] - starts[:-1]).max())  # eager CPU: the largest group (host read)
    rank = torch.arange(slots, device=q.device) - starts[group_sorted]
    q_pad = q.new_zeros(batch * heads, width, q.shape[-1]).index_put((group_sorted, rank),
                                                                     q.reshape(slots, -1)[order])
    pos = torch.full((batch * heads, width), -1, dtype=torch.long, device=q.device)
    pos = pos.index_put((group_sorted, rank), t[order]).view(batch, heads, width)
    q_pad = q_pad.view(batch, heads, width, -1)
    if causal:
        o = _causal_chunks(q_pad, k, v, pos, dropout, static)
    else:
        o = _gathered_masks(q_pad, k, v, pos, bias, empty_rows, dropout)
    o_sorted = o.reshape(batch * heads, width, -1)[group_sorted, rank]
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(slots, device=q.device))
    return o_sorted.index_select(0, inverse).view(n, top_k, -1)


def _slots_layout(q: Tensor, k: Tensor, v: Tensor, b: Tensor, t: Tensor, r: Tensor, bias: Tensor | None,
                  empty_rows: Tensor | None, causal: bool, dropout: float, heads: int) -> Tensor:
    """One attention row per slot against its own head's keys ``k[b, r // (R / G)]`` (decoding)."""
    kv = r // (heads // k.shape[1])  # the K/V head of each slot's routed head (grouped-query attention)
    k_slot, v_slot = k[b, kv].unsqueeze(1), v[b, kv].unsqueeze(1)  # (slots, 1, S, d): the selected heads only
    bias_slot = empty_slot = None
    batch_heads = torch.Size((k.shape[0], heads))
    if bias is not None:
        bias_slot = _rows(bias, batch_heads, b, r, t)
        empty_slot = None if empty_rows is None else _rows(empty_rows, batch_heads, b, r, t)
    # causal with one query over one key: nothing is masked
    return scaled_dot_product(q, k_slot, v_slot, bias_slot, empty_slot, dropout).reshape(q.shape[0], -1)


def _rows(mask: Tensor, batch_heads: torch.Size, b: Tensor, r: Tensor, t: Tensor) -> Tensor:
    """``mask[b, r, t]`` of a mask broadcastable to ``(B, R, T, X)``, as ``(slots, 1, 1, X)``."""
    m = mask.expand(*batch_heads, *mask.shape[2:])
    return m[b, r, t][:, None, None, :]


def _causal_chunks(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, dropout: float, static: bool = False) -> Tensor:
    """Rows at positions ``pos`` (``-1``: padding) with the causal mask ``key <= pos``, in chunks of rows
    that each attend only to the keys up to the chunk's last position (``static``: one chunk of every row
    over every key, no host read)."""
    width = q.shape[2]
    rows = max(width, 1) if static else CAUSAL_CHUNK_ROWS
    outs = []
    for start in range(0, width, rows):
        p = pos[:, :, start:start + rows]
        keys = k.shape[2] if static else int(p.max()) + 1  # eager CPU: the keys this chunk can see (host read)
        cols = torch.arange(keys, device=q.device)
        forbidden = (cols > p[..., None]) & (p[..., None] >= 0)  # padding rows see every key (discarded)
        bias = torch.zeros(forbidden.shape, dtype=q.dtype, device=q.device).masked_fill(forbidden, float("-inf"))
        outs.append(scaled_dot_product(q[:, :, start:start + rows], k[:, :, :keys], v[:, :, :keys],
                                       bias, None, dropout))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _gathered_masks(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, bias: Tensor | None, empty_rows: Tensor | None,
                    dropout: float) -> Tensor:
    """Rows at positions ``pos`` with the rows of ``bias`` / ``empty_rows`` at those positions."""
    batch, heads, width = pos.shape
    source = k.shape[2]
    valid = pos >= 0
    rows = pos.clamp(min=0)[..., None]
    bias_rows = empty = None
    if bias is not None:
        bias_rows = _gather_rows(bias, rows, source).masked_fill(~valid[..., None], 0.0)
    if empty_rows is not None:
        empty = _gather_rows(empty_rows, rows, 1) & valid[..., None]
    return scaled_dot_product(q, k, v, bias_rows, empty, dropout)


def _gather_rows(mask: Tensor, rows: Tensor, width: int) -> Tensor:
    """``mask[b, r, rows[b, r, i]]`` ``(B, R, c, width)`` of a mask broadcastable to ``(B, R, T, width)`` (a
    mask with one row, e.g. key padding only, is the same for every row)."""
    batch, heads, count, _ = rows.shape
    if mask.shape[2] == 1:
        return mask.expand(batch, heads, count, width)
    full = mask.expand(batch, heads, mask.shape[2], width)
    return torch.gather(full, 2, rows.expand(-1, -1, -1, width))
