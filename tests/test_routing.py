"""Routers and routing losses against hand computations on fixed routings (MoA eq. 2-3, 7-9, 13-17;
MoH's load-balancing loss)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from headmix import MixtureOfAttentionHeads, MixtureOfHeadsAttention
from headmix.routing import Routing, TopKRouter, load_balancing_loss, load_summary, router_z_loss, routing_losses

# 4 tokens, 3 experts, k = 2; token 3 is padding.
PROBS = [[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6], [0.7, 0.2, 0.1]]
INDEX = [[0, 1], [1, 2], [2, 0], [0, 1]]
MASK = [True, True, True, False]


def hand_load_balance(probs, index, mask) -> float:
    """E * sum_i f_i P_i over the real tokens, in exact fractions (eq. 13-15)."""
    num_experts = len(probs[0])
    real = [t for t, m in enumerate(mask) if m]
    slots = [Fraction(0)] * num_experts
    for t in real:
        for e in index[t]:
            slots[e] += 1
    f = [s / sum(slots) for s in slots]
    p = [sum(Fraction(probs[t][e]).limit_denominator(1000) for t in real) / len(real) for e in range(num_experts)]
    return float(num_experts * sum(fi * pi for fi, pi in zip(f, p)))


def test_load_balancing_loss_by_hand():
    probs = torch.tensor(PROBS, dtype=torch.float64)
    index = torch.tensor(INDEX)
    mask = torch.tensor(MASK)
    # real tokens: slots E0 2, E1 2, E2 2 -> f = 1/3 each; P = (0.8, 1.1, 1.1) / 3
    # L_a = 3 * (1/3) * (0.8 + 1.1 + 1.1) / 3 = 1.0
    assert hand_load_balance(PROBS, INDEX, MASK) == pytest.approx(1.0, abs=1e-15)
    torch.testing.assert_close(load_balancing_loss(probs, index, mask), torch.tensor(1.0, dtype=torch.float64))
    # an uneven routing: f = (3, 2, 1) / 6 over all 4 tokens... computed by hand
    uneven = [[0, 1], [0, 2], [0, 1], [1, 0]]
    expected = hand_load_balance(PROBS, uneven, [True] * 4)
    # f = (4, 3, 1)/8, P = (1.5, 1.3, 1.2)/4 -> 3 * (6 + 3.9 + 1.2) / 32 = 33.3 / 32
    assert expected == pytest.approx(3 * (4 * 1.5 + 3 * 1.3 + 1 * 1.2) / 32)
    torch.testing.assert_close(load_balancing_loss(probs, torch.tensor(uneven)), torch.tensor(expected, dtype=torch.float64))
    with_mask = hand_load_balance(PROBS, uneven, MASK)  # f = (3, 2, 1)/6, P = (0.8, 1.1, 1.1)/3
    assert with_mask == pytest.approx(3 * (3 * 0.8 + 2 * 1.1 + 1 * 1.1) / 18)
    torch.testing.assert_close(load_balancing_loss(probs, torch.tensor(uneven), mask), torch.tensor(with_mask, dtype=torch.float64))


def test_load_balancing_gradient_flows_through_p_only():
    # dL/dp_{t,i} = E f_i / T over real tokens, 0 on padding: f carries no gradient (eq. 14 counts).
    probs = torch.tensor(PROBS, dtype=torch.float64, requires_grad=True)
    uneven = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    load_balancing_loss(probs, uneven, torch.tensor(MASK)).backward()
    f = torch.tensor([3, 2, 1], dtype=torch.float64) / 6
    expected = torch.cat([(3 * f / 3).expand(3, 3), torch.zeros(1, 3, dtype=torch.float64)])
    torch.testing.assert_close(probs.grad, expected)


def test_z_loss_by_hand():
    # logsumexp of [0, 0] is log 2, of [log 3, 0] is log 4; the padded row is ignored (eq. 16)
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0], [5.0, 5.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([True, True, False])
    z = router_z_loss(logits, mask)
    expected = (math.log(2) ** 2 + math.log(4) ** 2) / 2
    torch.testing.assert_close(z.double(), torch.tensor(expected, dtype=torch.float64))  # computed in float32
    z.backward()
    # d/dx_i (lse)^2 / T = 2 lse softmax(x)_i / T
    grad = torch.tensor([[math.log(2) * 0.5, math.log(2) * 0.5], [math.log(4) * 0.75, math.log(4) * 0.25], [0, 0]],
                        dtype=torch.float64)
    torch.testing.assert_close(logits.grad, grad)


def test_routing_losses_weights_by_hand():
    probs = torch.tensor(PROBS)
    routing = Routing(probs.log() + 1.0, probs, torch.tensor(INDEX), torch.ones(4, 2), torch.tensor(MASK), (1, 4))
    aux, parts = routing_losses(routing, load_balance_weight=0.25, z_loss_weight=0.5)
    la = load_balancing_loss(probs, torch.tensor(INDEX), torch.tensor(MASK))
    lz = router_z_loss(probs.log() + 1.0, torch.tensor(MASK))
    torch.testing.assert_close(lz, torch.tensor(1.0))  # log sum exp(log p + 1) = 1 for every token
    torch.testing.assert_close(aux, 0.25 * la + 0.5 * lz)
    assert set(parts) == {"load_balance", "z_loss"}
    torch.testing.assert_close(parts["load_balance"], la)


def test_moa_layer_loss_weights_are_applied():
    torch.manual_seed(0)
    layer = MixtureOfAttentionHeads(8, num_experts=4, top_k=2, head_dim=4, load_balance_weight=0.3,
                                    z_loss_weight=0.07).eval()
    out = layer(torch.randn(2, 5, 8))
    torch.testing.assert_close(out.aux_loss, 0.3 * out.losses["load_balance"] + 0.07 * out.losses["z_loss"])
    off = MixtureOfAttentionHeads(8, 4, 2, 4, load_balance_weight=0.0, z_loss_weight=0.0)
    assert off(torch.randn(2, 5, 8)).aux_loss.item() == 0.0


def test_moh_load_balance_by_hand_ignores_padding():
    torch.manual_seed(0)
    layer = MixtureOfHeadsAttention(8, num_heads=4, num_shared_heads=1, top_k=2, load_balance_weight=0.2).eval()
    with torch.no_grad():
        layer.routed_gate.weight.normal_()
    x = torch.randn(2, 4, 8)
    pad = torch.zeros(2, 4, dtype=torch.bool)
    pad[1, 1:] = True
    out = layer(x, key_padding_mask=pad, query_padding_mask=pad)
    # by hand over the 5 real tokens: p = softmax(x W_r), f from the selected routed heads
    real = x[~pad].double()
    p = torch.softmax(real @ layer.routed_gate.weight.double().T, -1)
    chosen = p.topk(2, dim=-1).indices
    f = torch.bincount(chosen.reshape(-1), minlength=3).double() / chosen.numel()
    expected = 3 * (f * p.mean(0)).sum()
    torch.testing.assert_close(out.losses["load_balance"].double(), expected)
    torch.testing.assert_close(out.aux_loss, 0.2 * out.losses["load_balance"])
    # padded positions' content does not matter
    x2 = x.clone()
    x2[1, 1:] = 100.0
    torch.testing.assert_close(layer(x2, key_padding_mask=pad, query_padding_mask=pad).aux_loss, out.aux_loss)


def test_noisy_topk_gates_by_hand():
    # H = x W_g + N(0, 1) * softplus(x W_noise) in training (eq. 2), gates softmax over the kept H (eq. 3);
    # p = softmax(x W_g) for the load-balancing loss.
    torch.manual_seed(0)
    router = TopKRouter(6, 5, 2, router="noisy_topk")
    with torch.no_grad():
        router.gate.weight.normal_()
        router.noise.weight.normal_()
    x = torch.randn(1, 7, 6)
    router.train()
    torch.manual_seed(123)
    got = router(x)
    torch.manual_seed(123)
    flat = x[0]
    clean = flat @ router.gate.weight.T
    noisy = clean + torch.randn(7, 5) * F.softplus(flat @ router.noise.weight.T)
    top, index = noisy.topk(2, dim=-1)
    assert torch.equal(got.expert_index, index)
    torch.testing.assert_close(got.gates, top.softmax(-1))
    torch.testing.assert_close(got.probs, clean.softmax(-1))
    torch.testing.assert_close(got.logits, clean)
    # no noise in eval mode
    router.eval()
    ev = router(x)
    torch.testing.assert_close(ev.gates, clean.topk(2, dim=-1).values.softmax(-1))


@pytest.mark.parametrize("renormalize", ["detached", "live", "none"])
def test_renormalize_gates_and_their_gradient_by_hand(renormalize):
    # w_i = p_i / S with S = sum_{j in G} p_j (eq. 9). d w_i / d p_m for selected m:
    # detached: delta_im / S; live: delta_im / S - p_i / S^2; none: delta_im.
    torch.manual_seed(0)
    router = TopKRouter(4, 3, 2, renormalize=renormalize)
    x = torch.randn(1, 1, 4)
    r = router(x)
    p = r.probs[0].detach()
    sel = r.expert_index[0]
    s = p[sel].sum()
    expected = {"detached": p[sel] / s, "live": p[sel] / s, "none": p[sel]}[renormalize]
    torch.testing.assert_close(r.gates[0], expected)
    # gradient of w_0 (the best expert's weight) with respect to the selected probabilities
    (grad,) = torch.autograd.grad(r.gates[0, 0], r.probs, retain_graph=True)
    eye = torch.eye(2)[0]
    want = {"detached": eye / s, "live": eye / s - p[sel[0]] / s ** 2, "none": eye}[renormalize]
    torch.testing.assert_close(grad[0, sel], want)
    unselected = [e for e in range(3) if e not in sel.tolist()]
    assert grad[0, unselected].abs().max() == 0


def test_load_summary_by_hand():
    s = load_summary(torch.tensor([4, 3, 1, 0]))
    shares = [0.5, 0.375, 0.125, 0.0]
    mean = 0.25
    std = math.sqrt(sum((v - mean) ** 2 for v in shares) / 4)  # population std
    entropy = -sum(v * math.log(v) for v in shares if v > 0) / math.log(4)
    assert s == pytest.approx({"max_share": 0.5, "min_share": 0.0, "cv": std / mean, "norm_entropy": entropy}, rel=1e-12)
    assert load_summary(torch.tensor([2, 2, 2])) == pytest.approx({"max_share": 1 / 3, "min_share": 1 / 3, "cv": 0.0,
                                                                   "norm_entropy": 1.0})
    assert load_summary(torch.tensor([5]))["norm_entropy"] == 1.0


@pytest.mark.parametrize("fractions", ["normalized", "per_token"])
@pytest.mark.parametrize("masked", [False, True])
def test_grouped_load_balancing_loss_is_the_mean_of_the_groups_losses(fractions, masked):
    """GQE's and MoH's per-group routers: one pass over every group equals the loop of per-group losses, in value and
    in the gradient of the probabilities (float64), with padded tokens left out."""
    from headmix.routing.losses import grouped_load_balancing_loss

    g = torch.Generator().manual_seed(3)
    n, groups, per, k = 11, 3, 5, 2
    logits = torch.randn(n, groups, per, generator=g, dtype=torch.float64, requires_grad=True)
    probs = logits.softmax(-1)
    index = torch.randn(n, groups, per, generator=g).topk(k, dim=-1).indices
    mask = torch.rand(n, generator=g) > 0.3 if masked else None
    loop = torch.stack([load_balancing_loss(probs[:, j], index[:, j], mask, fractions) for j in range(groups)]).mean()
    one = grouped_load_balancing_loss(probs, index, mask, fractions)
    torch.testing.assert_close(one, loop, rtol=1e-14, atol=0)
    (want,) = torch.autograd.grad(loop, logits, retain_graph=True)
    (got,) = torch.autograd.grad(one, logits)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    # a group's own experts only: moving one token's choice to another group's numbering changes the loss
    skewed = index.clone()
    skewed[:, 0] = 0
    assert not torch.isclose(grouped_load_balancing_loss(probs, skewed, mask, fractions), one)
