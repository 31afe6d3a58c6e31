"""The fused softmax top-k router (:mod:`headmix.kernels.fused_router`, one C++ operation forward and one backward)
against its reference, :mod:`headmix.routing`'s composed router and losses (MoA eq. 7-9, 13-17; the per-group form
of GQE and MoH): probabilities, choice, gates, the losses and the gradient into the logits from every output, in
float64 and float32, with padding masks, every renormalisation, several routers, odd sizes, ties, the custom op's
checks and compile; then MoA, GQE and MoH with the fused router against the same layers on their composed path
(``HEADMIX_CPU_KERNEL=python``), outputs and gradients."""

from __future__ import annotations

import zlib

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.utils._python_dispatch import TorchDispatchMode

from test_kernels_cpu_op import built_kernel  # noqa: F401  (autouse: the C++ kernels built, or the module skipped)

from headmix.attention import (GroupedQueryExpertsAttention, MixtureOfAttentionHeads, MixtureOfHeadsAttention,
                               SwitchHeadAttention)
from headmix.kernels import cpp_build, fused_router
from headmix.routing import Routing, routing_losses
from headmix.routing.losses import weighted_load_balance


def composed(logits, mask, groups, top_k, renormalize, scale, lb_weight, z_weight, per_token, z_loss):
    """The reference: headmix.routing's composed router and losses on the same logits."""
    n = logits.shape[0]
    per = logits.shape[1] // groups
    probs = logits.view(n, groups, per).softmax(-1)
    top_p, index = probs.topk(top_k, dim=-1)
    if renormalize == "detached":
        gates = top_p / top_p.sum(-1, keepdim=True).detach() * scale
    elif renormalize == "live":
        gates = top_p / top_p.sum(-1, keepdim=True) * scale
    elif renormalize == "live_total":  # over every router of the token
        gates = top_p / top_p.sum((1, 2), keepdim=True) * scale
    else:
        gates = top_p * scale
    fractions = "per_token" if per_token else "normalized"
    if z_loss:
        routing = Routing(logits, probs.view(n, -1), index.view(n, -1), gates.view(n, -1), mask, (1, n))
        total, parts = routing_losses(routing, lb_weight, z_weight, fractions)
        return probs.view(n, -1), index, gates, total, parts["load_balance"], parts["z_loss"]
    experts = (index + per * torch.arange(groups)[:, None]).view(n, groups * top_k)
    total, la = weighted_load_balance(probs.view(n, -1), experts, mask, lb_weight, fractions, groups)
    return probs.view(n, -1), index, gates, total, la, logits.new_zeros(())


def outputs_and_grad(fn, logits, mask, cotangents, **options):
    z = logits.detach().clone().requires_grad_()
    probs, index, gates, total, la, lz = fn(z, mask, **options)
    c_probs, c_gates, c_total, c_la, c_lz = cotangents
    loss = (probs * c_probs).sum() + (gates * c_gates).sum() + total * c_total + la * c_la + lz * c_lz
    (grad,) = torch.autograd.grad(loss, z)
    return [probs.detach(), index, gates.detach(), total.detach(), la.detach(), lz.detach(), grad]


def fused(logits, mask, **options):
    return fused_router.softmax_topk_route(logits, mask, groups=options["groups"], top_k=options["top_k"],
                                           renormalize=options["renormalize"], scale=options["scale"],
                                           load_balance_weight=options["lb_weight"],
                                           z_loss_weight=options["z_weight"], per_token=options["per_token"],
                                           z_loss=options["z_loss"])


def reference(logits, mask, **options):
    return composed(logits, mask, **options)


