"""MoA's auxiliary losses computed together (``routing_losses``, eq. 15-17) with their hand-written backward:
values and gradients (into the router logits, through ``probs = softmax(logits)``) equal to the separate
``load_balancing_loss`` and ``router_z_loss``, with and without padding, both load-balance fractions, and
with gradients through the returned parts; and the op count of a MoA training step."""

from __future__ import annotations

import pytest
import torch

from headmix.routing import load_balancing_loss, router_z_loss, routing_losses
from headmix.routing.router import Routing


def routing_from(logits: torch.Tensor, top_k: int, mask: torch.Tensor | None) -> Routing:
    probs = logits.softmax(-1)
    _, index = probs.detach().topk(top_k, dim=-1)
    return Routing(logits, probs, index, probs.gather(1, index), mask, (1, logits.shape[0]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("fractions", ["normalized", "per_token"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("weights", [(0.01, 0.001), (0.5, 2.0), (0.0, 1.0), (1.0, 0.0)])
def test_fused_losses_equal_the_separate_ones(dtype, fractions, masked, weights):
    g = torch.Generator().manual_seed(0)
    n, e, k = 13, 7, 3
    logits = (3 * torch.randn(n, e, generator=g, dtype=torch.float64)).to(dtype)
    mask = (torch.rand(n, generator=g) < 0.7) if masked else None
    alpha, beta = weights
    cot = torch.randn(3, generator=g, dtype=torch.float64)  # through the total and both parts
    if beta == 0:
        cot[2] = 0.0  # no gradient through L_z: the float64 load-balance gradient alone, checked exactly

    def losses(fused):
        z = logits.clone().requires_grad_()
        r = routing_from(z, k, mask)
        if fused:
            total, parts = routing_losses(r, alpha, beta, fractions)
            la, lz = parts["load_balance"], parts["z_loss"]
        else:
            la = load_balancing_loss(r.probs, r.expert_index, mask, fractions)
            lz = router_z_loss(z, mask)
            total = alpha * la + beta * lz
        values = torch.stack([total.double(), la.double(), lz.double()])
        (grad,) = torch.autograd.grad((values * cot).sum(), z)
        return values.detach(), grad

    # the z-loss's logsumexp is float32 in both (its gradient: float32 softmax there, float64 p here)
    exact = dtype == torch.float64 and beta == 0
    tol = dict(atol=1e-12, rtol=1e-10) if exact else dict(atol=1e-6, rtol=1e-5)
    (v_fused, g_fused), (v_sep, g_sep) = losses(True), losses(False)
    torch.testing.assert_close(v_fused, v_sep, atol=1e-7, rtol=1e-6)  # the z-loss is float32 in both
    torch.testing.assert_close(g_fused, g_sep, **tol)
    if masked:
        assert torch.all(g_fused[~mask] == 0)


def test_only_the_total_or_only_a_part_has_a_gradient():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 5, generator=g, dtype=torch.float64, requires_grad=True)
    for pick in ("total", "load_balance", "z_loss"):
        r = routing_from(logits, 2, None)
        total, parts = routing_losses(r, 0.3, 0.7)
        out = total if pick == "total" else parts[pick]
        (got,) = torch.autograd.grad(out, logits)
        r = routing_from(logits, 2, None)
        la = load_balancing_loss(r.probs, r.expert_index)
        lz = router_z_loss(logits)
        want_out = {"total": 0.3 * la + 0.7 * lz, "load_balance": la, "z_loss": lz}[pick]
        (want,) = torch.autograd.grad(want_out, logits)
        tol = 1e-12 if pick == "load_balance" else 1e-6  # the z-loss: float32 logsumexp
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_no_tokens():
    logits = torch.zeros(0, 4, requires_grad=True)
    total, parts = routing_losses(routing_from(logits, 2, None), 0.1, 0.1)
    assert total.item() == 0 and parts["load_balance"].item() == 0
