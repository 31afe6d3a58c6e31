"""The fused load-balancing loss of MoH and GQE (:func:`headmix.routing.losses.weighted_load_balance`, issue 58) against
the plain :func:`~headmix.routing.losses.grouped_load_balancing_loss`: values and gradients, one and several routers,
padding masks (some, all), both fractions, no token."""

from __future__ import annotations

import pytest
import torch

from headmix.routing.losses import grouped_load_balancing_loss, weighted_load_balance


def routers(n: int, groups: int, per: int, top_k: int, seed: int = 0):
    """``groups`` softmax routers over ``per`` experts each: logits ``(n, groups per)`` (float64) and each router's
    top ``top_k`` numbered over all the experts."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, groups, per, generator=g, dtype=torch.float64, requires_grad=True)
    local = logits.detach().softmax(-1).topk(top_k, dim=-1).indices
    experts = (local + per * torch.arange(groups)[:, None]).reshape(n, groups * top_k)
    return logits, local, experts


@pytest.mark.parametrize("fractions", ["normalized", "per_token"])
@pytest.mark.parametrize("mask", [None, "some", "none_real"])
@pytest.mark.parametrize("groups,per,top_k", [(1, 6, 2), (3, 4, 1), (2, 5, 3)])
def test_fused_load_balance_matches_the_plain_loss(groups, per, top_k, mask, fractions):
    n = 7
    logits, local, experts = routers(n, groups, per, top_k)
    token_mask = None if mask is None else torch.tensor([True, False, True, True, False, True, True]) \
        if mask == "some" else torch.zeros(n, dtype=torch.bool)
    weight = 0.3
    g_w, g_l = torch.randn(2, dtype=torch.float64)

    probs = logits.softmax(-1)
    want = grouped_load_balancing_loss(probs, local, token_mask, fractions)
    (want_grad,) = torch.autograd.grad(g_w * weight * want + g_l * want, logits)

    aux, la = weighted_load_balance(logits.softmax(-1).view(n, groups * per), experts, token_mask, weight, fractions,
                                    groups)
    (grad,) = torch.autograd.grad(g_w * aux + g_l * la, logits)
    torch.testing.assert_close(la, want, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(aux, weight * want, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-15)


def test_fused_load_balance_gradient_of_one_output():
    logits, local, experts = routers(5, 2, 3, 1)
    aux, _ = weighted_load_balance(logits.softmax(-1).view(5, 6), experts, None, 0.5, groups=2)
    (grad,) = torch.autograd.grad(aux, logits)
    want = 0.5 * grouped_load_balancing_loss(logits.softmax(-1), local)
    torch.testing.assert_close(grad, torch.autograd.grad(want, logits)[0], rtol=1e-10, atol=1e-15)


def test_fused_load_balance_without_tokens():
    probs = torch.zeros(0, 4, requires_grad=True)
    aux, la = weighted_load_balance(probs, torch.zeros(0, 2, dtype=torch.long), None, 0.1, groups=2)
    assert aux.item() == 0.0 and la.item() == 0.0
    aux.backward()
    assert probs.grad.shape == (0, 4)
