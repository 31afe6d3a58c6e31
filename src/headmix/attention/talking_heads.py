"""Talking-Heads attention (Shazeer, Lan, Cheng, Ding, Hou 2020)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import AttentionLayer, AttentionOutput, KVCache, attention_bias, zero_loss
from .mha import merge_heads, resolve_head_dims, split_heads


def mix_heads(mixing: Tensor, x: Tensor) -> Tensor:
    """``out[:, i] = sum_j mixing[i, j] * x[:, j]`` over the head axis of ``(batch, heads, T, S)``."""
    return torch.einsum("ij,bjts->bits", mixing, x)


class TalkingHeadsAttention(AttentionLayer):
    """Multi-head attention whose heads exchange information through learned ``h x h`` mixing matrices.

    ``pre_softmax``: the logits are mixed before the softmax, ``J^(i) = sum_j lambda_ij J_hat^(j)``;
    ``post_softmax``: the attention weights are mixed again after it. Both matrices start as the
    identity, so a fresh layer equals :class:`MultiHeadAttention` with the same projections.
    Masks apply to the mixed logits. The full ``(batch, heads, T, S)`` weights are materialised
    (``h T S`` memory): no flash kernel applies.
    """

    def __init__(self, embed_dim: int, num_heads: int, pre_softmax: bool = True, post_softmax: bool = True, *,
                 head_dim: int | None = None, key_dim: int | None = None, bias: bool = True, dropout: float = 0.0):
        super().__init__(embed_dim)
        self.num_heads = num_heads
        self.head_dim, self.key_dim = resolve_head_dims(embed_dim, num_heads, head_dim, key_dim)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.dropout = nn.Dropout(dropout)
        self.q_proj = nn.Linear(embed_dim, num_heads * self.key_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, num_heads * self.key_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, num_heads * self.head_dim, bias=bias)
        self.out_proj = nn.Linear(num_heads * self.head_dim, embed_dim, bias=bias)
        self.pre_mix = nn.Parameter(torch.eye(num_heads)) if pre_softmax else None
        self.post_mix = nn.Parameter(torch.eye(num_heads)) if post_softmax else None

    def _project_kv(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        return split_heads(self.k_proj(key), self.num_heads), split_heads(self.v_proj(value), self.num_heads)

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None, is_causal: bool = False,
                use_cache: bool = False, cache: KVCache | None = None, query_padding_mask: Tensor | None = None) -> AttentionOutput:
        query, key, value = self._check_inputs(query, key, value)
        k, v, new_cache, past_len = self._keys_values(query, key, value, use_cache, cache)
        q = split_heads(self.q_proj(query), self.num_heads)
        batch, _, tgt, _ = q.shape
        logits = q @ k.transpose(-1, -2) * self.key_dim ** -0.5
        if self.pre_mix is not None:
            logits = mix_heads(self.pre_mix.to(logits.dtype), logits)
        bias, empty, causal = attention_bias(batch, self.num_heads, tgt, k.shape[2], key_padding_mask=key_padding_mask,
                                             attn_mask=attn_mask, is_causal=is_causal, past_len=past_len,
                                             dtype=q.dtype, device=q.device)
        if causal:
            bias = torch.zeros(tgt, tgt, dtype=q.dtype, device=q.device).masked_fill(
                torch.ones(tgt, tgt, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        if bias is not None:
            logits = logits + bias
        weights = logits.softmax(dim=-1)
        if empty is not None:
            weights = weights.masked_fill(empty, 0.0)
        if self.post_mix is not None:
            weights = mix_heads(self.post_mix.to(weights.dtype), weights)
        o = self.dropout(weights) @ v
        return AttentionOutput(self.out_proj(merge_heads(o)), zero_loss(query), new_cache)
