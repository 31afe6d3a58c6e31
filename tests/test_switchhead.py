"""SwitchHead (arXiv 2312.07987) against its plain reference, its one-expert special case, the masks,
the cache, the expert kernels and, when their code is at hand, the authors' module."""

from __future__ import annotations

import importlib
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from headmix import SwitchHeadAttention, SwitchHeadRouting
from headmix.attention.reference import (
    reference_mask,
    reference_rotary,
    reference_softmax_attention,
    reference_switchhead,
    reference_switchhead_selection,
)
from headmix.kernels import IMPLS
from kernel_cases import define_interpreted_kernels
from test_attention import D, decode_step_by_step, inputs_for as attention_inputs_for


def make(num_heads=2, num_experts=4, top_k=2, head_dim=6, **kw) -> SwitchHeadAttention:
    torch.manual_seed(0)
    layer = SwitchHeadAttention(D, num_heads, num_experts, top_k, head_dim, **kw).eval()
    with torch.no_grad():  # selectors with clear margins, so the top-k does not hinge on rounding
        for sel in (layer.value_selector, layer.output_selector):
            if sel is not None:
                sel.weight.normal_()
    return layer


CONFIGS = {
    "2h4e2k": {},
    "3h3e1k_bias": dict(num_heads=3, num_experts=3, top_k=1, head_dim=5, bias=True),
    "2h1e1k": dict(num_experts=1, top_k=1),
    "1h3e3k": dict(num_heads=1, num_experts=3, top_k=3),
}


def inputs_for(case: str, batch=2, tgt=5, src=7):
    """The mask cases of test_attention, plus a boolean ``(batch, tgt, tgt)`` attn_mask."""
    if case != "bool_mask_per_batch":
        return attention_inputs_for(case, batch, tgt, src)
    x, _, _ = attention_inputs_for("none", batch, tgt, src)
    return x, None, {"attn_mask": torch.rand(batch, tgt, tgt, generator=torch.Generator().manual_seed(4)) < 0.3}


def run_with_grads(fn, layer, x, mem, kw, w):
    x = x.clone().requires_grad_()
    mem = None if mem is None else mem.clone().requires_grad_()
    out = fn(layer, x, mem, **kw)
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()
    return out, x.grad, None if mem is None else mem.grad, grads


def layer_output(layer, x, mem, **kw):
    return layer(x, mem, **kw).output


# --------------------------------------------------------------------------- against the reference

@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("case", ["none", "padding", "causal", "cross", "float_mask", "bool_mask_per_batch",
                                  "fully_masked_row"])
def test_matches_reference_outputs_and_gradients(config, case):
    layer = make(**CONFIGS[config])
    x, mem, kw = inputs_for(case)
    w = torch.randn(x.shape)
    out, gx, gm, grads = run_with_grads(layer_output, layer, x, mem, kw, w)
    ref, rx, rm, rgrads = run_with_grads(reference_switchhead, layer, x, mem, kw, w)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(gx, rx, atol=2e-6, rtol=1e-5)
    if mem is not None:
        torch.testing.assert_close(gm, rm, atol=2e-6, rtol=1e-5)
    assert grads.keys() == rgrads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], rgrads[n], atol=5e-6, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    # every expert bank and selector learns
    for n in ("value_experts", "output_experts", "output_selector.weight", "q_proj.weight", "k_proj.weight"):
        assert grads[n].abs().sum() > 0, n
    if layer.value_selector is not None:
        assert grads["value_selector.weight"].abs().sum() > 0


def test_value_selector_reads_the_key_and_experts_project_the_value():
    """With different key and value inputs: the value-side selector reads the key source (as the
    authors' ``sel_v`` reads ``k_src``), the value experts project the value source."""
    layer = make()
    x, key, value = torch.randn(2, 4, D), torch.randn(2, 6, D), torch.randn(2, 6, D)
    out = layer(x, key, value)
    torch.testing.assert_close(out.output, reference_switchhead(layer, x, key, value), atol=2e-6, rtol=1e-5)
    s = torch.sigmoid(key.reshape(-1, D) @ layer.value_selector.weight.T)
    torch.testing.assert_close(out.routing.value.gates, s.gather(-1, out.routing.value.expert_index))


def test_fully_masked_row_gives_zeros_and_finite_gradients():
    layer = make(bias=True)
    x, _, kw = inputs_for("fully_masked_row")
    x = x.requires_grad_()
    out = layer(x, **kw).output
    assert out[:, 2].eq(layer.out_bias).all()
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


