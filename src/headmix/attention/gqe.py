"""GQE: Grouped Query Experts, mixture-of-experts on the query heads of grouped-query attention (Tripathi,
Kumar 2026, arXiv 2606.20945; the authors' code: FrontiersMindAI/GQE on GitHub, ``gqe/gqe.py``,
``GQEAttention``).

Grouped-query attention has ``G`` K/V heads, each shared by a group of query heads. GQE makes the query heads
of each group ``M`` experts: per token and group a router takes the softmax of the group's ``M`` logits and
keeps the top ``k``; only those ``k G`` query heads are computed, each attending over its group's K/V head,
which stays dense (the KV cache is GQA's). The output (the paper's eq. 6) is ``Concat(O, o_bar, s) W_O``:

- ``O``: the ``k G`` selected heads' outputs, unscaled ("hard slots");
- ``o_bar = sum w o``: one weighted-sum slot over the same ``k G`` outputs, ``w = p / sum_selected p`` (``p``
  the router's per-group softmax; the sum over all selected heads of all groups): the router's only
  differentiable path from the task loss;
- ``s``: an always-on shared head, attending over the mean of the ``G`` K/V heads (the authors' code).

``W_O`` therefore has ``(k G + 2) d_h`` inputs. The main setting is 16 experts on 8 K/V heads, ``k = 1``: 9 of
16 query-attention computations. With weights copied, the layer equals the authors' ``GQEAttention`` for its
three variants (``tests/test_gqe_authors.py``); :data:`AUTHORS_OPTIONS` gives the authors' initialisation,
biases and loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.fused_router import fused_router_applies, softmax_topk_route
from ..routing import Routing
from ..routing.losses import check_fractions, weighted_load_balance
from ..routing.random import RandomRouter, check_random_router
from ..routing.router import router_dtype
from ..routing.task_gradient import check_router_learns, gqe_router_without_task_gradient
from .base import (AttentionLayer, AttentionOutput, KVCache, attention_bias, check_experts, check_mask_dtype,
                   check_positive, scaled_dot_product, zero_loss)
from .mha import resolve_bias, split_heads
from .padding import check_flag, real_token_mask, zero_padded_queries
from .rotary import RotaryEmbedding, make_rotary

#: How the hard slots are scaled: ``"none"`` (the paper's GQE, unscaled) or ``"p"`` (each selected head's output
#: times its router probability: Table 2's "weighted concat" ablation).
HARD_SLOT_SCALES = ("none", "p")
GQE_ROUTERS = ("softmax", "random")
#: The shared head's K/V: ``"mean"`` (the mean of the ``G`` K/V heads, the authors' code) or ``"head0"`` (K/V
#: head 0, headmix's form before the authors' code was read: layers and configs stored without the option).
SHARED_HEAD_KVS = ("mean", "head0")
#: The router's initial weights: ``"normal"`` (std ``0.1 / sqrt(d_model)``, as MoH's) or ``"zero"`` (the authors').
ROUTER_INITS = ("normal", "zero")
#: The projections' initial weights: ``"default"`` (``torch.nn.Linear``'s) or ``"xavier_uniform"`` (the authors':
#: Xavier-uniform ``W_q`` of the experts, ``W_q`` of the shared head, ``W_k``, ``W_v``, ``W_O``; biases zero).
WEIGHT_INITS = ("default", "xavier_uniform")
#: The GQE authors' layer (FrontiersMindAI/GQE, ``GQEAttention``) as headmix options, beside the defaults they share
#: (the shared head over the K/V heads' mean, ``load_balance_weight`` 0.01): no biases, the router initialised at
#: zero, Xavier-uniform projections, the Switch-style load-balancing fractions (``top_k`` per group). Both
#: ``GroupedQueryExpertsAttention(d, **AUTHORS_OPTIONS)`` and ``AttentionConfig(kind="gqe", **AUTHORS_OPTIONS)``.
AUTHORS_OPTIONS = dict(bias=False, router_init="zero", weight_init="xavier_uniform", load_balance_fractions="per_token")


class GroupedQueryExpertsAttention(AttentionLayer):
    """Grouped Query Experts (arXiv 2606.20945): ``num_experts`` query-head experts on ``kv_heads`` K/V heads,
    ``M = num_experts / kv_heads`` per group, ``top_k`` (``k``) of each group's ``M`` selected per token.

    With ``x_t`` the query input, ``G = kv_heads`` and ``d_h = head_dim``:

    - router (per group ``g``): ``p_{t,g} = softmax(x_t W_r^g)`` over the group's ``M`` experts, the selected
      set ``TopK(p_{t,g}, k)``;
    - expert ``e`` of group ``g`` owns its query projection ``W_q^{g,e}`` (``d_model x d_h``); all of a group's
      experts attend over the group's K/V head ``K W_k^g``, ``V W_v^g``;
    - slots: slot ``(g, j)``, ``j < k``, holds the output ``o_{t,g,j}`` of the ``j``-th expert token ``t``
      selected in group ``g``, **in decreasing order of** ``p`` (the order ``torch.topk`` returns; the random
      control: the random router's order, itself random). The order fixes what each block of ``W_O`` reads:
      block ``(g, j)`` reads "the token's ``j``-th choice in group ``g``", whichever expert that is. Rank order
      was chosen over ascending expert index because every expert can then fill every slot (with ascending
      index and ``k = 2`` of ``M = 4``, expert 0 could only ever fill slot 0) and because it is what top-k
      gives; at the main setting ``k = 1`` the two orders coincide;
    - ``y_t = Concat(o_{t,0,0} .. o_{t,G-1,k-1}, o_bar_t, s_t) W_O + b_O`` with the slots group-major,
      ``o_bar_t = sum_{g,j} w_{t,g,j} o_{t,g,j}``, ``w_{t,g,j} = p_{t,g,e_j} / sum_{g',j'} p_{t,g',e_j'}``
      (the gradient flows through the denominator too) and ``s_t`` the shared head's output.

    Options (the paper's Table 2 ablations): ``weighted_slot=False`` drops ``o_bar`` (hard slots only: then the
    router gets no gradient from the task loss, as the paper finds, so with unscaled hard slots it is refused
    unless ``allow_router_without_task_gradient=True`` asks for it as an ablation,
    :mod:`headmix.routing.task_gradient`); ``weighted_slot_renormalize=False`` takes
    ``w = p`` (the weighted slot without renormalisation); ``shared_head=False`` drops ``s``;
    ``hard_slot_scale="p"`` multiplies each hard slot by its ``p``. ``W_O`` has ``(k G + [weighted_slot] +
    [shared_head]) d_h`` inputs.

    Choices the paper leaves open, settled by the authors' code where it settles them (see
    ``docs/implementations.md``):

    - **the shared head's K/V** (``shared_head_kv``): ``"mean"`` (default, the authors' code: ``key.mean``,
      ``value.mean`` over the ``G`` K/V heads, the keys after rotary, as cached) or ``"head0"`` (K/V head 0,
      group 0's: headmix's form before the authors' code was read; a config stored without the option loads
      as it). Its own query projection is the last ``d_h`` rows of ``q_proj`` (the authors' ``q_shared``). It
      adds no K/V head, so the KV cache stays GQA's ``G`` heads (the mean is taken from the cached heads: ``2 G
      d_h`` additions per cached position, each call); it costs one query-head attention, the paper's count (9 =
      8 + 1 at the main setting), as a second attention call beside the slots' one.
    - **the auxiliary loss**: the load-balancing loss (MoA eq. 13-15) of each group's router over its ``M``
      experts, averaged over the groups, weighted by ``load_balance_weight`` (default 0.01, MoA's, MoH's and the
      authors'); no z-loss. ``load_balance_fractions`` as MoH (the authors' loss: ``"per_token"``).
    - **the router's input**: the layer's query input ``x_t`` (as MoA, MoH and the authors), ``W_r`` without
      bias, initialised small (``router_init="normal"``: std ``0.1 / sqrt(d_model)``, as MoH's) or at zero
      (``"zero"``, the authors'), so a fresh router is (near) uniform.
    - **initialisation** (``weight_init``): ``"default"`` (``torch.nn.Linear``'s) or ``"xavier_uniform"`` (the
      authors': the experts' ``W_q`` and the shared head's ``W_q`` each as its own matrix, ``W_k``, ``W_v``,
      ``W_O``; biases zero).
    - **rotary** (``rotary``, ``rotary_fraction``): on every query head (the slots, the shared head) at the
      token's position and on the ``G`` keys, as in GQA; no QK-norm (the paper names none).
    - **biases**: ``bias`` / ``q_bias`` / ``kv_bias`` / ``out_bias`` as :class:`MultiHeadAttention` (the
      project's layers default to biases on; Llama-style models and the authors set them off).

    :data:`AUTHORS_OPTIONS` sets all of the authors' choices that are not headmix's defaults.

    ``router="random"`` is the random-routing control (:mod:`headmix.routing.random`): each token's ``k``
    experts per group drawn at random (``router_seed``), no router parameters, no auxiliary loss, and
    ``p = 1/M`` for every expert, so the weighted slot is the plain mean ``1/(k G)`` of the selected heads.

    ``attn_mask`` may be ``(T, S)`` or ``(B, T, S)`` (or 4-d with a head dimension of 1): a per-head mask has no
    meaning when a token's heads vary. ``routing`` (returned, not stored): ``expert_index`` ``(B*T, G k)`` the
    selected experts numbered ``g M + e``, slot order; ``gates`` the weighted slot's ``w``; ``probs`` ``(B*T,
    G M)`` the per-group softmaxes side by side.
    """

    repr_sizes = ("embed_dim", "num_experts", "kv_heads", "top_k", "head_dim")

    def __init__(self, embed_dim: int, num_experts: int = 16, kv_heads: int = 8, top_k: int = 1,
                 head_dim: int | None = None, *, weighted_slot: bool = True, weighted_slot_renormalize: bool = True,
                 shared_head: bool = True, hard_slot_scale: str = "none", bias: bool = True,
                 q_bias: bool | None = None, kv_bias: bool | None = None, out_bias: bool | None = None,
                 dropout: float = 0.0, rotary: bool | RotaryEmbedding = False, rotary_base: float = 10000.0,
                 rotary_fraction: float = 1.0, router: str = "softmax", router_seed: int | None = None,
                 load_balance_weight: float = 0.01, load_balance_fractions: str = "normalized",
                 zero_padded_queries: bool = False, allow_router_without_task_gradient: bool = False,
                 shared_head_kv: str = "mean", router_init: str = "normal", weight_init: str = "default"):
        super().__init__(embed_dim)
        check_positive("num_experts", num_experts)
        check_positive("kv_heads", kv_heads)
        if num_experts % kv_heads:
            raise ValueError(f"kv_heads ({kv_heads}) must divide num_experts ({num_experts}): each K/V head has "
                             f"num_experts / kv_heads query-head experts")
        per_group = num_experts // kv_heads
        if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > per_group:
            raise ValueError(f"top_k ({top_k}) must not exceed the experts per group, num_experts / kv_heads = {per_group}")
        check_experts(per_group, top_k)
        if head_dim is None:
            if embed_dim % num_experts:
                raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_experts ({num_experts}) when "
                                 f"head_dim is not given")
            head_dim = embed_dim // num_experts
        check_positive("head_dim", head_dim)
        self.weighted_slot = check_flag("weighted_slot", weighted_slot)
        self.weighted_slot_renormalize = check_flag("weighted_slot_renormalize", weighted_slot_renormalize)
        self.shared_head = check_flag("shared_head", shared_head)
        for name, value, choices in (("hard_slot_scale", hard_slot_scale, HARD_SLOT_SCALES),
                                     ("shared_head_kv", shared_head_kv, SHARED_HEAD_KVS),
                                     ("router_init", router_init, ROUTER_INITS),
                                     ("weight_init", weight_init, WEIGHT_INITS)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if isinstance(load_balance_weight, bool) or not isinstance(load_balance_weight, (int, float)) \
                or load_balance_weight < 0:
            raise ValueError(f"load_balance_weight must be a non-negative number, got {load_balance_weight!r}")
        check_fractions(load_balance_fractions)
        self.random_routing = check_random_router(router, GQE_ROUTERS)
        check_router_learns(gqe_router_without_task_gradient(per_group, weighted_slot, hard_slot_scale, router,
                                                             top_k * kv_heads, weighted_slot_renormalize),
                            allow_router_without_task_gradient, "GQE")
        self.num_experts, self.kv_heads, self.top_k, self.head_dim = num_experts, kv_heads, top_k, head_dim
        self.experts_per_group = per_group
        self.hard_slot_scale, self.dropout = hard_slot_scale, dropout
        self.shared_head_kv, self.router_init, self.weight_init = shared_head_kv, router_init, weight_init
        self.load_balance_weight, self.load_balance_fractions = float(load_balance_weight), load_balance_fractions
        #: W_O's input blocks: the k G hard slots, the weighted-sum slot, the shared head.
        self.num_slots = top_k * kv_heads + int(weighted_slot) + int(shared_head)
        q_bias, kv_bias, out_bias = (resolve_bias(n, b, bias) for n, b in
                                     (("q_bias", q_bias), ("kv_bias", kv_bias), ("out_bias", out_bias)))
        # rows g M d_h + e d_h .. : expert e of group g's W_q^{g,e}; the last d_h rows: the shared head's
        self.q_proj = nn.Linear(embed_dim, (num_experts + int(shared_head)) * head_dim, bias=q_bias)
        self.k_proj = nn.Linear(embed_dim, kv_heads * head_dim, bias=kv_bias)
        self.v_proj = nn.Linear(embed_dim, kv_heads * head_dim, bias=kv_bias)
        self.out_proj = nn.Linear(self.num_slots * head_dim, embed_dim, bias=out_bias)
        self.router_gate = self.random_router = None
        if self.random_routing:
            self.random_router = RandomRouter(per_group, top_k, kv_heads, router_seed)
        else:
            self.router_gate = nn.Linear(embed_dim, num_experts, bias=False)  # rows g M + e: W_r^g's row e
            if router_init == "zero":
                nn.init.zeros_(self.router_gate.weight)
            else:
                nn.init.normal_(self.router_gate.weight, std=embed_dim ** -0.5 * 0.1)
        if weight_init == "xavier_uniform":
            self._xavier_uniform()
        self.rotary = make_rotary(rotary, rotary_base, rotary_fraction, head_dim)
        self.zero_padded_queries = check_flag("zero_padded_queries", zero_padded_queries)

    @torch.no_grad()
    def _xavier_uniform(self) -> None:
        """The authors' initialisation: Xavier-uniform weights of the experts' ``W_q`` (``E d_h`` rows), of the
        shared head's ``W_q`` (its own ``d_h`` rows, a separate matrix in their layer), ``W_k``, ``W_v`` and
        ``W_O``; zero biases."""
        rows = self.num_experts * self.head_dim
        weights = [self.q_proj.weight[:rows], self.k_proj.weight, self.v_proj.weight, self.out_proj.weight]
        if self.shared_head:
            weights.append(self.q_proj.weight[rows:])
        for weight in weights:
            nn.init.xavier_uniform_(weight)
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)

    def _project_kv(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        return split_heads(self.k_proj(key), self.kv_heads), split_heads(self.v_proj(value), self.kv_heads)

    def router_logits(self, x: Tensor) -> Tensor:
        """The router logits ``x W_r`` ``(B*T, G M)`` of ``x`` ``(B, T, d_model)``, in at least float32 (also under
        autocast)."""
        flat = x.reshape(-1, x.shape[-1]).to(router_dtype(x))
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(flat, self.router_gate.weight.to(flat.dtype))

    def route(self, x: Tensor, offset: int | Tensor = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The router on ``x`` ``(B, T, d_model)``: ``(logits, p, index, top_p)`` with ``logits`` and ``p``
        ``(B*T, G, M)`` (``p`` the per-group softmax) and the selection ``index`` (the expert within its group)
        and its ``top_p`` ``(B*T, G, k)`` in slot order (decreasing ``p``). In at least float32. The random
        control: zero logits (``p = 1/M``), the experts drawn for the tokens at positions ``offset ..``."""
        batch, time, _ = x.shape
        n, groups, per = batch * time, self.kv_heads, self.experts_per_group
        if self.random_router is not None:
            logits = x.new_zeros(n, groups, per, dtype=router_dtype(x))
            p = logits.softmax(-1)
            index = self.random_router.choose(batch, time, offset)
            return logits, p, index, p.gather(-1, index)
        logits = self.router_logits(x).view(n, groups, per)
        with torch.autocast(device_type=x.device.type, enabled=False):
            p = logits.softmax(-1)
            top_p, index = p.topk(self.top_k, dim=-1)  # sorted: decreasing p, the slot order
        return logits, p, index, top_p

    def slot_weights(self, top_p: Tensor) -> Tensor:
        """The weighted-sum slot's ``w`` ``(N, G, k)``: ``p / sum_selected p`` over every selected head of every
        group (``weighted_slot_renormalize=False``: ``p``)."""
        if not self.weighted_slot_renormalize:
            return top_p
        return top_p / top_p.sum((1, 2), keepdim=True)

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None, is_causal: bool = False,
                use_cache: bool = False, cache: KVCache | None = None,
                query_padding_mask: Tensor | None = None) -> AttentionOutput:
        """GQE attention of ``query`` ``(B, T, embed_dim)`` over ``key`` / ``value`` (``None``: self-attention):
        eq. 6, ``Concat(O, o_bar, s) W_O``. The slots' attention is grouped-query attention with ``k G`` query
        heads over the ``G`` K/V heads (slot ``(g, j)`` is query head ``g k + j``, which reads K/V head ``g``):
        one :func:`scaled_dot_product` call, static shapes, no host sync; the shared head is a second call over
        :meth:`shared_kv`. Returns an :class:`AttentionOutput` (``routing``, ``aux_loss`` the weighted load-balancing
        loss, ``cache`` with ``use_cache``). Masks as :class:`MultiHeadAttention` (no per-head ``attn_mask``)."""
        check_mask_dtype("query_padding_mask", query_padding_mask, additive=False)
        query, key, value = self._check_inputs(query, key, value)  # layer(x, x, x) is layer(x)
        batch, tgt, _ = query.shape
        n, groups, k_sel, d_h = batch * tgt, self.kv_heads, self.top_k, self.head_dim
        k, v, new_cache, past_len = self._keys_values(query, key, value, use_cache, cache)
        token_mask = real_token_mask(query, key, key_padding_mask, query_padding_mask, cache)
        mask = None if token_mask is None else token_mask.reshape(n)
        losses = None  # (aux, load balance) where the fused router computed them with the routing
        # The weighted-sum slot's renormalisation over every selected head of every group is the fused router's own
        # (its gates, the sum over the groups differentiated), where the hard slots do not read top_p itself.
        weights_from_router = self.weighted_slot_renormalize and self.hard_slot_scale != "p"
        if self.random_router is None and fused_router_applies(query):  # one C++ operation (kernels/fused_router.py)
            logits = self.router_logits(query)
            # top_p: the selected probabilities, or with weights_from_router their renormalisation w
            p, index, top_p, aux, lb, _ = softmax_topk_route(
                logits, mask, groups=groups, top_k=k_sel, renormalize="live_total" if weights_from_router else "none",
                scale=1.0, load_balance_weight=self.load_balance_weight, z_loss_weight=0.0,
                per_token=self.load_balance_fractions == "per_token", z_loss=False)
            logits, p, losses = logits.view(n, groups, -1), p.view(n, groups, -1), (aux, lb)
        else:
            logits, p, index, top_p = self.route(query, past_len)
            weights_from_router = False
        # all the experts' queries in one GEMM, then each token's selected ones (faster on the CPU at the paper's
        # shapes than gathering per-token expert weights; counted as computed in models/counting.py)
        q_experts = self.q_proj(query)
        if self.shared_head:  # the experts' queries and the shared head's: one split (backward: one concatenation)
            q_experts, q_shared = q_experts.split([self.num_experts * d_h, d_h], -1)
        q_experts = q_experts.view(batch, tgt, groups, self.experts_per_group, d_h)
        pick = index.view(batch, tgt, groups, k_sel, 1).expand(-1, -1, -1, -1, d_h)
        q = q_experts.gather(3, pick).view(batch, tgt, groups * k_sel, d_h).transpose(1, 2)
        q = self._rotate_queries(q, key, cache, past_len)
        bias, empty, causal = attention_bias(batch, 1, tgt, k.shape[2], key_padding_mask=key_padding_mask,
                                             attn_mask=attn_mask, is_causal=is_causal, past_len=past_len,
                                             dtype=q.dtype, device=q.device)
        dropout = self.dropout if self.training else 0.0
        o = scaled_dot_product(q, k, v, bias, empty, dropout, causal=causal).transpose(1, 2)  # (B, T, G k, d_h)
        slots = [o * top_p.view(batch, tgt, groups * k_sel, 1).to(o.dtype) if self.hard_slot_scale == "p" else o]
        w = top_p if weights_from_router else self.slot_weights(top_p)
        if self.weighted_slot:
            slots.append((o * w.view(batch, tgt, groups * k_sel, 1).to(o.dtype)).sum(2, keepdim=True))
        if self.shared_head:
            q_s = self._rotate_queries(q_shared.unsqueeze(1), key, cache, past_len)
            o_s = scaled_dot_product(q_s, *self.shared_kv(k, v), bias, empty, dropout, causal=causal)
            slots.append(o_s.transpose(1, 2))
        y = self.out_proj(torch.cat(slots, dim=2).reshape(batch, tgt, self.num_slots * d_h))
        if self.zero_padded_queries:
            y = zero_padded_queries(y, token_mask)
        per = self.experts_per_group  # group g's first expert g M: one arange with a step
        experts = index + torch.arange(0, groups * per, per, device=index.device)[:, None]
        routing = Routing(logits.view(n, self.num_experts), p.view(n, self.num_experts),
                          experts.view(n, groups * k_sel), w.view(n, groups * k_sel).to(query.dtype), mask,
                          (batch, tgt))
        if self.random_routing:
            return AttentionOutput(y, zero_loss(query), new_cache, routing)
        # the mean over the groups of each group's load-balancing loss (MoA eq. 13-15) over its M experts
        aux, lb = losses or weighted_load_balance(routing.probs, routing.expert_index, mask, self.load_balance_weight,
                                                  self.load_balance_fractions, groups)
        return AttentionOutput(y, aux, new_cache, routing, {"load_balance": lb})

    def shared_kv(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The shared head's keys and values ``(B, 1, S, d_h)`` from the ``G`` K/V heads ``k``, ``v`` ``(B, G, S,
        d_h)`` (keys rotated, as cached): their mean (``shared_head_kv="mean"``, the authors' ``key.mean(dim=2)``,
        ``value.mean(dim=2)`` after rotary) or K/V head 0 (``"head0"``)."""
        if self.shared_head_kv == "head0":
            return k[:, :1], v[:, :1]
        return k.mean(1, keepdim=True), v.mean(1, keepdim=True)
