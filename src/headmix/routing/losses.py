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

    ``probs``: ``(N, E)``; ``expert_index``: ``(N, k)``; ``token_mask``: ``(N,)`` True for real tokens.
    """
    check_fractions(fractions)
    num_experts = probs.shape[-1]
    if probs.shape[0] == 0:
        return probs.sum() * 0.0
    slot_weight = torch.ones_like(expert_index, dtype=probs.dtype)
    top_k = expert_index.shape[1]
    if token_mask is None:
        tokens = float(probs.shape[0])
    else:
        # Padded tokens weigh 0 (masked, not dropped: the shapes stay static, so the loss compiles with
        # no data-dependent shape); with no real token both fractions are 0 and so is the loss.
        probs = probs.masked_fill(~token_mask[:, None], 0.0)
        slot_weight = slot_weight.masked_fill(~token_mask[:, None], 0.0)
        tokens = token_mask.sum().to(probs.dtype).clamp(min=1)
    counts = torch.zeros(num_experts, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(0, expert_index.reshape(-1), slot_weight.reshape(-1))
    # every real token fills k slots, so the slots counted are tokens * k (no reduction needed)
    f = (counts / (tokens * top_k if fractions == "normalized" else tokens)).detach()
    p = probs.sum(0) / tokens
    return num_experts * (f * p).sum()


def router_z_loss(logits: Tensor, token_mask: Tensor | None = None) -> Tensor:
    """``L_z = mean_t (log sum_i exp(x_{i,t}))^2`` over the pre-softmax logits (eq. 16), via logsumexp."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    squared = torch.logsumexp(logits.float(), dim=-1).pow(2)
    if token_mask is None:
        return squared.mean()
    # the mean over real tokens with static shapes (padded rows masked, not dropped)
    return squared.masked_fill(~token_mask, 0.0).sum() / token_mask.sum().clamp(min=1)


def routing_losses(routing: Routing, load_balance_weight: float, z_loss_weight: float,
                   load_balance_fractions: str = "normalized") -> tuple[Tensor, dict[str, Tensor]]:
    """The weighted sum ``alpha L_a + beta L_z`` (eq. 17 for one layer) and the unweighted parts
    (``load_balance_fractions``: see :func:`load_balancing_loss`)."""
    la = load_balancing_loss(routing.probs, routing.expert_index, routing.token_mask, load_balance_fractions)
    lz = router_z_loss(routing.logits, routing.token_mask)
    return load_balance_weight * la + z_loss_weight * lz, {"load_balance": la, "z_loss": lz}
