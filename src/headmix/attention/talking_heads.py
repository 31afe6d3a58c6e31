"""Talking-Heads attention (Shazeer, Lan, Cheng, Ding, Hou 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .base import AttentionOutput, KVCache, check_mask_dtype, check_positive, zero_loss
from .mha import QK_NORM_EPS, MultiHeadAttention, merge_heads
from .rotary import RotaryEmbedding


def mix_heads(mixing: Tensor, x: Tensor) -> Tensor:
    """``out[:, i] = sum_j mixing[i, j] * x[:, j]`` over the head axis of ``(batch, heads, T, S)``."""
    return torch.einsum("ij,bjts->bits", mixing, x)


class TalkingHeadsAttention(MultiHeadAttention):
    """Multi-head attention whose heads exchange information through learned ``h x h`` mixing matrices.

    ``pre_softmax``: the logits are mixed before the softmax, ``J^(i) = sum_j lambda_ij J_hat^(j)``;
    ``post_softmax``: the attention weights are mixed again after it. Both matrices start as the
    identity, so a fresh layer equals :class:`MultiHeadAttention` with the same projections.
    Masks apply to the mixed logits. The ``(batch, heads, T, S)`` weights are materialised: no flash kernel
    applies (the mixing couples the heads' scores). To bound the memory, a training call with more than
    ``query_block`` queries runs block by block with activation checkpointing: the backward keeps only the
    inputs and recomputes each block's scores, so the score tensors alive at once are one block's
    (``query_block / T`` of the full ones) at the cost of recomputing the score part of the forward once
    (``query_block=None``: no blocks). The results are those of the full computation (rows are independent).
    ``rotary`` options and the self-attention rule (``layer(x, x, x)`` is ``layer(x)``) as
    :class:`MultiHeadAttention`.

    ``kv_heads``, ``qk_norm`` and ``output_gate`` as :class:`MultiHeadAttention`: with ``G`` K/V heads the
    logits of query head ``h`` are ``J_hat^(h) = q_h K_{h // (H/G)}^T`` (then mixed over all ``H`` heads) and
    its weights read the values of the same K/V head; the scores are computed with the ``H/G`` query heads of
    a group against their one K/V head by broadcasting (no copy of K/V). The G1 gate multiplies each head's
    output after the post-softmax mixing and the values, before ``out_proj``.
    """

    def __init__(self, embed_dim: int, num_heads: int, pre_softmax: bool = True, post_softmax: bool = True, *,
                 head_dim: int | None = None, key_dim: int | None = None, bias: bool = True, dropout: float = 0.0,
                 q_bias: bool | None = None, kv_bias: bool | None = None, out_bias: bool | None = None,
                 rotary: bool | RotaryEmbedding = False, rotary_base: float = 10000.0, rotary_fraction: float = 1.0,
                 zero_padded_queries: bool = False, query_block: int | None = 128, kv_heads: int | None = None,
                 qk_norm: bool = False, qk_norm_eps: float = QK_NORM_EPS, output_gate: str | None = None):
        super().__init__(embed_dim, num_heads, head_dim=head_dim, key_dim=key_dim, bias=bias, dropout=dropout,
                         q_bias=q_bias, kv_bias=kv_bias, out_bias=out_bias, rotary=rotary,
                         rotary_base=rotary_base, rotary_fraction=rotary_fraction, zero_padded_queries=zero_padded_queries,
                         kv_heads=kv_heads, qk_norm=qk_norm, qk_norm_eps=qk_norm_eps, output_gate=output_gate)
        self.pre_mix = nn.Parameter(torch.eye(num_heads)) if pre_softmax else None
        self.post_mix = nn.Parameter(torch.eye(num_heads)) if post_softmax else None
        if query_block is not None:
            check_positive("query_block", query_block)
        self.query_block = query_block

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None, is_causal: bool = False,
                use_cache: bool = False, cache: KVCache | None = None, query_padding_mask: Tensor | None = None) -> AttentionOutput:
        """Multi-head attention of ``query`` ``(B, T, embed_dim)`` over ``key`` / ``value`` (``None``:
        self-attention) whose ``num_heads`` attention logits are mixed across heads by ``pre_mix`` before the
        softmax and the weights by ``post_mix`` after it (Shazeer et al. 2020, Algorithm 2). Returns an
        :class:`AttentionOutput`: ``output`` ``(B, T, embed_dim)``, no routing.
        Masks: ``key_padding_mask`` ``(B, S)``, ``attn_mask`` ``(T, S)`` (or per batch / head), ``is_causal``,
        ``query_padding_mask`` ``(B, T)``, with ``torch.nn.MultiheadAttention``'s conventions (``True`` =
        padding / forbidden; see :mod:`headmix.attention.base`); ``use_cache`` returns the new ``cache``."""
        check_mask_dtype("query_padding_mask", query_padding_mask, additive=False)  # also when zero_padded_queries is off
        query, key, value = self._check_inputs(query, key, value)  # layer(x, x, x) is layer(x)
        q, k, v, new_cache, (bias, empty, causal) = self._heads_and_masks(
            query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal,
            use_cache=use_cache, cache=cache)
        tgt = q.shape[2]
        if causal:
            bias = torch.zeros(tgt, tgt, dtype=q.dtype, device=q.device).masked_fill(
                torch.ones(tgt, tgt, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        dropout = self.dropout if self.training else 0.0
        block = self.query_block
        if block is None or tgt <= block or not torch.is_grad_enabled():
            o = self._attend(q, k, v, bias, empty, dropout)
        else:
            # Query blocks, each recomputed in the backward (activation checkpointing): only one block's
            # (batch, heads, block, S) scores are alive at a time instead of several (batch, heads, T, S).
            blocks = []
            for start in range(0, tgt, block):
                rows = slice(start, min(start + block, tgt))
                blocks.append(checkpoint(self._attend, q[:, :, rows], k, v, _query_rows(bias, rows, tgt),
                                         _query_rows(empty, rows, tgt), dropout, use_reentrant=False))
            o = torch.cat(blocks, dim=2)
        o = self._gate_heads(o, query)
        y = self._zero_padded(self.out_proj(merge_heads(o)), query, key, key_padding_mask, query_padding_mask, cache)
        return AttentionOutput(y, zero_loss(query), new_cache)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, empty: Tensor | None,
                dropout: float) -> Tensor:
        """Talking-heads attention of the queries ``q`` ``(batch, heads, t, key_dim)`` (Shazeer et al. 2020,
        Algorithm 2): logits, pre-softmax mixing ``J = sum_j lambda_ij J_hat^(j)``, masks, softmax,
        post-softmax mixing, dropout, and the weighted sum of the values."""
        logits = _grouped_matmul(q, k.transpose(-1, -2)) * self.key_dim ** -0.5
        if self.pre_mix is not None:
            logits = mix_heads(self.pre_mix.to(logits.dtype), logits)
        if bias is not None:
            logits = logits + bias
        weights = logits.softmax(dim=-1)
        if empty is not None:
            weights = weights.masked_fill(empty, 0.0)
        if self.post_mix is not None:
            weights = mix_heads(self.post_mix.to(weights.dtype), weights)
        if dropout > 0:
            weights = F.dropout(weights, dropout)
        return _grouped_matmul(weights, v)


def _grouped_matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` over ``(batch, H, ...)`` and ``(batch, G, ...)`` with ``G`` dividing ``H``: head ``h`` of ``a``
    with head ``h // (H / G)`` of ``b`` (grouped-query attention), by broadcasting ``b`` over each group's
    ``H / G`` heads (no copy)."""
    heads, groups = a.shape[1], b.shape[1]
    if heads == groups:
        return a @ b
    out = a.unflatten(1, (groups, heads // groups)) @ b.unsqueeze(2)
    return out.flatten(1, 2)


def _query_rows(mask: Tensor | None, rows: slice, tgt: int) -> Tensor | None:
    """The rows ``rows`` of a mask broadcastable to ``(batch, heads, tgt, S)`` (unchanged when it broadcasts
    over the queries)."""
    if mask is None or mask.shape[-2] != tgt:
        return mask
    return mask[..., rows, :]
