"""headmix's routers as one C++ operation forward and one backward each (CPU): the softmax top-k router with its
auxiliary losses (:func:`softmax_topk_route`), MoH's whole head weighting (:func:`moh_route`) and SwitchHead's
sigmoid selectors (:func:`sigmoid_topk_route`).

What it computes is :mod:`headmix.routing`'s (its reference, tested against it in tests/test_fused_router.py), for
``G`` routers side by side of ``M`` experts each (MoA: ``G = 1``; GQE and MoH routed per K/V group: one router per
group), on the router logits ``z`` ``(N, G M)`` (the gate GEMM stays outside, an ordinary ``F.linear``):

* MoA eq. 7-8: ``p = softmax(z_g)`` per router, ``index, top_p = TopK(p, k)`` (``torch.topk``'s choice and order,
  ties included);
* eq. 9: the gates ``c top_p / S`` with ``S`` the selected probabilities' sum, held constant
  (``renormalize="detached"``, the paper) or differentiated (``"live"``), or ``c top_p`` (``"none"``); ``c`` is
  ``scale`` (MoH's ``k`` or ``M``, 1 elsewhere); ``"live_total"``: ``S`` the sum over every router of the token,
  differentiated (GQE's weighted-sum slot, ``p`` over the ``G k`` selected heads);
* eq. 13-15 averaged over the routers: ``L_a = M / (G K T^2) sum_e c_e sum_t p_{t,e}`` over the ``T`` real tokens,
  ``c_e`` the real slots routed to expert ``e``, ``K = k`` (``1`` with per-token fractions);
* eq. 16: ``L_z = (1/T) sum_t lse_t^2`` (``z_loss=True``, one router only);
* eq. 17 for the layer: ``total = w_a L_a + w_z L_z``.

The composed form takes about 30 ATen operations forward and backward (softmax, top-k, the renormalisation, the
two losses' fused autograd functions and their backward); here the forward is one operation and the backward one,
so a training step dispatches the router's gate GEMM and these two. The operation runs on CPU tensors where the C++
kernels are built (:mod:`.cpp_build`); :func:`fused_router_applies` says when, and the layers run their composed
form everywhere else (a GPU, a compiled graph, ``HEADMIX_CPU_KERNEL=python``, no compiler, no token). It is a
``torch.library`` custom op with a fake implementation, so ``torch.compile(fullgraph=True)`` of a function that
calls it sees one operation; the layers themselves keep the composed form under compile (vLLM's graphs leave the
token count unbacked, and asking whether a batch has tokens would guard on it).

:func:`moh_route` is MoH's head weighting (Jin et al. 2024, eq. 5-6; the composed form is
:class:`headmix.attention.moh.MoHHeadWeighting`'s) per router group ``g`` of ``G``, each of ``S`` shared and
``M = R / G`` routed heads, from the logits of one GEMM ``z = [z_r (N, R) | z_a (N, G, 2) | z_s (N, G, S)]``
(``z_a``, ``z_s`` absent when ``S = 0``):

* the routed heads by the router above on ``z_r``: ``p = softmax(z_r,g)``, ``index, top_p = TopK(p, k)``, the
  gates ``k top_p / sum(top_p)`` (``"renormalized"``, the sum differentiated), ``M top_p`` (``"scaled"``) or
  ``top_p`` (``"paper"``), and ``L_a``, ``total = w_a L_a`` (no z-loss);
* eq. 6's split and shared weights: ``a = c softmax(z_a,g)``, ``s = c_s softmax(z_s,g)`` (``c = 2``, ``c_s = S``;
  ``"paper"``: 1 and 1); the routed heads' weights ``a_1 gates``, the shared heads' ``a_0 s`` (``S = 0``: the
  gates alone).

Group ``g``'s heads are the layer's heads ``g (S + M) .. g (S + M) + S + M - 1``, its shared heads first
(:func:`headmix.attention.moh.head_ids`). The composed form is three GEMMs and about 40 more ATen operations
forward and backward; here the forward is one operation and the backward one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .cpp_build import cpp_kernel_available, cpp_ops

__all__ = ["MOH_WEIGHTING_CODES", "RENORMALIZE_CODES", "fused_router_applies", "moh_route", "sigmoid_topk_route",
           "softmax_topk_route"]

#: ``renormalize`` as the kernel numbers it.
RENORMALIZE_CODES = {"none": 0, "detached": 1, "live": 2, "live_total": 3}


@torch.library.custom_op("headmix::softmax_topk_route", mutates_args=(), device_types="cpu")
def _route_op(logits: Tensor, token_mask: Tensor | None, groups: int, top_k: int, renorm: int, scale: float,
              lb_weight: float, z_weight: float, per_token: bool, z_loss: bool
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(probs, index, gates, total, L_a, L_z, lse, scaled_counts, tokens)``; the last three are kept for the
    backward (``lse`` empty without the z-loss)."""
    outputs = cpp_ops().softmax_topk_route(logits, token_mask, groups, top_k, renorm, scale, lb_weight, z_weight,
                                           per_token, z_loss)
    return tuple(outputs)


