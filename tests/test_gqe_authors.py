"""GQE (``kind="gqe"``) against its authors' layer: ``GQEAttention`` of FrontiersMindAI/GQE (``gqe/gqe.py``),
variants ``"gqe"`` (the full method), ``"hard_concat"`` and ``"weighted_concat"`` (the paper's Table 2), with
the authors' defaults (:data:`~headmix.attention.gqe.AUTHORS_OPTIONS`).

- Always: :func:`authors_gqe`, a plain float64 oracle of the authors' forward written from reading their code
  (token by token and group by group: rotary on queries and keys, each group's softmax and top k, the hard slots,
  the renormalised slot, the shared head over ``key.mean(dim=2)`` / ``value.mean(dim=2)`` of the rotated keys,
  the Switch-style loss averaged over the groups), against headmix's layer with the same weights: outputs, input
  and parameter gradients, routing, the auxiliary loss.
- Where their repository is in ``.peers/gqe`` (its ``gqe/`` package inside; ignored by git; docs/implementations.md
  gives the command that puts it there; skipped otherwise): their layer itself, weights copied, the same
  comparisons plus cached decoding (theirs and headmix's, one token at a time after a prompt, equal to each
  other and to the full forward), and the oracle against their layer.

Every combination: the three variants, k = 1 and 2, 16 experts on 8 K/V heads and 8 on 2, rotary.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from pathlib import Path

import pytest
import torch

from headmix import GroupedQueryExpertsAttention
from headmix.attention.gqe import AUTHORS_OPTIONS
from headmix.models import AttentionConfig

PEER = Path(__file__).resolve().parents[1] / ".peers" / "gqe" / "gqe" / "gqe.py"
D, HEAD, THETA = 24, 4, 500.0
#: The authors' variants as headmix options (beside AUTHORS_OPTIONS).
VARIANTS = {
    "gqe": dict(),
    "hard_concat": dict(weighted_slot=False, shared_head=False, allow_router_without_task_gradient=True),
    "weighted_concat": dict(weighted_slot=False, shared_head=False, hard_slot_scale="p"),
}
SIZES = [(16, 8), (8, 2)]
CASES = list(itertools.product(VARIANTS, SIZES, (1, 2)))
IDS = [f"{v}-{e}on{g}-k{k}" for v, (e, g), k in CASES]


def authors_parameters(experts: int, groups: int, variant: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights in the authors' layout (no biases, their default), float64, the router far from uniform."""
    gen = torch.Generator().manual_seed(seed)

    def w(rows: int, cols: int, scale: float = 0.4) -> torch.Tensor:
        return torch.randn(rows, cols, dtype=torch.float64, generator=gen) * scale

    params = {"q_proj": w(experts * HEAD, D), "k_proj": w(groups * HEAD, D), "v_proj": w(groups * HEAD, D),
              "router": w(experts, D, 1.0)}
    if variant == "gqe":
        params["q_shared"] = w(HEAD, D)
    return params


