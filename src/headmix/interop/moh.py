"""Dense attention -> Mixture-of-Head attention, for continue-tuning a trained model into MoH as the MoH
paper does with LLaMA3-8B (Jin et al. 2024, section 4.4).

What the conversion preserves, exactly: the query, key, value and output projections (and their biases,
and the rotary embedding), the grouped K/V heads (``kv_heads``), the QK-norm weights (``q_norm``, ``k_norm``)
and the output gate (``gate_proj``) are copied, so every head ``H^i`` and its output block ``W_O^i`` are the dense
layer's. The new routers (routed-head gate ``W_r``, and with shared heads the shared gate ``W_s`` and the
group gate ``W_h``) start at zero: uniform scores, so every active head gets the weight 1 with MoH's
``head_weighting="renormalized"`` (the default; ``a_r = a_s = 1`` and ``k p_i / sum_{TopK} p = 1``) and
``"scaled"`` (``R p_i = 1``). The paper's equations (``"paper"``: ``g_i = a_r p_i`` without the factor 2 and
the group sizes) weight a fresh head ``1 / (2R)``, which no zero-initialised router can undo: that
weighting is refused. Hence:

- with ``top_k`` equal to the number of routed heads (every head active), the MoH layer's output equals
  the dense layer's for every input (``sum_i 1 * H^i W_O^i`` is MHA's summation form);
- with fewer routed heads per token, each token's output is the dense output without the contributions of
  the heads not selected for it (``sum_{i active} H^i W_O^i``); at zero router weights the top-k choice
  among equal scores is a tie, broken by ``torch.topk``. Continue-tuning learns the router from there.

A router that would get no gradient from the task loss is refused as in any MoH layer
(:mod:`headmix.routing.task_gradient`): ``top_k=1`` with the default ``"renormalized"`` weighting (the selected
head weighs ``a_r``, whatever the scores), and one routed head (per group). ``top_k=1`` with
``head_weighting="scaled"`` starts from the dense layer as well and its router learns.

The auxiliary load-balancing loss of the new layer is not part of the dense model (it is 1 at uniform
routing, times ``load_balance_weight``).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..attention import MixtureOfHeadsAttention, MultiHeadAttention


#: The MoH head weightings under which zero routers weight every active head 1.
PRESERVING_WEIGHTINGS = ("renormalized", "scaled")


def zero_moh_routers(layer: MixtureOfHeadsAttention) -> MixtureOfHeadsAttention:
    """Set MoH's router weights (``routed_gate``, ``shared_gate``, ``group_gate``) to zero: uniform scores,
    every active head weighted 1 (``ValueError`` for ``head_weighting="paper"``, where that does not hold).
    Returns the layer."""
    if layer.head_weighting not in PRESERVING_WEIGHTINGS:
        raise ValueError(f"head_weighting must be one of {PRESERVING_WEIGHTINGS} to start from the dense layer "
                         f"(with {layer.head_weighting!r} a zero router weights each head 1/(2R), not 1)")
    with torch.no_grad():
        for gate in (layer.routed_gate, layer.shared_gate, layer.group_gate):
            if gate is not None:
                gate.weight.zero_()
    return layer


def moh_from_dense(layer: MultiHeadAttention, num_shared_heads: int, top_k: int, *,
                   load_balance_weight: float = 0.01, **moh_options) -> MixtureOfHeadsAttention:
    """A :class:`MixtureOfHeadsAttention` with the heads of the dense ``layer`` (a headmix
    :class:`MultiHeadAttention`; its first ``num_shared_heads`` heads become the shared heads) and zero
    routers, with the layer's ``kv_heads``, QK-norm and output gate; see the module docstring for what is
    preserved. ``moh_options`` are passed to MoH's constructor (e.g. its weighting option, or
    ``route_per_group=True``)."""
    if type(layer) is not MultiHeadAttention:
        raise ValueError(f"layer must be a headmix MultiHeadAttention, got {type(layer).__name__}")
    if layer.key_dim != layer.head_dim:
        raise ValueError(f"layer has key_dim {layer.key_dim} != head_dim {layer.head_dim}; MoH heads have one size")
    weight = layer.q_proj.weight
    rotary = copy.deepcopy(layer.rotary) if getattr(layer, "rotary", None) is not None else False
    moh = MixtureOfHeadsAttention(layer.embed_dim, layer.num_heads, num_shared_heads, top_k, layer.head_dim,
                                  q_bias=layer.q_proj.bias is not None, kv_bias=layer.k_proj.bias is not None,
                                  out_bias=layer.out_proj.bias is not None, dropout=layer.dropout,
                                  load_balance_weight=load_balance_weight, rotary=rotary, kv_heads=layer.kv_heads,
                                  qk_norm=layer.qk_norm, qk_norm_eps=layer.q_norm.eps if layer.qk_norm else 1e-6,
                                  output_gate=layer.output_gate, **moh_options)
    moh.to(device=weight.device, dtype=weight.dtype)
    copy_projections(moh, layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj)
    with torch.no_grad():
        for name in ("q_norm", "k_norm", "gate_proj"):
            if getattr(layer, name) is not None:
                getattr(moh, name).load_state_dict(getattr(layer, name).state_dict())
    return zero_moh_routers(moh)


def copy_projections(target: MultiHeadAttention, q: nn.Linear, k: nn.Linear, v: nn.Linear, out: nn.Linear) -> None:
    """Copy four linear layers' weights (and biases, which must exist on both sides or neither) into the
    ``q_proj``/``k_proj``/``v_proj``/``out_proj`` of a headmix MHA-family layer."""
    with torch.no_grad():
        for mine, theirs, name in ((target.q_proj, q, "q_proj"), (target.k_proj, k, "k_proj"),
                                   (target.v_proj, v, "v_proj"), (target.out_proj, out, "out_proj")):
            if mine.weight.shape != theirs.weight.shape:
                raise ValueError(f"{name}: shape {tuple(theirs.weight.shape)} does not fit {tuple(mine.weight.shape)}")
            if (mine.bias is None) != (theirs.bias is None):
                raise ValueError(f"{name}: bias {'missing' if theirs.bias is None else 'present'} in the source")
            mine.weight.copy_(theirs.weight)
            if mine.bias is not None:
                mine.bias.copy_(theirs.bias)