CASES = {
    # name: (tokens, groups, experts per group, top_k, z-loss)
    "moa": (13, 1, 8, 3, True),
    "moa one token": (1, 1, 5, 2, True),
    "moa top 1": (9, 1, 6, 1, True),
    "moa every expert": (7, 1, 4, 4, True),
    "per group": (11, 3, 5, 2, False),
    "per group top 1": (10, 4, 2, 1, False),
}
#: The cases whose load-balancing fractions are per token (Switch's form: k times the normalized loss; k >= 2 so
#: that the two differ).
PER_TOKEN = {"moa one token", "per group"}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("renormalize", ["detached", "live", "live_total", "none"])
@pytest.mark.parametrize("masked", ["none", "some", "all padded"])
@pytest.mark.parametrize("case", CASES)
def test_fused_router_equals_the_composed_router(case, masked, renormalize, dtype):
    n, groups, per, top_k, z_loss = CASES[case]
    gen = torch.Generator().manual_seed(hash((case, masked, renormalize)) % 2**31)
    logits = torch.randn(n, groups * per, generator=gen, dtype=torch.float64).mul(2).to(dtype)
    mask = {"none": None, "some": torch.rand(n, generator=gen) > 0.4,
            "all padded": torch.zeros(n, dtype=torch.bool)}[masked]
    options = dict(groups=groups, top_k=top_k, renormalize=renormalize, scale=1.0 if groups == 1 else top_k,
                   lb_weight=0.3, z_weight=0.05 if z_loss else 0.0, per_token=case in PER_TOKEN, z_loss=z_loss)
    cotangents = [torch.randn(n, groups * per, generator=gen, dtype=torch.float64).to(dtype),
                  torch.randn(n, groups, top_k, generator=gen, dtype=torch.float64).to(dtype),
                  torch.tensor(1.7, dtype=dtype), torch.tensor(0.4, dtype=dtype), torch.tensor(0.2, dtype=dtype)]
    got = outputs_and_grad(fused, logits, mask, cotangents, **options)
    want = outputs_and_grad(reference, logits, mask, cotangents, **options)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for name, g, w in zip(("probs", "index", "gates", "total", "L_a", "L_z", "grad"), got, want):
        if name == "index":
            assert torch.equal(g, w), "the choice differs from torch.topk's"
        else:
            torch.testing.assert_close(g, w, **tol, msg=lambda m, name=name: f"{name}: {m}")


def test_only_the_used_outputs_need_a_gradient():
    """The loss reads the total alone (the training step's case): the gradient is the total's."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 6, generator=gen, dtype=torch.float64)
    options = dict(groups=1, top_k=2, renormalize="detached", scale=1.0, lb_weight=0.5, z_weight=0.1,
                   per_token=False, z_loss=True)
    grads = []
    for fn in (fused, reference):
        z = logits.clone().requires_grad_()
        grads.append(torch.autograd.grad(fn(z, None, **options)[3], z)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)
    assert grads[0].abs().sum() > 0


def test_ties_choose_what_torch_topk_chooses():
    """Equal logits (a router initialised at zero, GQE's authors' option): the same experts as torch.topk."""
    for per, top_k in ((8, 2), (16, 4), (64, 2), (100, 3)):
        logits = torch.zeros(4, per)
        _, index, *_ = fused_router.softmax_topk_route(logits, None, groups=1, top_k=top_k, renormalize="none",
                                                       scale=1.0, load_balance_weight=0.0, z_loss_weight=0.0,
                                                       per_token=False, z_loss=False)
        assert torch.equal(index.view(4, top_k), logits.softmax(-1).topk(top_k, -1).indices)


def _rows_with(kind: str, rows: int, per: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, per, generator=gen, dtype=torch.float64)
    if kind == "ties":  # a few values only: ties inside the k largest and at the k-th
        x = torch.randint(0, 3, (rows, per), generator=gen).double()
    elif kind == "boundary" and top_k < per:  # the k-th and (k+1)-th largest equal, the k - 1 above them distinct
        x = torch.arange(per, 0, -1, dtype=torch.float64).repeat(rows, 1)
        x[:, top_k] = x[:, top_k - 1]
        x = x.gather(1, torch.rand(rows, per, generator=gen).argsort(1))
    elif kind == "nan":
        x[torch.rand(rows, per, generator=gen) < 0.05] = float("nan")
    elif kind == "inf":
        x[torch.rand(rows, per, generator=gen) < 0.3] = float("-inf")
    elif kind == "zeros":
        x = torch.zeros(rows, per, dtype=torch.float64)
    return x


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["distinct", "ties", "boundary", "nan", "inf", "zeros"])
def test_topk_rows_equals_torch_topk(kind, dtype):
    """The routers' top-k (``headmix_cpp::topk_rows``: a rank per value where the choice is unique, torch.topk on the
    rows with a tie or a NaN) gives torch.topk's values and indices on every row, ties included."""
    gen = torch.Generator().manual_seed(len(kind))
    for per, top_k in ((16, 1), (16, 2), (16, 4), (16, 16), (3, 2), (1, 1), (64, 8)):
        x = _rows_with(kind, 300, per, top_k, gen).to(dtype)
        values, index = torch.ops.headmix_cpp.topk_rows(x, top_k)
        want = torch.topk(x, top_k, dim=-1)
        assert torch.equal(index, want.indices), (per, top_k)
        assert torch.equal(values.nan_to_num(7.0), want.values.nan_to_num(7.0)), (per, top_k)


