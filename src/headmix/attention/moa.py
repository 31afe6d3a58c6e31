"""Mixture of Attention Heads (MoA; Zhang et al. 2022, arXiv 2210.05144)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..kernels import IMPLS, expert_map, expert_reduce, expert_routing
from ..routing import TopKRouter, routing_losses
from .base import (AttentionLayer, AttentionOutput, KVCache, attention_bias, check_mask_dtype, check_positive,
                   scaled_dot_product)


class MixtureOfAttentionHeads(AttentionLayer):
    """A router picks ``top_k`` of ``num_experts`` attention experts per token (MoA).

    - Router (eq. 7-9): ``p_t = softmax(q_t W_g)``, ``G(q_t) = TopK(p_t, k)``, gate weights
      ``w_{i,t} = p_{i,t} / Detach(sum_{j in G} p_{j,t})`` by default; ``renormalize="live"`` keeps the
      gradient of the denominator, ``"none"`` uses ``p`` unnormalised (the authors' released code), and
      ``router="noisy_topk"`` is the noisy top-k gate of eq. 2-3. See :class:`headmix.routing.TopKRouter`.
    - Experts (eq. 10-12): expert ``i`` owns ``W_q^i`` (``embed_dim x head_dim``, ``query_experts[i]``)
      and ``W_o^i`` (``head_dim x embed_dim``, ``output_experts[i]``); ``W_k`` and ``W_v``
      (``embed_dim x head_dim``) are shared, so keys and values are computed once, as one
      multi-query attention head: ``E_i = softmax(q W_q^i (K W_k)^T / sqrt(d_h)) V W_v W_o^i``.
    - Output (eq. 6): ``y_t = sum_{i in G(q_t)} w_{i,t} E_i(q_t, K, V)`` (+ one output bias).
    - Auxiliary loss (eq. 13-17): ``load_balance_weight * L_a + z_loss_weight * L_z`` over real tokens,
      returned as ``aux_loss``; the unweighted parts are in ``AttentionOutput.losses``.
    - Parameters (eq. 20): ``(2E + 2) d_h d_m`` weights, plus the router's ``E d_m`` and, with ``bias``,
      ``2 d_h + d_m`` biases.

    ``expert_impl`` picks the kernel of the grouped expert projections (``"auto"``, ``"reference"``,
    ``"dense"``, ``"sorted"``, ``"gather"``, ``"triton"``; see :mod:`headmix.kernels`).
    """

    def __init__(self, embed_dim: int, num_experts: int, top_k: int, head_dim: int, *, bias: bool = True,
                 dropout: float = 0.0, router: str = "softmax", renormalize: str = "detached",
                 load_balance_weight: float = 0.01, z_loss_weight: float = 0.001, expert_impl: str = "auto"):
        super().__init__(embed_dim)
        check_positive("num_experts", num_experts)
        check_positive("top_k", top_k)
        check_positive("head_dim", head_dim)
        if top_k > num_experts:
            raise ValueError(f"top_k ({top_k}) must not exceed num_experts ({num_experts})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if expert_impl not in IMPLS:
            raise ValueError(f"expert_impl must be one of {IMPLS}, got {expert_impl!r}")
        for name, w in (("load_balance_weight", load_balance_weight), ("z_loss_weight", z_loss_weight)):
            if w < 0:
                raise ValueError(f"{name} must be >= 0, got {w}")
        self.num_experts, self.top_k, self.head_dim = num_experts, top_k, head_dim
        self.dropout = dropout
        self.load_balance_weight, self.z_loss_weight = load_balance_weight, z_loss_weight
        self.expert_impl = expert_impl
        self.router = TopKRouter(embed_dim, num_experts, top_k, router=router, renormalize=renormalize)
        self.query_experts = nn.Parameter(torch.empty(num_experts, embed_dim, head_dim))
        self.output_experts = nn.Parameter(torch.empty(num_experts, head_dim, embed_dim))
        self.k_proj = nn.Linear(embed_dim, head_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, head_dim, bias=bias)
        self.out_bias = nn.Parameter(torch.zeros(embed_dim)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # The same scale as an nn.Linear(embed_dim, head_dim) per expert (uniform +-1/sqrt(fan_in)).
        bound_q = self.embed_dim ** -0.5
        bound_o = self.head_dim ** -0.5
        nn.init.uniform_(self.query_experts, -bound_q, bound_q)
        nn.init.uniform_(self.output_experts, -bound_o, bound_o)
        if self.out_bias is not None:
            nn.init.zeros_(self.out_bias)

    def _project_kv(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        # One shared key head and one shared value head (eq. 10-11): (batch, 1, S, head_dim).
        return self.k_proj(key).unsqueeze(1), self.v_proj(value).unsqueeze(1)

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None, is_causal: bool = False,
                use_cache: bool = False, cache: KVCache | None = None, query_padding_mask: Tensor | None = None) -> AttentionOutput:
        query, key, value = self._check_inputs(query, key, value)
        batch, tgt, dim = query.shape
        k_shared, v_shared, new_cache, past_len = self._keys_values(query, key, value, use_cache, cache)

        token_mask = real_token_mask(query, key, key_padding_mask, query_padding_mask, cache)
        routing = self.router(query, token_mask)
        n, k = batch * tgt, self.top_k
        info = expert_routing(routing.expert_index, self.num_experts)

        # The grouped kernels are custom autograd functions that autocast does not see: cast by hand.
        compute = autocast_dtype(query) or query.dtype
        # eq. 10: q_{i,t} = q_t W_q^i for the k selected experts, as k query heads over one shared K/V head.
        q = expert_map(query.reshape(n, dim).to(compute), self.query_experts.to(compute), info, impl=self.expert_impl)
        q = q.view(batch, tgt, k, self.head_dim).transpose(1, 2)
        bias, empty, causal = attention_bias(batch, 1, tgt, k_shared.shape[2], key_padding_mask=key_padding_mask,
                                             attn_mask=attn_mask, is_causal=is_causal, past_len=past_len,
                                             dtype=q.dtype, device=q.device)
        o = scaled_dot_product(q, k_shared, v_shared, bias, empty, self.dropout if self.training else 0.0, causal=causal)
        # eq. 11-12 and 6: o_{i,t} W_o^i, weighted by w_{i,t} and summed over the selected experts.
        o = o.transpose(1, 2).reshape(n, k, self.head_dim).to(compute)
        y = expert_reduce(o, self.output_experts.to(compute), routing.gates.to(compute), info,
                          impl=self.expert_impl).view(batch, tgt, dim)
        if self.out_bias is not None:
            y = y + self.out_bias.to(y.dtype)  # keeps y in the autocast dtype, as a Linear's output would be
        aux, parts = routing_losses(routing, self.load_balance_weight, self.z_loss_weight)
        return AttentionOutput(y, aux, new_cache, routing, parts)


def autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The autocast dtype in force for ``x``'s device, or None outside autocast."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


def real_token_mask(query: Tensor, key: Tensor | None, key_padding_mask: Tensor | None,
                    query_padding_mask: Tensor | None, cache: KVCache | None) -> Tensor | None:
    """``(batch, time)`` True for real query tokens, from ``query_padding_mask`` or, in self-attention
    without a cache, from a boolean ``key_padding_mask`` (the queries are the keys)."""
    batch, tgt = query.shape[:2]
    check_mask_dtype("query_padding_mask", query_padding_mask, additive=False)
    if query_padding_mask is not None:
        if query_padding_mask.shape != (batch, tgt):
            raise ValueError(f"query_padding_mask must have shape (batch, time) = ({batch}, {tgt}), got {tuple(query_padding_mask.shape)}")
        return ~query_padding_mask
    if key is None and cache is None and key_padding_mask is not None and key_padding_mask.dtype == torch.bool \
            and key_padding_mask.shape == (batch, tgt):
        return ~key_padding_mask
    return None
