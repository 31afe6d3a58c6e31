"""MoH: multi-head attention as a mixture of heads (Jin, Zhu, Yan, Yuan 2024)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import IMPLS, choose_impl, expert_map, expert_reduce, expert_routing
from ..kernels.fused_router import fused_router_applies, moh_route
from ..routing import Routing
from ..routing.losses import check_fractions, weighted_load_balance
from ..routing.random import RandomRouter, check_random_router
from ..routing.router import router_dtype
from ..routing.task_gradient import check_router_learns, moh_router_without_task_gradient
from .base import AttentionOutput, KVCache, attention_bias, query_offset, scaled_dot_product, zero_loss
from .mha import QK_NORM_EPS, MultiHeadAttention, merge_heads
from .moa import autocast_dtype
from .moh_sparse import routed_heads_attention, routed_layout, slot_attention
from .padding import check_flag, real_token_mask, zero_padded_queries
from .rotary import RotaryEmbedding


HEAD_WEIGHTINGS = ("renormalized", "paper", "scaled")

#: MoH's routers: the learned one (``"softmax"``), the random-routing control, MoH-LLaMA3's query-norm rule.
ROUTERS = ("softmax", "random", "query_norm")

#: How MoH computes its heads: ``"dense"`` every head, then weights (the MoH authors' code); ``"sparse"`` only
#: the shared heads and each token's selected routed heads; ``"auto"`` picks (see :func:`choose_moh_impl`).
MOH_IMPLS = ("auto", "dense", "sparse")

#: ``auto`` picks ``sparse`` on the CPU when at most this fraction of the routed heads is active per token
#: (``top_k / routed``). ``headmix bench attention --moh-curve`` (2-core CPU, fp32, d_model 512, 8 heads of
#: 64, 2 shared, batch 2 x 512 causal, forward+backward): see docs/performance.md, "Sparse MoH".
SPARSE_MAX_ACTIVE_FRACTION = 0.5
#: ``auto`` picks ``sparse`` only for calls of at least this many queries per sequence: below it the routing and
#: the slots' layout cost more than the skipped heads save. The slot form at d_model 128 (8 heads of 16, H/4 shared
#: + top H/4, or top 2 of 4 per K/V group), batch 8, fp32, 2-core Intel Xeon, sparse over dense MoH, forward +
#: backward, 1 / 2 threads: T 64 1.17-1.20 / 1.57-1.75, T 128 0.93-0.97 / 1.31-1.44, T 256 0.79-0.80 / 0.97,
#: T 512 0.67-0.68 / 0.73-0.81 (``headmix bench compute --rows MoH``, 2026-12-07; docs/performance.md, "Sparse MoH").
SPARSE_MIN_QUERIES = 256
#: Global routing over several K/V heads (the ``heads`` layout, CPU eager): ``sparse`` only with gradients, at least
#: this many queries per sequence and heads at least this wide. At d_model 128 (heads of 16) it was slower than
#: dense MoH at every length measured (T 64-512: 1.07-1.81x forward+backward, 1.53-2.05x prefill); at d_model 1024
#: (heads of 64) 0.88-0.94x forward+backward at one thread, 0.98-1.05x at two, 1.01-1.18x prefill; at d_model 512
#: (heads of 64), T 512, 0.80x (one thread, 2026-11-23).
GLOBAL_SPARSE_MIN_QUERIES = 512
GLOBAL_SPARSE_MIN_HEAD_DIM = 64


def head_ids(groups: int, group_heads: int, num_shared_heads: int) -> tuple[list[int], list[int]]:
    """MoH's head numbering: the layer's indices of the shared heads and of the routed heads, in routing order.
    Each of the ``groups`` router groups (the K/V groups with ``route_per_group``, else one) holds ``group_heads``
    consecutive query heads, its first ``num_shared_heads`` shared, the rest routed."""
    shared = [g * group_heads + j for g in range(groups) for j in range(num_shared_heads)]
    routed = [g * group_heads + j for g in range(groups) for j in range(num_shared_heads, group_heads)]
    return shared, routed


def choose_moh_impl(device: torch.device, top_k: int, routed: int, tgt: int, slot_form: bool = False,
                    head_dim: int | None = None, needs_grad: bool = True) -> str:
    """The ``auto`` rule. ``routed``: the routed heads ``top_k`` picks from (per group with ``route_per_group``);
    ``tgt``: queries per sequence in the call; ``slot_form``: the layer's selected heads are query heads of
    grouped-query attention (:attr:`MixtureOfHeadsAttention.slot_form`: ``route_per_group``, or one K/V head);
    ``head_dim``: the heads' width (``None``: unknown, taken as wide); ``needs_grad``: a training step, not a
    forward without gradients (prefill, evaluation).

    - ``dense`` without routed heads, for one-query decoding steps, when more than ``SPARSE_MAX_ACTIVE_FRACTION``
      of the routed heads are active, and for fewer than :data:`SPARSE_MIN_QUERIES` queries per sequence: the
      projections are one GEMM of every head either way and the sparse step adds routing and layout work that the
      skipped heads do not pay back there (CPU measurements beside the constants; docs/performance.md, "Sparse
      MoH").
    - ``slot_form``: ``sparse`` otherwise, on every device and under ``torch.compile``. Its attention is one
      grouped-query call of the selected heads only (``moh_sparse``'s ``grouped_query`` layout): static shapes
      and no host read, so it is the same path off the CPU and compiled. Measured on the CPU only; the length
      threshold holds off the CPU unmeasured.
    - otherwise (global routing over several K/V heads) ``sparse`` on the CPU outside ``torch.compile`` only with
      gradients, at least :data:`GLOBAL_SPARSE_MIN_QUERIES` queries and heads of at least
      :data:`GLOBAL_SPARSE_MIN_HEAD_DIM` (the ``heads`` layout reads group sizes back to the host); ``dense``
      on other devices and under compile: there the sparse path must keep static shapes and pads every (row,
      head) group to the sequence length (``padded``), so its attention is as large as dense's and only the
      routed projections are saved."""
    if routed == 0 or tgt < SPARSE_MIN_QUERIES or top_k > SPARSE_MAX_ACTIVE_FRACTION * routed:
        return "dense"
    if slot_form:
        return "sparse"
    if torch.compiler.is_compiling() or device.type != "cpu":
        return "dense"
    wide = head_dim is None or head_dim >= GLOBAL_SPARSE_MIN_HEAD_DIM
    return "sparse" if needs_grad and wide and tgt >= GLOBAL_SPARSE_MIN_QUERIES else "dense"


class HeadRoute(NamedTuple):
    """What MoH's router gives one call (:meth:`MoHHeadWeighting.route`), ``N = batch * time`` tokens, ``G`` router
    groups of ``S`` shared and ``M`` routed heads each, ``k`` selected per group."""

    #: The routed heads' routing: ``expert_index`` ``(N, G k)`` numbers them from 0 group by group, ``gates``
    #: are their weights ``g``.
    routing: Routing
    #: ``(N, G (S + k))``: each token's active heads as the layer numbers them, group by group the ``S`` shared
    #: heads then the ``k`` selected routed heads (a group's slots are consecutive).
    slot_heads: Tensor
    #: ``(N, G (S + k))``: the active heads' weights ``g`` in the order of ``slot_heads``.
    slot_weights: Tensor
    #: ``(B, T, num_heads)``: every head's weight (0 for the unselected routed heads), where asked for.
    head_weights: Tensor | None
    #: The weighted load-balancing loss and its value where the fused router computed them, else None.
    losses: tuple[Tensor, Tensor] | None


class MoHHeadWeighting:
    """MoH's head weights ``g`` (eq. 5-6, the authors' form per ``head_weighting``, per K/V group with
    ``route_per_group``, the random control, or MoH-LLaMA3's query-norm rule) as one piece that any module laying
    out MoH's heads can use: :class:`MixtureOfHeadsAttention` and headmix's vLLM model
    (:class:`headmix.serving.model.MixtureOfHeads`). A class using it sets: ``num_heads``, ``num_shared_heads``,
    ``num_routed_heads``, ``num_routed_per_group``, ``top_k``, ``route_groups``, ``head_weighting``,
    ``routed_gate``, ``shared_gate``, ``group_gate`` (``nn.Linear`` or ``None``), ``random_router`` (or ``None``)
    and ``query_norm_routing``; with the query-norm rule it passes ``routed_queries`` or defines
    ``routed_queries(x)``. The load-balancing loss's ``load_balance_weight`` and ``load_balance_fractions`` default
    to 0 and ``"normalized"`` (a serving module computes no loss)."""

    load_balance_weight: float = 0.0
    load_balance_fractions: str = "normalized"

    def head_weights(self, x: Tensor, token_mask: Tensor | None, offset: int | Tensor = 0,
                     routed_queries: Tensor | None = None) -> tuple[Tensor | None, Routing | None]:
        """Per-token head weights ``g`` ``(batch, time, num_heads)`` and the routing of the routed heads
        (``expert_index`` counts routed heads from 0, ``gates`` are the selected routed heads' ``g``), or
        ``(None, None)`` when every head is shared. ``routed_queries``: see :meth:`route`."""
        if not self.num_routed_heads:
            return None, None
        route = self.route(x, token_mask, offset, routed_queries, dense=True)
        return route.head_weights, route.routing

    def route(self, x: Tensor, token_mask: Tensor | None, offset: int | Tensor = 0,
              routed_queries: Tensor | None = None, dense: bool = False) -> HeadRoute:
        """The router on ``x`` ``(B, T, d_model)`` (layer with routed heads): each token's active heads and
        their weights (:class:`HeadRoute`; ``head_weights`` with ``dense``), the routing of the routed heads and,
        where the fused router computed them, the losses. Eq. 5-6, or the authors' code's form, per
        ``head_weighting``; with ``route_per_group`` per K/V group (eq. 5-6 within the group, the shared weights
        and the ``[a_s, a_r]`` pair per group). ``router="random"``: the routed heads drawn at random (the tokens
        at positions ``offset ..``) and every score equal (zero logits). ``router="query_norm"``:
        :meth:`_query_norm_weights` of ``routed_queries`` (the routed heads' queries ``(N, R, key_dim)``, before
        rotary and QK-norm; projected here when not given). On the CPU in eager mode the learned router is one
        C++ operation forward and one backward (:func:`~headmix.kernels.fused_router.moh_route`) on one GEMM of
        the three gates; elsewhere the same in ATen operations (:meth:`_composed_weights`)."""
        batch, time, dim = x.shape
        n, groups, shared_heads = batch * time, self.route_groups, self.num_shared_heads
        if self.query_norm_routing:
            return self._head_route(x, dense, *self._query_norm_weights(x, token_mask, routed_queries), None)
        flat32 = x.reshape(n, dim).to(router_dtype(x))
        mask = None if token_mask is None else token_mask.reshape(n)
        with torch.autocast(device_type=x.device.type, enabled=False):
            if self.random_router is None:
                gates = [self.routed_gate.weight] + ([self.group_gate.weight, self.shared_gate.weight]
                                                     if shared_heads else [])
                weight = gates[0] if len(gates) == 1 else torch.cat(gates)  # one GEMM of the three gates
                logits = F.linear(flat32, weight.to(flat32.dtype))
            else:
                logits = flat32.new_zeros(n, self.num_routed_heads + (groups * (2 + shared_heads) if shared_heads else 0))
            if self.random_router is None and fused_router_applies(x):  # one C++ operation, losses included
                probs, index, slot_heads, slot_weights, g, aux, lb = moh_route(
                    logits, mask, routed_heads=self.num_routed_heads, groups=groups, top_k=self.top_k,
                    shared=shared_heads, weighting=self.head_weighting, load_balance_weight=self.load_balance_weight,
                    per_token=self.load_balance_fractions == "per_token", dense=dense)
                routed = slot_weights.view(n, groups, shared_heads + self.top_k)[..., shared_heads:].reshape(
                    n, groups * self.top_k).to(x.dtype)
                routing = Routing(logits[:, :self.num_routed_heads], probs, index, routed, mask, (batch, time))
                return HeadRoute(routing, slot_heads, slot_weights.to(x.dtype),
                                 g.to(x.dtype).view(batch, time, self.num_heads) if dense else None, (aux, lb))
            routed_logits, shared = logits, None
            if shared_heads:
                routed_logits, group_logits, shared_logits = logits.split(
                    [self.num_routed_heads, 2 * groups, groups * shared_heads], dim=1)
            routed, probs, index = self._composed_weights(routed_logits, n, batch, time, offset)
            if shared_heads:
                group_w = group_logits.view(n, groups, 2).softmax(-1)
                shared = shared_logits.view(n, groups, shared_heads).softmax(-1)
                if self.head_weighting != "paper":
                    group_w, shared = 2.0 * group_w, shared * shared_heads
                routed = group_w[..., 1:] * routed
                shared = (group_w[..., :1] * shared).view(n, groups * shared_heads)
        routing = self._routing(x, token_mask, routed_logits, probs, index, routed)
        return self._head_route(x, dense, shared, routing, None)

    def _head_route(self, x: Tensor, dense: bool, shared: Tensor | None, routing: Routing,
                    losses: tuple[Tensor, Tensor] | None) -> HeadRoute:
        """The :class:`HeadRoute` of the shared heads' weights ``(N, G S)`` (None without shared heads) and the
        routing, in ATen operations."""
        index, gates = routing.expert_index, routing.gates
        n, groups, s, top = index.shape[0], self.route_groups, self.num_shared_heads, self.top_k
        g = None
        with torch.autocast(device_type=x.device.type, enabled=False):
            if dense:
                g = routing.probs.new_zeros(routing.probs.shape).scatter(1, index, gates.to(routing.probs.dtype))
                if shared is not None:  # each group's shared heads, then its routed heads
                    g = torch.cat([shared.view(n, groups, s), g.view(n, groups, self.num_routed_per_group)], dim=2)
                g = g.to(x.dtype).view(*x.shape[:2], self.num_heads)
            if shared is None:
                return HeadRoute(routing, index, gates, g, losses)
            # routed head r (numbered group by group) of group g is the layer's head r + S (g + 1): each group's S
            # shared heads come first
            offsets = torch.arange(s, s * (groups + 1), s, device=index.device)[:, None]
            shared_heads = torch.arange(self.num_heads, device=index.device).view(groups, -1)[None, :, :s]
            slot_heads = torch.cat([shared_heads.expand(n, groups, s), index.view(n, groups, top) + offsets], dim=2)
            weights = torch.cat([shared.view(n, groups, s).to(gates.dtype), gates.view(n, groups, top)], dim=2)
        slots = groups * (s + top)
        return HeadRoute(routing, slot_heads.view(n, slots), weights.view(n, slots), g, losses)

    def _composed_weights(self, logits: Tensor, n: int, batch: int, time: int,
                          offset: int | Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The routed heads' weights ``(N, G, top_k)`` before the shared/routed split, the per-group softmax
        ``(N, G, R/G)`` and the selection (group-local), in ATen operations (the fused router's reference)."""
        # (N, groups, routed per group): one group without route_per_group; routed per K/V group inside each group
        probs = logits.view(n, self.route_groups, self.num_routed_per_group).softmax(-1)
        if self.random_router is not None:
            index = self.random_router.choose(batch, time, offset)
            top_p = probs.gather(-1, index)
        else:
            top_p, index = probs.topk(self.top_k, dim=-1)
        if self.head_weighting == "renormalized":
            # no clamp: the selected probabilities hold the largest (>= 1 / routed heads), or with
            # router="random" equal ones (zero logits), so their sum is positive
            return top_p / top_p.sum(-1, keepdim=True) * self.top_k, probs, index
        if self.head_weighting == "scaled":
            return top_p * self.num_routed_per_group, probs, index
        return top_p, probs, index

    def _routing(self, x: Tensor, token_mask: Tensor | None, logits: Tensor, probs: Tensor, index: Tensor,
                 routed: Tensor) -> Routing:
        """The :class:`Routing` of a call from the per-group ``probs`` ``(N, G, R/G)``, ``index`` and weights
        ``routed`` ``(N, G, top_k)`` (group-local head numbers, renumbered here group by group)."""
        batch, time, _ = x.shape
        n, route_groups = batch * time, self.route_groups
        if route_groups > 1:  # routed heads numbered group by group
            per = self.num_routed_per_group  # each group's first routed head: one arange with a step
            index = index + torch.arange(0, route_groups * per, per, device=x.device)[:, None]
        mask = None if token_mask is None else token_mask.reshape(-1)
        slots = route_groups * self.top_k
        return Routing(logits.reshape(n, self.num_routed_heads), probs.reshape(n, self.num_routed_heads),
                       index.reshape(n, slots), routed.reshape(n, slots).to(x.dtype), mask, (batch, time))

    def _query_norm_weights(self, x: Tensor, token_mask: Tensor | None,
                            routed_queries: Tensor | None) -> tuple[Tensor | None, Routing]:
        """``router="query_norm"`` (MoH-LLaMA3's rule, class docstring): per token and router group, the scores
        ``||q_i|| / std_j ||q_j||`` over the routed heads (0 where the standard deviation is 0 or undefined),
        the ``top_k`` largest norms selected (the same heads as the largest scores), every active head weighted
        1. The rule is piecewise constant: nothing of it carries a gradient."""
        n, route_groups, per = x.shape[0] * x.shape[1], self.route_groups, self.num_routed_per_group
        if routed_queries is None:
            routed_queries = self.routed_queries(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            norms = routed_queries.detach().to(router_dtype(x)).norm(dim=-1).view(n, route_groups, per)
            if per > 1:
                std = norms.std(dim=-1, keepdim=True)
                no_spread = ~(std > 0)  # std 0 or NaN (masked fills: torch.where of Python numbers builds tensors)
                logits = (norms / std.masked_fill(no_spread, 1.0)).masked_fill(no_spread, 0.0)
            else:  # one routed head: no standard deviation; it is always selected
                logits = torch.zeros_like(norms)
            probs = logits.softmax(-1)
            index = norms.topk(self.top_k, dim=-1).indices
            routed = norms.new_ones(n, route_groups, self.top_k)
            shared = norms.new_ones(n, route_groups * self.num_shared_heads) if self.num_shared_heads else None
        return shared, self._routing(x, token_mask, logits, probs, index, routed)


class MixtureOfHeadsAttention(MoHHeadWeighting, MultiHeadAttention):
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

    ``impl`` (see :data:`MOH_IMPLS`): ``"dense"`` computes every head's attention and lets the head weights
    select, as the MoH authors' code does; ``"sparse"`` computes the shared heads and, for each routed head,
    the query projection, the attention rows and the head's slice of the output projection only for the
    tokens that selected it (:mod:`headmix.attention.moh_sparse`; the routed heads' projections run on the
    grouped expert kernels of :mod:`headmix.kernels`, ``expert_impl``). Keys and values are computed for every
    head (any query may pick any head). With ``route_per_group`` or one K/V head (:attr:`slot_form`) a token's
    ``j``-th selected head of group ``g`` always reads K/V head ``g``, so the selected heads are the query heads
    of one grouped-query attention call: the attention skipped on every device and under ``torch.compile``
    (``fullgraph=True``, no host read). With global routing over several K/V heads the selected heads fall in
    any group: the skipping layout reads group sizes back to the host, so on CUDA and under compile the sparse
    path pads each head's rows to the sequence length and skips no attention (:mod:`~headmix.attention.moh_sparse`).
    Both impls give the same outputs, losses and gradients, and have the same parameters.

    ``kv_heads``, ``qk_norm`` and ``output_gate`` as :class:`MultiHeadAttention` (grouped K/V heads, QK-norm,
    Gated Attention's G1 gate on each head's output, before the head weight ``g_i`` and ``W_O^i``; the two
    are products, so their order does not matter). Query head ``h`` reads K/V head ``h // (num_heads /
    kv_heads)``; the sparse path reads the K/V heads in place wherever the shared and routed heads cover
    whole groups (always with ``route_per_group``), and gathers them for the heads that split a group.

    ``route_per_group=True`` (MoH routed per K/V group; needs ``kv_heads``; headmix called it GQE before the
    paper's method was read, but the paper's Grouped Query Experts, arXiv 2606.20945, is
    :class:`~headmix.attention.GroupedQueryExpertsAttention`, ``kind="gqe"``: hard slots, a weighted-sum slot and
    a shared head, where this form keeps MoH's weights and per-head output projections, so at ``top_k=1`` with
    the default ``"renormalized"`` weighting its routed scores get no gradient from the task loss): the router
    works inside each of the ``G = kv_heads`` groups of ``H/G`` query heads sharing a K/V head.
    ``num_shared_heads`` and ``top_k`` then count per group: the first ``num_shared_heads`` heads of each
    group are always on, each token selects ``top_k`` of the group's other ``H/G - num_shared_heads`` heads,
    and every group is one MoH of its own: ``p = softmax`` of the router logits over the group's routed heads,
    the weights (``head_weighting``) renormalised within the group, the shared heads' softmax and the
    ``[a_s, a_r]`` pair per group (``shared_gate`` ``(G S, d)``, ``group_gate`` ``(2 G, d)``), and the
    load-balancing loss the mean of the groups' losses. A token thus computes ``G (S + k)`` query heads.
    With ``kv_heads=1`` it is the global layer above, parameter for parameter. ``routing.expert_index``
    numbers the routed heads group by group (routed head ``r`` is in group ``r // (H/G - S)``).

    A learned router that would get no gradient from the task loss is refused with a ``ValueError`` unless
    ``allow_router_without_task_gradient=True`` asks for it as an ablation (:mod:`headmix.routing.task_gradient`):
    ``head_weighting="renormalized"`` with ``top_k=1`` (the selected head weighs ``a_r * k * p_i / sum_TopK p =
    a_r``: the probabilities cancel; use ``top_k >= 2`` or ``"paper"`` / ``"scaled"``), and one routed head (per
    group), whose softmax is the constant 1. One shared head is allowed: its softmax ``s`` is also the constant 1
    (``W_s`` gets no gradient), but that head is always on and ``[a_s, a_r]`` still learns: harmless.

    ``router="random"`` is the random-routing control (:mod:`headmix.routing.random`): each token's ``top_k``
    routed heads (per group with ``route_per_group``) drawn uniformly at random (``router_seed``, or a seed drawn
    at construction), the weights ``head_weighting`` gives at equal router scores (``W_r = W_s = W_h = 0``:
    with the default ``"renormalized"`` every active head, shared or routed, weighs 1), no router parameters and
    no auxiliary loss (``aux_loss`` zero, ``losses`` empty).

    ``router="query_norm"`` is the router of the MoH authors' MoH-LLaMA3 (SkyworkAI/MoH,
    ``MoH-LLaMA3/Inference_code/modeling_llama.py``), which has no parameters: for each token, routed head
    ``i``'s score is the L2 norm of its query ``||x W_q^i + b_q^i||`` (the query projection's output, before
    rotary and before any QK-norm) divided by the unbiased standard deviation of those norms over the token's
    routed heads (of its group with ``route_per_group``); ``p`` is the softmax of the scores over the routed
    heads and the ``top_k`` largest are selected; every active head, shared or selected, weighs 1 (a 0/1 mask,
    so no gradient reaches the rule) and there is no auxiliary loss. Dividing by a positive per-token constant
    keeps the order and the softmax is monotone, so the selection is the top ``k`` of the norms themselves,
    which is what the layer computes (``routing.logits`` holds the scores, ``routing.probs`` their softmax).
    Fewer than 2 routed heads (per group) have no standard deviation, and equal norms a zero one: the scores
    are then 0 (``p`` uniform), and the choice among equal norms is ``torch.topk``'s (by position). The rule
    reads every routed head's query, so the sparse path computes the whole query projection and skips only
    the unselected heads' attention rows and output projections. Its weights are fixed at 1, which is
    ``head_weighting="renormalized"`` at equal scores; ``"paper"`` and ``"scaled"`` would rescale the heads by
    constants that the rule does not have, and are refused.
    """

    repr_sizes = ("embed_dim", "num_heads", "num_shared_heads", "top_k", "head_dim", "key_dim")

    def __init__(self, embed_dim: int, num_heads: int, num_shared_heads: int, top_k: int, head_dim: int | None = None,
                 *, bias: bool = True, dropout: float = 0.0, load_balance_weight: float = 0.01,
                 q_bias: bool | None = None, kv_bias: bool | None = None, out_bias: bool | None = None,
                 rotary: bool | RotaryEmbedding = False, rotary_base: float = 10000.0, rotary_fraction: float = 1.0,
                 head_weighting: str = "renormalized", load_balance_fractions: str = "normalized",
                 zero_padded_queries: bool = False, impl: str = "auto", expert_impl: str = "auto",
                 kv_heads: int | None = None, qk_norm: bool = False, qk_norm_eps: float = QK_NORM_EPS,
                 output_gate: str | None = None, route_per_group: bool = False, router: str = "softmax",
                 router_seed: int | None = None, allow_router_without_task_gradient: bool = False):
        super().__init__(embed_dim, num_heads, head_dim=head_dim, bias=bias, dropout=dropout,
                         q_bias=q_bias, kv_bias=kv_bias, out_bias=out_bias, rotary=rotary,
                         rotary_base=rotary_base, rotary_fraction=rotary_fraction, zero_padded_queries=zero_padded_queries,
                         kv_heads=kv_heads, qk_norm=qk_norm, qk_norm_eps=qk_norm_eps, output_gate=output_gate)
        self.route_per_group = check_flag("route_per_group", route_per_group)
        if route_per_group and kv_heads is None:
            raise ValueError("route_per_group needs kv_heads (the GQA groups to route in)")
        #: The router's groups: the K/V groups with route_per_group, else one group of every head.
        self.route_groups = self.kv_heads if route_per_group else 1
        group_heads = num_heads // self.route_groups
        where = " per group (route_per_group)" if route_per_group else ""
        for name, v in (("num_shared_heads", num_shared_heads), ("top_k", top_k)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        if num_shared_heads > group_heads:
            limit = f"the {group_heads} heads{where}" if route_per_group else f"num_heads ({num_heads})"
            raise ValueError(f"num_shared_heads ({num_shared_heads}) must not exceed {limit}")
        routed_per_group = group_heads - num_shared_heads
        routed = routed_per_group * self.route_groups
        if routed == 0 and top_k != 0:
            raise ValueError(f"top_k must be 0 when every head is shared (num_shared_heads = {num_shared_heads}{where}), got {top_k}")
        if routed > 0 and not 1 <= top_k <= routed_per_group:
            raise ValueError(
                f"top_k must be between 1 and the number of routed heads{where}, {group_heads} - num_shared_heads "
                f"{num_shared_heads} = {routed_per_group}; got {top_k}")
        #: Query heads in the order the sparse path and the weights use them: shared ones, routed ones.
        self.shared_head_ids, self.routed_head_ids = head_ids(self.route_groups, group_heads, num_shared_heads)
        if load_balance_weight < 0:
            raise ValueError(f"load_balance_weight must be >= 0, got {load_balance_weight}")
        if head_weighting not in HEAD_WEIGHTINGS:
            raise ValueError(f"head_weighting must be one of {HEAD_WEIGHTINGS}, got {head_weighting!r}")
        check_router_learns(moh_router_without_task_gradient(routed_per_group, top_k, head_weighting, router,
                                                             route_per_group),
                            allow_router_without_task_gradient, "MoH routed per K/V group" if route_per_group else "MoH")
        check_fractions(load_balance_fractions)
        if impl not in MOH_IMPLS:
            raise ValueError(f"impl must be one of {MOH_IMPLS}, got {impl!r}")
        if expert_impl not in IMPLS:
            raise ValueError(f"expert_impl must be one of {IMPLS}, got {expert_impl!r}")
        self.impl, self.expert_impl = impl, expert_impl
        self.num_shared_heads, self.num_routed_heads, self.top_k = num_shared_heads, routed, top_k
        self.num_routed_per_group = routed_per_group
        self.load_balance_weight = load_balance_weight
        self.head_weighting, self.load_balance_fractions = head_weighting, load_balance_fractions
        self.routed_gate = self.shared_gate = self.group_gate = self.random_router = None
        self.random_routing = check_random_router(router, ROUTERS)
        #: MoH-LLaMA3's parameter-free rule (see the class docstring): no router parameters, weights 0/1.
        self.query_norm_routing = router == "query_norm"
        if self.query_norm_routing and head_weighting != "renormalized":
            raise ValueError(f"head_weighting must be 'renormalized' with router='query_norm' (the rule weighs every "
                             f"active head 1), got {head_weighting!r}")
        if routed and self.random_routing:
            self.random_router = RandomRouter(routed_per_group, top_k, self.route_groups, router_seed)
        elif routed and not self.query_norm_routing:
            self.routed_gate = nn.Linear(embed_dim, routed, bias=False)
            nn.init.normal_(self.routed_gate.weight, std=embed_dim ** -0.5 * 0.1)
            if num_shared_heads:
                self.shared_gate = nn.Linear(embed_dim, num_shared_heads * self.route_groups, bias=False)
                self.group_gate = nn.Linear(embed_dim, 2 * self.route_groups, bias=False)
                nn.init.zeros_(self.shared_gate.weight)
                nn.init.zeros_(self.group_gate.weight)

    @property
    def slot_form(self) -> bool:
        """Whether every token selects the same number of routed heads in each K/V group (``route_per_group``,
        or one K/V head), so that the sparse path runs the selected heads as the query heads of one
        grouped-query attention call (:func:`~headmix.attention.moh_sparse.routed_layout`)."""
        return bool(self.route_per_group or self.kv_heads == 1)

    def _head_blocks(self, weight: Tensor, size: int, dim: int) -> tuple[Tensor | None, Tensor]:
        """The shared and the routed heads' blocks of a per-head weight (:func:`_head_blocks`)."""
        return _head_blocks(weight, self.route_groups, self.num_shared_heads, size, dim)

    def routed_queries(self, x: Tensor, rows: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
        """The routed heads' queries ``x W_q^i + b_q^i`` ``(N, R, key_dim)`` (``N = batch * time``), heads in
        :attr:`routed_head_ids` order: what ``router="query_norm"`` reads (before rotary and QK-norm). ``rows``,
        ``bias``: the routed heads' rows of ``W_q`` and ``b_q`` where the caller has them (cast already); by
        default the layer's, its weight cast whole under autocast (not its routed rows apart)."""
        if rows is None:
            compute = autocast_dtype(x)
            w_q, b_q = (None if t is None else t.to(compute or t.dtype) for t in (self.q_proj.weight, self.q_proj.bias))
            rows = self._head_blocks(w_q, self.key_dim, 0)[1]
            bias = None if b_q is None else self._head_blocks(b_q, self.key_dim, 0)[1]
        return F.linear(x.reshape(-1, x.shape[-1]), rows, bias).view(-1, self.num_routed_heads, self.key_dim)

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None, is_causal: bool = False,
                use_cache: bool = False, cache: KVCache | None = None, query_padding_mask: Tensor | None = None) -> AttentionOutput:
        """Multi-head attention of ``query`` ``(B, T, embed_dim)`` over ``key`` / ``value`` (``None``:
        self-attention) in which each token uses the ``num_shared_heads`` shared heads and ``top_k`` of the
        routed heads, the heads' outputs weighted as ``head_weighting`` says (MoH, Jin et al. 2024, eq. 3; weights eq. 5-6)
        before ``out_proj``. Returns an :class:`AttentionOutput`: ``output`` ``(B, T, embed_dim)``, ``routing``
        (the routed heads each token chose and their weights), ``aux_loss`` (the weighted load-balancing loss).
        Masks: ``key_padding_mask`` ``(B, S)``, ``attn_mask`` ``(T, S)`` (or per batch / head), ``is_causal``,
        ``query_padding_mask`` ``(B, T)``, with ``torch.nn.MultiheadAttention``'s conventions (``True`` =
        padding / forbidden; see :mod:`headmix.attention.base`); ``use_cache`` returns the new ``cache``."""
        query, key, value = self._check_inputs(query, key, value)  # layer(x, x, x) is layer(x)
        impl = (choose_moh_impl(query.device, self.top_k, self.num_routed_per_group, query.shape[1], self.slot_form,
                                self.head_dim, torch.is_grad_enabled())
                if self.impl == "auto" else self.impl)  # top_k of each router group's routed heads
        if impl == "sparse" and self.num_routed_heads:
            return self._forward_sparse(query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                        is_causal=is_causal, use_cache=use_cache, cache=cache,
                                        query_padding_mask=query_padding_mask)
        projected = routed_q = None
        if self.query_norm_routing and self.num_routed_heads:  # the rule reads the query projection's output
            projected = self.q_proj(query)
            routed_q = projected.view(-1, self.num_heads, self.key_dim)[:, self.routed_head_ids]
        q, k, v, new_cache, (bias, empty, causal) = self._heads_and_masks(
            query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal,
            use_cache=use_cache, cache=cache, projected_queries=projected)
        o = scaled_dot_product(q, k, v, bias, empty, self.dropout if self.training else 0.0, causal=causal)
        token_mask = real_token_mask(query, key, key_padding_mask, query_padding_mask, cache)
        route = (self.route(query, token_mask, query_offset(cache), routed_q, dense=True)
                 if self.num_routed_heads else None)
        o = self._gate_heads(o, query)
        if route is not None:
            o = o * route.head_weights.transpose(1, 2).unsqueeze(-1)
        y = self.out_proj(merge_heads(o))
        if self.zero_padded_queries:
            y = zero_padded_queries(y, token_mask)
        if route is None:
            return AttentionOutput(y, zero_loss(query), new_cache)
        return self._output(y, new_cache, route.routing, route.losses)

    def _output(self, y: Tensor, cache: KVCache | None, routing: Routing,
                losses: tuple[Tensor, Tensor] | None = None) -> AttentionOutput:
        """The layer's output with its auxiliary loss: the load-balancing loss (MoA eq. 13-15) over the routed
        heads, weighted by ``load_balance_weight``; none (zero) with ``router="random"`` or ``"query_norm"``.
        With ``route_per_group``, the mean over the groups of each group's loss (each group's router is balanced
        over its own heads): :func:`~headmix.routing.losses.weighted_load_balance`, whose backward is written by
        hand; ``losses`` where the fused router computed them."""
        if self.random_routing or self.query_norm_routing:
            return AttentionOutput(y, zero_loss(y), cache, routing)
        aux, lb = losses or weighted_load_balance(routing.probs, routing.expert_index, routing.token_mask,
                                                  self.load_balance_weight, self.load_balance_fractions,
                                                  self.route_groups)
        return AttentionOutput(y, aux, cache, routing, {"load_balance": lb})

    def _forward_sparse(self, query: Tensor, key: Tensor | None, value: Tensor | None, *,
                        key_padding_mask: Tensor | None, attn_mask: Tensor | None, is_causal: bool, use_cache: bool,
                        cache: KVCache | None, query_padding_mask: Tensor | None) -> AttentionOutput:
        """``impl="sparse"``: each token's active heads only, ``y_t = sum_{i in A(t)} g_i H^i W_O^i`` over the shared
        heads and the token's selected routed heads ``A(t)`` (MoH eq. 3, summation form, the unselected heads' zero
        terms skipped). The active heads are the token's slots (:class:`HeadRoute`), the shared ones included: one
        grouped query projection, one attention call and one grouped output projection with the weights ``g``
        (:mod:`headmix.kernels`, ``expert_impl``), every head an expert whose rows are the tokens that use it. With
        global routing over several K/V heads (not :attr:`slot_form`) the shared heads run apart
        (:meth:`_shared_heads`) in training and prefill."""
        batch, tgt, dim = query.shape
        k, v, new_cache, past_len = self._keys_values(query, key, value, use_cache, cache)
        token_mask = real_token_mask(query, key, key_padding_mask, query_padding_mask, cache)
        compute = autocast_dtype(query) or query.dtype
        n, heads, dk, dv = batch * tgt, self.num_heads, self.key_dim, self.head_dim
        # Under autocast each weight is cast whole, once per call (as autocast casts a dense layer's weights).
        w_q, b_q, w_o = (None if t is None else t.to(compute)
                         for t in (self.q_proj.weight, self.q_proj.bias, self.out_proj.weight))
        x = query.reshape(n, dim).to(compute)
        decoding = tgt == 1
        q_every = None
        if decoding or self.query_norm_routing:
            # A decoding step's projection is a matrix-vector product per token, which reads every head's weights
            # whichever heads it keeps, and router="query_norm" reads every routed head's query: one GEMM of every
            # head, the active heads kept (the attention below reads only their cache slices).
            q_every = F.linear(x, w_q, b_q)
        routed_q = (self._head_blocks(q_every, dk, 1)[1].reshape(n, self.num_routed_heads, dk)
                    if self.query_norm_routing else None)
        route = self.route(query, token_mask, past_len, routed_q)
        slot_heads, slot_weights = route.slot_heads, route.slot_weights
        bias, empty, causal = attention_bias(batch, heads, tgt, k.shape[2], key_padding_mask=key_padding_mask,
                                             attn_mask=attn_mask, is_causal=is_causal, past_len=past_len,
                                             dtype=k.dtype, device=k.device)
        masks = (_four_dims(bias), _four_dims(empty), causal, self.dropout if self.training else 0.0)
        gates_all = self.output_gates(query)  # Gated Attention G1, (batch, time, heads, 1 or d_v), or None
        if gates_all is not None:
            gates_all = gates_all.reshape(n, heads, -1)
        y_shared = None
        if not (self.slot_form or decoding) and self.num_shared_heads:
            # Global routing over several K/V heads: the selected routed heads' attention is the "heads" layout,
            # which pads each head's rows to the largest head's count (a shared head's would be every token's),
            # so the shared heads run apart, as multi-head attention of whole GEMMs.
            s = self.num_shared_heads
            y_shared = self._shared_heads(x, q_every, (w_q, b_q, w_o), k, v, masks, slot_weights[:, :s], gates_all,
                                          (batch, tgt), key, cache, past_len)
            # the routed heads S .. H-1 are the experts, numbered from 0 (the routing's numbers)
            first, slot_heads, slot_weights = s, route.routing.expert_index, slot_weights[:, s:]
        else:
            first = 0
        experts, slots_per_token = heads - first, slot_heads.shape[1]
        expert_impl = self.expert_impl
        if expert_impl == "auto" and first == 0 and self.num_shared_heads and not decoding:
            expert_impl = shared_slots_impl(query.device, n * slots_per_token, experts, slots_per_token, compute)
        if first:  # the experts' rows of W_q, b_q and columns of W_O (no slice without shared heads apart: its
            # backward would be a zero-filled copy)
            w_q, b_q, w_o = w_q[first * dk:], None if b_q is None else b_q[first * dk:], w_o[:, first * dv:]
        info = None if decoding else expert_routing(slot_heads, experts, check_range=False)
        if q_every is not None:
            q = q_every.view(n, heads, dk)[:, first:].gather(1, slot_heads[..., None].expand(n, slots_per_token, dk))
        else:  # head i's W_q^i (d_k, d_model) read in place by the grouped kernels as its transpose (no copy)
            q = expert_map(x, w_q.view(experts, dk, dim).transpose(1, 2), info, impl=expert_impl)
            if b_q is not None:
                q = q + b_q.view(experts, dk)[slot_heads]
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.rotary is not None and key is None and not (cache is not None and cache.static):
            positions = (torch.arange(n, device=query.device) % tgt + past_len)[:, None].expand(n, slots_per_token)
            q = self.rotary.rotate_at(q, positions)
        bias, empty, causal, dropout = masks
        if routed_layout(self.slot_form, tgt, query) == "grouped_query":
            # Each token's slots of K/V group g (its shared heads, then its selected ones) read K/V head g whichever
            # heads they are: the slots are the query heads of grouped-query attention (moh_sparse, "grouped_query").
            o = slot_attention(q.to(k.dtype).view(batch, tgt, slots_per_token, dk), k, v,
                               slot_heads.view(batch, tgt, slots_per_token), bias=bias, empty_rows=empty,
                               causal=causal, dropout=dropout).reshape(n, slots_per_token, dv)
        else:
            o = routed_heads_attention(q.to(k.dtype), _kv_of_heads(k, first, heads, heads),
                                       _kv_of_heads(v, first, heads, heads),
                                       slot_heads, batch, tgt, bias=_mask_heads(bias, first, heads),
                                       empty_rows=_mask_heads(empty, first, heads), causal=causal, dropout=dropout,
                                       routed_heads=experts)
        if gates_all is not None:
            o = o * gates_all[:, first:].gather(1, slot_heads[..., None].expand(-1, -1, gates_all.shape[-1])).to(
                o.dtype)
        weights = slot_weights.to(compute)
        if decoding:
            weighted = o.to(compute) * weights[..., None]
            every = weighted.new_zeros(n, heads, dv).scatter(1, slot_heads[..., None].expand(n, slots_per_token, dv),
                                                             weighted)
            y = F.linear(every.view(n, heads * dv), w_o)
        else:  # head i's W_o^i (d_model, d_v) read in place as its transpose
            y = expert_reduce(o.to(compute), w_o.view(dim, experts, dv).permute(1, 2, 0), weights,
                              info, impl=expert_impl)
        y = y.view(batch, tgt, dim) if y_shared is None else (y + y_shared).view(batch, tgt, dim)
        if self.out_proj.bias is not None:
            y = y + self.out_proj.bias.to(y.dtype)
        if self.zero_padded_queries:
            y = zero_padded_queries(y, token_mask)
        return self._output(y, new_cache, route.routing, route.losses)

    def _shared_heads(self, x: Tensor, q_every: Tensor | None, weights: tuple[Tensor, Tensor | None, Tensor], k: Tensor,
                      v: Tensor, masks: tuple, shared_weights: Tensor, gates: Tensor | None, sizes: tuple[int, int],
                      key: Tensor | None, cache: KVCache | None, past_len: int | Tensor) -> Tensor:
        """``sum_{i shared} g_i H^i W_O^i`` ``(N, d_model)`` of global routing's shared heads ``0 .. S-1`` (one group)
        as multi-head attention: one GEMM of their queries (or their part of ``q_every``), one attention call, one
        GEMM of their output projection. ``weights``: ``W_q``, ``b_q``, ``W_O`` cast already; ``masks``: the
        layer's ``(bias, empty rows, causal, dropout)``; ``shared_weights`` ``(N, S)``: their ``g``; ``gates``: the
        Gated Attention gates ``(N, heads, 1 or d_v)`` or None."""
        (w_q, b_q, w_o), (bias, empty, causal, dropout) = weights, masks
        (batch, tgt), s, dk, dv = sizes, self.num_shared_heads, self.key_dim, self.head_dim
        n = batch * tgt
        q_s = q_every[:, :s * dk] if q_every is not None else F.linear(x, w_q[:s * dk], None if b_q is None else
                                                                        b_q[:s * dk])
        q_s = q_s.view(batch, tgt, s, dk).transpose(1, 2)
        if self.q_norm is not None:
            q_s = self.q_norm(q_s)
        q_s = self._rotate_queries(q_s, key, cache, past_len)
        o = scaled_dot_product(q_s.to(k.dtype), _kv_of_heads(k, 0, s, self.num_heads),
                               _kv_of_heads(v, 0, s, self.num_heads), _mask_heads(bias, 0, s),
                               _mask_heads(empty, 0, s), dropout, causal=causal).transpose(1, 2).reshape(n, s, dv)
        if gates is not None:
            o = o * gates[:, :s].to(o.dtype)
        o = o.to(x.dtype) * shared_weights.to(x.dtype)[..., None]
        return F.linear(o.reshape(n, s * dv), w_o[:, :s * dv])


def shared_slots_impl(device: torch.device, num_slots: int, num_experts: int, top_k: int,
                      dtype: torch.dtype) -> str:
    """The grouped kernels' ``auto`` choice for sparse MoH whose shared heads are slots (the slot form): an expert
    that every token uses holds all ``N`` rows, which ``sorted`` (:func:`~headmix.kernels.choose_impl`'s CPU
    choice with gradients on several threads) gathers into a copy each call, where ``grouped_cpp`` reads them in
    place; so ``grouped_cpp`` wherever ``auto`` would pick ``sorted`` with gradients. MoH with one K/V head (2
    shared + top 2 of 6, d_model 128, batch 8 x 512; 4 shared + top 4 of 12, d_model 1024, T 1024), forward +
    backward, two threads, interleaved in one process, idle 2-core Intel Xeon, 2026-12-08, the shared heads as
    slots over the shared heads apart (whole GEMMs) with ``sorted``: 1.31x and 1.09x; with ``grouped_cpp``:
    1.04x and 1.00x, and 1.09x and 1.02x over the apart layer on ``auto`` (docs/performance.md, "MoH on one
    router operation")."""
    choice = choose_impl(device, num_slots, num_experts, top_k, torch.is_grad_enabled(), dtype)
    return "grouped_cpp" if choice == "sorted" and torch.is_grad_enabled() else choice


def _four_dims(mask: Tensor | None) -> Tensor | None:
    """A mask broadcastable to ``(batch, heads, T, X)`` with its four dimensions: ``(T, X)`` is ``(1, 1, T, X)``."""
    return None if mask is None else mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _mask_heads(mask: Tensor | None, start: int, stop: int) -> Tensor | None:
    """Query heads ``start .. stop-1`` of a mask ``(B, 1 or heads, T, X)``."""
    return mask if mask is None or mask.shape[1] == 1 else mask[:, start:stop]


def _kv_of_heads(t: Tensor, start: int, stop: int, num_heads: int) -> Tensor:
    """The keys or values that query heads ``start .. stop-1`` of ``num_heads`` read from ``t`` ``(B, G, S, d)``
    (query head ``h`` reads K/V head ``h // (num_heads / G)``), laid out for grouped-query attention of those heads
    (the ``i``-th reads returned head ``i // (count / G')``): a slice where they fill whole groups, else each K/V
    head repeated for its query heads (one copy; no index tensor built from the head numbers)."""
    per = num_heads // t.shape[1]
    low, high = start // per, -(-stop // per)
    if start % per == 0 and stop % per == 0:
        return t[:, low:high]
    batch, used, length, width = t.shape[0], high - low, t.shape[2], t.shape[3]
    repeated = t[:, low:high, None].expand(batch, used, per, length, width).reshape(batch, used * per, length, width)
    return repeated[:, start - low * per:stop - low * per]


def _head_blocks(weight: Tensor, groups: int, shared: int, size: int, dim: int) -> tuple[Tensor | None, Tensor]:
    """The rows (``dim=0``) or columns (``dim=1``) of the shared and of the routed query heads (:func:`head_ids`:
    ``groups`` groups of equal size, the first ``shared`` heads of each shared) in a per-head weight (``size``
    each), split in one operation (its backward is one concatenation; a slice per block would cost a
    zero-filled copy each and their sum): views with one group, a copy of each block with several (no index
    tensor built from the head numbers, which would be a host-to-device copy on a GPU). The shared block is None
    without shared heads."""
    if not shared:
        return None, weight
    group_size = weight.shape[dim] // groups
    blocks = weight.unflatten(dim, (groups, group_size)) if groups > 1 else weight
    at = dim + 1 if groups > 1 else dim
    shared_block, routed_block = blocks.split([shared * size, group_size - shared * size], at)
    if groups == 1:
        return shared_block, routed_block
    return shared_block.contiguous().flatten(dim, at), routed_block.contiguous().flatten(dim, at)
