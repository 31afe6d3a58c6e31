"""SwitchHead: mixture-of-experts values and outputs per head (Csordás, Piękos, Irie, Schmidhuber,
NeurIPS 2024, arXiv 2312.07987; the authors' code is RobertCsordas/switchhead)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import IMPLS, expert_map, expert_map_weighted, expert_reduce, expert_routing
from ..kernels.fused_router import fused_router_applies, sigmoid_topk_route
from ..routing import Routing
from ..routing.random import RandomRouter, check_random_router
from ..routing.router import router_dtype
from .base import (AttentionLayer, AttentionOutput, KVCache, attention_bias, check_experts, query_offset, scaled_dot_product,
                   zero_loss)
from .mha import resolve_head_dims, split_heads
from .moa import autocast_dtype
from .padding import check_flag, real_token_mask, zero_padded_queries
from .rotary import RotaryEmbedding, make_rotary

#: Where SwitchHead's ``dropout`` applies: ``"attention"`` (the attention probabilities, as the other headmix
#: layers) or ``"queries"`` (the projected queries of each head, before rotary, as the authors' code).
DROPOUT_PLACEMENTS = ("attention", "queries")


@dataclass
class SwitchHeadRouting:
    """The routing of one :class:`SwitchHeadAttention` call, per side.

    ``value``: the value-side selection over the key/value tokens (``None`` with one expert per head,
    which has no value selector); ``output``: the output-side selection over the query tokens. Each is a
    :class:`~headmix.routing.Routing` over ONE expert index space of ``num_heads * num_experts``
    experts: expert ``h * num_experts + e`` is expert ``e`` of head ``h``, and a token fills
    ``num_heads * top_k`` slots (``top_k`` per head, head-major). In these routings ``probs`` holds the
    selector's sigmoids ``s = sigmoid(x W_sel)`` (not a distribution: they do not sum to 1), ``logits``
    the pre-sigmoid scores and ``gates`` the selected sigmoids, the weights SwitchHead uses.
    """

    value: Routing | None
    output: Routing
    num_heads: int
    num_experts: int

    def expert_counts(self) -> Tensor:
        """Slots per expert of both sides, ``(2 H E,)`` long: the value side's ``H E`` counts (zeros
        without a value selector), then the output side's, each in the ``h * E + e`` order."""
        out = self.output.expert_counts()
        value = self.value.expert_counts() if self.value is not None else torch.zeros_like(out)
        return torch.cat([value, out])


