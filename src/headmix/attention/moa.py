"""Mixture of Attention Heads (MoA; Zhang et al. 2022, arXiv 2210.05144)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..kernels import IMPLS, expert_map, expert_reduce, expert_routing
from ..kernels.fused_router import fused_router_applies, softmax_topk_route
from ..routing import ROUTERS, Routing, TopKRouter, routing_losses
from ..routing.random import RandomRouter, check_random_router, uniform_routing
from ..routing.losses import check_fractions
from ..routing.task_gradient import check_router_learns, moa_router_without_task_gradient
from .base import AttentionLayer, AttentionOutput, KVCache, attention_bias, check_experts, check_positive, scaled_dot_product, zero_loss
from .mha import resolve_bias, split_heads
from .padding import check_flag, real_token_mask, zero_padded_queries
from .rotary import RotaryEmbedding, make_rotary


class MixtureOfAttentionHeads(AttentionLayer):
    """A router picks ``top_k`` of ``num_experts`` attention experts per token (MoA).

    - Router (eq. 7-9): ``p_t = softmax(q_t W_g)``, ``G(q_t) = TopK(p_t, k)``, gate weights
      ``w_{i,t} = p_{i,t} / Detach(sum_{j in G} p_{j,t})`` by default; ``renormalize="live"`` keeps the
      gradient of the denominator, ``"none"`` uses ``p`` unnormalised (the authors' released code), and
      ``router="noisy_topk"`` is the noisy top-k gate of eq. 2-3. See :class:`headmix.routing.TopKRouter`.
    - ``router="random"``, the random-routing control (:mod:`headmix.routing.random`): ``G(q_t)`` is ``k``
      experts drawn uniformly at random per token (``router_seed``, or a seed drawn at construction), every
      weight ``w_{i,t} = 1/k`` (eq. 9 at equal router scores); no router parameters and no auxiliary loss
      (``aux_loss`` is zero, ``losses`` empty).
    - Experts (eq. 10-12): expert ``i`` owns ``W_q^i`` (``embed_dim x head_dim``, ``query_experts[i]``)
      and ``W_o^i`` (``head_dim x embed_dim``, ``output_experts[i]``); ``W_k`` and ``W_v``
      (``embed_dim x head_dim``) are shared, so keys and values are computed once, as one
      multi-query attention head: ``E_i = softmax(q W_q^i (K W_k)^T / sqrt(d_h)) V W_v W_o^i``.
    - Output (eq. 6): ``y_t = sum_{i in G(q_t)} w_{i,t} E_i(q_t, K, V)`` (+ one output bias).
    - Auxiliary loss (eq. 13-17): ``load_balance_weight * L_a + z_loss_weight * L_z`` over real tokens,
      returned as ``aux_loss``; the unweighted parts are in ``AttentionOutput.losses``.
      ``load_balance_fractions="per_token"`` gives Hugging Face JetMoe's ``L_a``, ``top_k`` times ours
      (see :func:`headmix.routing.load_balancing_loss`).
    - ``zero_padded_queries=True`` returns 0 (output bias included) at padded query positions
      (``query_padding_mask``, or a boolean ``key_padding_mask`` in self-attention without a cache), as the
      MoA authors' code and x-transformers do; by default those rows hold the attention output of the
      padding token, which a model ignores anyway.
    - Parameters (eq. 20): ``(2E + 2) d_h d_m`` weights (``(2E + 2) G d_h d_m`` with ``kv_heads=G``), plus
      the router's ``E d_m`` and, with ``bias``, ``2 G d_h + d_m`` biases: ``kv_bias`` (the K/V projections'
      ``2 G d_h``) and ``out_bias`` (the ``d_m`` output bias), when given, override ``bias`` for their part
      (JetMoE: ``kv_bias=False, out_bias=True``).

    ``kv_heads=G`` (grouped K/V heads, the JetMoE form): ``W_k`` and ``W_v`` give ``G`` key/value heads
    (``embed_dim x G d_h``), each expert's ``W_q^i`` gives one query head per K/V head
    (``query_experts`` ``(E, d_m, G d_h)``, ``output_experts`` ``(E, G d_h, d_m)``; query head ``g`` of an
    expert is columns ``g d_h .. (g+1) d_h`` and attends with K/V head ``g``), so a token has ``k G`` query
    heads and the cache holds ``2 G d_h`` numbers per token. Attention runs as grouped-query attention;
    headmix does not repeat K/V (see :func:`~headmix.attention.base.scaled_dot_product`). ``G = 1`` is the
    paper's layer, with the same parameter names and shapes.

    ``rotary=True`` (RoPE, :class:`RotaryEmbedding`; ``rotary_base``, ``rotary_fraction``, or a module
    instance) rotates the shared key head and each selected expert's query by position, as JetMoE does;
    self-attention only (``key=None`` or the query itself as key), keys cached after rotation, see
    :class:`MultiHeadAttention`.

    A learned router that would get no gradient from the task loss (``top_k=1`` with ``renormalize="live"``
    or ``router="noisy_topk"``, whose weight is then the constant 1; ``num_experts=1``) is refused with a
    ``ValueError`` unless ``allow_router_without_task_gradient=True`` asks for it as an ablation (see
    :mod:`headmix.routing.task_gradient`); the default ``renormalize="detached"`` learns at every ``top_k``.

    ``expert_impl`` picks the kernel of the grouped expert projections (``"auto"``, ``"reference"``,
    ``"dense"``, ``"sorted"``, ``"gather"``, ``"bag"``, ``"triton"``; see :mod:`headmix.kernels`).
    """

    repr_sizes = ("embed_dim", "num_experts", "top_k", "head_dim", "kv_heads")

    def __init__(self, embed_dim: int, num_experts: int, top_k: int, head_dim: int, *, bias: bool = True,
                 dropout: float = 0.0, router: str = "softmax", renormalize: str = "detached",
                 load_balance_weight: float = 0.01, z_loss_weight: float = 0.001, expert_impl: str = "auto",
                 rotary: bool | RotaryEmbedding = False, rotary_base: float = 10000.0, rotary_fraction: float = 1.0,
                 kv_heads: int = 1, kv_bias: bool | None = None, out_bias: bool | None = None,
                 load_balance_fractions: str = "normalized", zero_padded_queries: bool = False,
                 router_seed: int | None = None, allow_router_without_task_gradient: bool = False):
        super().__init__(embed_dim)
        check_experts(num_experts, top_k)
        check_positive("head_dim", head_dim)
        check_positive("kv_heads", kv_heads)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if expert_impl not in IMPLS:
            raise ValueError(f"expert_impl must be one of {IMPLS}, got {expert_impl!r}")
        for name, w in (("load_balance_weight", load_balance_weight), ("z_loss_weight", z_loss_weight)):
            if w < 0:
                raise ValueError(f"{name} must be >= 0, got {w}")
        self.num_experts, self.top_k, self.head_dim, self.kv_heads = num_experts, top_k, head_dim, kv_heads
        self.dropout = dropout
        self.load_balance_weight, self.z_loss_weight = load_balance_weight, z_loss_weight
        self.expert_impl = expert_impl
        check_fractions(load_balance_fractions)
        self.load_balance_fractions = load_balance_fractions
        self.zero_padded_queries = check_flag("zero_padded_queries", zero_padded_queries)
        self.random_routing = check_random_router(router, ROUTERS + ("random",))
        check_router_learns(moa_router_without_task_gradient(num_experts, top_k, router, renormalize),
                            allow_router_without_task_gradient, "MoA")
        if self.random_routing:
            if renormalize != "detached":
                raise ValueError(f"renormalize applies to learned routers; router='random' weights every expert 1/k, "
                                 f"got renormalize={renormalize!r}")
            self.router = RandomRouter(num_experts, top_k, router_seed=router_seed)
        else:
            self.router = TopKRouter(embed_dim, num_experts, top_k, router=router, renormalize=renormalize)
        self.query_experts = nn.Parameter(torch.empty(num_experts, embed_dim, kv_heads * head_dim))
        self.output_experts = nn.Parameter(torch.empty(num_experts, kv_heads * head_dim, embed_dim))
        kv_bias, out_bias = resolve_bias("kv_bias", kv_bias, bias), resolve_bias("out_bias", out_bias, bias)
        self.k_proj = nn.Linear(embed_dim, kv_heads * head_dim, bias=kv_bias)
        self.v_proj = nn.Linear(embed_dim, kv_heads * head_dim, bias=kv_bias)
        self.out_bias = nn.Parameter(torch.zeros(embed_dim)) if out_bias else None
        self.rotary = make_rotary(rotary, rotary_base, rotary_fraction, head_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # The same scale as an nn.Linear(embed_dim, head_dim) per expert (uniform +-1/sqrt(fan_in)).
        bound_q = self.embed_dim ** -0.5
        bound_o = (self.kv_heads * self.head_dim) ** -0.5
        nn.init.uniform_(self.query_experts, -bound_q, bound_q)
        nn.init.uniform_(self.output_experts, -bound_o, bound_o)
        if self.out_bias is not None:
            nn.init.zeros_(self.out_bias)

    def _project_kv(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        # kv_heads shared key and value heads (eq. 10-11; one in the paper): (batch, kv_heads, S, head_dim).
        return split_heads(self.k_proj(key), self.kv_heads), split_heads(self.v_proj(value), self.kv_heads)

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None, is_causal: bool = False,
                use_cache: bool = False, cache: KVCache | None = None, query_padding_mask: Tensor | None = None) -> AttentionOutput:
        """Route each token of ``query`` ``(B, T, embed_dim)`` to ``top_k`` of ``num_experts`` experts (eq. 7-9)
        and mix their attention outputs over ``key`` / ``value`` ``(B, S, embed_dim)`` (``None``: self-attention)
        with the gate weights (eq. 6, 10-12). Returns an :class:`AttentionOutput`: ``output``
        ``(B, T, embed_dim)``, ``routing`` (each token's ``expert_index`` and ``gates``, ``(B*T, top_k)``),
        ``aux_loss`` (eq. 13-17, weighted; add it to the training loss).
        Masks: ``key_padding_mask`` ``(B, S)``, ``attn_mask`` ``(T, S)`` (or per batch / head), ``is_causal``,
        ``query_padding_mask`` ``(B, T)``, with ``torch.nn.MultiheadAttention``'s conventions (``True`` =
        padding / forbidden; see :mod:`headmix.attention.base`); ``use_cache`` returns the new ``cache``."""
        query, key, value = self._check_inputs(query, key, value)
        batch, tgt, dim = query.shape
        k_shared, v_shared, new_cache, past_len = self._keys_values(query, key, value, use_cache, cache)

        token_mask = real_token_mask(query, key, key_padding_mask, query_padding_mask, cache)
        n, k = batch * tgt, self.top_k
        losses = None  # (aux, parts) where the fused router computed them with the routing
        if self.random_routing:
            routing = uniform_routing(self.router.choose(batch, tgt, past_len).view(n, k), self.num_experts, 1.0 / k,
                                      token_mask, (batch, tgt), query.dtype)
        elif self.router.noise is None and fused_router_applies(query):  # one C++ operation (kernels/fused_router.py)
            mask = None if token_mask is None else token_mask.reshape(n)
            logits = self.router.logits(query)
            probs, index, gates, aux, la, lz = softmax_topk_route(
                logits, mask, groups=1, top_k=k, renormalize=self.router.renormalize, scale=1.0,
                load_balance_weight=self.load_balance_weight, z_loss_weight=self.z_loss_weight,
                per_token=self.load_balance_fractions == "per_token", z_loss=True)
            routing = Routing(logits, probs, index.view(n, k), gates.view(n, k).to(query.dtype), mask, (batch, tgt))
            losses = (aux, {"load_balance": la, "z_loss": lz})
        else:
            routing = self.router(query, token_mask)
        info = expert_routing(routing.expert_index, self.num_experts, check_range=False)  # top-k: in range

        # The grouped kernels are custom autograd functions that autocast does not see: cast by hand.
        compute = autocast_dtype(query) or query.dtype
        # eq. 10: q_{i,t} = q_t W_q^i for the k selected experts: k * kv_heads query heads, ordered
        # (K/V head g, expert slot j) so that query head g * k + j uses K/V head g (grouped-query attention).
        q = expert_map(query.reshape(n, dim).to(compute), self.query_experts.to(compute), info, impl=self.expert_impl)
        q = q.view(batch, tgt, k, self.kv_heads, self.head_dim).permute(0, 3, 2, 1, 4)
        # one K/V head: a view; more: one copy (contiguous, then a view: reshape would add an _unsafe_view operation)
        q = (q if self.kv_heads == 1 else q.contiguous()).reshape(batch, self.kv_heads * k, tgt, self.head_dim)
        q = self._rotate_queries(q, key, cache, past_len)
        bias, empty, causal = attention_bias(batch, 1, tgt, k_shared.shape[2], key_padding_mask=key_padding_mask,
                                             attn_mask=attn_mask, is_causal=is_causal, past_len=past_len,
                                             dtype=q.dtype, device=q.device)
        o = scaled_dot_product(q, k_shared, v_shared, bias, empty, self.dropout if self.training else 0.0, causal=causal)
        # eq. 11-12 and 6: o_{i,t} W_o^i, weighted by w_{i,t} and summed over the selected experts.
        o = o.view(batch, self.kv_heads, k, tgt, self.head_dim).permute(0, 3, 2, 1, 4).contiguous().view(
            n, k, self.kv_heads * self.head_dim).to(compute)
        y = expert_reduce(o, self.output_experts.to(compute), routing.gates.to(compute), info,
                          impl=self.expert_impl).view(batch, tgt, dim)
        if self.out_bias is not None:
            y = y + self.out_bias.to(y.dtype)  # keeps y in the autocast dtype, as a Linear's output would be
        if self.zero_padded_queries:
            y = zero_padded_queries(y, token_mask)
        if self.random_routing:
            return AttentionOutput(y, zero_loss(query), new_cache, routing)
        if losses is None:
            losses = routing_losses(routing, self.load_balance_weight, self.z_loss_weight, self.load_balance_fractions)
        return AttentionOutput(y, losses[0], new_cache, routing, losses[1])


def autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The autocast dtype in force for ``x``'s device, or None outside autocast."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None