@pytest.mark.parametrize("length", [0, 1])
def test_length_zero_and_one(length):
    layer = make()
    x = torch.randn(2, length, D, requires_grad=True)
    out = layer(x, is_causal=True).output
    assert out.shape == (2, length, D)
    out.sum().backward()
    if length:
        torch.testing.assert_close(out, reference_switchhead(layer, x, is_causal=True), atol=2e-6, rtol=1e-5)
    assert layer(torch.randn(2, 3, D), torch.randn(2, 0, D)).output.abs().max() == 0  # no keys: zeros


def test_gradcheck_float64():
    layer = make(num_heads=2, num_experts=3, top_k=2, head_dim=3, bias=True).double()
    x = torch.randn(1, 3, D, dtype=torch.float64, requires_grad=True)
    mem = torch.randn(1, 4, D, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: layer(a, b).output, (x, mem))


def test_query_padding_mask_marks_the_output_side():
    qpm = torch.zeros(2, 3, dtype=torch.bool)
    qpm[0, 2] = True
    r = make()(torch.randn(2, 3, D), torch.randn(2, 4, D), query_padding_mask=qpm).routing
    assert r.output.token_mask.tolist() == [True, True, False, True, True, True] and r.value.token_mask is None


def sigmoid_gated_attention(x: torch.Tensor, wq, wk, wv, wo, gate, num_heads: int, causal: bool) -> torch.Tensor:
    """Multi-head attention whose head outputs are scaled by ``sigmoid(x gate_h)`` before the output
    projection, written independently of headmix: ``y = sum_h sigmoid(x g_h) o^h W_o^h``."""
    b, t, _ = x.shape

    def heads(z):
        return z.view(b, t, num_heads, -1).transpose(1, 2)

    o = F.scaled_dot_product_attention(heads(x @ wq), heads(x @ wk), heads(x @ wv), is_causal=causal)
    o = o * torch.sigmoid(x @ gate).transpose(1, 2).unsqueeze(-1)           # (b, h, t, d_h) * (b, h, t, 1)
    return o.transpose(1, 2).reshape(b, t, -1) @ wo


@pytest.mark.parametrize("causal", [False, True])
def test_one_expert_is_attention_with_a_sigmoid_output_gate_per_head(causal):
    h, dh = 4, 3
    layer = SwitchHeadAttention(D, h, 1, 1, dh).eval()
    assert layer.value_selector is None
    x = torch.randn(2, 6, D)
    wq, wk = layer.q_proj.weight.T, layer.k_proj.weight.T
    wv = layer.value_experts.permute(1, 0, 2).reshape(D, h * dh)             # [W_v^0 | W_v^1 | ...]
    wo = layer.output_experts.reshape(h * dh, D)                             # [W_o^0; W_o^1; ...]
    expected = sigmoid_gated_attention(x, wq, wk, wv, wo, layer.output_selector.weight.T, h, causal)
    torch.testing.assert_close(layer(x, is_causal=causal).output, expected, atol=2e-6, rtol=1e-5)


# --------------------------------------------------------------------------- routing state

def test_routing_state_per_side_and_head():
    layer = make(num_heads=3, num_experts=4, top_k=2)
    x, mem = torch.randn(2, 5, D), torch.randn(2, 7, D)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, 4:] = True
    r = layer(x, mem, key_padding_mask=kpm).routing
    assert isinstance(r, SwitchHeadRouting) and (r.num_heads, r.num_experts) == (3, 4)
    assert r.value.batch_shape == (2, 7) and r.output.batch_shape == (2, 5)
    assert r.value.num_experts == r.output.num_experts == 12
    # slot h * k + j holds an expert of head h, and the k experts of a head are distinct
    for side, src in ((r.value, mem), (r.output, x)):
        heads = side.expert_index.view(-1, 3, 2) // 4
        assert heads.eq(torch.arange(3)[:, None]).all()
        assert (side.expert_index.view(-1, 3, 2)[..., 0] != side.expert_index.view(-1, 3, 2)[..., 1]).all()
        sel = layer.value_selector if side is r.value else layer.output_selector
        s = torch.sigmoid(src.reshape(-1, D) @ sel.weight.T)
        # the weights are the selected sigmoids, not renormalised, and they are the top-k per head
        torch.testing.assert_close(side.gates, s.gather(-1, side.expert_index))
        top = s.view(-1, 3, 4).topk(2, -1).values.view(-1, 6)
        torch.testing.assert_close(side.gates, top)
    # value side: the padded memory tokens are marked; output side: every query is real
    assert r.value.token_mask.tolist() == (~kpm).reshape(-1).tolist()
    assert r.output.token_mask is None
    counts = r.expert_counts()
    assert counts.shape == (24,) and counts[:12].sum() == 2 * 3 * (7 + 4) and counts[12:].sum() == 10 * 3 * 2
    assert not hasattr(layer, "routing") and layer(x).aux_loss.item() == 0.0