class SwitchHeadAttention(AttentionLayer):
    """SwitchHead attention: a few heads, each with ``num_experts`` value and output projections.

    Per head ``h`` (``W_q^h, W_k^h`` dense, ``embed_dim x head_dim``):

    - selectors: ``s_t^h = sigmoid(x_t W_S^h)`` on the key/value source (value side) and
      ``s'_t^h = sigmoid(q_t W_D^h)`` on the query source (output side), ``W_S^h, W_D^h`` of
      ``embed_dim x num_experts``; each side keeps the ``top_k`` experts with the largest sigmoid and
      weights them by the sigmoid itself (no softmax competition, no renormalisation);
    - values: ``v_t^h = sum_{e in topk(s_t^h)} s_{t,e}^h x_t W_v^{h,e}``;
    - attention: ``o_t^h = softmax(q_t W_q^h (K W_k^h)^T / sqrt(d_h)) V^h``;
    - output: ``y_t = sum_h sum_{e in topk(s'_t^h)} s'^h_{t,e} o_t^h W_o^{h,e}``.

    With ``num_experts=1`` there is no value selector (as in the authors' code) and the layer is
    multi-head attention with a learned sigmoid gate per head on the output,
    ``y_t = sum_h sigmoid(q_t w_h) o_t^h W_o^h``.

    ``expert_dropout`` (training only, as the authors): each expert is excluded from the top-k choice
    with this probability per token and head; the weights stay the undropped sigmoids. There is no
    auxiliary loss (the authors use none): ``aux_loss`` is zero. ``dropout`` (training only) applies where
    ``dropout_on`` says: ``"attention"`` (default) drops attention probabilities, as the other headmix layers;
    ``"queries"`` drops the projected queries ``q_t W_q^h`` of every head before rotary, as the authors'
    ``SwitchHeadCore.forward`` (``q = self.dropout(q)`` before ``attend``), with no dropout on the attention.
    ``init_scale`` scales the initial weights as the authors' ``reset_parameters(init_scale)``: normal
    with std ``init_scale / sqrt(fan_in)`` (``fan_in = num_heads * head_dim`` for ``W_o``), the selector
    rows renormalised as theirs. ``bias`` adds biases to the query and key projections and to the output
    (the authors' layer has none, the default). ``expert_impl`` picks the kernel of the grouped
    value/output projections (see :mod:`headmix.kernels`), run over one expert index space of
    ``num_heads * num_experts`` (token ``t``, head ``h`` uses expert ``h * num_experts + e``).

    ``rotary=True`` (``rotary_base``, ``rotary_fraction``, or a :class:`RotaryEmbedding`) rotates each head's
    queries and keys of self-attention by position, as in the other layers and the authors' ``SwitchHeadRope``
    (which rotates half of each head by default: ``rotary_fraction=0.5``). Self-attention is ``key=None`` or
    the query tensor itself passed as key (and value): ``layer(x, x, x)`` is ``layer(x)``; a different key
    tensor is cross-attention and is not rotated (the authors rotate every call);
    ``zero_padded_queries=True`` returns zeros at padded queries.

    ``router="random"`` is the random-routing control (:mod:`headmix.routing.random`): each side's ``top_k``
    experts of every head drawn uniformly at random per token (``router_seed``, or a seed drawn at construction;
    the value and output sides independently), every selected expert weighted ``sigmoid(0) = 1/2``, what the
    selectors give at equal (zero) scores; there are no selectors. The weight keeps the learned layer's scale:
    its selectors start with scores around 0, and both sides sum ``top_k`` weighted experts.

    The cache holds the keys (after rotation) and the values after the expert mixing, ``(batch, num_heads, S,
    head_dim)``.
    ``routing`` is a :class:`SwitchHeadRouting`.

    Not here: ``kv_heads``, ``qk_norm`` and ``output_gate`` (which MHA, MoH and Talking-Heads take). A head's
    values are its own per-token mixture of value experts, so sharing K/V heads across query heads would change
    the layer (one expert selection for several heads) rather than shrink its cache; QK-norm and the G1 gate
    would apply as in MHA, but no paper or peer combines them with SwitchHead to test against (and with
    ``num_experts=1`` the output selector already is a sigmoid gate per head). See docs/implementations.md.
    """

    repr_sizes = ("embed_dim", "num_heads", "num_experts", "top_k", "head_dim")

    def __init__(self, embed_dim: int, num_heads: int, num_experts: int, top_k: int, head_dim: int | None = None, *,
                 bias: bool = False, dropout: float = 0.0, expert_dropout: float = 0.0, init_scale: float = 1.0,
                 expert_impl: str = "auto", rotary: bool | RotaryEmbedding = False, rotary_base: float = 10000.0,
                 rotary_fraction: float = 1.0, zero_padded_queries: bool = False, dropout_on: str = "attention",
                 router: str = "sigmoid", router_seed: int | None = None):
        super().__init__(embed_dim)
        self.head_dim, _ = resolve_head_dims(embed_dim, num_heads, head_dim, None)
        check_experts(num_experts, top_k)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if dropout_on not in DROPOUT_PLACEMENTS:
            raise ValueError(f"dropout_on must be one of {DROPOUT_PLACEMENTS}, got {dropout_on!r}")
        if not 0.0 <= expert_dropout < 1.0:
            raise ValueError(f"expert_dropout must be in [0, 1), got {expert_dropout}")
        if not isinstance(init_scale, (int, float)) or isinstance(init_scale, bool) or not init_scale > 0:
            raise ValueError(f"init_scale must be a positive number, got {init_scale!r}")
        if expert_impl not in IMPLS:
            raise ValueError(f"expert_impl must be one of {IMPLS}, got {expert_impl!r}")
        self.num_heads, self.num_experts, self.top_k = num_heads, num_experts, top_k
        self.dropout, self.expert_dropout, self.init_scale = dropout, expert_dropout, float(init_scale)
        self.dropout_on = dropout_on
        self.expert_impl = expert_impl
        h, e, dh = num_heads, num_experts, self.head_dim
        self.q_proj = nn.Linear(embed_dim, h * dh, bias=bias)
        self.k_proj = nn.Linear(embed_dim, h * dh, bias=bias)
        # W_v^{h,e} and W_o^{h,e} stacked head-major: row h * E + e.
        self.value_experts = nn.Parameter(torch.empty(h * e, embed_dim, dh))
        self.output_experts = nn.Parameter(torch.empty(h * e, dh, embed_dim))
        self.random_routing = check_random_router(router, ("sigmoid", "random"))
        learned = not self.random_routing
        if self.random_routing and expert_dropout:
            raise ValueError(f"expert_dropout applies to the learned selectors; router='random' chooses without "
                             f"them, got expert_dropout={expert_dropout}")
        self.value_selector = nn.Linear(embed_dim, h * e, bias=False) if e > 1 and learned else None
        self.output_selector = nn.Linear(embed_dim, h * e, bias=False) if learned else None
        self.random_router = RandomRouter(e, top_k, h, router_seed) if self.random_routing else None
        self.out_bias = nn.Parameter(torch.zeros(embed_dim)) if bias else None
        self.rotary = make_rotary(rotary, rotary_base, rotary_fraction, dh)
        self.zero_padded_queries = check_flag("zero_padded_queries", zero_padded_queries)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std_in = self.init_scale / math.sqrt(self.embed_dim)
        for w in (self.q_proj.weight, self.k_proj.weight, self.value_experts):
            nn.init.normal_(w, 0.0, std_in)
        nn.init.normal_(self.output_experts, 0.0, self.init_scale / math.sqrt(self.num_heads * self.head_dim))
        for lin in (self.q_proj, self.k_proj):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        if self.out_bias is not None:
            nn.init.zeros_(self.out_bias)
        for sel in (self.value_selector, self.output_selector):
            if sel is not None:
                nn.init.normal_(sel.weight, 0.0, std_in)
                _renormalise_rows(sel.weight)

    # ---------------------------------------------------------------------------------- selection
    def select(self, x: Tensor, selector: nn.Linear | None, token_mask: Tensor | None, offset: int | Tensor = 0,
               stream: int = 0) -> Routing:
        """Top-k of ``sigmoid(x W_sel)`` per head over ``x`` ``(batch, time, embed_dim)``, as a
        :class:`~headmix.routing.Routing` in the ``h * E + e`` expert space (see
        :class:`SwitchHeadRouting`). Runs in (at least) float32, also under autocast. ``router="random"``
        (``selector`` None): ``top_k`` experts per head drawn at random for the tokens at positions ``offset ..``
        (``stream`` 0 for the value side, 1 for the output side), every score 0."""
        batch, time, dim = x.shape
        n, h, e, k = batch * time, self.num_heads, self.num_experts, self.top_k
        flat = x.reshape(n, dim).to(router_dtype(x))
        mask = None if token_mask is None else token_mask.reshape(n)
        with torch.autocast(device_type=x.device.type, enabled=False):
            if (selector is not None and not (self.training and self.expert_dropout > 0)
                    and fused_router_applies(x)):  # one C++ operation each way (kernels/fused_router.py)
                logits = F.linear(flat, selector.weight.to(flat.dtype))
                s, index, gates = sigmoid_topk_route(logits, h, k)
                return Routing(logits, s, index.view(n, h * k), gates.view(n, h * k), mask, (batch, time))
            if selector is None:
                logits = flat.new_zeros(n, h * e)
            else:
                logits = F.linear(flat, selector.weight.to(flat.dtype))
            s = logits.sigmoid().view(n, h, e)
            with torch.no_grad():
                pick = s
                if self.training and self.expert_dropout > 0:
                    pick = s.masked_fill(torch.rand_like(s) < self.expert_dropout, float("-inf"))
                if selector is None:
                    index = self.random_router.choose(batch, time, offset, stream)
                else:
                    index = pick.topk(k, dim=-1).indices                               # (N, H, k)
            gates = s.gather(-1, index)                                             # selected sigmoids
            index = index + torch.arange(0, h * e, e, device=x.device)[:, None]     # expert h * E + e
        return Routing(logits, s.view(n, h * e), index.view(n, h * k), gates.view(n, h * k), mask, (batch, time))

    def _project_kv_routed(self, key: Tensor, value: Tensor, token_mask: Tensor | None,
                           offset: int | Tensor = 0) -> tuple[Tensor, Tensor, Routing | None]:
        """Keys ``(batch, H, S, head_dim)``, the mixed values ``v^h`` of the same shape and the value-side
        routing (``None`` with one expert per head)."""
        batch, src, dim = value.shape
        n, h, dh = batch * src, self.num_heads, self.head_dim
        k = split_heads(self.k_proj(key), h)
        compute = autocast_dtype(value) or value.dtype
        if self.num_experts == 1:
            routing = None
            index = torch.arange(h, device=value.device).expand(n, h)
            gates = None
        else:
            routing = self.select(key, self.value_selector, token_mask, offset, stream=0)
            index, gates = routing.expert_index, routing.gates
        info = expert_routing(index, h * self.num_experts, check_range=False)  # top-k: in range
        # v^h_t = sum_{e in topk} s_{t,e}^h x_t W_v^{h,e} for every head: (N, H, head_dim).
        x_v, w_v = value.reshape(n, dim).to(compute), self.value_experts.to(compute)
        if gates is None:
            v = expert_map(x_v, w_v, info, impl=self.expert_impl)
        else:
            v = expert_map_weighted(x_v, w_v, gates.to(compute), info, h, impl=self.expert_impl)
        return k, v.view(batch, src, h, dh).transpose(1, 2), routing

    def _project_kv(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        k, v, _ = self._project_kv_routed(key, value, None)
        return k, v

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None, is_causal: bool = False,
                use_cache: bool = False, cache: KVCache | None = None, query_padding_mask: Tensor | None = None) -> AttentionOutput:
        """SwitchHead attention of ``query`` ``(B, T, embed_dim)`` over ``key`` / ``value`` (``None``:
        self-attention): per head ``h``, ``top_k`` of ``num_experts`` value projections chosen by the sigmoid
        selector ``s = sigmoid(x W_S^h)`` on the key/value side and ``top_k`` output projections by
        ``s' = sigmoid(q W_D^h)`` on the query side, the selected sigmoids as weights (Csordás et al., arXiv
        2312.07987).
        Returns an :class:`AttentionOutput`: ``output`` ``(B, T, embed_dim)``, ``routing`` (a
        :class:`SwitchHeadRouting` with its ``value`` and ``output`` sides), no auxiliary loss.
        Masks: ``key_padding_mask`` ``(B, S)``, ``attn_mask`` ``(T, S)`` (or per batch / head), ``is_causal``,
        ``query_padding_mask`` ``(B, T)``, with ``torch.nn.MultiheadAttention``'s conventions (``True`` =
        padding / forbidden; see :mod:`headmix.attention.base`); ``use_cache`` returns the new ``cache``."""
        query, key, value = self._check_inputs(query, key, value)
        batch, tgt, dim = query.shape
        h, k = self.num_heads, self.top_k
        value_routing: list[Routing | None] = [None]
        offset = query_offset(cache)

        def project(key_src: Tensor, value_src: Tensor) -> tuple[Tensor, Tensor]:
            keys, values, value_routing[0] = self._project_kv_routed(
                key_src, value_src, _new_key_mask(key_padding_mask, key_src.shape[:2]), offset)
            return keys, values

        keys, values, new_cache, past_len = self._keys_values(query, key, value, use_cache, cache, project=project)
        q = split_heads(self.q_proj(query), h)
        if self.training and self.dropout_on == "queries":
            q = F.dropout(q, self.dropout)  # the authors' placement: queries, before rotary
        q = self._rotate_queries(q, key, cache, past_len)
        attention_dropout = self.dropout if self.training and self.dropout_on == "attention" else 0.0
        bias, empty, causal = attention_bias(batch, h, tgt, keys.shape[2], key_padding_mask=key_padding_mask,
                                             attn_mask=attn_mask, is_causal=is_causal, past_len=past_len,
                                             dtype=q.dtype, device=q.device)
        o = scaled_dot_product(q, keys, values, bias, empty, attention_dropout, causal=causal)

        token_mask = real_token_mask(query, key, key_padding_mask, query_padding_mask, cache)
        routing = self.select(query, self.output_selector, token_mask, offset, stream=1)
        info = expert_routing(routing.expert_index, h * self.num_experts, check_range=False)  # top-k: in range
        compute = autocast_dtype(query) or query.dtype
        n = batch * tgt
        # o_t^h once per selected expert of head h (slot h * k + j: a stride-0 view, the Triton kernels read it
        # in place), then sum_{h, j} s' o_t^h W_o^{h,e}.
        o = o.transpose(1, 2).reshape(n, h, 1, self.head_dim).to(compute).expand(n, h, k, self.head_dim)
        y = expert_reduce(o, self.output_experts.to(compute), routing.gates.to(compute), info,
                          impl=self.expert_impl).view(batch, tgt, dim)
        if self.out_bias is not None:
            y = y + self.out_bias.to(y.dtype)
        if self.zero_padded_queries:
            y = zero_padded_queries(y, token_mask)
        state = SwitchHeadRouting(value_routing[0], routing, h, self.num_experts)
        return AttentionOutput(y, zero_loss(query), new_cache, state)


def _new_key_mask(key_padding_mask: Tensor | None, shape: tuple[int, int]) -> Tensor | None:
    """``(batch, S_new)`` True for the real tokens among the keys projected in this call (the last
    ``S_new`` columns of a boolean ``key_padding_mask``), or None."""
    if key_padding_mask is None or key_padding_mask.dtype != torch.bool or key_padding_mask.dim() != 2:
        return None
    batch, new = shape
    if key_padding_mask.shape[0] != batch or key_padding_mask.shape[1] < new:
        return None
    return ~key_padding_mask[:, key_padding_mask.shape[1] - new:]


def _renormalise_rows(w: Tensor) -> None:
    """The authors' selector initialisation, in place: each row scaled to unit norm, then every row
    multiplied by its former standard deviation over the standard deviation of the unit-norm matrix."""
    row_std = w.std(dim=-1, keepdim=True)
    unit = w / w.norm(dim=-1, keepdim=True)
    w.copy_(unit * (row_std / unit.std()))
