"""MoH: multi-head attention as a mixture of heads (Jin, Zhu, Yan, Yuan 2024)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..routing import Routing, load_balancing_loss
from ..routing.losses import check_fractions
from ..routing.router import router_dtype
from .base import AttentionOutput, KVCache, scaled_dot_product, zero_loss
from .mha import MultiHeadAttention, merge_heads
from .padding import real_token_mask, zero_padded_queries
from .rotary import RotaryEmbedding


HEAD_WEIGHTINGS = ("renormalized", "paper", "scaled")


class MixtureOfHeadsAttention(MultiHeadAttention):
    """Multi-head attention in summation form with per-token head weights: ``sum_i g_i H^i W_O^i``.

    Heads ``0 .. num_shared_heads-1`` are shared (always active); of the other ``R = num_heads -
    num_shared_heads`` routed heads a router activates ``top_k`` (``k``) per token. With ``S`` shared heads,
    ``p = softmax(x W_r)`` over the routed heads, ``s = softmax(x W_s)`` over the shared ones and the two
    group weights ``[a_s, a_r]``, ``head_weighting`` picks the weights ``g`` (0 for unselected routed heads):

    - ``"renormalized"`` (default), the MoH authors' released code (ViT ``Attention``): selected routed head
      ``g_i = a_r * k * p_i / sum_{j in TopK} p_j`` (gradient through the denominator), shared head
      ``g_i = a_s * S * s_i``, ``[a_s, a_r] = 2 * softmax(x W_h)``;
    - ``"paper"``, the paper's equations as printed (Jin et al. 2024, eq. 5-6): ``g_i = a_r * p_i`` for the
      selected routed heads, ``g_i = a_s * s_i`` for the shared ones, ``[a_s, a_r] = softmax(x W_h)``
      (without shared heads, ``a_r = 1``);
    - ``"scaled"``: headmix's weighting before this option existed (kept so that layers trained with it
      load and compute the same): ``g_i = a_r * R * p_i`` (no renormalisation over the selected heads),
      ``g_i = a_s * S * s_i``, ``[a_s, a_r] = 2 * softmax(x W_h)``.

    The default is the released code's form because the paper's results were trained with it, and because
    its scale does not depend on the scores: the selected routed heads' weights always sum to ``a_r * k``
    and uniform scores (``W_r = W_s = W_h = 0``) give every active head the weight 1, so such a layer is
    multi-head attention restricted to the active heads, which is where converting a dense model to MoH
    starts. The paper's form gives the active heads much smaller weights (``a_r / R`` each at uniform
    scores), scaling the attention output down; ``"scaled"`` gives weight 1 only when all ``R`` routed
    scores are equal.

    With every head shared there is nothing to route, no router exists and the layer is exactly
    multi-head attention (for every ``head_weighting``). The auxiliary loss is the load-balancing loss
    (MoA eq. 13-15) over the routed heads, weighted by ``load_balance_weight``;
    ``load_balance_fractions="per_token"`` uses the MoH code's convention (``top_k`` times larger, see
    :func:`headmix.routing.load_balancing_loss`). ``zero_padded_queries=True`` zeroes the output at the
    padded query positions (see :class:`MixtureOfAttentionHeads`). ``rotary`` options and the
    self-attention rule (``layer(x, x, x)`` is ``layer(x)``) as :class:`MultiHeadAttention`.

    Every head's attention is computed densely; the head weights then select (see ``docs/`` for the
    MACs this costs).
    """

    def __init__(self, embed_dim: int, num_heads: int, num_shared_heads: int, top_k: int, head_dim: int | None = None,
                 *, bias: bool = True, dropout: float = 0.0, load_balance_weight: float = 0.01,
                 q_bias: bool | None = None, kv_bias: bool | None = None, out_bias: bool | None = None,
                 rotary: bool | RotaryEmbedding = False, rotary_base: float = 10000.0, rotary_fraction: float = 1.0,
                 head_weighting: str = "renormalized", load_balance_fractions: str = "normalized",
                 zero_padded_queries: bool = False):
        super().__init__(embed_dim, num_heads, head_dim=head_dim, bias=bias, dropout=dropout,
                         q_bias=q_bias, kv_bias=kv_bias, out_bias=out_bias, rotary=rotary,
                         rotary_base=rotary_base, rotary_fraction=rotary_fraction, zero_padded_queries=zero_padded_queries)
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
        if head_weighting not in HEAD_WEIGHTINGS:
            raise ValueError(f"head_weighting must be one of {HEAD_WEIGHTINGS}, got {head_weighting!r}")
        check_fractions(load_balance_fractions)
        self.num_shared_heads, self.num_routed_heads, self.top_k = num_shared_heads, routed, top_k
        self.load_balance_weight = load_balance_weight
        self.head_weighting, self.load_balance_fractions = head_weighting, load_balance_fractions
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
        (``expert_index`` counts routed heads from 0, ``gates`` are the selected routed heads' ``g``), or
        ``(None, None)`` when every head is shared."""
        if self.routed_gate is None:
            return None, None
        batch, time, dim = x.shape
        flat = x.reshape(batch * time, dim)
        flat32 = flat.to(router_dtype(x))
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(flat32, self.routed_gate.weight.to(flat32.dtype))
            probs = logits.softmax(-1)
            top_p, index = probs.topk(self.top_k, dim=-1)
            if self.head_weighting == "renormalized":
                denominator = top_p.sum(-1, keepdim=True).clamp_min(torch.finfo(top_p.dtype).eps)
                routed = top_p / denominator * self.top_k
            elif self.head_weighting == "scaled":
                routed = top_p * self.num_routed_heads
            else:
                routed = top_p
            parts = []
            if self.shared_gate is not None:
                groups = F.linear(flat32, self.group_gate.weight.to(flat32.dtype)).softmax(-1)
                shared = F.linear(flat32, self.shared_gate.weight.to(flat32.dtype)).softmax(-1)
                if self.head_weighting != "paper":
                    groups, shared = 2.0 * groups, shared * self.num_shared_heads
                routed = groups[:, 1:] * routed
                parts.append(groups[:, :1] * shared)
            g_routed = torch.zeros_like(probs).scatter(1, index, routed)
            g = torch.cat(parts + [g_routed], dim=1)
        mask = None if token_mask is None else token_mask.reshape(-1)
        routing = Routing(logits, probs, index, routed.to(x.dtype), mask, (batch, time))
        return g.to(x.dtype).view(batch, time, self.num_heads), routing

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None, is_causal: bool = False,
                use_cache: bool = False, cache: KVCache | None = None, query_padding_mask: Tensor | None = None) -> AttentionOutput:
        query, key, value = self._check_inputs(query, key, value)  # layer(x, x, x) is layer(x)
        q, k, v, new_cache, (bias, empty, causal) = self._heads_and_masks(
            query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal,
            use_cache=use_cache, cache=cache)
        o = scaled_dot_product(q, k, v, bias, empty, self.dropout if self.training else 0.0, causal=causal)
        token_mask = real_token_mask(query, key, key_padding_mask, query_padding_mask, cache)
        g, routing = self.head_weights(query, token_mask)
        if g is not None:
            o = o * g.transpose(1, 2).unsqueeze(-1)
        y = self.out_proj(merge_heads(o))
        if self.zero_padded_queries:
            y = zero_padded_queries(y, token_mask)
        if g is None:
            return AttentionOutput(y, zero_loss(query), new_cache)
        lb = load_balancing_loss(routing.probs, routing.expert_index, routing.token_mask,
                                 fractions=self.load_balance_fractions)
        return AttentionOutput(y, self.load_balance_weight * lb, new_cache, routing, {"load_balance": lb})