@_route_op.register_fake
def _(logits, token_mask, groups, top_k, renorm, scale, lb_weight, z_weight, per_token, z_loss):
    n, experts = logits.shape
    scalar = logits.new_empty(())
    return (logits.new_empty(n, experts), logits.new_empty(n, groups, top_k, dtype=torch.long),
            logits.new_empty(n, groups, top_k), scalar, logits.new_empty(()), logits.new_empty(()),
            logits.new_empty(n if z_loss else 0), logits.new_empty(experts), logits.new_empty(()))


@torch.library.custom_op("headmix::softmax_topk_route_backward", mutates_args=(), device_types="cpu")
def _route_backward_op(grad_probs: Tensor | None, grad_gates: Tensor | None, grad_total: Tensor | None,
                       grad_la: Tensor | None, grad_lz: Tensor | None, probs: Tensor, index: Tensor,
                       token_mask: Tensor | None, lse: Tensor, scaled_counts: Tensor, tokens: Tensor, groups: int,
                       renorm: int, scale: float, lb_weight: float, z_weight: float) -> Tensor:
    """The gradient of :func:`_route_op`'s differentiable outputs with respect to the logits."""
    return cpp_ops().softmax_topk_route_backward(grad_probs, grad_gates, grad_total, grad_la, grad_lz, probs, index,
                                                 token_mask, lse, scaled_counts, tokens, groups, renorm, scale,
                                                 lb_weight, z_weight)


@_route_backward_op.register_fake
def _(grad_probs, grad_gates, grad_total, grad_la, grad_lz, probs, index, token_mask, lse, scaled_counts, tokens,
      groups, renorm, scale, lb_weight, z_weight):
    return probs.new_empty(probs.shape)


def _setup_context(ctx, inputs, output):
    logits, token_mask, groups, top_k, renorm, scale, lb_weight, z_weight, per_token, z_loss = inputs
    probs, index, gates, total, la, lz, lse, scaled_counts, tokens = output
    ctx.save_for_backward(probs, index, token_mask, lse, scaled_counts, tokens)
    ctx.consts = (groups, renorm, scale, lb_weight, z_weight)
    ctx.mark_non_differentiable(index, lse, scaled_counts, tokens)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_probs, grad_index, grad_gates, grad_total, grad_la, grad_lz, *unused):
    probs, index, token_mask, lse, scaled_counts, tokens = ctx.saved_tensors
    if grad_probs is None and grad_gates is None and grad_total is None and grad_la is None and grad_lz is None:
        return (None,) * 10
    grad = _route_backward_op(grad_probs, grad_gates, grad_total, grad_la, grad_lz, probs, index, token_mask, lse,
                              scaled_counts, tokens, *ctx.consts)
    return (grad,) + (None,) * 9


_route_op.register_autograd(_backward, setup_context=_setup_context)


