"""Plain reference implementations, written straight from the papers' equations.

They are slow on purpose: explicit softmax, a loop over every expert or head, every expert computed for
every token. The layers' fast paths are tested against them (outputs and gradients). Each function
takes a layer (for its parameters) and the same inputs and mask keywords as the layer, in eval mode
(no dropout, no router noise).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..routing.random import EVAL_SALT, reference_random_choice
from .base import is_self_attention
from .gqe import GroupedQueryExpertsAttention
from .moa import MixtureOfAttentionHeads
from .mha import MultiHeadAttention
from .moh import MixtureOfHeadsAttention
from .mosa import MixtureOfSparseAttention
from .switchhead import SwitchHeadAttention
from .talking_heads import TalkingHeadsAttention


def reference_mask(batch: int, heads: int, tgt: int, src: int, *, key_padding_mask: Tensor | None = None,
                   attn_mask: Tensor | None = None, is_causal: bool = False, past_len: int = 0) -> tuple[Tensor, Tensor]:
    """Dense ``(allowed, added)`` of shape ``(batch, heads, tgt, src)``: a boolean of allowed positions and
    a float tensor added to the scores, built entry by entry from the masks' definitions."""
    allowed = torch.ones(batch, heads, tgt, src, dtype=torch.bool)
    added = torch.zeros(batch, heads, tgt, src, dtype=torch.float64)

    def apply(mask: Tensor) -> None:  # mask broadcastable to (batch, heads, tgt, src)
        nonlocal allowed, added
        mask = mask.expand(batch, heads, tgt, src).cpu()
        if mask.dtype == torch.bool:
            allowed = allowed & ~mask
        else:
            allowed = allowed & ~torch.isneginf(mask)
            added = added + torch.where(torch.isneginf(mask), torch.zeros((), dtype=torch.float64), mask.double())

    if key_padding_mask is not None:
        apply(key_padding_mask[:, None, None, :])
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            apply(attn_mask[None, None])
        elif attn_mask.dim() == 3 and attn_mask.shape[0] == batch * heads and heads > 1:
            apply(attn_mask.view(batch, heads, tgt, src))
        elif attn_mask.dim() == 3:
            apply(attn_mask[:, None])
        else:
            apply(attn_mask)
    if is_causal:
        for i in range(tgt):
            allowed[:, :, i, past_len + i + 1:] = False
    return allowed, added


def reference_softmax_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, added: Tensor, scale: float,
                                pre_mix: Tensor | None = None, post_mix: Tensor | None = None) -> Tensor:
    """``softmax(q k^T * scale + added)`` restricted to ``allowed``, times ``v``; rows with no allowed key
    give zeros. Optional talking-heads mixing of the logits (before) and weights (after the softmax)."""
    if k.shape[-2] == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    scores = q @ k.transpose(-1, -2) * scale
    if pre_mix is not None:
        scores = torch.einsum("ij,bjts->bits", pre_mix, scores)
    scores = scores + added.to(scores)
    allowed = allowed.to(scores.device)
    has_key = allowed.any(-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~has_key, 0.0)
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    weights = weights / weights.sum(-1, keepdim=True)
    weights = weights * has_key
    if post_mix is not None:
        weights = torch.einsum("ij,bjts->bits", post_mix, weights)
    return weights @ v