def test_opcheck():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(7, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([True, True, False, True, True, False, True])
    torch.library.opcheck(fused_router._route_op, (logits, mask, 2, 2, 2, 2.0, 0.1, 0.0, False, False))
    torch.library.opcheck(fused_router._route_op, (logits, None, 1, 3, 1, 1.0, 0.1, 0.02, True, True))


def test_one_operation_under_compile():
    counter = CompileCounter()

    def route(z, mask):
        probs, index, gates, total, la, lz = fused_router.softmax_topk_route(
            z, mask, groups=1, top_k=2, renormalize="detached", scale=1.0, load_balance_weight=0.1,
            z_loss_weight=0.01, per_token=False, z_loss=True)
        return gates.sum() + total

    compiled = torch.compile(route, backend=counter, fullgraph=True)
    z = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(10) > 0.3
    got = torch.autograd.grad(compiled(z, mask), z)[0]
    want = torch.autograd.grad(route(z, mask), z)[0]
    torch.testing.assert_close(got, want)
    assert counter.frame_count == 1


def test_forced_python_runs_the_composed_path(monkeypatch):
    x = torch.randn(2, 3, 8)
    assert fused_router.fused_router_applies(x)
    monkeypatch.setenv(cpp_build.ENV_VAR, "python")
    assert not fused_router.fused_router_applies(x)
    monkeypatch.delenv(cpp_build.ENV_VAR)
    assert not fused_router.fused_router_applies(x[:, :0])  # no token: the composed path's empty-input rules


def test_z_loss_needs_one_router():
    with pytest.raises(ValueError, match="z_loss is defined for one router"):
        fused_router.softmax_topk_route(torch.randn(3, 8), None, groups=2, top_k=1, renormalize="none", scale=1.0,
                                        load_balance_weight=0.0, z_loss_weight=0.1, per_token=False, z_loss=True)


LAYERS = {
    "moa detached": lambda: MixtureOfAttentionHeads(24, num_experts=6, top_k=2, head_dim=8, z_loss_weight=0.01),
    "moa live, 2 K/V": lambda: MixtureOfAttentionHeads(24, num_experts=6, top_k=2, head_dim=8, kv_heads=2,
                                                       renormalize="live"),
    "moa none, per token": lambda: MixtureOfAttentionHeads(24, num_experts=5, top_k=3, head_dim=8,
                                                           renormalize="none", load_balance_fractions="per_token"),
    "gqe": lambda: GroupedQueryExpertsAttention(24, num_experts=6, kv_heads=2, top_k=2, head_dim=8),
    "gqe per token": lambda: GroupedQueryExpertsAttention(24, num_experts=12, kv_heads=4, top_k=2, head_dim=8,
                                                          load_balance_fractions="per_token"),
    # one K/V group: the weighted slot's renormalisation is the fused router's own (renormalize="live")
    "gqe one K/V head": lambda: GroupedQueryExpertsAttention(24, num_experts=4, kv_heads=1, top_k=2, head_dim=8),
    "moh global": lambda: MixtureOfHeadsAttention(24, 6, num_shared_heads=2, top_k=2),
    "moh per group": lambda: MixtureOfHeadsAttention(24, 8, 0, kv_heads=2, route_per_group=True, top_k=2,
                                                              load_balance_weight=0.05),
    "moh per group, shared, sparse": lambda: MixtureOfHeadsAttention(24, 8, kv_heads=2, route_per_group=True,
                                                                     num_shared_heads=1, top_k=2, impl="sparse"),
    "moh scaled": lambda: MixtureOfHeadsAttention(24, 6, num_shared_heads=1, top_k=2, head_weighting="scaled"),
    "moh paper, sparse": lambda: MixtureOfHeadsAttention(24, 6, num_shared_heads=2, top_k=3, head_weighting="paper",
                                                         impl="sparse"),
    "switchhead": lambda: SwitchHeadAttention(24, 2, 4, 2),
    "switchhead top 1, 3 heads": lambda: SwitchHeadAttention(24, 3, 3, 1, head_dim=8),
}


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def layer_outputs(layer, x, padding, fused_op_runs):
    x = x.clone().requires_grad_()
    with OpNames() as ops:
        out = layer(x, is_causal=True, key_padding_mask=padding, query_padding_mask=padding)
    fused_ops = {"headmix.softmax_topk_route", "headmix.sigmoid_topk_route", "headmix.moh_route"} & ops.names
    assert bool(fused_ops) == fused_op_runs, sorted(ops.names)
    cotangent = torch.randn(out.output.shape, generator=torch.Generator().manual_seed(4), dtype=x.dtype)
    loss = (out.output * cotangent).sum() + 3.0 * out.aux_loss
    params = [p for p in layer.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [x, *params])
    sides = [out.routing.value, out.routing.output] if hasattr(out.routing, "value") else [out.routing]
    routing = [t for side in sides for t in (side.expert_index, side.gates.detach(), side.probs.detach())]
    return [out.output.detach(), out.aux_loss.detach(), *routing,
            *out.losses.values(), *grads]


@pytest.mark.parametrize("name", LAYERS)
def test_layers_with_the_fused_router_equal_their_composed_path(name, monkeypatch):
    torch.manual_seed(0)
    layer = LAYERS[name]().double().train()
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, -2:] = True
    got = layer_outputs(layer, x, padding, fused_op_runs=True)
    monkeypatch.setenv(cpp_build.ENV_VAR, "python")
    want = layer_outputs(layer, x, padding, fused_op_runs=False)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(9, 2, 4, 2), (1, 3, 5, 1), (6, 1, 3, 3)])