def test_one_expert_has_no_value_routing():
    r = make(num_experts=1, top_k=1)(torch.randn(1, 3, D)).routing
    assert r.value is None and r.output.gates.shape == (3, 2)
    assert r.expert_counts().tolist() == [0, 0, 3, 3]


def test_expert_dropout_only_changes_the_choice_in_training():
    layer = make(num_heads=2, num_experts=8, top_k=2, expert_dropout=0.5)
    x = torch.randn(4, 16, D)
    eval_routing = layer(x).routing
    torch.manual_seed(1)
    layer.train()
    train_routing = layer(x).routing.output
    plain = eval_routing.output
    # some choices move away from the plain top-k, yet the weights are always the undropped sigmoids
    assert not torch.equal(train_routing.expert_index, plain.expert_index)
    torch.testing.assert_close(train_routing.gates, train_routing.probs.gather(-1, train_routing.expert_index))
    torch.testing.assert_close(train_routing.probs, plain.probs)
    layer.eval()
    assert torch.equal(layer(x).routing.output.expert_index, plain.expert_index)


# --------------------------------------------------------------------------- dropout placement

def query_dropout_reference(layer: SwitchHeadAttention, x: torch.Tensor, keep: torch.Tensor, **masks) -> torch.Tensor:
    """SwitchHead self-attention with the authors' dropout placement (RobertCsordas/switchhead,
    ``SwitchHeadCore.forward``: ``q = self.dropout(q)`` on the projected queries of every head, before
    ``attend`` rotates them), written out one head and one expert at a time: ``keep`` ``(batch, heads, time,
    head_dim)`` holds the dropout's multipliers (0 or ``1 / (1 - p)``); no dropout on the attention."""
    n_h, n_e, d = layer.num_heads, layer.num_experts, layer.head_dim
    allowed, added = reference_mask(x.shape[0], 1, x.shape[1], x.shape[1], **masks)
    _, w_v = reference_switchhead_selection(layer, x, layer.value_selector)
    _, w_o = reference_switchhead_selection(layer, x, layer.output_selector)
    y = torch.zeros_like(x)
    for h in range(n_h):
        sl = slice(h * d, (h + 1) * d)
        q_h = (x @ layer.q_proj.weight[sl].T) * keep[:, h]                   # dropped queries
        k_h = x @ layer.k_proj.weight[sl].T
        v_h = sum(w_v[..., h, e:e + 1] * (x @ layer.value_experts[h * n_e + e]) for e in range(n_e))
        q_h = reference_rotary(q_h.unsqueeze(1), layer.rotary)                # rotated after the dropout
        k_h = reference_rotary(k_h.unsqueeze(1), layer.rotary)
        o_h = reference_softmax_attention(q_h, k_h, v_h.unsqueeze(1), allowed, added, 1.0 / math.sqrt(d)).squeeze(1)
        y = y + sum(w_o[..., h, e:e + 1] * (o_h @ layer.output_experts[h * n_e + e]) for e in range(n_e))
    return y


