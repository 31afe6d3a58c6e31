"""Auxiliary router losses of MoA (eq. 13-17), averaged over real tokens only."""

from __future__ import annotations

import torch
from torch import Tensor

from .router import Routing


LOAD_BALANCE_FRACTIONS = ("normalized", "per_token")


def check_fractions(fractions: str) -> None:
    if fractions not in LOAD_BALANCE_FRACTIONS:
        raise ValueError(f"load_balance_fractions must be one of {LOAD_BALANCE_FRACTIONS}, got {fractions!r}")


def load_balancing_loss(probs: Tensor, expert_index: Tensor, token_mask: Tensor | None = None,
                        fractions: str = "normalized") -> Tensor:
    """``L_a = E * sum_i f_i P_i`` (eq. 13-15).

    ``f_i`` is the fraction of routing slots of the real tokens that go to expert ``i`` (no gradient);
    ``P_i`` the fraction of router probability mass on expert ``i``. Both sum to 1 over experts, so
    a perfectly uniform router gives ``L_a = 1``.

    ``fractions="per_token"`` takes ``f_i`` as the fraction of real tokens that select expert ``i``, which
    sums to ``k`` over experts (the Switch-Transformer form as Hugging Face ``JetMoe``'s
    ``load_balancing_loss_func`` and the MoH authors' code compute it with top-k): the loss is then exactly
    ``k`` times the ``"normalized"`` one (uniform router: ``k``).

    ``probs``: ``(N, E)``; ``expert_index``: ``(N, k)``; ``token_mask``: ``(N,)`` True for real tokens. One router
    group of :func:`grouped_load_balancing_loss`.
    """
    return grouped_load_balancing_loss(probs[:, None], expert_index[:, None], token_mask, fractions)


