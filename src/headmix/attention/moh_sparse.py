"""Attention of MoH's routed heads computed only where a token selected the head (sparse MoH).

In MoH (Jin et al. 2024) token ``t`` uses the shared heads and its ``k`` selected routed heads; every other
head gets the weight 0 (eq. 5-6). A routed head's query for token ``t`` still attends to every key of that
head (its K/V are computed for all tokens, since any later query may pick the head), so the work that can be
skipped is the unselected heads' queries, attention rows and output projections. This module computes the
attention rows of the selected (token, head) slots only.

A slot ``s = n k + j`` is token ``n = b T + t`` with its ``j``-th selected routed head ``r``. Four layouts
(:data:`ROUTED_LAYOUTS`; :func:`routed_layout` picks one):

- ``grouped_query`` (the slot form; MoH routed per K/V group and MoH with one K/V head): every token
  selects exactly ``k`` routed heads in each of the ``G`` K/V groups, so its slot ``g C + j`` reads K/V head
  ``g`` whichever head it selected. The slots (``C = S + k`` per group: the layer puts each group's ``S`` shared
  heads first) are then the ``G C`` query heads of ordinary grouped-query
  attention, ``(B, G C, T, d)`` against the ``G`` K/V heads (:func:`slot_attention`): one
  ``scaled_dot_product_attention`` call with the plain causal kernel (flash on CUDA), every row a real
  (token, selected head) pair, no sorting, no padding, shapes that depend on the sizes only (no host read,
  ``torch.compile(fullgraph=True)``), at ``k / (H/G - S)`` of the routed heads' dense attention. A per-head
  mask is gathered per slot (row ``t`` of slot ``j`` is row ``t`` of the head that token selected). Used on
  every device, compiled or not, for training, prefill and cached decoding.
- ``heads`` (global routing over several K/V heads; training, prefill, eager on the CPU): the slots are
  grouped by (batch row, head), ordered by position inside a group, and padded to the largest group ``c``:
  queries ``(B, R, c, d)`` against the routed heads' own keys ``(B, R, S, d)`` in one attention call, with
  each row's mask read at its original position. With a plain causal mask the rows are split into position
  chunks, and a chunk attends only to the keys up to its last position, which recovers most of the causal
  half that a full row would waste. The largest group ``c`` and the chunks' key bounds are read back to the
  host.
- ``padded`` (the same, where a host read would be a sync: any device but the CPU, and under
  ``torch.compile``, :func:`static_shapes`): every group is padded to the static capacity ``c = T`` (a token
  selects a head at most once) and the causal mask is applied to whole rows, so no shape depends on the
  routing: it compiles with ``fullgraph=True`` and can be captured in a CUDA graph, but its attention is as
  large as dense MoH's routed heads' (only the routed projections stay sparse). A token's selected heads fall
  in any K/V group, so no static layout of fewer rows holds them all: global-top-k MoH's attention is not
  skipped on CUDA or under compile.
- ``slots`` (global routing, one query per batch row, i.e. cached decoding): each slot is its own attention
  row against its head's keys, gathered from the cache; only the selected heads' slices of the cache are read.

Every layout gives exactly what dense MoH gives for the selected heads (the unselected heads contribute 0
there). Group sizes come from device offsets (a sort and a ``searchsorted``, no ``bincount``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import scaled_dot_product

#: Rows per causal chunk of the ``heads`` layout: fewer chunks waste more of the causal half, more chunks
#: add attention calls (each with its mask: about 8 operations forward and backward). Global MoH at d_model 1024,
#: 16 heads of 64, 4 shared + top 4, forward+backward, one thread, CPU time, median of 5 (AMD EPYC, 2026-11-28):
#: 64 / 256 / one chunk took 399 / 383 / 382 ms at T 1024 (256 / 194 / 176 operations) and 2665 / 2535 / 2793 ms
#: at T 4096; 64 was chosen at sequence 512, d_model 512.
CAUSAL_CHUNK_ROWS = 256


def static_shapes(t: Tensor) -> bool:
    """Whether the ``heads`` layout must keep routing-independent shapes (no host sync): on every device but
    the CPU, and under ``torch.compile``."""
    return t.device.type != "cpu" or torch.compiler.is_compiling()


#: How the routed heads' attention rows are laid out (module docstring); :func:`routed_layout` picks one.
ROUTED_LAYOUTS = ("grouped_query", "heads", "padded", "slots")


def routed_layout(slot_form: bool, tgt: int, t: Tensor) -> str:
    """The layout of the routed heads' attention (:data:`ROUTED_LAYOUTS`) for a call of ``tgt`` queries per
    batch row on ``t``'s device. ``slot_form``: each token selects the same number of routed heads in every
    K/V group (MoH with ``route_per_group``, or with one K/V head), so the slots are query heads of
    grouped-query attention: ``grouped_query`` on every device, compiled or not, and for decoding steps. On
    the CPU in eager mode it is also faster than the ``heads`` layout, which could run there: fp32,
    forward+backward, batch 2, causal, d_model 512, 8 heads of 64 (MoH per K/V group on 2 K/V heads, top 2 of 4 or 1 shared
    + top 1 of 3 per group; one K/V head, 2 shared + top 2 of 6), ``heads`` took 1.06-1.15x ``grouped_query``'s
    time at T 512 and 1.15-1.25x at T 1024 (one thread, CPU time; AMD EPYC, 2 cores shared, load average
    7-11, commit 404ede2; docs/performance.md, "Sparse MoH"). Otherwise ``slots`` for one query per row,
    ``padded`` where a host read would be a sync (:func:`static_shapes`), else ``heads``."""
    if slot_form:
        return "grouped_query"
    if tgt == 1:
        return "slots"
    return "padded" if static_shapes(t) else "heads"


def slot_attention(q: Tensor, k: Tensor, v: Tensor, index: Tensor, *, bias: Tensor | None,
                   empty_rows: Tensor | None, causal: bool, dropout: float) -> Tensor:
    """The ``grouped_query`` layout: attention outputs ``(B, T, C, d_v)`` of the ``C`` slots per token.

    ``q`` ``(B, T, C, d)``: each slot's query (rotated already), slot ``c`` of a token reading K/V head
    ``c // (C / G)`` of ``k``/``v`` ``(B, G, S, d)`` (grouped-query attention: ``C = G k`` with
    ``route_per_group``, any ``C`` with ``G = 1``); ``index`` ``(B, T, C)``: the routed head of each slot;
    ``bias`` and ``empty_rows``: :func:`~headmix.attention.base.attention_bias`'s masks of the routed heads,
    broadcastable to ``(B, R, T, S)`` and ``(B, R, T, 1)`` (head dimension 1, or ``R``: then each slot reads
    the rows of the head it selected), or None; ``causal``: the only mask is a plain causal one."""
    bias, empty_rows = _slot_rows(bias, index), _slot_rows(empty_rows, index)
    o = scaled_dot_product(q.transpose(1, 2), k, v, bias, empty_rows, dropout, causal=causal)
    return o.transpose(1, 2)


def _slot_rows(mask: Tensor | None, index: Tensor) -> Tensor | None:
    """A mask broadcastable to ``(B, R, T, X)`` laid out for the slots: itself when it is the same for every
    head, else ``mask[b, index[b, t, c], t]`` as ``(B, C, T, X)``."""
    if mask is None or mask.dim() < 4 or mask.shape[1] == 1:
        return mask
    batch, tgt, slots = index.shape
    full = mask.expand(batch, mask.shape[1], tgt, mask.shape[3])
    rows = index.transpose(1, 2)[..., None].expand(batch, slots, tgt, mask.shape[3])
    return torch.gather(full, 1, rows)


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