def test_sigmoid_router_equals_the_composed_selector(shape, dtype):
    """SwitchHead's selectors: the sigmoid, the choice numbered h E + e, the selected sigmoids and the gradient
    from both, against the composed form (SwitchHeadAttention.select's ATen operations)."""
    n, heads, per, top_k = shape
    gen = torch.Generator().manual_seed(sum(shape))
    logits = torch.randn(n, heads * per, generator=gen, dtype=torch.float64).to(dtype)
    c_s = torch.randn(n, heads * per, generator=gen, dtype=torch.float64).to(dtype)
    c_g = torch.randn(n, heads, top_k, generator=gen, dtype=torch.float64).to(dtype)

    def composed_selector(z):
        s = z.sigmoid().view(n, heads, per)
        index = s.detach().topk(top_k, dim=-1).indices
        return s.view(n, -1), index + per * torch.arange(heads)[:, None], s.gather(-1, index)

    results = []
    for fn in (lambda z: fused_router.sigmoid_topk_route(z, heads, top_k), composed_selector):
        z = logits.clone().requires_grad_()
        s, index, gates = fn(z)
        (grad,) = torch.autograd.grad((s * c_s).sum() + (gates * c_g).sum(), z)
        results.append((s.detach(), index, gates.detach(), grad))
    (s, index, gates, grad), (s_ref, index_ref, gates_ref, grad_ref) = results
    assert torch.equal(index, index_ref)
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-7)
    for got, want in ((s, s_ref), (gates, gates_ref), (grad, grad_ref)):
        torch.testing.assert_close(got, want, **tol)


def test_sigmoid_router_opcheck():
    logits = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(fused_router._sigmoid_op, (logits, 2, 2))


@pytest.mark.parametrize("name", ["moh per group", "moh global"])
def test_a_compiled_graph_with_an_unbacked_token_count_keeps_the_composed_router(name):
    """vLLM compiles its models with the token count unbacked: asking whether a batch has tokens (the fused
    router's condition) would guard on it, so compiled graphs keep the composed router (vLLM's compiled MoH engines
    failed to start before)."""
    torch.manual_seed(0)
    layer = LAYERS[name]().eval()
    x = torch.randn(1, 6, 24)
    torch._dynamo.decorators.mark_unbacked(x, 1)
    # MoH's head weighting, as headmix's vLLM model calls it (serving/model.py)
    compiled = torch.compile(lambda t: layer.head_weights(t, None)[0], fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), layer.head_weights(x, None)[0])