def grouped_load_balancing_loss(probs: Tensor, expert_index: Tensor, token_mask: Tensor | None = None,
                                fractions: str = "normalized") -> Tensor:
    """The mean over ``G`` router groups of each group's :func:`load_balancing_loss` over its ``M`` experts (GQE's
    and MoH's per-group routers), in one pass: ``(1/G) sum_g M sum_i f_{g,i} P_{g,i}``.

    ``probs``: ``(N, G, M)``, each group's softmax; ``expert_index``: ``(N, G, k)``, each group's selected experts
    numbered within the group; ``token_mask``: ``(N,)`` True for real tokens. The same value as the loop over the
    groups, with a fixed number of operations whatever ``G`` is (one kernel each on a GPU, not one per group)."""
    check_fractions(fractions)
    n, groups, per = probs.shape
    if n == 0:
        return probs.sum() * 0.0
    top_k = expert_index.shape[2]
    slot_weight = torch.ones_like(expert_index, dtype=probs.dtype)
    if token_mask is None:
        tokens = float(n)
    else:
        # Padded tokens weigh 0 (masked, not dropped: the shapes stay static, so the loss compiles with
        # no data-dependent shape); with no real token both fractions are 0 and so is the loss.
        probs = probs.masked_fill(~token_mask[:, None, None], 0.0)
        slot_weight = slot_weight.masked_fill(~token_mask[:, None, None], 0.0)
        tokens = token_mask.sum().to(probs.dtype).clamp(min=1)
    flat = expert_index + per * torch.arange(groups, device=expert_index.device)[:, None]
    counts = torch.zeros(groups * per, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(0, flat.reshape(-1), slot_weight.reshape(-1))
    # every real token fills k slots per group, so the slots counted are tokens * k (no reduction needed)
    f = counts.div(tokens * top_k if fractions == "normalized" else tokens).detach()
    p = probs.sum(0).reshape(-1) / tokens
    return per * (f * p).sum() / groups


def weighted_load_balance(probs: Tensor, expert_index: Tensor, token_mask: Tensor | None, weight: float,
                          fractions: str = "normalized", groups: int = 1) -> tuple[Tensor, Tensor]:
    """``(weight * L_a, L_a)``: :func:`grouped_load_balancing_loss` of ``groups`` routers side by side, computed
    with a hand-written backward into ``probs`` (:class:`_FusedLoadBalance`: seven operations forward and two
    backward instead of about 25; each one a kernel on a GPU).

    ``probs``: ``(N, E)``, the ``groups`` routers' softmaxes side by side (router ``g`` over experts ``g M .. g M +
    M - 1``, ``M = E / groups``); ``expert_index``: ``(N, groups k)``, every router's ``k`` selections numbered
    over all ``E`` experts; ``token_mask``: ``(N,)`` True for real tokens. With one group it is
    :func:`load_balancing_loss` weighted by ``weight``."""
    check_fractions(fractions)
    if probs.shape[0] == 0:
        n, per = probs.shape[0], probs.shape[1] // groups
        la = grouped_load_balancing_loss(probs.view(n, groups, per),
                                         expert_index.view(n, groups, expert_index.shape[1] // groups) % per,
                                         token_mask, fractions)
        return weight * la, la
    return _FusedLoadBalance.apply(probs, expert_index, token_mask, float(weight), groups, fractions == "per_token")


class _FusedLoadBalance(torch.autograd.Function):
    """``(w L_a, L_a)`` of :func:`weighted_load_balance` with its gradient written by hand.

    With ``T`` real tokens, ``c_e`` the real slots routed to expert ``e`` (no gradient), ``M`` experts per router,
    ``G`` routers, ``K = k`` per router (``1`` for ``fractions="per_token"``) and ``m_e = sum_t p_{t,e}`` over the
    real tokens: ``L_a = M / (G K T^2) sum_e c_e m_e`` (eq. 13-15 averaged over the routers), so
    ``dL_a / dp_{t,e} = M c_e / (G K T^2)`` for a real token and 0 for a padded one."""

    @staticmethod
    def forward(ctx, probs, expert_index, token_mask, weight, groups, per_token):
        n, num_experts = probs.shape
        slots = expert_index.shape[1]
        factor = (num_experts // groups) / (groups * (1 if per_token else slots // groups))
        if token_mask is None:
            real = None
            # c_e times the loss's scale, M / (G K T^2): one scatter of the scale itself
            slot_value = probs.new_full((), factor / (n * n)).expand(n * slots)
            mass = probs.sum(0)
        else:
            real = token_mask.to(probs.dtype)
            tokens = real.sum().clamp(min=1)
            slot_value = real.repeat_interleave(slots) * (factor / (tokens * tokens))
            # a masked sum, not `real @ probs`: a matmul would count as model MACs (FlopCounterMode)
            mass = (probs * real[:, None]).sum(0)
        scaled_counts = probs.new_zeros(num_experts).scatter_add_(0, expert_index.reshape(-1), slot_value)
        la = torch.dot(scaled_counts, mass)
        ctx.save_for_backward(scaled_counts, real)
        ctx.consts = (n, weight)
        ctx.set_materialize_grads(False)
        return la * weight, la

    @staticmethod
    def backward(ctx, grad_weighted, grad_la):
        scaled_counts, real = ctx.saved_tensors
        n, weight = ctx.consts
        if grad_weighted is None and grad_la is None:
            return None, None, None, None, None, None
        coefficient = grad_la if grad_weighted is None else grad_weighted * weight if grad_la is None else \
            torch.add(grad_la, grad_weighted, alpha=weight)
        per_expert = scaled_counts * coefficient
        grad = per_expert.expand(n, -1) if real is None else real[:, None] * per_expert
        return grad, None, None, None, None, None


def _at_least_float32(t: Tensor) -> Tensor:
    """``t`` in float32, or float64 where it is float64."""
    return t if t.dtype == torch.float64 else t.float()


def router_z_loss(logits: Tensor, token_mask: Tensor | None = None) -> Tensor:
    """``L_z = mean_t (log sum_i exp(x_{i,t}))^2`` over the pre-softmax logits (eq. 16), via logsumexp."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    squared = torch.logsumexp(_at_least_float32(logits), dim=-1).pow(2)
    if token_mask is None:
        return squared.mean()
    # the mean over real tokens with static shapes (padded rows masked, not dropped)
    return squared.masked_fill(~token_mask, 0.0).sum() / token_mask.sum().clamp(min=1)


def routing_losses(routing: Routing, load_balance_weight: float, z_loss_weight: float,
                   load_balance_fractions: str = "normalized") -> tuple[Tensor, dict[str, Tensor]]:
    """The weighted sum ``alpha L_a + beta L_z`` (eq. 17 for one layer) and the unweighted parts
    (``load_balance_fractions``: see :func:`load_balancing_loss`).

    The values are :func:`load_balancing_loss`'s and :func:`router_z_loss`'s; they are computed together, with a
    hand-written backward straight into ``routing.logits`` (:class:`_FusedRouterLosses`: a dozen operations
    forward and seven backward instead of about 28), which takes ``routing.probs`` to be
    ``softmax(routing.logits)``, as :class:`~headmix.routing.TopKRouter` makes it."""
    check_fractions(load_balance_fractions)
    if routing.probs.shape[0] == 0:
        la = load_balancing_loss(routing.probs, routing.expert_index, routing.token_mask, load_balance_fractions)
        lz = router_z_loss(routing.logits, routing.token_mask)
        return load_balance_weight * la + z_loss_weight * lz, {"load_balance": la, "z_loss": lz}
    total, la, lz = _FusedRouterLosses.apply(routing.logits, routing.probs.detach(), routing.expert_index,
                                             routing.token_mask, float(load_balance_weight), float(z_loss_weight),
                                             load_balance_fractions == "per_token")
    return total, {"load_balance": la, "z_loss": lz}


class _FusedRouterLosses(torch.autograd.Function):
    """``(alpha L_a + beta L_z, L_a, L_z)`` of eq. 15-17 with the gradient written by hand into the logits.

    With ``T`` real tokens, ``c_i`` the real slots routed to expert ``i`` (no gradient), ``K = k`` (``1`` for
    ``fractions="per_token"``), ``p = softmax(z)`` and ``lse_t = log sum_i exp(z_{t,i})``:
    ``L_a = E / (K T^2) sum_i c_i sum_t p_{t,i}`` and ``L_z = (1/T) sum_t lse_t^2``. For a real token,
    with ``w_i = g_a E c_i / (K T^2)``: ``dL/dz_{t,j} = p_{t,j} (w_j - sum_i p_{t,i} w_i + 2 g_z lse_t / T)``
    (the softmax Jacobian applied to ``w``, and ``d lse_t / dz = p_t``); padded tokens get 0.
    """

    @staticmethod
    def forward(ctx, logits, probs, expert_index, token_mask, lb_weight, z_weight, per_token):
        n, num_experts = probs.shape
        top_k = expert_index.shape[1]
        lse = torch.logsumexp(_at_least_float32(logits), dim=-1)  # the z-loss in float32 at least, as router_z_loss
        if token_mask is None:
            tokens, real = float(n), None
            slot_weight = probs.new_ones(()).expand(n * top_k)
            prob_mass, lse_real = probs.sum(0), lse
        else:
            real = token_mask.to(probs.dtype)
            tokens = real.sum().clamp(min=1)
            slot_weight = real.repeat_interleave(top_k)
            # a masked sum, not `real @ probs`: a matmul would count as model MACs (FlopCounterMode, models/counting.py)
            prob_mass, lse_real = (probs * real[:, None]).sum(0), lse * real.to(lse.dtype)
        counts = probs.new_zeros(num_experts).scatter_add_(0, expert_index.reshape(-1), slot_weight)
        lb_scale = num_experts / ((1 if per_token else top_k) * tokens * tokens)
        la = torch.dot(counts, prob_mass) * lb_scale
        lz = torch.dot(lse_real, lse) / tokens
        ctx.save_for_backward(probs, lse_real, counts)
        ctx.consts = (lb_scale, tokens, real, lb_weight, z_weight, logits.dtype)
        ctx.set_materialize_grads(False)
        return torch.add(la * lb_weight, lz, alpha=z_weight), la, lz

    @staticmethod
    def backward(ctx, grad_total, grad_la, grad_lz):
        probs, lse_real, counts = ctx.saved_tensors
        lb_scale, tokens, real, lb_weight, z_weight, dtype = ctx.consts
        # the scalar factors of the two parts' gradients: g_a lb_scale and 2 g_z / T
        scale_a = _scaled_sum(grad_total, lb_weight * lb_scale, grad_la, lb_scale)
        scale_z = _scaled_sum(grad_total, z_weight * 2.0 / tokens, grad_lz, 2.0 / tokens)
        per_row = lse_real.new_zeros(()) if scale_z is None else lse_real * scale_z
        if scale_a is None:
            grad = probs * per_row.to(probs.dtype)[:, None]
        else:
            w = counts * scale_a  # (E,): d(alpha L_a)/dp of a real token
            if real is not None:
                per_row = per_row - (probs @ w) * real  # padded tokens: no load-balance gradient
                grad = probs * (w[None, :] * real[:, None] + per_row.to(probs.dtype)[:, None])
            else:
                grad = probs * (w[None, :] + (per_row - probs @ w).to(probs.dtype)[:, None])
        return grad.to(dtype), None, None, None, None, None, None


def _scaled_sum(grad_total: Tensor | None, total_factor, grad_part: Tensor | None, part_factor) -> Tensor | None:
    """``grad_total * total_factor + grad_part * part_factor``, the missing (None) terms left out."""
    terms = [g * f for g, f in ((grad_total, total_factor), (grad_part, part_factor)) if g is not None]
    return None if not terms else terms[0] if len(terms) == 1 else terms[0] + terms[1]