def test_query_dropout_matches_the_authors_placement():
    p = 0.4
    layer = make(rotary=True, rotary_fraction=0.5, dropout=p, dropout_on="queries").double().train()
    x = torch.randn(2, 6, D, dtype=torch.float64)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    torch.manual_seed(7)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = layer(x1, is_causal=True, key_padding_mask=kpm).output
    # The same multipliers: the layer draws nothing else (no expert dropout), and its queries are a
    # (batch, heads, time, head_dim) view of the (batch, time, heads * head_dim) projection, as the authors'.
    torch.manual_seed(7)
    keep = F.dropout(torch.ones(2, 6, layer.num_heads, layer.head_dim, dtype=torch.float64), p).transpose(1, 2)
    assert 0 < int((keep == 0).sum()) < keep.numel()
    w = torch.randn_like(out)
    (out * w).sum().backward()
    grads = {n: q.grad.clone() for n, q in layer.named_parameters()}
    layer.zero_grad()
    expected = query_dropout_reference(layer, x2, keep, is_causal=True, key_padding_mask=kpm)
    (expected * w).sum().backward()
    # float64, but the layer's rotary angles are float32 (as Hugging Face Llama): agreement to ~1e-8
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-6, atol=1e-7)
    for n, q in layer.named_parameters():
        torch.testing.assert_close(grads[n], q.grad, rtol=1e-6, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("dropout_on", ["attention", "queries"])
def test_dropout_applies_in_training_only(dropout_on):
    layer = make(rotary=True, dropout=0.5, dropout_on=dropout_on)
    x = torch.randn(2, 6, D)
    plain = reference_switchhead(layer, x, is_causal=True)
    torch.testing.assert_close(layer(x, is_causal=True).output, plain, atol=2e-6, rtol=1e-5)  # eval: no dropout
    layer.train()
    torch.manual_seed(3)
    dropped = layer(x, is_causal=True).output
    assert not torch.allclose(dropped, plain, atol=1e-3)
    torch.manual_seed(3)  # the same draws reproduce the same call
    torch.testing.assert_close(layer(x, is_causal=True).output, dropped, rtol=0, atol=0)


def test_dropout_placements_differ_and_attention_is_the_default():
    assert make().dropout_on == "attention"
    x = torch.randn(2, 6, D)
    outs = {}
    for placement in ("attention", "queries"):
        layer = make(dropout=0.5, dropout_on=placement).train()
        torch.manual_seed(3)
        outs[placement] = layer(x, is_causal=True).output
    assert not torch.allclose(outs["attention"], outs["queries"], atol=1e-3)


def test_query_dropout_matches_the_authors_module_in_training(monkeypatch):
    theirs_mod = _authors_switchhead()
    monkeypatch.setattr(theirs_mod, "cvmm", torch_cvmm)
    h, dh, e, k, p = 2, 8, 4, 2, 0.3  # their rotary needs an even half head
    torch.manual_seed(0)
    theirs = theirs_mod.SwitchHeadRope(D, h, e, dropout=p, d_head=dh, moe_k=k).train()  # rotate_fraction 0.5
    ours = SwitchHeadAttention(D, h, e, k, dh, dropout=p, dropout_on="queries", rotary=True,
                               rotary_fraction=0.5).train()
    with torch.no_grad():
        ours.q_proj.weight.copy_(theirs.q.weight)
        ours.k_proj.weight.copy_(theirs.k.weight)
        ours.output_selector.weight.copy_(theirs.sel_o)
        ours.value_selector.weight.copy_(theirs.sel_v)
        ours.value_experts.copy_(theirs.v)
        ours.output_experts.copy_(theirs.o)
    x = torch.randn(2, 6, D)
    torch.manual_seed(5)
    mine = ours(x, x, x, is_causal=True).output  # their call form: key and value given
    torch.manual_seed(5)
    torch.testing.assert_close(mine, theirs(x, x, x, None)[0], atol=2e-6, rtol=1e-5)


# --------------------------------------------------------------------------- caches

@pytest.mark.parametrize("config", ["2h4e2k", "2h1e1k"])
def test_step_by_step_decoding_equals_full_causal_forward(config):
    layer = make(**CONFIGS[config])
    x = torch.randn(2, 6, D)
    full = layer(x, is_causal=True).output
    steps, cache = decode_step_by_step(layer, x)
    torch.testing.assert_close(steps, full, atol=2e-6, rtol=1e-5)
    assert cache.length == 6 and cache.value.shape == (2, layer.num_heads, 6, layer.head_dim)


def test_cache_holds_values_after_the_expert_mixing():
    layer = make()
    x = torch.randn(2, 5, D)
    cache = layer(x, use_cache=True).cache
    _, w_v = __import__("headmix.attention.reference", fromlist=["x"]).reference_switchhead_selection(
        layer, x, layer.value_selector)
    for h in range(layer.num_heads):
        v_h = sum(w_v[..., h, e:e + 1] * (x @ layer.value_experts[h * 4 + e]) for e in range(4))
        torch.testing.assert_close(cache.value[:, h], v_h, atol=2e-6, rtol=1e-5)


def test_cross_attention_static_cache():
    layer = make()
    x, mem = torch.randn(2, 4, D), torch.randn(2, 7, D)
    full = layer(x, mem).output
    first = layer(x[:, :1], mem, use_cache=True)
    assert first.cache.static
    rest = layer(x[:, 1:], mem, use_cache=True, cache=first.cache)
    assert rest.routing.value is None  # the memory's values come from the cache, not reselected
    torch.testing.assert_close(torch.cat([first.output, rest.output], 1), full, atol=2e-6, rtol=1e-5)


# --------------------------------------------------------------------------- kernels

def _cpu_impls() -> list[str]:
    """Every implementation, ``triton`` in the Triton interpreter unless its kernels are compiled for a GPU."""
    from headmix.kernels.grouped_triton import triton_available

    impls = [i for i in IMPLS if i != "triton"]
    if triton_available() and define_interpreted_kernels():
        impls.append("triton")
    return impls


@pytest.mark.parametrize("impl", _cpu_impls())
def test_every_expert_impl_agrees(impl):
    base = make(num_heads=2, num_experts=5, top_k=2, expert_impl="reference")
    layer = make(num_heads=2, num_experts=5, top_k=2, expert_impl=impl)
    x, mem, kw = inputs_for("cross")
    w = torch.randn(x.shape)
    out, gx, gm, grads = run_with_grads(layer_output, layer, x, mem, kw, w)
    ref, rx, rm, rgrads = run_with_grads(layer_output, base, x, mem, kw, w)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(gx, rx, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(gm, rm, atol=2e-6, rtol=1e-5)
    for n in grads:
        torch.testing.assert_close(grads[n], rgrads[n], atol=5e-6, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    with torch.no_grad():  # no-grad decoding path (``gather`` is chosen there by ``auto``)
        torch.testing.assert_close(layer(x[:1, :1], mem[:1]).output, base(x[:1, :1], mem[:1]).output,
                                   atol=2e-6, rtol=1e-5)


def test_bf16_autocast_close_to_float32():
    layer = make()
    x = torch.randn(2, 5, D)
    ref = layer(x).output
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x).output
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.05)


# --------------------------------------------------------------------------- arguments

@pytest.mark.parametrize("kwargs, message", [
    (dict(num_heads=0), "num_heads must be a positive integer"),
    (dict(num_experts=0), "num_experts must be a positive integer"),
    (dict(top_k=0), "top_k must be a positive integer"),
    (dict(num_experts=2, top_k=3), r"top_k \(3\) must not exceed num_experts \(2\)"),
    (dict(head_dim=0), "head_dim must be a positive integer"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
    (dict(expert_dropout=-0.1), r"expert_dropout must be in \[0, 1\)"),
    (dict(init_scale=0.0), "init_scale must be a positive number"),
    (dict(expert_impl="fast"), "expert_impl must be one of"),
    (dict(dropout_on="values"), r"dropout_on must be one of \('attention', 'queries'\)"),
])
def test_bad_arguments_give_one_line_errors(kwargs, message):
    args = dict(num_heads=2, num_experts=4, top_k=2, head_dim=4) | kwargs
    with pytest.raises(ValueError, match=message) as err:
        SwitchHeadAttention(D, args.pop("num_heads"), args.pop("num_experts"), args.pop("top_k"), args.pop("head_dim"),
                            **args)
    assert "\n" not in str(err.value)


def test_bad_inputs_give_one_line_errors():
    layer = make()
    with pytest.raises(ValueError, match=r"query must have shape \(batch, time, 16\)"):
        layer(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        layer(torch.randn(2, 3, D), key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="embed_dim .* must be divisible by num_heads"):
        SwitchHeadAttention(D, 3, 2, 1)


def test_init_scale_scales_the_weights():
    small = SwitchHeadAttention(64, 2, 4, 2, 16, init_scale=0.25)
    torch.manual_seed(0)
    unit = SwitchHeadAttention(64, 2, 4, 2, 16)
    assert abs(unit.value_experts.std().item() - 64 ** -0.5) < 0.1 * 64 ** -0.5
    assert abs(unit.output_experts.std().item() - 32 ** -0.5) < 0.1 * 32 ** -0.5
    ratio = small.value_experts.std() / unit.value_experts.std()
    assert abs(ratio.item() - 0.25) < 0.03


# --------------------------------------------------------------------------- the authors' module

def _authors_switchhead():
    """The authors' ``switchhead`` package (RobertCsordas/switchhead): importable, or from the folder
    named by ``HEADMIX_SWITCHHEAD_SRC``; the test is skipped otherwise."""
    path = os.environ.get("HEADMIX_SWITCHHEAD_SRC")
    if path and path not in sys.path:
        sys.path.insert(0, path)
    try:
        return importlib.import_module("switchhead.switchhead")
    except ImportError as err:  # pragma: no cover - depends on the machine
        pytest.skip(f"the authors' switchhead package is not importable ({err}); set HEADMIX_SWITCHHEAD_SRC")


def torch_cvmm(x, sel, keys):
    """A plain-torch stand-in for the authors' ``cvmm`` Triton kernel (which needs CUDA): row ``m`` of the
    sorted selection multiplies input row ``sel.sel_index[m]`` by ``keys[sel.sel[m]]`` and lands at
    ``sel.out_index[m]``; a ``reduction_weight`` then sums the selections of a row with those weights."""
    flat = x.flatten(end_dim=-2)
    experts = sel.sel.flatten()
    prod = torch.bmm(flat[sel.sel_index].unsqueeze(1), keys[experts]).squeeze(1)
    out = torch.empty_like(prod).index_copy(0, sel.out_index, prod)
    if sel.reduction_weight is None:
        return out.view(*sel.raw_sel.shape, -1)
    out = out.view(*sel.reduction_weight.shape, -1)
    return (sel.reduction_weight.unsqueeze(-2).type_as(out) @ out).squeeze(-2)


@pytest.mark.parametrize("num_experts, top_k", [(4, 2), (1, 1)])
def test_matches_the_authors_module(monkeypatch, num_experts, top_k):
    theirs_mod = _authors_switchhead()
    monkeypatch.setattr(theirs_mod, "cvmm", torch_cvmm)
    h, dh = 2, 6
    torch.manual_seed(0)
    theirs = theirs_mod.SwitchHeadRope(D, h, num_experts, d_head=dh, moe_k=top_k, rotate_fraction=0.0).eval()
    ours = SwitchHeadAttention(D, h, num_experts, top_k, dh).eval()
    with torch.no_grad():
        ours.q_proj.weight.copy_(theirs.q.weight)
        ours.k_proj.weight.copy_(theirs.k.weight)
        ours.output_selector.weight.copy_(theirs.sel_o)
        if num_experts > 1:
            ours.value_selector.weight.copy_(theirs.sel_v)
            ours.value_experts.copy_(theirs.v)
            ours.output_experts.copy_(theirs.o)
        else:
            ours.value_experts.copy_(theirs.v.view(h, dh, D).transpose(1, 2))
            ours.output_experts.copy_(theirs.o.T.reshape(h, dh, D))
    x, mem = torch.randn(2, 6, D), torch.randn(2, 6, D)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    cases = [  # (our call, their call); their masks: True = masked, None = causal
        (lambda: ours(x, is_causal=True).output, lambda: theirs(x, x, x, None)[0]),
        (lambda: ours(x, mem, key_padding_mask=kpm).output,
         lambda: theirs(x, mem, mem, theirs_mod.AttentionMask(None, kpm))[0]),
    ]
    for ours_call, theirs_call in cases:
        torch.testing.assert_close(ours_call(), theirs_call(), atol=2e-6, rtol=1e-5)
    # gradients of the whole layer, causal self-attention
    w = torch.randn(2, 6, D)
    (ours(x, is_causal=True).output * w).sum().backward()
    (theirs(x, x, x, None)[0] * w).sum().backward()
    torch.testing.assert_close(ours.q_proj.weight.grad, theirs.q.weight.grad, atol=5e-6, rtol=1e-5)
    torch.testing.assert_close(ours.output_selector.weight.grad, theirs.sel_o.grad, atol=5e-6, rtol=1e-5)
    if num_experts > 1:
        torch.testing.assert_close(ours.value_experts.grad, theirs.v.grad, atol=5e-6, rtol=1e-5)
        torch.testing.assert_close(ours.value_selector.weight.grad, theirs.sel_v.grad, atol=5e-6, rtol=1e-5)
        torch.testing.assert_close(ours.output_experts.grad, theirs.o.grad, atol=5e-6, rtol=1e-5)
    assert math.isfinite(float(ours.k_proj.weight.grad.sum()))


# --------------------------------------------------------------------------- models, counting

def test_config_kind_builds_the_layer_in_every_task():
    from headmix.models import build_model, get_config

    for task in ("translation", "mlm", "lm"):
        cfg = get_config("tiny-switchhead", task=task)
        model = build_model(cfg)
        layers = [m for m in model.modules() if isinstance(m, SwitchHeadAttention)]
        assert len(layers) == {"translation": 6, "mlm": 2, "lm": 2}[task]
        assert {(l.num_heads, l.num_experts, l.top_k, l.head_dim, l.out_bias) for l in layers} == {(2, 4, 2, 22, None)}
        ids = torch.randint(3, cfg.vocab_size, (2, 5))
        out = model(ids, ids) if task == "translation" else model(ids)
        assert out.aux_loss.item() == 0.0
        assert all(isinstance(r, SwitchHeadRouting) for _, r in out.routing) and len(out.routing) == len(layers)


def test_config_switchhead_fields_and_errors():
    from headmix.models.config import AttentionConfig

    att = AttentionConfig(kind="switchhead", num_heads=2, num_experts=4, top_k=2, expert_dropout=0.25, init_scale=0.5,
                          expert_impl="sorted")
    layer = att.build(16)
    assert (layer.head_dim, layer.expert_dropout, layer.init_scale, layer.expert_impl) == (8, 0.25, 0.5, "sorted")
    assert AttentionConfig.from_dict(att.to_dict()) == att
    assert layer.dropout_on == "attention"  # unset: the attention probabilities
    queries = AttentionConfig(kind="switchhead", num_heads=2, num_experts=4, top_k=2, dropout=0.1, dropout_on="queries")
    assert queries.build(16).dropout_on == "queries"
    assert AttentionConfig.from_dict(queries.to_dict()) == queries
    with pytest.raises(ValueError, match=r"attention.dropout_on must be one of \('attention', 'queries'\)"):
        AttentionConfig(kind="switchhead", num_heads=2, num_experts=2, top_k=1, dropout_on="values")
    with pytest.raises(ValueError, match="attention.dropout_on applies to kind 'switchhead' only"):
        AttentionConfig(kind="mha", num_heads=2, dropout_on="queries")
    with pytest.raises(ValueError, match="attention.num_experts is required for kind 'switchhead'"):
        AttentionConfig(kind="switchhead", num_heads=2, top_k=1)
    with pytest.raises(ValueError, match="attention.top_k K=3 exceeds num_experts E=2"):
        AttentionConfig(kind="switchhead", num_heads=2, num_experts=2, top_k=3)
    with pytest.raises(ValueError, match=r"attention.expert_dropout must be a number in \[0, 1\)"):
        AttentionConfig(kind="switchhead", num_heads=2, num_experts=2, top_k=1, expert_dropout=1.0)
    with pytest.raises(ValueError, match="attention.init_scale must be a positive number"):
        AttentionConfig(kind="switchhead", num_heads=2, num_experts=2, top_k=1, init_scale=0)
    with pytest.raises(ValueError, match="attention.expert_dropout applies to kind 'switchhead' only"):
        AttentionConfig(kind="moa", num_experts=2, top_k=1, head_dim=4, expert_dropout=0.1)


@pytest.mark.parametrize("num_experts, top_k, bias", [(4, 2, False), (1, 1, True)])
def test_paper_counts_of_one_layer(num_experts, top_k, bias):
    from headmix.models.config import AttentionConfig
    from headmix.models.counting import attention_macs, attention_parameters

    d, h, dh, t, s = 64, 2, 24, 10, 7
    att = AttentionConfig(kind="switchhead", num_heads=h, num_experts=num_experts, top_k=top_k, head_dim=dh, bias=bias)
    layer = att.build(d)
    weights = layer.q_proj.weight.numel() + layer.k_proj.weight.numel() + layer.value_experts.numel() \
        + layer.output_experts.numel()
    assert weights == 2 * h * (num_experts + 1) * dh * d
    assert attention_parameters(att, d) == (sum(p.numel() for p in layer.parameters()), weights)
    full, paper = attention_macs(att, d, t, t)
    products = 2 * h * t * dh * (d * (1 + top_k) + t)                       # self-attention form
    selectors = t * d * h * num_experts * (2 if num_experts > 1 else 1)     # the layer's H E d_m per side
    assert full == products + selectors
    # the authors' count adds the weighted sums (k d_h per token, head, side) and selectors as E d_m per side
    assert paper == products + 2 * h * top_k * t * dh + 2 * num_experts * d * t
    # cross-attention: K and V projections, the value-side sum and selector over the S source tokens
    full_cross, paper_cross = attention_macs(att, d, t, s)
    products_cross = h * ((t + s) * d * dh + top_k * (s + t) * d * dh + 2 * t * s * dh)
    assert full_cross == products_cross + (t + (s if num_experts > 1 else 0)) * d * h * num_experts
    assert paper_cross == products_cross + h * top_k * dh * (s + t) + num_experts * d * (s + t)


def test_macs_cli_shows_switchhead(capsys):
    import json

    from headmix.cli.main import main
    from headmix.models import analytic_macs, get_config

    assert main(["macs", "tiny-switchhead", "--task", "lm", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["macs_measured"] == out["macs"] == analytic_macs(get_config("tiny-switchhead", task="lm")).total
    assert out["macs_paper"] < out["macs"]


# --------------------------------------------------------------------------- analysis

def test_expert_load_per_head_value_and_output_sides():
    from headmix.analysis import expert_load, routed_layers
    from headmix.models import build_model, get_config

    torch.manual_seed(0)
    model = build_model(get_config("tiny-switchhead", vocab_size=50)).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SwitchHeadAttention):
                for sel in (m.value_selector, m.output_selector):
                    sel.weight.normal_()
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(3, 50, (3, 7), generator=g), torch.randint(3, 50, (3, 5), generator=g)
    src[2, 5:] = 0  # padding: never counted
    tgt[1, 4:] = 0
    names = [l.name for l in routed_layers(model)]
    assert names[:2] == ["encoder.layers.0.self_attn:value", "encoder.layers.0.self_attn:output"]
    assert len(names) == 2 * 6 and "decoder.layers.1.cross_attn:value" in names
    report = expert_load(model, [{"src": src, "tgt_in": tgt}])
    # expected: the model's own routing, counted by hand per side over that side's real tokens
    with torch.no_grad():
        enc = model.encode(src)
        dec = model.decode(tgt, enc)
    state = dict(enc.routing + dec.routing)
    for layer in report.layers:
        module, side = layer.name.split(":")
        r = getattr(state[module], side)
        ids = src if module.startswith("encoder") or (side == "value" and module.endswith("cross_attn")) else tgt
        real = ids.reshape(-1) != 0
        expected = torch.bincount(r.expert_index[real].reshape(-1), minlength=8)
        assert layer.counts == expected.tolist(), layer.name
        assert layer.num_tokens == int(real.sum()) and (layer.num_groups, layer.top_k, layer.num_experts) == (2, 2, 8)
        assert layer.labels[:5] == ["h0.E0", "h0.E1", "h0.E2", "h0.E3", "h1.E0"]
        for h, head in enumerate(layer.groups):
            c_h = expected.view(2, 4)[h].double()
            assert head["share"] == pytest.approx((c_h / c_h.sum()).tolist())
            assert head["max_share"] == pytest.approx(float(c_h.max() / c_h.sum()))
    text = report.to_markdown()
    assert "Per head (shares of the group's own slots)" in text and "| decoder.layers.1.cross_attn:value | h1 | 4 |" in text


def test_token_expert_pmi_on_a_switchhead_side():
    from headmix.analysis import token_expert_pmi
    from headmix.models import build_model, get_config

    torch.manual_seed(0)
    model = build_model(get_config("tiny-switchhead", task="lm", vocab_size=40)).eval()
    ids = torch.randint(3, 40, (4, 12), generator=torch.Generator().manual_seed(2))
    report = token_expert_pmi(model, [ids], layer="decoder.layers.1.self_attn:output", min_count=1)
    assert report.name == "decoder.layers.1.self_attn:output" and report.num_slots == 2 * 2 * ids.numel()
    assert "SwitchHead layer with 8 experts, top-2" in report.to_markdown()


def test_one_expert_layers_have_only_an_output_side():
    from headmix.analysis import routed_layers
    from headmix.models import build_model
    from headmix.models.config import AttentionConfig
    from headmix.models.presets import cpu_model

    att = AttentionConfig(kind="switchhead", num_heads=2, num_experts=1, top_k=1)
    model = build_model(cpu_model("lm", att, 50, d_model=16, ffn_dim=32, layers=1, max_positions=16))
    assert [l.name for l in routed_layers(model)] == ["decoder.layers.0.self_attn:output"]


# --------------------------------------------------------------------------- bench attention

def test_bench_attention_switchhead_spec_and_rows():
    from headmix.bench.attention import bench_decoding, bench_layers, parse_switchhead

    assert parse_switchhead("2H4E2K", 512) == (2, 4, 2, 171)          # 2 H d_h d_m (1 + k) ~= 4 d_m^2
    assert parse_switchhead("3H8E1K64D", 512) == (3, 8, 1, 64)
    for bad in ("2H4E", "2H2E3K", "0H4E2K"):
        with pytest.raises(ValueError, match="--switchhead"):
            parse_switchhead(bad, 512)
    specs = [(2, 3, 2, 8)]
    rows = bench_layers([8], [4], embed_dim=16, top_k=2, head_dim=8, batch_tokens=16, batch=None, repeats=1, warmup=0,
                        device=torch.device("cpu"), dtype=torch.float32, switchheads=specs)
    assert [r["layer"] for r in rows] == ["torch MHA", "headmix MHA", "MoA 2K4E8D", "SwitchHead 2H3E2K8D"]
    dec = bench_decoding(embed_dim=16, top_k=2, head_dim=8, experts=[], batch=2, prompt=3, steps=2, repeats=1,
                         device=torch.device("cpu"), dtype=torch.float32, switchheads=specs)
    assert dec[-1]["layer"] == "SwitchHead 2H3E2K8D"
    assert dec[-1]["cache_bytes_per_token"] == 2 * 2 * 8 * 4                 # keys and mixed values, 2 heads of 8