# ------------------------------------------------------------------------------------ MoH's head weighting
def composed_moh(logits, mask, routed_heads, groups, top_k, shared, weighting, lb_weight, per_token, dense):
    """The reference: MoHHeadWeighting's composed head weighting (moh.py: _composed_weights, route,
    _head_route, weighted_load_balance) in ATen operations on the same logits."""
    n, per = logits.shape[0], routed_heads // groups
    probs = logits[:, :routed_heads].reshape(n, groups, per).softmax(-1)
    top_p, index = probs.topk(top_k, dim=-1)
    if weighting == "renormalized":
        routed = top_p / top_p.sum(-1, keepdim=True) * top_k
    elif weighting == "scaled":
        routed = top_p * per
    else:
        routed = top_p
    shared_w = None
    if shared:
        a = logits[:, routed_heads:routed_heads + 2 * groups].reshape(n, groups, 2).softmax(-1)
        s = logits[:, routed_heads + 2 * groups:].reshape(n, groups, shared).softmax(-1)
        if weighting != "paper":
            a, s = 2.0 * a, s * shared
        routed = a[..., 1:] * routed
        shared_w = a[..., :1] * s  # (N, G, S)
    expert_index = (index + per * torch.arange(groups)[:, None]).view(n, groups * top_k)
    total, la = weighted_load_balance(probs.view(n, -1), expert_index, mask, lb_weight,
                                      "per_token" if per_token else "normalized", groups)
    first = (shared + per) * torch.arange(groups)[:, None]  # each group's first head
    shared_heads = (first + torch.arange(shared)).expand(n, groups, shared)
    slot_heads = torch.cat([shared_heads, first + shared + index], dim=2).view(n, -1)
    slot_weights = routed if shared_w is None else torch.cat([shared_w, routed], dim=2)
    head_weights = logits.new_empty(0)
    if dense:
        g_routed = probs.new_zeros(n, groups, per).scatter(2, index, routed)
        head_weights = g_routed if shared_w is None else torch.cat([shared_w, g_routed], dim=2)
        head_weights = head_weights.reshape(n, -1)
    return probs.view(n, -1), expert_index, slot_heads, slot_weights.reshape(n, -1), head_weights, total, la


def fused_moh(logits, mask, routed_heads, groups, top_k, shared, weighting, lb_weight, per_token, dense):
    return fused_router.moh_route(logits, mask, routed_heads=routed_heads, groups=groups, top_k=top_k, shared=shared,
                                  weighting=weighting, load_balance_weight=lb_weight, per_token=per_token,
                                  dense=dense)


MOH_OUTPUTS = ("probs", "expert_index", "slot_heads", "slot_weights", "head_weights", "total", "L_a")


def moh_outputs_and_grad(fn, logits, mask, cotangents, **options):
    """Every output, and the gradient into the logits of the outputs paired with a cotangent (None: unused)."""
    z = logits.detach().clone().requires_grad_()
    outputs = fn(z, mask, **options)
    terms = [(out * c).sum() for out, c in zip(outputs, cotangents) if c is not None]
    grad = torch.autograd.grad(sum(terms), z)[0] if terms else None
    return [o.detach() for o in outputs] + [grad]


def moh_logits(n, routed_heads, groups, shared, dtype, gen, ties=False):
    width = routed_heads + (groups * (2 + shared) if shared else 0)
    if ties:  # a few values only: ties among each group's routed heads, torch.topk's choice decides
        return torch.randint(0, 3, (n, width), generator=gen).to(dtype)
    return torch.randn(n, width, generator=gen, dtype=torch.float64).mul(2).to(dtype)


def moh_cotangents(outputs, gen):
    """A random cotangent for every differentiable output (the indices get None)."""
    return [None if o.dtype == torch.long else torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
            for o in outputs]


def check_moh(logits, mask, cotangents, dtype, **options):
    got = moh_outputs_and_grad(fused_moh, logits, mask, cotangents, **options)
    want = moh_outputs_and_grad(composed_moh, logits, mask, cotangents, **options)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for name, g, w in zip(MOH_OUTPUTS + ("grad",), got, want):
        if g is None or g.dtype == torch.long:
            assert (g is None and w is None) or torch.equal(g, w), name
        else:
            torch.testing.assert_close(g, w, **tol, msg=lambda m, name=name: f"{name}: {m}")