def fused_router_applies(x: Tensor) -> bool:
    """True where :func:`softmax_topk_route` runs the C++ operation for a router reading ``x``: CPU tensors of at
    least one token, eager (a compiled graph, vLLM's with its token count unbacked among them, keeps the composed
    router, which it traces whole: asking for the token count there would guard on it), with the C++ kernels built
    and not forced off (``HEADMIX_CPU_KERNEL=python``)."""
    return (x.device.type == "cpu" and not torch.compiler.is_compiling() and x.numel() > 0
            and cpp_kernel_available())


def softmax_topk_route(logits: Tensor, token_mask: Tensor | None, *, groups: int, top_k: int, renormalize: str,
                       scale: float, load_balance_weight: float, z_loss_weight: float, per_token: bool,
                       z_loss: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(probs (N, G M), index (N, G, k), gates (N, G, k), total, L_a, L_z)`` of the module docstring's equations
    for ``logits`` ``(N, G M)`` and ``token_mask`` ``(N,)`` (True for real tokens; None: all real); ``index`` numbers
    the experts within their router. ``L_z`` is 0 without ``z_loss``. Call where :func:`fused_router_applies`."""
    if z_loss and groups != 1:
        raise ValueError(f"z_loss is defined for one router, got groups={groups}")
    outputs = _route_op(logits, token_mask, groups, top_k, RENORMALIZE_CODES[renormalize], float(scale),
                        float(load_balance_weight), float(z_loss_weight), bool(per_token), bool(z_loss))
    return outputs[:6]


# ------------------------------------------------------------------------------------ MoH's head weighting
#: MoH's ``head_weighting`` as the kernel numbers it.
MOH_WEIGHTING_CODES = {"renormalized": 0, "paper": 1, "scaled": 2}


@torch.library.custom_op("headmix::moh_route", mutates_args=(), device_types="cpu")
def _moh_op(logits: Tensor, token_mask: Tensor | None, routed: int, groups: int, top_k: int, shared: int,
            weighting: int, lb_weight: float, per_token: bool, dense: bool
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                       Tensor]:
    """``(probs, expert_index, slot_heads, slot_weights, head_weights, total, L_a, index, gates, a, s,
    scaled_counts, tokens)`` of :func:`moh_route`; the last six are kept for the backward (``index`` group-local,
    ``gates`` the routed gates before the split, ``a`` and ``s`` the unscaled softmaxes, empty without shared
    heads)."""
    return tuple(cpp_ops().moh_route(logits, token_mask, routed, groups, top_k, shared, weighting, lb_weight,
                                     per_token, dense))


@_moh_op.register_fake
def _(logits, token_mask, routed, groups, top_k, shared, weighting, lb_weight, per_token, dense):
    n = logits.shape[0]
    slots, heads = groups * (shared + top_k), groups * (shared + routed // groups)
    long = dict(dtype=torch.long)
    return (logits.new_empty(n, routed), logits.new_empty(n, groups * top_k, **long),
            logits.new_empty(n, slots, **long), logits.new_empty(n, slots),
            logits.new_empty(n, heads) if dense else logits.new_empty(0), logits.new_empty(()),
            logits.new_empty(()), logits.new_empty(n, groups, top_k, **long), logits.new_empty(n, groups, top_k),
            logits.new_empty(n, groups, 2) if shared else logits.new_empty(0),
            logits.new_empty(n, groups, shared) if shared else logits.new_empty(0), logits.new_empty(routed),
            logits.new_empty(()))


@torch.library.custom_op("headmix::moh_route_backward", mutates_args=(), device_types="cpu")
def _moh_backward_op(grad_probs: Tensor | None, grad_slot_weights: Tensor | None, grad_head_weights: Tensor | None,
                     grad_total: Tensor | None, grad_la: Tensor | None, probs: Tensor, index: Tensor, gates: Tensor,
                     group_gates: Tensor, shared_gates: Tensor, token_mask: Tensor | None, scaled_counts: Tensor,
                     tokens: Tensor, groups: int, shared: int, weighting: int, lb_weight: float) -> Tensor:
    """The gradient of :func:`_moh_op`'s differentiable outputs with respect to the logits ``(N, R + 2G + G S)``."""
    return cpp_ops().moh_route_backward(grad_probs, grad_slot_weights, grad_head_weights, grad_total, grad_la, probs,
                                        index, gates, group_gates, shared_gates, token_mask, scaled_counts, tokens,
                                        groups, shared, weighting, lb_weight)


@_moh_backward_op.register_fake
def _(grad_probs, grad_slot_weights, grad_head_weights, grad_total, grad_la, probs, index, gates, group_gates,
      shared_gates, token_mask, scaled_counts, tokens, groups, shared, weighting, lb_weight):
    n, routed = probs.shape
    return probs.new_empty(n, routed + (groups * (2 + shared) if shared else 0))


def _moh_setup_context(ctx, inputs, output):
    logits, token_mask, routed, groups, top_k, shared, weighting, lb_weight, per_token, dense = inputs
    probs, expert_index, slot_heads, _, _, _, _, index, gates, a, s, scaled_counts, tokens = output
    ctx.save_for_backward(probs, index, gates, a, s, token_mask, scaled_counts, tokens)
    ctx.consts = (groups, shared, weighting, lb_weight)
    ctx.mark_non_differentiable(expert_index, slot_heads, index, gates, a, s, scaled_counts, tokens)
    ctx.set_materialize_grads(False)


def _moh_backward(ctx, grad_probs, grad_expert_index, grad_slot_heads, grad_slot_weights, grad_head_weights,
                  grad_total, grad_la, *unused):
    probs, index, gates, a, s, token_mask, scaled_counts, tokens = ctx.saved_tensors
    if all(g is None for g in (grad_probs, grad_slot_weights, grad_head_weights, grad_total, grad_la)):
        return (None,) * 10
    grad = _moh_backward_op(grad_probs, grad_slot_weights, grad_head_weights, grad_total, grad_la, probs, index,
                            gates, a, s, token_mask, scaled_counts, tokens, *ctx.consts)
    return (grad,) + (None,) * 9


_moh_op.register_autograd(_moh_backward, setup_context=_moh_setup_context)


def moh_route(logits: Tensor, token_mask: Tensor | None, *, routed_heads: int, groups: int, top_k: int, shared: int,
              weighting: str, load_balance_weight: float, per_token: bool, dense: bool
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """MoH's head weighting (the module docstring's equations) in one operation forward and one backward, on
    ``logits`` ``(N, R + 2G + G S)`` = ``[routed (N, R) | group gates (N, G, 2) | shared gates (N, G, S)]``
    (``(N, R)`` when ``shared`` is 0), ``R = routed_heads``, ``G = groups``, ``S = shared`` shared heads per group,
    ``M = R / G`` routed heads per group, and ``token_mask`` ``(N,)`` (True for real tokens; None: all real).
    ``weighting``: ``"renormalized"``, ``"paper"`` or ``"scaled"``; ``per_token``: the load-balancing fractions per
    token (else normalized). Returns:

    * ``probs`` ``(N, R)``: each group's softmax over its routed heads;
    * ``expert_index`` ``(N, G k)``: the selected routed heads, numbered ``g M + local`` group by group;
    * ``slot_heads`` ``(N, G (S + k))``: each token's active heads per group as the layer numbers them,
      ``g (S + M) + j``: the group's ``S`` shared heads, then its ``k`` selected routed heads in top-k order;
    * ``slot_weights`` ``(N, G (S + k))``: their weights, in the same order;
    * ``head_weights`` ``(N, G (S + M))``: every head's weight (0 for the unselected routed heads) with ``dense``,
      else an empty tensor;
    * ``total`` (``load_balance_weight`` times ``L_a``) and ``L_a``, 0-dim.

    The gradient reaches the logits from ``probs``, ``slot_weights``, ``head_weights``, ``total`` and ``L_a``.
    Call where :func:`fused_router_applies`."""
    if not isinstance(logits, Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a 2-d tensor (N, R + 2G + G S), got "
                         f"{tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__}")
    if logits.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"logits must be float32 or float64, got {logits.dtype}")
    if logits.device.type != "cpu":
        raise ValueError(f"logits must be on the CPU, got {logits.device}")
    if weighting not in MOH_WEIGHTING_CODES:
        raise ValueError(f"weighting must be one of {sorted(MOH_WEIGHTING_CODES)}, got {weighting!r}")
    for name, value, least in (("groups", groups, 1), ("routed_heads", routed_heads, 1), ("top_k", top_k, 1),
                               ("shared", shared, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if routed_heads % groups:
        raise ValueError(f"routed_heads must be a multiple of groups={groups}, got {routed_heads}")
    if top_k > routed_heads // groups:
        raise ValueError(f"top_k must be at most the {routed_heads // groups} routed heads per group, got {top_k}")
    width = routed_heads + (groups * (2 + shared) if shared else 0)
    if logits.shape[1] != width:
        raise ValueError(f"logits must have R + 2G + G S = {width} columns (routed_heads={routed_heads}, "
                         f"groups={groups}, shared={shared}), got {logits.shape[1]}")
    if token_mask is not None and (token_mask.dtype != torch.bool or tuple(token_mask.shape) != logits.shape[:1]):
        raise ValueError(f"token_mask must be a bool tensor ({logits.shape[0]},), got {token_mask.dtype} "
                         f"{tuple(token_mask.shape)}")
    outputs = _moh_op(logits, token_mask, routed_heads, groups, top_k, shared, MOH_WEIGHTING_CODES[weighting],
                      float(load_balance_weight), bool(per_token), bool(dense))
    return outputs[:7]


# ------------------------------------------------------------------------------------ SwitchHead's selectors
@torch.library.custom_op("headmix::sigmoid_topk_route", mutates_args=(), device_types="cpu")
def _sigmoid_op(logits: Tensor, heads: int, top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(s, index, gates)`` of :func:`sigmoid_topk_route`."""
    return tuple(cpp_ops().sigmoid_topk_route(logits, heads, top_k))


@_sigmoid_op.register_fake
def _(logits, heads, top_k):
    n = logits.shape[0]
    return (logits.new_empty(logits.shape), logits.new_empty(n, heads, top_k, dtype=torch.long),
            logits.new_empty(n, heads, top_k))


@torch.library.custom_op("headmix::sigmoid_topk_route_backward", mutates_args=(), device_types="cpu")
def _sigmoid_backward_op(grad_s: Tensor | None, grad_gates: Tensor | None, s: Tensor, index: Tensor) -> Tensor:
    """The gradient of :func:`_sigmoid_op`'s ``s`` and ``gates`` with respect to the logits."""
    return cpp_ops().sigmoid_topk_route_backward(grad_s, grad_gates, s, index)


@_sigmoid_backward_op.register_fake
def _(grad_s, grad_gates, s, index):
    return s.new_empty(s.shape)


def _sigmoid_setup_context(ctx, inputs, output):
    s, index, _ = output
    ctx.save_for_backward(s, index)
    ctx.mark_non_differentiable(index)
    ctx.set_materialize_grads(False)


def _sigmoid_backward(ctx, grad_s, grad_index, grad_gates):
    s, index = ctx.saved_tensors
    if grad_s is None and grad_gates is None:
        return None, None, None
    return _sigmoid_backward_op(grad_s, grad_gates, s, index), None, None


_sigmoid_op.register_autograd(_sigmoid_backward, setup_context=_sigmoid_setup_context)


def sigmoid_topk_route(logits: Tensor, heads: int, top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """SwitchHead's selectors (Csordás et al., arXiv 2312.07987) on ``logits`` ``(N, H E)``: ``s = sigmoid(z)``
    ``(N, H E)``, per head the ``top_k`` largest ``s`` (``torch.topk``'s choice and order) as ``index`` ``(N, H, k)``
    numbered ``h E + e``, and their ``s`` as ``gates`` ``(N, H, k)``; the gradient flows through ``s`` and the
    gates, not the choice. Call where :func:`fused_router_applies`."""
    return _sigmoid_op(logits, heads, top_k)
