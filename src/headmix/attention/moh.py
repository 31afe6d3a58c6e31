"""MoH: multi-head attention as a mixture of heads (Jin, Zhu, Yan, Yuan 2024)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..routing import Routing, load_balancing_loss
from ..routing.router import router_dtype
from .base import AttentionOutput, KVCache, scaled_dot_product, zero_loss
from .mha import MultiHeadAttention, merge_heads
from .moa import real_token_mask
from .rotary import RotaryEmbedding


class MixtureOfHeadsAttention(MultiHeadAttention):
    """Multi-head attention in summation form with per-token head weights: ``sum_i g_i H^i W_O^i``.

    Heads ``0 .. num_shared_heads-1`` are shared (always active); of the other
    ``num_heads - num_shared_heads`` routed heads a router activates ``top_k`` per token. The weights
    follow MoH's two-stage routing:

    - routed heads: ``g_i = a_r * R * softmax(x W_r)_i`` for the selected heads, 0 for the others;
    - shared heads: ``g_i = a_s * S * softmax(x W_s)_i``;
    - the group weights ``[a_s, a_r] = 2 * softmax(x W_h)`` balance the two groups per token.

    ``S`` and ``R`` are the group sizes: the scaling (as in the MoH reference code) makes uniform scores
    give every active head the weight 1, so a fresh layer (``W_s = W_h = 0``) is multi-head attention
    restricted to the active heads. With every head shared there is nothing to route, no router exists
    and the layer is exactly multi-head attention. The auxiliary loss is the load-balancing loss
    (MoA eq. 13-15) over the routed heads, weighted by ``load_balance_weight``.

    Every head's attention is computed densely; the head weights then select (see ``docs/`` for the
    MACs this costs).
    """

    def __init__(self, embed_dim: int, num_heads: int, num_shared_heads: int, top_k: int, head_dim: int | None = None,
                 *, bias: bool = True, dropout: float = 0.0, load_balance_weight: float = 0.01,
                 q_bias: bool | None = None, kv_bias: bool | None = None, out_bias: bool | None = None,
                 rotary: bool | RotaryEmbedding = False, rotary_base: float = 10000.0, rotary_fraction: float = 1.0):
        super().__init__(embed_dim, num_heads, head_dim=head_dim, bias=bias, dropout=dropout,
                         q_bias=q_bias, kv_bias=kv_bias, out_bias=out_bias, rotary=rotary,
                         rotary_base=rotary_base, rotary_fraction=rotary_fraction)
        for name, v in (("num_shared_heads", num_shared_heads), ("top_k", top_k)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        if num_shared_heads > num_heads:
            raise ValueError(f"num_shared_heads ({num_shared_heads}) must not exceed num_heads ({num_heads})")
        routed = num_heads - num_shared_heads
        if routed == 0 and top_k != 0:
            raise ValueError(f"top_k must be 0 when every head is shared (num_shared_heads = num_heads = {num_heads}), got {top_k}")
        if routed > 0 and not 1 <= top_k <= routed:
            raise ValueError(
                f"top_k must be between 1 and the number of routed heads, num_heads - num_shared_heads = "
                f"{num_heads} - {num_shared_heads} = {routed}; got {top_k}")
        if load_balance_weight < 0:
            raise ValueError(f"load_balance_weight must be >= 0, got {load_balance_weight}")
        self.num_shared_heads, self.num_routed_heads, self.top_k = num_shared_heads, routed, top_k
        self.load_balance_weight = load_balance_weight
        self.routed_gate = self.shared_gate = self.group_gate = None
        if routed:
            self.routed_gate = nn.Linear(embed_dim, routed, bias=False)
            nn.init.normal_(self.routed_gate.weight, std=embed_dim ** -0.5 * 0.1)
            if num_shared_heads:
                self.shared_gate = nn.Linear(embed_dim, num_shared_heads, bias=False)
                self.group_gate = nn.Linear(embed_dim, 2, bias=False)
                nn.init.zeros_(self.shared_gate.weight)
                nn.init.zeros_(self.group_gate.weight)

    def head_weights(self, x: Tensor, token_mask: Tensor | None) -> tuple[Tensor | None, Routing | None]:
        """Per-token head weights ``g`` ``(batch, time, num_heads)`` and the routing of the routed heads
        (``expert_index`` counts routed heads from 0), or ``(None, None)`` when every head is shared."""
        if self.routed_gate is None:
            return None, None
        batch, time, dim = x.shape
        flat = x.reshape(batch * time, dim)
        flat32 = flat.to(router_dtype(x))
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(flat32, self.routed_gate.weight.to(flat32.dtype))
            probs = logits.softmax(-1)
            top_p, index = probs.topk(self.top_k, dim=-1)
            routed = top_p * self.num_routed_heads
            parts = []
            if self.shared_gate is not None:
                groups = 2.0 * F.linear(flat32, self.group_gate.weight.to(flat32.dtype)).softmax(-1)
                shared = groups[:, :1] * self.num_shared_heads * F.linear(flat32, self.shared_gate.weight.to(flat32.dtype)).softmax(-1)
                routed = groups[:, 1:] * routed
                parts.append(shared)
            g_routed = torch.zeros_like(probs).scatter(1, index, routed)
            g = torch.cat(parts + [g_routed], dim=1)
        mask = None if token_mask is None else token_mask.reshape(-1)
        routing = Routing(logits, probs, index, routed.to(x.dtype), mask, (batch, time))
        return g.to(x.dtype).view(batch, time, self.num_heads), routing

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None, is_causal: bool = False,
                use_cache: bool = False, cache: KVCache | None = None, query_padding_mask: Tensor | None = None) -> AttentionOutput:
        q, k, v, new_cache, (bias, empty, causal) = self._heads_and_masks(
            query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal,
            use_cache=use_cache, cache=cache)
        o = scaled_dot_product(q, k, v, bias, empty, self.dropout if self.training else 0.0, causal=causal)
        g, routing = self.head_weights(query, real_token_mask(query, key, key_padding_mask, query_padding_mask, cache))
        if g is None:
            return AttentionOutput(self.out_proj(merge_heads(o)), zero_loss(query), new_cache)
        o = o * g.transpose(1, 2).unsqueeze(-1)
        lb = load_balancing_loss(routing.probs, routing.expert_index, routing.token_mask)
        return AttentionOutput(self.out_proj(merge_heads(o)), self.load_balance_weight * lb, new_cache, routing,
                               {"load_balance": lb})