MOH_SHAPES = {  # name: (tokens, groups, routed heads per group, top_k)
    "one group": (7, 1, 6, 2),
    "two groups": (33, 2, 4, 3),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("weighting", ["renormalized", "paper", "scaled"])
@pytest.mark.parametrize("shared", [0, 1, 2])
@pytest.mark.parametrize("shape", MOH_SHAPES)
@pytest.mark.parametrize("masked", [False, True])
def test_moh_route_equals_the_composed_head_weighting(masked, shape, shared, weighting, dtype):
    """Every output of headmix::moh_route and the gradient into the logits from all the differentiable ones
    (random cotangents) against MoH's composed head weighting, dense on and off; ties included (a few logit
    values: torch.topk's choice)."""
    n, groups, per, top_k = MOH_SHAPES[shape]
    gen = torch.Generator().manual_seed(zlib.crc32(repr((masked, shape, shared, weighting)).encode()))
    mask = torch.rand(n, generator=gen) > 0.3 if masked else None
    for ties in (False, True):
        logits = moh_logits(n, groups * per, groups, shared, dtype, gen, ties)
        for dense in (True, False):
            options = dict(routed_heads=groups * per, groups=groups, top_k=top_k, shared=shared,
                           weighting=weighting, lb_weight=0.3, per_token=shape == "two groups", dense=dense)
            outputs = composed_moh(logits, mask, **options)
            check_moh(logits, mask, moh_cotangents(outputs, gen), dtype, **options)


@pytest.mark.parametrize("used", ["slot_weights", "head_weights", "total", "L_a", "probs", "slot and head weights",
                                  "none"])
def test_moh_route_with_only_some_outputs_used(used):
    """The other outputs' gradients are None (materialize_grads off): the gradient is that of the used ones."""
    n, groups, per, top_k, shared = 9, 2, 3, 2, 2
    gen = torch.Generator().manual_seed(len(used))
    logits = moh_logits(n, groups * per, groups, shared, torch.float64, gen)
    mask = torch.rand(n, generator=gen) > 0.3
    options = dict(routed_heads=groups * per, groups=groups, top_k=top_k, shared=shared, weighting="renormalized",
                   lb_weight=0.5, per_token=False, dense=True)
    cotangents = moh_cotangents(composed_moh(logits, mask, **options), gen)
    names = used.replace("slot and head", "slot_weights head_weights").split()
    cotangents = [c if name in names else None for name, c in zip(MOH_OUTPUTS, cotangents)]
    check_moh(logits, mask, cotangents, torch.float64, **options)
    if used == "none":  # nothing differentiable used: no gradient, and backward never runs
        out = fused_moh(logits.clone().requires_grad_(), mask, **options)
        assert all(not o.requires_grad for o in (out[1], out[2]))


def test_moh_route_opcheck():
    gen = torch.Generator().manual_seed(3)
    mask = torch.tensor([True, True, False, True, True, False, True])
    for routed, groups, top_k, shared, weighting, dense in ((6, 2, 2, 1, 0, True), (6, 1, 3, 0, 2, False),
                                                            (8, 2, 1, 2, 1, False)):
        logits = moh_logits(7, routed, groups, shared, torch.float64, gen).requires_grad_()
        for m in (mask, None):
            torch.library.opcheck(fused_router._moh_op, (logits, m, routed, groups, top_k, shared, weighting, 0.1,
                                                         bool(shared % 2), dense))


def test_moh_route_is_one_operation_under_compile():
    """torch.compile(fullgraph=True) of a function calling moh_route: one frame, whose graph calls the one op."""
    targets = []

    def backend(graph_module, example_inputs):
        targets.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module

    counter = CompileCounter()

    def route(z, mask):
        probs, _, _, slot_weights, head_weights, total, la = fused_router.moh_route(
            z, mask, routed_heads=6, groups=2, top_k=2, shared=1, weighting="renormalized", load_balance_weight=0.1,
            per_token=False, dense=True)
        return slot_weights.sum() + (head_weights ** 2).sum() + total + probs[:, 0].sum()

    z = torch.randn(10, 12, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(10) > 0.3
    want = torch.autograd.grad(route(z, mask), z)[0]
    got = torch.autograd.grad(torch.compile(route, backend=counter, fullgraph=True)(z, mask), z)[0]
    torch.testing.assert_close(got, want)
    assert counter.frame_count == 1
    torch._dynamo.reset()
    torch.compile(route, backend=backend, fullgraph=True)(z, mask)
    routers = [t for t in targets if "headmix" in t or "softmax" in t or "topk" in t]
    assert routers == ["headmix.moh_route.default"], targets


MOH_BAD = {  # (argument changes, the argument the message names)
    "width": (dict(shared=2), "logits must have R \\+ 2G \\+ G S = 14 columns"),
    "width without shared": (dict(shared=0), "logits must have R \\+ 2G \\+ G S = 6 columns"),
    "top_k": (dict(top_k=4), "top_k must be at most the 3 routed heads per group"),
    "weighting": (dict(weighting="renormalised"), "weighting must be one of"),
    "groups": (dict(groups=4), "routed_heads must be a multiple of groups=4"),
    "mask": (dict(token_mask=torch.ones(5, dtype=torch.bool)), "token_mask must be a bool tensor \\(7,\\)"),
    "int mask": (dict(token_mask=torch.ones(7, dtype=torch.long)), "token_mask must be a bool tensor"),
    "dtype": (dict(logits=torch.randn(7, 12, dtype=torch.bfloat16)), "logits must be float32 or float64"),
    "1-d logits": (dict(logits=torch.randn(12)), "logits must be a 2-d tensor"),
    "shared": (dict(shared=-1), "shared must be an int >= 0"),
}


@pytest.mark.parametrize("case", MOH_BAD)
def test_moh_route_refuses_bad_arguments(case):
    changes, message = MOH_BAD[case]
    arguments = dict(logits=torch.randn(7, 12), token_mask=None, routed_heads=6, groups=2, top_k=2, shared=1,
                     weighting="paper", load_balance_weight=0.1, per_token=False, dense=False)
    arguments.update(changes)
    with pytest.raises(ValueError, match=message) as error:
        fused_router.moh_route(arguments.pop("logits"), arguments.pop("token_mask"), **arguments)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name", ["moh global", "moh per group", "moh scaled", "moh paper, sparse",
                                  "moh per group, shared, sparse"])