def output_parameters(params: dict[str, torch.Tensor], slots: int, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {**params, "o_proj": torch.randn(D, slots * HEAD, dtype=torch.float64, generator=gen) * 0.4}


def headmix_layer(variant: str, experts: int, groups: int, top_k: int,
                  params: dict[str, torch.Tensor]) -> GroupedQueryExpertsAttention:
    layer = GroupedQueryExpertsAttention(D, experts, groups, top_k, HEAD, rotary=True, rotary_base=THETA,
                                         **AUTHORS_OPTIONS, **VARIANTS[variant]).double().eval()
    with torch.no_grad():
        layer.q_proj.weight.copy_(torch.cat([params["q_proj"], params.get("q_shared", params["q_proj"][:0])]))
        layer.k_proj.weight.copy_(params["k_proj"])
        layer.v_proj.weight.copy_(params["v_proj"])
        layer.router_gate.weight.copy_(params["router"])
        layer.out_proj.weight.copy_(params["o_proj"])
    return layer


def headmix_gradients(layer: GroupedQueryExpertsAttention) -> dict[str, torch.Tensor | None]:
    """Each parameter's gradient in the authors' layout."""
    q = layer.q_proj.weight.grad
    rows = layer.num_experts * HEAD
    grads = {"q_proj": q[:rows], "k_proj": layer.k_proj.weight.grad, "v_proj": layer.v_proj.weight.grad,
             "router": layer.router_gate.weight.grad, "o_proj": layer.out_proj.weight.grad}
    if layer.shared_head:
        grads["q_shared"] = q[rows:]
    return grads


def slot_count(variant: str, groups: int, top_k: int) -> int:
    return groups * top_k + (2 if variant == "gqe" else 0)


# --------------------------------------------------------------------------- the plain oracle
def _rope(x: torch.Tensor, position: int) -> torch.Tensor:
    """Their rotary: angles ``position * theta^(-2i/d)`` in float32, ``cat(freqs, freqs)``, rotate-half."""
    inv_freq = 1.0 / (THETA ** (torch.arange(0, HEAD, 2, dtype=torch.float32) / HEAD))
    angles = torch.tensor(float(position), dtype=torch.float32) * inv_freq
    cos = torch.cat([angles, angles]).cos().to(x.dtype)
    sin = torch.cat([angles, angles]).sin().to(x.dtype)
    half = HEAD // 2
    return x * cos + torch.cat([-x[half:], x[:half]]) * sin


def _attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    scores = torch.stack([q @ k for k in keys]) / math.sqrt(HEAD)
    a = torch.exp(scores - scores.max())
    a = a / a.sum()
    return sum(ai * v for ai, v in zip(a, values))


def authors_gqe(params: dict[str, torch.Tensor], x: torch.Tensor, variant: str, groups: int, top_k: int):
    """The authors' forward, causal, one token, group and head at a time: ``(y, probs (B, T, G, M), experts (B,
    T, G, k), aux_loss)``."""
    batch, time, _ = x.shape
    per = params["router"].shape[0] // groups
    keys = [[[_rope(x[b, s] @ params["k_proj"][g * HEAD:(g + 1) * HEAD].T, s) for g in range(groups)]
             for s in range(time)] for b in range(batch)]
    values = [[[x[b, s] @ params["v_proj"][g * HEAD:(g + 1) * HEAD].T for g in range(groups)]
               for s in range(time)] for b in range(batch)]
    rows, all_probs, all_experts = [], [], []
    for b in range(batch):
        for t in range(time):
            logits = (x[b, t] @ params["router"].T).view(groups, per)
            probs = torch.stack([torch.exp(lg - lg.max()) / torch.exp(lg - lg.max()).sum() for lg in logits])
            chosen = [sorted(range(per), key=lambda e, g=g: -float(probs[g, e].detach()))[:top_k] for g in range(groups)]
            outs, picked = [], []
            for g in range(groups):
                for e in chosen[g]:
                    row = (g * per + e) * HEAD
                    q = _rope(x[b, t] @ params["q_proj"][row:row + HEAD].T, t)
                    outs.append(_attend(q, [keys[b][s][g] for s in range(t + 1)], [values[b][s][g] for s in range(t + 1)]))
                    picked.append(probs[g, e])
            parts = [o * p for o, p in zip(outs, picked)] if variant == "weighted_concat" else list(outs)
            if variant == "gqe":
                total = sum(picked)
                parts.append(sum(p / total * o for p, o in zip(picked, outs)))
                q = _rope(x[b, t] @ params["q_shared"].T, t)
                mean_k = [sum(keys[b][s]) / groups for s in range(t + 1)]
                mean_v = [sum(values[b][s]) / groups for s in range(t + 1)]
                parts.append(_attend(q, mean_k, mean_v))
            rows.append(torch.cat(parts) @ params["o_proj"].T)
            all_probs.append(probs)
            all_experts.append(torch.tensor(chosen))
    probs = torch.stack(all_probs).view(batch, time, groups, per)
    experts = torch.stack(all_experts).view(batch, time, groups, top_k)
    # Switch-style: per group, M * sum_e (share of tokens sending a slot to e) * (mean p_e); mean over the groups
    fraction = torch.zeros(groups, per, dtype=x.dtype)
    for b, t, g in itertools.product(range(batch), range(time), range(groups)):
        for e in experts[b, t, g].tolist():
            fraction[g, e] += 1.0 / (batch * time)
    aux = (per * (fraction * probs.mean((0, 1))).sum(-1)).mean()
    return torch.stack(rows).view(batch, time, D), probs, experts, aux


def _check(layer, reference_run, params, x, atol=1e-12):
    """headmix's layer and ``reference_run(params, x) -> (y, probs, experts, aux)`` agree: outputs, the gradients
    of a random projection of the outputs (input and every parameter), routing, the auxiliary loss."""
    theirs = {n: p.clone().requires_grad_() for n, p in params.items()}
    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, probs, experts, aux = reference_run(theirs, x_theirs)
    out = layer(x_ours, is_causal=True)
    torch.testing.assert_close(out.output, y, atol=atol, rtol=0)
    weights = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(5))
    (y * weights).sum().backward()
    (out.output * weights).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, atol=atol, rtol=0)
    for name, grad in headmix_gradients(layer).items():
        want = theirs[name].grad
        if want is None or not want.abs().max() > 0:  # hard_concat: the task loss gives their router nothing
            assert grad is None or not grad.abs().max() > 0, name
        else:
            torch.testing.assert_close(grad, want, atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    n, groups, per = x.shape[0] * x.shape[1], layer.kv_heads, layer.experts_per_group
    torch.testing.assert_close(out.routing.probs, probs.reshape(n, groups * per).detach(), atol=atol, rtol=0)
    numbered = experts + per * torch.arange(groups)[:, None]
    assert torch.equal(out.routing.expert_index, numbered.reshape(n, -1))
    torch.testing.assert_close(out.losses["load_balance"], aux.detach(), atol=atol, rtol=0)
    torch.testing.assert_close(out.aux_loss, 0.01 * aux.detach(), atol=atol, rtol=0)


@pytest.mark.parametrize("variant, sizes, top_k", CASES, ids=IDS)
def test_layer_matches_the_plain_oracle_of_the_authors_code(variant, sizes, top_k):
    experts, groups = sizes
    params = output_parameters(authors_parameters(experts, groups, variant), slot_count(variant, groups, top_k))
    layer = headmix_layer(variant, experts, groups, top_k, params)
    x = torch.randn(2, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    _check(layer, lambda p, x: authors_gqe(p, x, variant, groups, top_k), params, x)


def test_the_shared_head_over_k_v_head_0_is_not_the_authors():
    """``shared_head_kv="head0"`` (headmix's form before the authors' code, what stored configs load as) differs
    from the oracle; switched to the mean it agrees."""
    params = output_parameters(authors_parameters(8, 2, "gqe"), slot_count("gqe", 2, 1))
    layer = headmix_layer("gqe", 8, 2, 1, params)
    x = torch.randn(1, 4, D, dtype=torch.float64)
    want = authors_gqe(params, x, "gqe", 2, 1)[0]
    layer.shared_head_kv = "head0"
    assert (layer(x, is_causal=True).output - want).abs().max() > 1e-3
    layer.shared_head_kv = "mean"
    torch.testing.assert_close(layer(x, is_causal=True).output, want, atol=1e-12, rtol=0)


def test_the_authors_initialisation():
    """``router_init="zero"``: a zero router (uniform p); ``weight_init="xavier_uniform"``: each projection within
    its Xavier bound, the experts' and the shared head's query rows each a matrix of their own; no biases."""
    layer = GroupedQueryExpertsAttention(64, 16, 8, 1, 8, **AUTHORS_OPTIONS)
    assert (layer.router_gate.weight == 0).all()
    assert all(lin.bias is None for lin in (layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj))
    q = layer.q_proj.weight
    for weight, fan_out in ((q[:128], 128), (q[128:], 8), (layer.k_proj.weight, 64), (layer.out_proj.weight, 64)):
        fan_in = weight.shape[1]
        bound = math.sqrt(6 / (fan_in + fan_out))
        assert weight.abs().max() <= bound and weight.abs().max() > 0.9 * bound
        assert abs(weight.std().item() - bound / math.sqrt(3)) < 0.1 * bound
    torch.manual_seed(0)
    default = GroupedQueryExpertsAttention(64, 16, 8, 1, 8)
    assert default.router_gate.weight.std() > 0 and default.q_proj.bias is not None
    assert default.q_proj.weight.abs().max() <= 1 / math.sqrt(64)  # torch.nn.Linear's bound: kept as the default


def test_the_authors_options_in_a_config():
    att = AttentionConfig(kind="gqe", **AUTHORS_OPTIONS)
    assert AttentionConfig.from_dict(att.to_dict()) == att
    layer = att.build(64)
    assert (layer.shared_head_kv, layer.router_init, layer.weight_init, layer.load_balance_fractions) == \
        ("mean", "zero", "xavier_uniform", "per_token")
    assert layer.load_balance_weight == 0.01 and (layer.router_gate.weight == 0).all()


# --------------------------------------------------------------------------- the authors' layer itself
def _authors_module():
    if not PEER.is_file():
        pytest.skip(f"the GQE authors' repository is not in {PEER.parents[1]} (docs/implementations.md)")
    spec = importlib.util.spec_from_file_location("gqe_authors_peer", PEER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # their dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def _authors_pair(variant: str, experts: int, groups: int, top_k: int):
    module = _authors_module()
    torch.manual_seed(0)
    theirs = module.GQEAttention(D, experts, groups, top_k, head_dim=HEAD, variant=variant, use_rope=True,
                                 rope_theta=THETA).double().eval()
    with torch.no_grad():
        theirs.router.weight.normal_(0.0, 1.0)  # far from uniform (theirs starts at zero), so selections differ
    params = {n: p.detach().clone() for n, p in theirs.named_parameters()}
    params = {n.removesuffix(".weight"): p for n, p in params.items()}
    assert set(params) == {"q_proj", "k_proj", "v_proj", "router", "o_proj"} | ({"q_shared"} if variant == "gqe" else set())
    return module, theirs, params, headmix_layer(variant, experts, groups, top_k, params)


@pytest.mark.parametrize("variant, sizes, top_k", CASES, ids=IDS)
def test_layer_matches_the_authors_layer(variant, sizes, top_k):
    experts, groups = sizes
    module, theirs, params, layer = _authors_pair(variant, experts, groups, top_k)
    x = torch.randn(2, 6, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    # outputs, gradients (theirs read from their module), routing, aux loss
    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_theirs = theirs(x_theirs, return_output=True)
    out = layer(x_ours, is_causal=True)
    torch.testing.assert_close(out.output, out_theirs.hidden_states, atol=1e-12, rtol=0)
    weights = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(4))
    (out_theirs.hidden_states * weights).sum().backward()
    (out.output * weights).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, atol=1e-12, rtol=0)
    for name, grad in headmix_gradients(layer).items():
        want = getattr(theirs, name).weight.grad
        if want is None or not want.abs().max() > 0:  # hard_concat's router: no task gradient in either
            assert grad is None or not grad.abs().max() > 0, name
        else:
            torch.testing.assert_close(grad, want, atol=1e-12, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    n = x.shape[0] * x.shape[1]
    torch.testing.assert_close(out.routing.probs, out_theirs.router_probs.reshape(n, -1).detach(), atol=1e-14, rtol=0)
    numbered = out_theirs.expert_indices + layer.experts_per_group * torch.arange(groups)[:, None]
    assert torch.equal(out.routing.expert_index, numbered.reshape(n, -1))
    torch.testing.assert_close(out.losses["load_balance"], out_theirs.aux_loss.detach(), atol=1e-14, rtol=0)
    # the plain oracle is their layer too
    y, probs, experts_chosen, aux = authors_gqe(params, x, variant, groups, top_k)
    torch.testing.assert_close(y, out_theirs.hidden_states.detach(), atol=1e-12, rtol=0)
    assert torch.equal(experts_chosen, out_theirs.expert_indices)
    torch.testing.assert_close(aux, out_theirs.aux_loss.detach(), atol=1e-14, rtol=0)


@pytest.mark.parametrize("variant, sizes, top_k", CASES, ids=IDS)
def test_cached_decoding_matches_the_authors_and_the_full_forward(variant, sizes, top_k):
    experts, groups = sizes
    _, theirs, _, layer = _authors_pair(variant, experts, groups, top_k)
    x = torch.randn(2, 7, D, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    prompt = 3
    with torch.no_grad():
        full = layer(x, is_causal=True).output
        ours = layer(x[:, :prompt], is_causal=True, use_cache=True)
        theirs_out, past = theirs(x[:, :prompt], use_cache=True)
        steps_ours, steps_theirs, cache = [ours.output], [theirs_out], ours.cache
        for t in range(prompt, x.shape[1]):
            ours = layer(x[:, t:t + 1], is_causal=True, use_cache=True, cache=cache)
            theirs_out, past = theirs(x[:, t:t + 1], past_key_value=past, use_cache=True)
            steps_ours.append(ours.output)
            steps_theirs.append(theirs_out)
            cache = ours.cache
    torch.testing.assert_close(torch.cat(steps_ours, 1), torch.cat(steps_theirs, 1), atol=1e-12, rtol=0)
    torch.testing.assert_close(torch.cat(steps_ours, 1), full, atol=1e-12, rtol=0)
    # the same cache: their (B, S, G, d_h) keys (rotated) and values are headmix's (B, G, S, d_h)
    torch.testing.assert_close(cache.key.transpose(1, 2), past[0], atol=1e-14, rtol=0)
    torch.testing.assert_close(cache.value.transpose(1, 2), past[1], atol=1e-14, rtol=0)