def reference_rotary(x: Tensor, rotary, offset: int = 0) -> Tensor:
    """RoFormer eq. 34 on ``(batch, heads, time, size)``: pair ``j`` of the rotated dimensions, as a complex
    number ``x_a + i x_b``, is multiplied by ``exp(i m theta_j)``, ``theta_j = base^(-2j/d)``, at position
    ``m = offset + t``. Pairs are ``(j, j + d/2)`` or, interleaved, ``(2j, 2j + 1)``. ``rotary=None``: ``x``."""
    if rotary is None:
        return x
    d = rotary.rotary_dim
    theta = rotary.base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    m = torch.arange(offset, offset + x.shape[2], dtype=torch.float64)
    turn = torch.polar(torch.ones(len(m), d // 2, dtype=torch.float64), m[:, None] * theta[None, :])
    if rotary.interleaved:
        a, b = x[..., 0:d:2], x[..., 1:d:2]
    else:
        a, b = x[..., :d // 2], x[..., d // 2:d]
    z = torch.complex(a.double(), b.double()) * turn
    if rotary.interleaved:
        rotated = torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    else:
        rotated = torch.cat([z.real, z.imag], dim=-1)
    return torch.cat([rotated.to(x.dtype), x[..., d:]], dim=-1)


def _self_rotary(layer, query: Tensor, key: Tensor | None, value: Tensor | None):
    """The layer's rotary module in self-attention (``key`` None or the query itself, see
    :func:`~headmix.attention.base.is_self_attention`); cross-attention is not rotated."""
    return layer.rotary if is_self_attention(query, key, value) else None


def _inputs(query: Tensor, key: Tensor | None, value: Tensor | None) -> tuple[Tensor, Tensor]:
    if key is None:
        return query, query
    return key, key if value is None else value


def _heads(x: Tensor, heads: int) -> Tensor:
    b, t, size = x.shape
    return x.view(b, t, heads, size // heads).transpose(1, 2)


def reference_mha(layer: MultiHeadAttention | TalkingHeadsAttention, query: Tensor, key: Tensor | None = None,
                  value: Tensor | None = None, **masks) -> Tensor:
    """Multi-head attention, ``Concat(head_1..head_h) W_O`` (Vaswani et al. 2017); with the talking-heads
    mixing matrices of a :class:`TalkingHeadsAttention`."""
    rotary = _self_rotary(layer, query, key, value)
    key, value = _inputs(query, key, value)
    h = layer.num_heads
    q = reference_rotary(reference_qk_norm(_heads(layer.q_proj(query), h), layer.q_norm), rotary)
    k = reference_rotary(reference_qk_norm(reference_repeat_kv(layer.k_proj(key), layer), layer.k_norm), rotary)
    v = reference_repeat_kv(layer.v_proj(value), layer)
    allowed, added = reference_mask(query.shape[0], h, query.shape[1], key.shape[1], **masks)
    pre = getattr(layer, "pre_mix", None)
    post = getattr(layer, "post_mix", None)
    o = reference_softmax_attention(q, k, v, allowed, added, 1.0 / math.sqrt(layer.key_dim), pre, post)
    o = o * reference_output_gates(layer, query).transpose(1, 2)
    return layer.out_proj(o.transpose(1, 2).flatten(2))


def reference_repeat_kv(projected: Tensor, layer: MultiHeadAttention) -> Tensor:
    """Grouped-query attention's keys or values (Ainslie et al. 2023): the ``(batch, S, kv_heads * size)``
    projection split into ``kv_heads`` heads, head ``j`` copied for query heads ``j * H/G .. (j+1) * H/G - 1``,
    so query head ``h`` reads K/V head ``h // (H / G)``: ``(batch, num_heads, S, size)``."""
    kv = _heads(projected, layer.kv_heads)
    return torch.stack([kv[:, h // (layer.num_heads // layer.kv_heads)] for h in range(layer.num_heads)], dim=1)


def reference_qk_norm(x: Tensor, norm) -> Tensor:
    """QK-norm: RMSNorm over each head's last dimension, ``x / sqrt(mean(x^2) + eps) * weight`` (Zhang &
    Sennrich 2019, as Qwen3 applies it per head), computed in float64; ``norm=None``: ``x``."""
    if norm is None:
        return x
    x64 = x.double()
    rms = torch.sqrt((x64 * x64).mean(-1, keepdim=True) + norm.eps)
    return (x64 / rms).to(x.dtype) * norm.weight


def reference_output_gates(layer: MultiHeadAttention, query: Tensor) -> Tensor:
    """Gated Attention's G1 gate (Qiu et al. 2025, eq. 5-6): ``sigmoid(x W_theta + b)`` of the query input,
    ``(batch, time, num_heads, 1 or head_dim)``; ones without an ``output_gate``."""
    if layer.gate_proj is None:
        return torch.ones(*query.shape[:2], layer.num_heads, 1, dtype=query.dtype)
    z = query @ layer.gate_proj.weight.T
    if layer.gate_proj.bias is not None:
        z = z + layer.gate_proj.bias
    return (1.0 / (1.0 + torch.exp(-z))).view(*query.shape[:2], layer.num_heads, -1)


def reference_random_selection(router, batch: int, time: int, stream: int = 0, salt: int = EVAL_SALT) -> Tensor:
    """The random-routing control's choice (:class:`~headmix.routing.random.RandomRouter`, an evaluation call by
    default) as ``(batch, time, groups, num_experts)`` 0/1, from the plain-integer
    :func:`~headmix.routing.random.reference_random_choice` of every token and group."""
    chosen = torch.zeros(batch, time, router.groups, router.num_experts, dtype=torch.float64)
    for b in range(batch):
        for t in range(time):
            for g in range(router.groups):
                for e in reference_random_choice(int(router.seed), salt, stream, b, t, g, router.num_experts,
                                                 router.top_k):
                    chosen[b, t, g, e] = 1.0
    return chosen


def reference_moa_routing(layer: MixtureOfAttentionHeads, query: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Router of eq. 7-9 (and eq. 3 without noise): ``(logits, p, selected index, weights w)``. The random
    control: logits 0 (``p = 1/E``), the randomly chosen experts, ``w`` eq. 9 at those equal scores (``1/k``)."""
    if layer.random_routing:
        logits = query.new_zeros(*query.shape[:2], layer.num_experts, dtype=torch.float64)
        p = torch.softmax(logits, dim=-1)
        chosen = reference_random_selection(layer.router, *query.shape[:2])[:, :, 0]
        index = chosen.topk(layer.top_k, dim=-1).indices                    # the chosen experts (all 1)
        top_p = p.gather(-1, index)
        return logits, p, index, top_p / top_p.sum(-1, keepdim=True)
    logits = query.double() @ layer.router.gate.weight.double().T          # x W_g
    p = torch.softmax(logits, dim=-1)                                       # eq. 7
    top_p, index = p.topk(layer.top_k, dim=-1)                              # eq. 8
    if layer.router.router_type == "noisy_topk":
        w = torch.softmax(logits.gather(-1, index), dim=-1)                 # eq. 3
    elif layer.router.renormalize == "detached":
        w = top_p / top_p.sum(-1, keepdim=True).detach()                    # eq. 9
    elif layer.router.renormalize == "live":
        w = top_p / top_p.sum(-1, keepdim=True)
    else:
        w = top_p
    return logits, p, index, w


def reference_moa(layer: MixtureOfAttentionHeads, query: Tensor, key: Tensor | None = None, value: Tensor | None = None,
                  **masks) -> Tensor:
    """MoA output (eq. 6) with every expert (eq. 10-12) evaluated for every token. With ``kv_heads = G``,
    expert ``i``'s query ``q_t W_q^i`` is split into ``G`` heads and head ``g`` attends with the shared
    key/value head ``g`` (``K W_k`` split the same way); the ``G`` head outputs, concatenated, go through
    ``W_o^i``."""
    rotary = _self_rotary(layer, query, key, value)
    key, value = _inputs(query, key, value)
    _, _, index, w = reference_moa_routing(layer, query)
    groups = layer.kv_heads
    k_shared = reference_rotary(_heads(layer.k_proj(key), groups), rotary)    # K W_k, shared: (B, G, S, d_h)
    v_shared = _heads(layer.v_proj(value), groups)                            # V W_v, shared
    allowed, added = reference_mask(query.shape[0], 1, query.shape[1], key.shape[1], **masks)  # same for all heads
    y = torch.zeros_like(query)
    for i in range(layer.num_experts):
        q_i = reference_rotary(_heads(query @ layer.query_experts[i], groups), rotary)  # q_t W_q^i
        o_i = reference_softmax_attention(q_i, k_shared, v_shared, allowed, added, 1.0 / math.sqrt(layer.head_dim))
        e_i = o_i.transpose(1, 2).flatten(2) @ layer.output_experts[i]       # eq. 12
        w_i = (w * (index == i)).sum(-1, keepdim=True).to(query.dtype)      # w_{i,t}, 0 if not selected
        y = y + w_i * e_i                                                   # eq. 6
    if layer.out_bias is not None:
        y = y + layer.out_bias
    return y


def reference_moa_losses(layer: MixtureOfAttentionHeads, query: Tensor, token_mask: Tensor | None = None) -> dict[str, Tensor]:
    """Unweighted load-balancing loss (eq. 13-15) and z-loss (eq. 16) for one call, over real tokens."""
    logits, p, index, _ = reference_moa_routing(layer, query)
    n_exp = layer.num_experts
    keep = torch.ones(query.shape[:2], dtype=torch.bool) if token_mask is None else token_mask
    f = torch.zeros(n_exp, dtype=torch.float64)
    big_p = torch.zeros(n_exp, dtype=torch.float64)
    for i in range(n_exp):
        f[i] = ((index == i).any(-1) & keep).sum()                          # tokens sent to expert i
        big_p[i] = p[..., i][keep].sum()                                    # router mass on expert i
    f, big_p = f / f.sum(), big_p / big_p.sum()
    z = torch.log(torch.exp(logits).sum(-1))[keep].pow(2).mean()
    return {"load_balance": n_exp * (f * big_p).sum(), "z_loss": z}


def reference_moh_weights(layer: MixtureOfHeadsAttention, x: Tensor) -> Tensor:
    """Head weights ``g`` ``(batch, time, num_heads)`` for each ``head_weighting``: ``p = softmax(x W_r)`` over
    the ``R`` routed heads, ``s = softmax(x W_s)`` over the ``S`` shared ones (heads ``0..S-1``).

    - ``"paper"`` (MoH eq. 5-6): ``g = [a_s s, a_r p * 1[TopK]]``, ``[a_s, a_r] = softmax(x W_h)``;
    - ``"renormalized"`` (the authors' code): ``g = [a_s S s, a_r k p * 1[TopK] / sum_TopK p]``,
      ``[a_s, a_r] = 2 softmax(x W_h)``;
    - ``"scaled"``: ``g = [a_s S s, a_r R p * 1[TopK]]``, ``[a_s, a_r] = 2 softmax(x W_h)``.
    Without shared heads the routed weights are used alone (``a_r = 1``).

    ``route_per_group`` (MoH per K/V group; not the paper's GQE): the same, group by group: group ``j`` (heads
    ``j H/G .. (j+1) H/G - 1``, its first ``S`` shared) has its own rows of ``W_r`` and ``W_s``, its own pair of
    ``W_h``, its own softmaxes and top-k, with ``S``, ``k`` and ``R`` counted in the group.

    The random control (``router="random"``): every router logit 0, the routed heads selected at random
    (:func:`reference_random_selection`). ``router="query_norm"``: :func:`reference_query_norm_weights`."""
    if layer.query_norm_routing:
        return reference_query_norm_weights(layer, x)
    x = x.double()
    groups = layer.kv_heads if layer.route_per_group else 1
    shared_per = layer.num_shared_heads
    routed_per = layer.num_heads // groups - shared_per
    random = layer.random_routing
    chosen = reference_random_selection(layer.random_router, *x.shape[:2]) if random else None

    def scores(gate, rows: slice) -> Tensor:  # x W (one group's rows), or 0 for the random control
        width = rows.stop - rows.start
        return x.new_zeros(*x.shape[:2], width) if random else x @ gate.weight.double()[rows].T

    out = []
    for j in range(groups):
        p = torch.softmax(scores(layer.routed_gate, slice(j * routed_per, (j + 1) * routed_per)), -1)
        if random:
            selected = chosen[:, :, j]
        else:
            selected = torch.zeros_like(p).scatter(-1, p.topk(layer.top_k, dim=-1).indices, 1.0)
        mode = layer.head_weighting
        if mode == "paper":
            routed = p * selected
        elif mode == "renormalized":
            routed = layer.top_k * p * selected / (p * selected).sum(-1, keepdim=True)
        else:
            routed = routed_per * p * selected
        if not shared_per:
            out.append(routed)
            continue
        a = torch.softmax(scores(layer.group_gate, slice(2 * j, 2 * j + 2)), -1)
        s = torch.softmax(scores(layer.shared_gate, slice(j * shared_per, (j + 1) * shared_per)), -1)
        if mode != "paper":
            a, s = 2 * a, shared_per * s
        out.append(torch.cat([a[..., :1] * s, a[..., 1:] * routed], -1))
    return torch.cat(out, -1)


def reference_query_norm_weights(layer: MixtureOfHeadsAttention, x: Tensor) -> Tensor:
    """MoH-LLaMA3's parameter-free router (SkyworkAI/MoH, ``MoH-LLaMA3/Inference_code/modeling_llama.py``) as
    head weights ``(batch, time, num_heads)``, one token and one router group at a time: the shared heads weigh
    1; routed head ``i``'s score is the L2 norm of its query ``x W_q^i + b_q^i`` (no rotary, no QK-norm) divided
    by the unbiased standard deviation of the group's routed heads' norms (score 0 where that is 0 or, with one
    routed head, undefined), a softmax over the group's routed heads, and the ``top_k`` largest probabilities
    weigh 1, the others 0 (equal probabilities: ``torch.topk`` picks by position)."""
    x = x.double()
    groups = layer.kv_heads if layer.route_per_group else 1
    per_group = layer.num_heads // groups
    shared, dk = layer.num_shared_heads, layer.key_dim
    w_q = layer.q_proj.weight.double()
    b_q = None if layer.q_proj.bias is None else layer.q_proj.bias.double()
    g = torch.zeros(*x.shape[:2], layer.num_heads, dtype=torch.float64)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for j in range(groups):
                heads = range(j * per_group, (j + 1) * per_group)
                norms = []
                for h in heads[shared:]:
                    q = w_q[h * dk:(h + 1) * dk] @ x[b, t]
                    if b_q is not None:
                        q = q + b_q[h * dk:(h + 1) * dk]
                    norms.append(torch.sqrt((q * q).sum()))
                norms = torch.stack(norms)
                std = norms.std() if len(norms) > 1 else torch.zeros((), dtype=torch.float64)
                scores = norms / std if std > 0 else torch.zeros_like(norms)
                p = torch.softmax(scores, dim=0)
                for h in heads[:shared]:
                    g[b, t, h] = 1.0
                for r in p.topk(layer.top_k).indices.tolist():
                    g[b, t, heads[shared + r]] = 1.0
    return g


def reference_moh(layer: MixtureOfHeadsAttention, query: Tensor, key: Tensor | None = None, value: Tensor | None = None,
                  **masks) -> Tensor:
    """MoH: ``sum_i g_i H^i W_O^i`` with the two-stage weights, one head at a time. Head ``i`` reads K/V head
    ``i // (H / kv_heads)``; with ``qk_norm`` its query and key are RMS-normalised before rotary, with an
    ``output_gate`` its output ``H^i`` is multiplied by its G1 gate."""
    rotary = _self_rotary(layer, query, key, value)
    key, value = _inputs(query, key, value)
    h, d, dk = layer.num_heads, layer.head_dim, layer.key_dim
    allowed, added = reference_mask(query.shape[0], h, query.shape[1], key.shape[1], **masks)  # per head
    x = query.double()
    if not layer.num_routed_heads:
        g = torch.ones(*query.shape[:2], h, dtype=torch.float64)
    else:
        g = reference_moh_weights(layer, x)
    gates = reference_output_gates(layer, query)
    y = torch.zeros_like(query)
    w_o = layer.out_proj.weight.T                                           # rows i*d:(i+1)*d = W_O^i

    def rows(lin, sl):
        return query.new_zeros(()) if lin.bias is None else lin.bias[sl]

    for i in range(h):
        sl, qsl = slice(i * d, (i + 1) * d), slice(i * dk, (i + 1) * dk)
        kv = i // (h // layer.kv_heads)
        ksl, vsl = slice(kv * dk, (kv + 1) * dk), slice(kv * d, (kv + 1) * d)
        q_i = (query @ layer.q_proj.weight[qsl].T + rows(layer.q_proj, qsl)).unsqueeze(1)
        k_i = (key @ layer.k_proj.weight[ksl].T + rows(layer.k_proj, ksl)).unsqueeze(1)
        v_i = (value @ layer.v_proj.weight[vsl].T + rows(layer.v_proj, vsl)).unsqueeze(1)
        q_i, k_i = reference_qk_norm(q_i, layer.q_norm), reference_qk_norm(k_i, layer.k_norm)
        q_i, k_i = reference_rotary(q_i, rotary), reference_rotary(k_i, rotary)
        h_i = reference_softmax_attention(q_i, k_i, v_i, allowed[:, i:i + 1], added[:, i:i + 1],
                                          1.0 / math.sqrt(dk)).squeeze(1)
        h_i = h_i * gates[:, :, i]
        y = y + g[..., i:i + 1].to(query.dtype) * (h_i @ w_o[sl])
    if layer.out_proj.bias is not None:
        y = y + layer.out_proj.bias
    return y


def reference_switchhead_selection(layer: SwitchHeadAttention, x: Tensor, selector: torch.nn.Linear | None,
                                   stream: int = 1) -> tuple[Tensor, Tensor]:
    """SwitchHead's selection for every head: ``(s, w)`` of shape ``(batch, time, heads, experts)``, the
    sigmoids ``s = sigmoid(x W_sel)`` and the weights ``w`` (``s`` on the ``top_k`` largest, 0 elsewhere;
    no softmax, no renormalisation). The random control: ``s = sigmoid(0) = 1/2`` on the experts chosen at
    random (:func:`reference_random_selection`; ``stream`` 0 for the value side, 1 for the output side)."""
    b, t, _ = x.shape
    if layer.random_routing:
        chosen = reference_random_selection(layer.random_router, b, t, stream).to(x.dtype)
        return torch.full_like(chosen, 0.5), 0.5 * chosen
    s = torch.sigmoid(x @ selector.weight.T).view(b, t, layer.num_heads, layer.num_experts)
    chosen = torch.zeros_like(s, dtype=torch.bool).scatter(-1, s.detach().double().topk(layer.top_k, dim=-1).indices, True)
    return s, s * chosen


def reference_switchhead(layer: SwitchHeadAttention, query: Tensor, key: Tensor | None = None,
                         value: Tensor | None = None, **masks) -> Tensor:
    """SwitchHead, one head and one expert at a time: ``v_t^h = sum_e w_{t,e}^h x_t W_v^{h,e}``,
    ``o^h = softmax(q W_q^h (K W_k^h)^T / sqrt(d_h)) V^h``, ``y_t = sum_h sum_e w'^h_{t,e} o_t^h W_o^{h,e}``
    (every expert evaluated, unselected ones weighted 0). With one expert there is no value selector. Rotary
    positions (self-attention) on each head's queries and keys, as :func:`reference_rotary`."""
    rotary = _self_rotary(layer, query, key, value)
    key, value = _inputs(query, key, value)
    n_h, n_e, d = layer.num_heads, layer.num_experts, layer.head_dim
    allowed, added = reference_mask(query.shape[0], 1, query.shape[1], key.shape[1], **masks)
    if layer.num_experts > 1:
        _, w_v = reference_switchhead_selection(layer, key, layer.value_selector, stream=0)
    else:
        w_v = torch.ones(*key.shape[:2], n_h, 1, dtype=query.dtype)
    _, w_o = reference_switchhead_selection(layer, query, layer.output_selector)
    y = torch.zeros_like(query)
    for h in range(n_h):
        sl = slice(h * d, (h + 1) * d)
        q_h = query @ layer.q_proj.weight[sl].T + (layer.q_proj.bias[sl] if layer.q_proj.bias is not None else 0)
        k_h = key @ layer.k_proj.weight[sl].T + (layer.k_proj.bias[sl] if layer.k_proj.bias is not None else 0)
        v_h = torch.zeros(*value.shape[:2], d, dtype=query.dtype)
        for e in range(n_e):
            v_h = v_h + w_v[..., h, e:e + 1] * (value @ layer.value_experts[h * n_e + e])
        q_h, k_h = reference_rotary(q_h.unsqueeze(1), rotary), reference_rotary(k_h.unsqueeze(1), rotary)
        o_h = reference_softmax_attention(q_h, k_h, v_h.unsqueeze(1), allowed, added, 1.0 / math.sqrt(d)).squeeze(1)
        for e in range(n_e):
            y = y + w_o[..., h, e:e + 1] * (o_h @ layer.output_experts[h * n_e + e])
    if layer.out_bias is not None:
        y = y + layer.out_bias
    return y


def reference_rotary_at(x: Tensor, rotary, positions: list[int]) -> Tensor:
    """RoFormer eq. 34 on ``(n, size)`` rows, row ``i`` at position ``positions[i]`` (see
    :func:`reference_rotary`)."""
    if rotary is None:
        return x
    rows = [reference_rotary(x[i][None, None, None], rotary, offset=p)[0, 0, 0] for i, p in enumerate(positions)]
    return torch.stack(rows) if rows else x


def reference_mosa_choice(layer: MixtureOfSparseAttention, x: Tensor, padding: Tensor | None = None) -> list[list[list[int]]]:
    """The tokens each sparse head chooses, ``choice[b][h]``: sorted original positions. ``"topk"``: the ``k``
    largest ``r = sigmoid(x W_r^h)`` among the real tokens (with ``include_first``, token 0 and the ``k - 1``
    largest of the rest); ``"threshold"``: every real token with ``r >= tau_h``."""
    b_n, t_n, _ = x.shape
    r = torch.sigmoid(x @ layer.router.weight.T).detach()
    k = layer.tokens_for(t_n)
    choice = []
    for b in range(b_n):
        real = [t for t in range(t_n) if padding is None or not bool(padding[b, t])]
        per_head = []
        for h in range(layer.num_sparse_heads):
            if layer.selection == "threshold":
                chosen = [t for t in real if float(r[b, t, h]) >= float(layer.score_threshold[h])]
            else:
                first = [0] if layer.include_first and 0 in real else []
                rest = sorted((t for t in real if t not in first), key=lambda t: -float(r[b, t, h]))
                chosen = (first + rest)[:k]
            per_head.append(sorted(chosen))
        choice.append(per_head)
    return choice


def reference_mosa(layer: MixtureOfSparseAttention, query: Tensor, *, key_padding_mask: Tensor | None = None,
                   attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
    """MoSA (arXiv 2505.00315, section 3), one sequence and one sparse head at a time: the chosen tokens
    ``I`` (:func:`reference_mosa_choice`), ``Q, K, V = X_I W_{Q,K,V}^h`` rotated at positions ``I``,
    ``softmax(Q K^T / sqrt(d_h) + M) V`` with ``M`` the masks at the original positions (causal:
    ``I_i >= I_j``), each row times its score ``r_{I_i}``, times ``W_O^h``, added at ``I_i``; plus the dense
    heads (:func:`reference_mha`)."""
    b_n, t_n, _ = query.shape
    d = layer.head_dim
    padding = None
    if key_padding_mask is not None:
        padding = key_padding_mask if key_padding_mask.dtype == torch.bool else torch.isneginf(key_padding_mask)
    choice = reference_mosa_choice(layer, query, padding)
    r = torch.sigmoid(query @ layer.router.weight.T)
    y = torch.zeros_like(query)
    for b in range(b_n):
        kpm = None if key_padding_mask is None else key_padding_mask[b:b + 1]
        am = attn_mask if attn_mask is None or attn_mask.dim() == 2 else attn_mask[b:b + 1]
        allowed, added = reference_mask(1, 1, t_n, t_n, key_padding_mask=kpm, attn_mask=am, is_causal=is_causal)
        for h in range(layer.num_sparse_heads):
            idx = choice[b][h]
            if not idx:
                continue
            w = layer.sparse_qkv[h]
            xs = query[b, idx]
            q = reference_rotary_at(xs @ w[:, :d], layer.rotary, idx)
            k = reference_rotary_at(xs @ w[:, d:2 * d], layer.rotary, idx)
            v = xs @ w[:, 2 * d:]
            sub_allowed = allowed[:, :, idx][:, :, :, idx]
            sub_added = added[:, :, idx][:, :, :, idx]
            o = reference_softmax_attention(q[None, None], k[None, None], v[None, None], sub_allowed, sub_added,
                                            1.0 / math.sqrt(d))[0, 0]
            rows = (o * r[b, idx, h][:, None]) @ layer.sparse_out[h]
            y = y.index_put((torch.full((len(idx),), b), torch.tensor(idx)), rows, accumulate=True)
    if layer.dense is not None:
        y = y + reference_mha(layer.dense, query, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                              is_causal=is_causal)
    return y


def reference_gqe_selection(layer: GroupedQueryExpertsAttention, x: Tensor) -> tuple[Tensor, list]:
    """GQE's router, token by token and group by group: ``p`` ``(batch, time, G, M)``, the softmax of each group's
    logits ``x_t W_r^g``, and ``chosen[b][t][g]``, the group's ``k`` selected experts in slot order: decreasing
    ``p``. The random control: ``p = 1/M`` and the experts of
    :func:`~headmix.routing.random.reference_random_choice` (an evaluation call), in its order."""
    b_n, t_n, _ = x.shape
    groups, per, k = layer.kv_heads, layer.experts_per_group, layer.top_k
    p = torch.zeros(b_n, t_n, groups, per, dtype=x.dtype)
    chosen = []
    for b in range(b_n):
        rows = []
        for t in range(t_n):
            picks = []
            for g in range(groups):
                if layer.random_routing:
                    p[b, t, g] = 1.0 / per
                    picks.append(reference_random_choice(int(layer.random_router.seed), EVAL_SALT, 0, b, t, g, per, k))
                    continue
                logits = x[b, t] @ layer.router_gate.weight[g * per:(g + 1) * per].T
                p_g = torch.exp(logits - logits.max())
                p[b, t, g] = p_g / p_g.sum()
                order = sorted(range(per), key=lambda e: (-float(p[b, t, g, e].detach()), e))
                picks.append(order[:k])
            rows.append(picks)
        chosen.append(rows)
    return p, chosen


def reference_gqe(layer: GroupedQueryExpertsAttention, query: Tensor, key: Tensor | None = None,
                  value: Tensor | None = None, **masks) -> Tensor:
    """GQE (arXiv 2606.20945, eq. 6), one token, group and slot at a time: slot ``(g, j)`` is
    ``o = softmax(q K_g^T / sqrt(d_h)) V_g`` with ``q = x_t W_q^{g,e}`` of the token's ``j``-th selected expert
    ``e`` in group ``g`` (:func:`reference_gqe_selection`), ``K_g, V_g`` the group's K/V head; the weighted slot
    ``sum w o`` with ``w = p / sum_selected p`` over all the token's selected heads (or ``p``); the shared head
    over the mean of the ``G`` K/V heads (keys rotated first) or K/V head 0 (``shared_head_kv``); ``y_t = Concat(slots, o_bar, s) W_O + b``. Hard slots times ``p`` with
    ``hard_slot_scale="p"``."""
    rotary = _self_rotary(layer, query, key, value)
    key, value = _inputs(query, key, value)
    b_n, t_n, _ = query.shape
    groups, per, k, d = layer.kv_heads, layer.experts_per_group, layer.top_k, layer.head_dim
    keys = reference_rotary(_heads(layer.k_proj(key), groups), rotary)      # (B, G, S, d_h)
    values = _heads(layer.v_proj(value), groups)
    allowed, added = reference_mask(b_n, 1, t_n, key.shape[1], **masks)
    p, chosen = reference_gqe_selection(layer, query)
    w_q, b_q = layer.q_proj.weight, layer.q_proj.bias

    if layer.shared_head_kv == "mean":  # the shared head's K/V: appended as head G, the mean of heads 0 .. G-1
        keys = torch.cat([keys, sum(keys[:, g:g + 1] for g in range(groups)) / groups], 1)
        values = torch.cat([values, sum(values[:, g:g + 1] for g in range(groups)) / groups], 1)
    shared_kv = groups if layer.shared_head_kv == "mean" else 0

    def head(b: int, t: int, row: int, kv: int) -> Tensor:  # query head `row` of q_proj at token t over K/V kv
        q = query[b, t] @ w_q[row * d:(row + 1) * d].T + (0 if b_q is None else b_q[row * d:(row + 1) * d])
        q = reference_rotary(q[None, None, None], rotary, offset=t)
        o = reference_softmax_attention(q, keys[b:b + 1, kv:kv + 1], values[b:b + 1, kv:kv + 1],
                                        allowed[b:b + 1, :, t:t + 1], added[b:b + 1, :, t:t + 1], 1.0 / math.sqrt(d))
        return o[0, 0, 0]

    rows = []
    for b in range(b_n):
        for t in range(t_n):
            outs, probs = [], []
            for g in range(groups):
                for e in chosen[b][t][g]:
                    outs.append(head(b, t, g * per + e, g))
                    probs.append(p[b, t, g, e])
            total = sum(probs)
            hard = [o * pr for o, pr in zip(outs, probs)] if layer.hard_slot_scale == "p" else list(outs)
            if layer.weighted_slot:
                weights = [pr / total for pr in probs] if layer.weighted_slot_renormalize else probs
                hard.append(sum(wt * o for wt, o in zip(weights, outs)))
            if layer.shared_head:
                hard.append(head(b, t, layer.num_experts, shared_kv))
            rows.append(torch.cat(hard))
    y = torch.stack(rows).view(b_n, t_n, -1) @ layer.out_proj.weight.T
    if layer.out_proj.bias is not None:
        y = y + layer.out_proj.bias
    return y