def test_moh_route_equals_the_layers_composed_head_weights(name, monkeypatch):
    """On one GEMM of the layer's three gates (routed | group | shared), moh_route's dense head weights, routing and
    losses are MoHHeadWeighting's composed ones (HEADMIX_CPU_KERNEL=python), values and gradients into x."""
    torch.manual_seed(0)
    layer = LAYERS[name]().double().train()
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, -2:] = False
    n, groups, shared = 14, layer.route_groups, layer.num_shared_heads
    gates = [layer.routed_gate] + ([layer.group_gate, layer.shared_gate] if shared else [])
    cotangent = torch.randn(n, layer.num_heads, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def fused_side(x):
        logits = x.reshape(n, 24) @ torch.cat([gate.weight for gate in gates]).T
        _, index, _, slot_weights, g, total, la = fused_router.moh_route(
            logits, mask.reshape(n), routed_heads=layer.num_routed_heads, groups=groups, top_k=layer.top_k,
            shared=shared, weighting=layer.head_weighting, load_balance_weight=layer.load_balance_weight,
            per_token=layer.load_balance_fractions == "per_token", dense=True)
        routed = slot_weights.view(n, groups, -1)[:, :, shared:].reshape(n, -1)
        return g, index, routed, total, la

    def composed_side(x):
        monkeypatch.setenv(cpp_build.ENV_VAR, "python")
        route = layer.route(x, mask, 0, dense=True)
        g, routing = route.head_weights, route.routing
        monkeypatch.delenv(cpp_build.ENV_VAR)
        total, la = weighted_load_balance(routing.probs, routing.expert_index, routing.token_mask,
                                          layer.load_balance_weight, layer.load_balance_fractions, groups)
        return g.view(n, -1), routing.expert_index, routing.gates, total, la

    results = []
    for side in (fused_side, composed_side):
        z = x.clone().requires_grad_()
        g, index, routed, total, la = side(z)
        (grad,) = torch.autograd.grad((g * cotangent).sum() + 3.0 * total + la, z)
        results.append((g.detach(), index, routed.detach(), total.detach(), la.detach(), grad))
    for got, want in zip(*results):
        if got.dtype == torch.long:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
