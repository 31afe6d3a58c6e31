"""The attention layers against torch.nn.MultiheadAttention and against the plain references."""

from __future__ import annotations

import math

import pytest
import torch
from optional_hypothesis import given, settings, st  # hypothesis' own where installed

from headmix import (
    MixtureOfAttentionHeads,
    MixtureOfHeadsAttention,
    MultiHeadAttention,
    TalkingHeadsAttention,
)
from headmix.attention.reference import (
    reference_mha,
    reference_moa,
    reference_moa_losses,
    reference_moh,
)

D = 16


def make(kind: str, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    if kind == "mha":
        layer = MultiHeadAttention(D, 4, **kw)
    elif kind == "mha_key":
        layer = MultiHeadAttention(D, 4, head_dim=3, key_dim=7, **kw)
    elif kind == "moa":
        layer = MixtureOfAttentionHeads(D, num_experts=5, top_k=2, head_dim=6, **kw)
    elif kind == "moa_kv":  # grouped K/V heads (JetMoE form): 3 K/V heads, 2 x 3 query heads per token
        layer = MixtureOfAttentionHeads(D, num_experts=5, top_k=2, head_dim=4, kv_heads=3, **kw)
    elif kind == "moh":
        layer = MixtureOfHeadsAttention(D, num_heads=4, num_shared_heads=1, top_k=2, **kw)
    elif kind == "moh_routed_only":
        layer = MixtureOfHeadsAttention(D, num_heads=4, num_shared_heads=0, top_k=3, **kw)
    elif kind == "th":
        layer = TalkingHeadsAttention(D, 4, **kw)
    else:
        raise AssertionError(kind)
    layer = layer.to(dtype).eval()
    if kind == "th":  # move away from the identity so the mixing is exercised
        with torch.no_grad():
            layer.pre_mix.add_(0.3 * torch.randn(4, 4, dtype=dtype))
            layer.post_mix.add_(0.3 * torch.randn(4, 4, dtype=dtype))
    if kind.startswith("moh"):
        with torch.no_grad():
            for lin in (layer.shared_gate, layer.group_gate):
                if lin is not None:
                    lin.weight.normal_()
            layer.routed_gate.weight.normal_()
    if kind.startswith("moa"):
        with torch.no_grad():
            layer.router.gate.weight.normal_()
    return layer


def reference_for(kind: str):
    return {"mha": reference_mha, "mha_key": reference_mha, "th": reference_mha, "moa": reference_moa,
            "moa_kv": reference_moa, "moh": reference_moh, "moh_routed_only": reference_moh}[kind]


KINDS = ["mha", "mha_key", "moa", "moa_kv", "moh", "moh_routed_only", "th"]


# --------------------------------------------------------------------------- torch equivalence

@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_matches_torch(bias):
    torch.manual_seed(1)
    ref = torch.nn.MultiheadAttention(D, 4, bias=bias, batch_first=True).eval()
    layer = MultiHeadAttention.from_torch(ref).eval()
    x, mem = torch.randn(3, 5, D), torch.randn(3, 7, D)
    kpm = torch.zeros(3, 7, dtype=torch.bool)
    kpm[1, 4:] = True
    cases = [
        dict(q=x, k=x, kw={}),
        dict(q=x, k=mem, kw=dict(key_padding_mask=kpm)),
        dict(q=x, k=x, kw=dict(attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(5))),
        dict(q=x, k=x, kw=dict(attn_mask=torch.rand(5, 5) > 0.6)),
        dict(q=x, k=mem, kw=dict(attn_mask=torch.randn(3 * 4, 5, 7))),
        dict(q=x, k=mem, kw=dict(attn_mask=torch.randn(5, 7), key_padding_mask=kpm)),
    ]
    for case in cases:
        expected, _ = ref(case["q"], case["k"], case["k"], need_weights=False, **case["kw"])
        got = layer(case["q"], None if case["k"] is x else case["k"], **case["kw"]).output
        rows_ok = ~torch.isnan(expected)  # torch gives NaN where a row is fully masked; we give zeros
        torch.testing.assert_close(got[rows_ok], expected[rows_ok], atol=1e-6, rtol=1e-5)
        assert not torch.isnan(got).any()


def test_from_torch_gradients_match():
    torch.manual_seed(2)
    ref = torch.nn.MultiheadAttention(D, 2, batch_first=True)
    layer = MultiHeadAttention.from_torch(ref)
    x = torch.randn(2, 4, D, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    ref(x, x, x, need_weights=False)[0].square().sum().backward()
    layer(x2).output.square().sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(layer.q_proj.weight.grad, ref.in_proj_weight.grad[:D], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(layer.out_proj.weight.grad, ref.out_proj.weight.grad, atol=1e-6, rtol=1e-5)


def test_from_torch_rejects_other_modules():
    with pytest.raises(ValueError, match="module"):
        MultiHeadAttention.from_torch(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))


# --------------------------------------------------------------------------- against the references

MASK_CASES = ["none", "padding", "causal", "cross", "float_mask", "fully_masked_row"]


def inputs_for(case: str, batch=2, tgt=5, src=7):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(batch, tgt, D, generator=g)
    kw: dict = {}
    mem = None
    if case == "padding":
        kpm = torch.zeros(batch, tgt, dtype=torch.bool)
        kpm[1, 3:] = True
        kw["key_padding_mask"] = kpm
    elif case == "causal":
        kw["is_causal"] = True
    elif case == "cross":
        mem = torch.randn(batch, src, D, generator=g)
        kpm = torch.zeros(batch, src, dtype=torch.bool)
        kpm[0, 5:] = True
        kw["key_padding_mask"] = kpm
    elif case == "float_mask":
        kw["attn_mask"] = torch.randn(tgt, tgt, generator=g)
    elif case == "fully_masked_row":
        m = torch.zeros(tgt, tgt, dtype=torch.bool)
        m[2, :] = True
        kw["attn_mask"] = m
    return x, mem, kw


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", MASK_CASES)
def test_layer_matches_reference_outputs_and_gradients(kind, case):
    layer = make(kind)
    x, mem, kw = inputs_for(case)
    x1 = x.clone().requires_grad_()
    m1 = None if mem is None else mem.clone().requires_grad_()
    out = layer(x1, m1, **kw).output
    assert not torch.isnan(out).any()
    if case == "fully_masked_row":
        assert out[:, 2].eq(layer.out_proj.bias if hasattr(layer, "out_proj") else layer.out_bias).all()
    w = torch.randn_like(out)
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()

    x2 = x.clone().requires_grad_()
    m2 = None if mem is None else mem.clone().requires_grad_()
    expected = reference_for(kind)(layer, x2, m2, **kw)
    (expected * w).sum().backward()
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(x1.grad, x2.grad, atol=2e-6, rtol=1e-5)
    if mem is not None:
        torch.testing.assert_close(m1.grad, m2.grad, atol=2e-6, rtol=1e-5)
    for n, p in layer.named_parameters():
        if p.grad is None:
            assert n not in grads or grads[n].abs().max() == 0, n
            continue
        torch.testing.assert_close(grads[n], p.grad, atol=5e-6, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    if kind.startswith("moa"):  # the router and the experts get gradients
        assert grads["router.gate.weight"].abs().sum() > 0
        assert grads["query_experts"].abs().sum() > 0 and grads["output_experts"].abs().sum() > 0


@pytest.mark.parametrize("renormalize", ["detached", "live", "none"])
def test_moa_renormalisation_options(renormalize):
    layer = make("moa", renormalize=renormalize)
    x = torch.randn(2, 4, D)
    out = layer(x)
    g = out.routing.gates
    p = out.routing.probs.gather(-1, out.routing.expert_index)
    if renormalize == "none":
        torch.testing.assert_close(g, p)
    else:
        torch.testing.assert_close(g.sum(-1), torch.ones(8))
    x1 = x.clone().requires_grad_()
    expected = reference_moa(layer, x1)
    torch.testing.assert_close(layer(x).output, expected, atol=2e-6, rtol=1e-5)


def test_detached_and_live_denominators_differ_only_in_router_gradient():
    grads = {}
    for mode in ("detached", "live"):
        layer = make("moa", renormalize=mode)
        x = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(0))
        layer(x).output.sum().backward()
        grads[mode] = {n: p.grad.clone() for n, p in layer.named_parameters()}
    assert not torch.allclose(grads["detached"]["router.gate.weight"], grads["live"]["router.gate.weight"])
    torch.testing.assert_close(grads["detached"]["query_experts"], grads["live"]["query_experts"])


def test_noisy_topk_router():
    layer = make("moa", router="noisy_topk")
    x = torch.randn(2, 6, D)
    ev = layer(x).routing
    torch.testing.assert_close(ev.gates, ev.logits.gather(-1, ev.expert_index).softmax(-1))
    torch.testing.assert_close(layer(x).output, reference_moa(layer, x), atol=2e-6, rtol=1e-5)
    layer.train()
    torch.manual_seed(5)
    tr = layer(x).routing
    torch.testing.assert_close(tr.gates.sum(-1), torch.ones(12))
    assert not torch.equal(tr.gates, ev.gates)
    with pytest.raises(ValueError, match="renormalize"):
        MixtureOfAttentionHeads(D, 4, 2, 4, router="noisy_topk", renormalize="none")


# --------------------------------------------------------------------------- special cases that equal MHA

def test_moa_one_expert_equals_single_head_attention_with_shared_kv():
    torch.manual_seed(0)
    # one expert: its router is a softmax over one logit (no task gradient), allowed here as the ablation
    moa = MixtureOfAttentionHeads(D, num_experts=1, top_k=1, head_dim=6, allow_router_without_task_gradient=True).eval()
    mha = MultiHeadAttention(D, 1, head_dim=6).eval()
    with torch.no_grad():
        mha.q_proj.weight.copy_(moa.query_experts[0].T)
        mha.q_proj.bias.zero_()
        mha.k_proj.load_state_dict(moa.k_proj.state_dict())
        mha.v_proj.load_state_dict(moa.v_proj.state_dict())
        mha.out_proj.weight.copy_(moa.output_experts[0].T)
        mha.out_proj.bias.copy_(moa.out_bias)
    x, mem = torch.randn(2, 5, D), torch.randn(2, 3, D)
    torch.testing.assert_close(moa(x, is_causal=True).output, mha(x, is_causal=True).output, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(moa(x, mem).output, mha(x, mem).output, atol=1e-6, rtol=1e-5)


def copy_projections(src, dst):
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        getattr(dst, name).load_state_dict(getattr(src, name).state_dict())


def test_moh_with_every_head_shared_equals_mha():
    moh = MixtureOfHeadsAttention(D, num_heads=4, num_shared_heads=4, top_k=0).eval()
    mha = MultiHeadAttention(D, 4).eval()
    copy_projections(moh, mha)
    x = torch.randn(2, 5, D)
    torch.testing.assert_close(moh(x, is_causal=True).output, mha(x, is_causal=True).output)
    assert moh(x).aux_loss.item() == 0.0 and moh(x).routing is None


def test_fresh_moh_weights_every_active_head_one():
    moh = MixtureOfHeadsAttention(D, num_heads=8, num_shared_heads=2, top_k=2).eval()
    x = torch.randn(2, 3, D)
    g, routing = moh.head_weights(x, None)
    assert torch.allclose(g[..., :2], torch.ones(()))
    # routed heads (default "renormalized"): 2 * 0.5 * k * p_i / sum_TopK p, summing to k over the selected
    # heads; exactly 0 when unselected
    assert (g[..., 2:] > 0).sum(-1).eq(2).all()
    torch.testing.assert_close(g[..., 2:].sum(-1), torch.full((2, 3), 2.0))
    with torch.no_grad():
        moh.routed_gate.weight.zero_()  # uniform scores: every active head has weight exactly 1
    g, _ = moh.head_weights(x, None)
    torch.testing.assert_close(g[..., 2:].sort(-1).values[..., -2:], torch.ones(2, 3, 2))


@pytest.mark.parametrize("weighting", ["renormalized", "paper", "scaled"])
@pytest.mark.parametrize("shared", [2, 0])
def test_moh_head_weightings_match_reference(weighting, shared):
    from headmix.attention.reference import reference_moh_weights

    torch.manual_seed(5)
    moh = MixtureOfHeadsAttention(D, num_heads=8, num_shared_heads=shared, top_k=3,
                                  head_weighting=weighting).eval()
    with torch.no_grad():
        for lin in (moh.routed_gate, moh.shared_gate, moh.group_gate):
            if lin is not None:
                lin.weight.normal_()
    x = torch.randn(2, 5, D)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[0, 3:] = True
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    g, _ = moh.head_weights(x, None)
    torch.testing.assert_close(g.double(), reference_moh_weights(moh, x), atol=1e-6, rtol=1e-5)
    routed = g[..., shared:]
    top = routed.max(-1).values
    if weighting == "paper":
        assert (routed.sum(-1) < 1).all()       # unnormalised probabilities of the selected heads
    elif weighting == "renormalized" and not shared:
        torch.testing.assert_close(routed.sum(-1), torch.full((2, 5), 3.0))
    assert (top > 0).all()
    out = moh(x1, is_causal=True, key_padding_mask=kpm).output
    w = torch.randn_like(out)
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in moh.named_parameters() if p.grad is not None}
    moh.zero_grad()
    (reference_moh(moh, x2, is_causal=True, key_padding_mask=kpm) * w).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, atol=2e-6, rtol=1e-5)
    for n, p in moh.named_parameters():
        if n in grads:
            torch.testing.assert_close(grads[n], p.grad, atol=5e-6, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    assert grads["routed_gate.weight"].abs().sum() > 0
    with pytest.raises(ValueError, match="head_weighting must be one of"):
        MixtureOfHeadsAttention(D, 4, 1, 2, head_weighting="softmax")


def test_talking_heads_at_init_equals_mha():
    th = TalkingHeadsAttention(D, 4).eval()
    mha = MultiHeadAttention(D, 4).eval()
    copy_projections(th, mha)
    x, mem = torch.randn(2, 5, D), torch.randn(2, 6, D)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[0, 4:] = True
    torch.testing.assert_close(th(x, is_causal=True).output, mha(x, is_causal=True).output, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(th(x, mem, key_padding_mask=kpm).output, mha(x, mem, key_padding_mask=kpm).output,
                               atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------- caches

@pytest.mark.parametrize("kind", KINDS)
def test_step_by_step_decoding_equals_full_causal_forward(kind):
    layer = make(kind)
    x = torch.randn(2, 6, D)
    full = layer(x, is_causal=True).output
    cache, steps = None, []
    # a prompt of 2 tokens, then one token at a time
    out = layer(x[:, :2], is_causal=True, use_cache=True)
    steps.append(out.output)
    cache = out.cache
    for t in range(2, 6):
        out = layer(x[:, t:t + 1], is_causal=True, use_cache=True, cache=cache)
        cache = out.cache
        steps.append(out.output)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-6, rtol=1e-5)
    assert cache.length == 6


@pytest.mark.parametrize("kind", KINDS)
def test_cross_attention_static_cache(kind):
    layer = make(kind)
    x, mem = torch.randn(2, 4, D), torch.randn(2, 7, D)
    full = layer(x, mem).output
    first = layer(x[:, :1], mem, use_cache=True)
    assert first.cache.static
    rest = layer(x[:, 1:], mem, use_cache=True, cache=first.cache)
    torch.testing.assert_close(torch.cat([first.output, rest.output], 1), full, atol=2e-6, rtol=1e-5)
    assert rest.cache is first.cache


def test_moa_cache_holds_one_shared_head():
    moa = MixtureOfAttentionHeads(512, num_experts=32, top_k=8, head_dim=64)
    mha = MultiHeadAttention(512, 8)
    x = torch.randn(1, 10, 512)
    moa_cache = moa(x, is_causal=True, use_cache=True).cache
    mha_cache = mha(x, is_causal=True, use_cache=True).cache
    assert moa_cache.key.shape == (1, 1, 10, 64)
    assert moa_cache.nbytes == 10 * 2 * 64 * 4           # 2 x head_dim x element size per token
    assert mha_cache.nbytes == 8 * moa_cache.nbytes       # 8x less than MHA at d_model 512, head_dim 64


def test_moa_kv_heads_cache_holds_g_heads():
    moa = MixtureOfAttentionHeads(64, num_experts=8, top_k=4, head_dim=16, kv_heads=2)
    x = torch.randn(1, 10, 64)
    cache = moa(x, is_causal=True, use_cache=True).cache
    assert cache.key.shape == cache.value.shape == (1, 2, 10, 16)
    assert cache.nbytes == 10 * 2 * 2 * 16 * 4            # kv_heads x 2 x head_dim x element size per token
    assert moa.query_experts.shape == (8, 64, 32) and moa.output_experts.shape == (8, 32, 64)
    assert moa.k_proj.weight.shape == moa.v_proj.weight.shape == (32, 64)
    with pytest.raises(ValueError, match="kv_heads must be a positive integer"):
        MixtureOfAttentionHeads(64, num_experts=8, top_k=4, head_dim=16, kv_heads=0)


def test_moa_kv_heads_one_loads_old_checkpoint_bit_identically():
    """tests/data/moa_kv1_checkpoint.pt was written by the layer before kv_heads existed (commit 781c003), in
    float32 on an AMD EPYC (AVX512) with torch 2.13.0.

    Bit for bit where the arithmetic is the same on every CPU: loading (every tensor of the state dict as
    saved). The output is compared with a tolerance, since float32 kernels sum in an order that depends on
    the CPU kind (torch's vectorised kernels by instruction set, the BLAS by vendor and model); an Intel Xeon
    differs from the machine that wrote the file. Two checks that hold on any CPU:

    - in float64 the loaded layer must give the stored output within 5e-7: the stored float32 output is the
      old layer's float32 result, a few float32 rounding errors from the exact value (measured: 8.4e-8; one
      float32 ulp at the largest output, 2.2, is 2.4e-7), and float64 adds none worth counting;
    - in float32, within 1e-6 + 1e-6 |x|: up to about 13 ulps at |x| = 2.2, room for the different summation
      orders of its projections (16 and 8 wide) and softmax.

    A changed layer (another expert, head or scale) moves the output by far more (tried: the attention scale
    times 1.01 fails both)."""
    from pathlib import Path

    saved = torch.load(Path(__file__).parent / "data" / "moa_kv1_checkpoint.pt")
    layer = MixtureOfAttentionHeads(16, num_experts=4, top_k=2, head_dim=8, kv_heads=1).eval()
    layer.load_state_dict(saved["state_dict"], strict=True)
    loaded = layer.state_dict()
    assert set(loaded) == set(saved["state_dict"])
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in saved["state_dict"].items())
    out = layer(saved["x"], is_causal=True, key_padding_mask=saved["key_padding_mask"])
    torch.testing.assert_close(out.output, saved["output"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.aux_loss, saved["aux_loss"], atol=1e-6, rtol=1e-6)
    exact = layer.double()(saved["x"].double(), is_causal=True, key_padding_mask=saved["key_padding_mask"])
    torch.testing.assert_close(exact.output, saved["output"].double(), atol=5e-7, rtol=0)
    torch.testing.assert_close(exact.aux_loss, saved["aux_loss"].double(), atol=5e-7, rtol=0)


def test_moa_query_head_g_of_an_expert_attends_with_kv_head_g():
    """Grouped layout: zeroing K/V head 1's value weights changes only the columns of W_o^i's group 1."""
    layer = make("moa_kv")
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        layer.v_proj.weight[4:8] = 0.0   # value head 1 (head_dim 4) gives zeros
        layer.v_proj.bias[4:8] = 0.0
        base = layer(x).output
        layer.output_experts[:, 4:8] = torch.randn_like(layer.output_experts[:, 4:8])  # group 1 of W_o^i
        torch.testing.assert_close(layer(x).output, base)
        layer.output_experts[:, 0:4] = torch.randn_like(layer.output_experts[:, 0:4])  # group 0 matters
        assert not torch.allclose(layer(x).output, base)


def test_cache_from_another_layer_is_rejected():
    a, b = make("moa"), make("moa")
    cache = a(torch.randn(1, 3, D), is_causal=True, use_cache=True).cache
    with pytest.raises(ValueError, match="cache belongs to another layer"):
        b(torch.randn(1, 1, D), is_causal=True, cache=cache)
    with pytest.raises(ValueError, match="cache must be a KVCache"):
        b(torch.randn(1, 1, D), cache=(cache.key, cache.value))


def test_cache_reorder_selects_rows():
    layer = make("mha")
    cache = layer(torch.randn(3, 2, D), is_causal=True, use_cache=True).cache
    r = cache.reorder(torch.tensor([2, 2, 0]))
    torch.testing.assert_close(r.key[1], cache.key[2])
    torch.testing.assert_close(r.value[2], cache.value[0])


# --------------------------------------------------------------------------- auxiliary losses

def test_moa_aux_loss_matches_reference_and_ignores_padding():
    layer = make("moa")
    x = torch.randn(2, 6, D)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 2:] = True
    out = layer(x, key_padding_mask=kpm)
    ref = reference_moa_losses(layer, x, ~kpm)
    torch.testing.assert_close(out.losses["load_balance"].double(), ref["load_balance"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.losses["z_loss"].double(), ref["z_loss"], rtol=1e-5, atol=1e-6)
    expected = 0.01 * ref["load_balance"] + 0.001 * ref["z_loss"]
    torch.testing.assert_close(out.aux_loss.double(), expected, rtol=1e-5, atol=1e-7)
    # the content of padded positions does not change the loss
    x2 = x.clone()
    x2[1, 2:] = torch.randn(4, D) * 10
    torch.testing.assert_close(layer(x2, key_padding_mask=kpm).aux_loss, out.aux_loss)
    # query_padding_mask works for cross-attention, where key padding says nothing about queries
    mem = torch.randn(2, 3, D)
    cross = layer(x, mem, query_padding_mask=kpm)
    torch.testing.assert_close(cross.aux_loss, out.aux_loss)


def test_load_balancing_loss_is_one_when_uniform_and_gradient_flows_only_through_p():
    from headmix.routing import load_balancing_loss
    probs = torch.full((8, 4), 0.25, requires_grad=True)
    index = torch.tensor([[0, 1], [2, 3]] * 4)
    loss = load_balancing_loss(probs, index)
    torch.testing.assert_close(loss, torch.tensor(1.0))
    loss.backward()
    # d/dp_{t,i} = E * f_i / T with f_i = 1/4
    torch.testing.assert_close(probs.grad, torch.full((8, 4), 4 * 0.25 / 8))


def test_z_loss_is_stable_for_large_logits():
    from headmix.routing import router_z_loss
    logits = torch.tensor([[1000.0, 1000.0]])
    torch.testing.assert_close(router_z_loss(logits), torch.tensor((1000 + math.log(2)) ** 2))


def test_moh_load_balancing_on_routed_heads():
    layer = make("moh")
    out = layer(torch.randn(2, 5, D))
    r = out.routing
    assert r.expert_index.max() < layer.num_routed_heads and r.probs.shape[-1] == 3
    torch.testing.assert_close(out.aux_loss, 0.01 * out.losses["load_balance"])


# --------------------------------------------------------------------------- numerical gradients

@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_float64(kind):
    # MoA's default detached denominator (eq. 9) is by design not the true derivative: check the live one.
    layer = make(kind, dtype=torch.float64, **({"renormalize": "live"} if kind.startswith("moa") else {}))
    x = torch.randn(1, 3, D, dtype=torch.float64, requires_grad=True)
    mem = torch.randn(1, 2, D, dtype=torch.float64, requires_grad=True)
    # routing is piecewise constant: check away from ties (gradcheck perturbs by 1e-6)
    assert torch.autograd.gradcheck(lambda a: layer(a, is_causal=True).output, (x,), eps=1e-6, atol=1e-5)
    assert torch.autograd.gradcheck(lambda a, m: layer(a, m).output, (x, mem), eps=1e-6, atol=1e-5)


# --------------------------------------------------------------------------- property-based

@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(KINDS), batch=st.integers(1, 3), tgt=st.integers(0, 6), src=st.integers(1, 6),
       cross=st.booleans(), pad=st.booleans(), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_property_shapes_masks_and_reference(kind, batch, tgt, src, cross, pad, causal, seed):
    layer = make(kind)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tgt, D, generator=g)
    s = src if cross else tgt
    mem = torch.randn(batch, s, D, generator=g) if cross else None
    kw = {}
    if pad and s > 0:
        kw["key_padding_mask"] = torch.rand(batch, s, generator=g) < 0.4
    if causal and not cross:
        kw["is_causal"] = True
    out = layer(x, mem, **kw)
    assert out.output.shape == (batch, tgt, D)
    assert torch.isfinite(out.output).all() and torch.isfinite(out.aux_loss)
    torch.testing.assert_close(out.output, reference_for(kind)(layer, x, mem, **kw), atol=5e-6, rtol=1e-5)


# --------------------------------------------------------------------------- precision and edge sizes

@pytest.mark.parametrize("kind", KINDS)
def test_bf16_autocast_close_to_float32(kind):
    layer = make(kind)
    x = torch.randn(2, 8, D)
    ref = layer(x, is_causal=True).output
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = layer(x, is_causal=True).output
    assert low.dtype == torch.bfloat16  # as an nn.Linear output under autocast: no float32 activations
    # stated tolerance: bf16 has 8 bits of mantissa; errors stay below 5% of the output scale
    assert (low.float() - ref).abs().max() <= 0.05 * ref.abs().max()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("length", [0, 1])
def test_length_zero_and_one(kind, length):
    layer = make(kind)
    x = torch.randn(2, length, D, requires_grad=True)
    out = layer(x, is_causal=True, use_cache=True)
    assert out.output.shape == (2, length, D)
    out.output.sum().backward()
    if x.grad is not None:  # an empty output may have no path back to an empty input
        assert x.grad.shape == x.shape
    torch.testing.assert_close(out.output, reference_for(kind)(layer, x, is_causal=True), atol=2e-6, rtol=1e-5)


def test_routing_is_returned_not_stored():
    layer = make("moa")
    before = {k: v for k, v in vars(layer).items() if k != "_modules"}
    out = layer(torch.randn(2, 3, D))
    after = {k: v for k, v in vars(layer).items() if k != "_modules"}
    assert before.keys() == after.keys()
    assert out.routing.expert_index.shape == (6, 2) and out.routing.logits.shape == (6, 5)
    assert out.routing.expert_counts().sum() == 12


# --------------------------------------------------------------------------- bad input

def test_bad_input_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"top_k \(6\) must not exceed num_experts \(5\)"):
        MixtureOfAttentionHeads(D, num_experts=5, top_k=6, head_dim=4)
    with pytest.raises(ValueError, match="num_experts must be a positive integer"):
        MixtureOfAttentionHeads(D, num_experts=0, top_k=1, head_dim=4)
    with pytest.raises(ValueError, match="embed_dim .* divisible by num_heads"):
        MultiHeadAttention(10, 4)
    with pytest.raises(ValueError, match=r"num_shared_heads \(5\) must not exceed num_heads \(4\)"):
        MixtureOfHeadsAttention(D, 4, 5, 0)
    with pytest.raises(ValueError, match="routed heads"):
        MixtureOfHeadsAttention(D, 4, 1, 4)
    with pytest.raises(ValueError, match="routed heads"):
        MixtureOfHeadsAttention(D, 4, 1, 0)
    with pytest.raises(ValueError, match="top_k must be 0 when every head is shared"):
        MixtureOfHeadsAttention(D, 4, 4, 1)
    with pytest.raises(ValueError, match="renormalize must be one of"):
        MixtureOfAttentionHeads(D, 4, 2, 4, renormalize="sometimes")
    layer = make("moa")
    with pytest.raises(ValueError, match=r"query must have shape \(batch, time, 16\)"):
        layer(torch.randn(2, 3, D + 1))
    with pytest.raises(ValueError, match=r"key must have shape \(batch, time, 16\)"):
        layer(torch.randn(2, 3, D), torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(batch, source_len\) = \(2, 3\)"):
        layer(torch.randn(2, 3, D), key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask must have shape"):
        layer(torch.randn(2, 3, D), attn_mask=torch.zeros(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="query_padding_mask must have shape"):
        layer(torch.randn(2, 3, D), query_padding_mask=torch.zeros(2, 2, dtype=torch.bool))


def test_attention_config_kv_heads():
    import json

    from headmix.models.config import AttentionConfig

    cfg = AttentionConfig(kind="moa", num_experts=4, top_k=2, head_dim=4, kv_heads=2)
    assert cfg.build(D).kv_heads == 2
    assert AttentionConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert AttentionConfig(kind="moa", num_experts=4, top_k=2, head_dim=4).build(D).kv_heads == 1
    with pytest.raises(ValueError, match="attention.kv_heads applies to kind 'moa' / 'mha' / 'moh' / 'talking_heads' / 'gqe' only"):
        AttentionConfig(kind="switchhead", num_heads=4, num_experts=2, top_k=1, kv_heads=2)
    with pytest.raises(ValueError, match="attention.kv_heads must be a positive integer"):
        AttentionConfig(kind="moa", num_experts=4, top_k=2, head_dim=4, kv_heads=0)


BIAS_CASES = [dict(bias=True, kv_bias=False), dict(bias=False, out_bias=True), dict(bias=False, q_bias=True),
              dict(bias=True, q_bias=False, out_bias=False)]


@pytest.mark.parametrize("kind", ["mha", "moa_kv", "moh", "th"])
@pytest.mark.parametrize("case", range(len(BIAS_CASES)))
def test_separate_bias_options(kind, case):
    from headmix.models.config import AttentionConfig
    from headmix.models.counting import attention_parameters

    kw = dict(BIAS_CASES[case])
    if kind.startswith("moa"):
        if "q_bias" in kw:
            with pytest.raises(TypeError):  # MoA's expert queries have no bias: no such option
                make(kind, **kw)
            return
    layer = make(kind, **kw)
    want = {name: kw.get(name, kw["bias"]) for name in ("q_bias", "kv_bias", "out_bias")}
    has_out = (layer.out_bias if kind.startswith("moa") else layer.out_proj.bias) is not None
    assert layer.k_proj.bias is not None and layer.v_proj.bias is not None if want["kv_bias"] else \
        layer.k_proj.bias is None and layer.v_proj.bias is None
    assert has_out == want["out_bias"]
    if not kind.startswith("moa"):
        assert (layer.q_proj.bias is not None) == want["q_bias"]
    x = torch.randn(2, 5, D)
    torch.testing.assert_close(layer(x, is_causal=True).output, reference_for(kind)(layer, x, is_causal=True),
                               atol=2e-6, rtol=1e-5)
    # the config builds the same layer and counts its parameters exactly
    cfg_kind = {"moa_kv": "moa", "th": "talking_heads"}.get(kind, kind)
    sizes = dict(num_experts=5, top_k=2, head_dim=4, kv_heads=3) if cfg_kind == "moa" else dict(num_heads=4)
    if cfg_kind == "moh":
        sizes.update(num_shared_heads=1, top_k=2)
    cfg = AttentionConfig(kind=cfg_kind, **sizes, **kw)
    built = cfg.build(D)
    assert {n: p.shape for n, p in built.named_parameters()} == {n: p.shape for n, p in layer.named_parameters()}
    assert attention_parameters(cfg, D)[0] == sum(p.numel() for p in built.parameters())


def test_bias_options_reject_non_bools():
    with pytest.raises(ValueError, match="kv_bias must be True, False or None"):
        MultiHeadAttention(D, 4, kv_bias=1)
    with pytest.raises(ValueError, match="out_bias must be True, False or None"):
        MixtureOfAttentionHeads(D, 4, 2, 4, out_bias="no")
    from headmix.models.config import AttentionConfig
    with pytest.raises(ValueError, match="attention.q_bias applies to kind"):
        AttentionConfig(kind="moa", num_experts=4, top_k=2, head_dim=4, q_bias=True)
    with pytest.raises(ValueError, match="attention.out_bias must be true, false or null"):
        AttentionConfig(kind="mha", num_heads=4, out_bias=0)


@pytest.mark.parametrize("kind", ["moa", "moa_kv", "moh"])
def test_load_balance_per_token_fractions_are_top_k_times_normalized(kind):
    x = torch.randn(2, 6, D)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 2:] = True
    normalized = make(kind)(x, key_padding_mask=kpm)
    per_token = make(kind, load_balance_fractions="per_token")(x, key_padding_mask=kpm)
    k = normalized.routing.expert_index.shape[-1]
    torch.testing.assert_close(per_token.losses["load_balance"], k * normalized.losses["load_balance"])
    assert per_token.aux_loss > normalized.aux_loss
    with pytest.raises(ValueError, match="load_balance_fractions must be one of"):
        make(kind, load_balance_fractions="sum_k")


@pytest.mark.parametrize("kind", ["mha", "moa", "moa_kv", "moh", "th"])
def test_zero_padded_queries_option(kind):
    x, mem = torch.randn(2, 5, D), torch.randn(2, 4, D)
    qpm = torch.zeros(2, 5, dtype=torch.bool)
    qpm[1, 3:] = True
    plain, zeroing = make(kind, out_bias=True), make(kind, out_bias=True, zero_padded_queries=True)
    for key, kw in ((None, dict(query_padding_mask=qpm, is_causal=True)), (None, dict(key_padding_mask=qpm)),
                    (mem, dict(query_padding_mask=qpm))):
        a, b = plain(x, key, **kw).output, zeroing(x, key, **kw).output
        assert b[1, 3:].eq(0).all() and a[1, 3:].abs().sum() > 0
        assert torch.equal(a[~qpm], b[~qpm])
    # without any padding information nothing is zeroed
    assert torch.equal(plain(x).output, zeroing(x).output)


def test_attention_config_peer_convention_fields():
    import json

    from headmix.models.config import AttentionConfig

    cfg = AttentionConfig(kind="moh", num_heads=4, num_shared_heads=1, top_k=2, head_weighting="paper",
                          load_balance_fractions="per_token", zero_padded_queries=True)
    layer = cfg.build(D)
    assert (layer.head_weighting, layer.load_balance_fractions, layer.zero_padded_queries) == ("paper", "per_token", True)
    assert AttentionConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert AttentionConfig(kind="moh", num_heads=4, num_shared_heads=1, top_k=2).build(D).head_weighting == "renormalized"
    assert AttentionConfig(kind="moa", num_experts=4, top_k=2, head_dim=4,
                           load_balance_fractions="per_token").build(D).load_balance_fractions == "per_token"
    for bad, match in ((dict(kind="moh", num_heads=4, num_shared_heads=1, top_k=2, head_weighting="x"), "head_weighting"),
                       (dict(kind="mha", num_heads=4, head_weighting="paper"), "head_weighting applies to kind 'moh'"),
                       (dict(kind="mha", num_heads=4, load_balance_fractions="k"), "load_balance_fractions"),
                       (dict(kind="mha", num_heads=4, zero_padded_queries=1), "zero_padded_queries")):
        with pytest.raises(ValueError, match=match):
            AttentionConfig(**bad)


def test_moa_kv_heads_attention_does_not_repeat_keys_and_values(monkeypatch):
    """The grouped path hands scaled_dot_product_attention the G K/V heads themselves (enable_gqa)."""
    import torch.nn.functional as F

    from headmix.attention import base

    seen = []
    original = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.shape[1], k.shape[1], v.shape[1], kw.get("enable_gqa", False)))
        return original(q, k, v, **kw)

    monkeypatch.setattr(base.F, "scaled_dot_product_attention", spy)
    layer = make("moa_kv")
    layer(torch.randn(2, 5, D), is_causal=True)
    assert seen == [(6, 3, 3, True)]   # k * G = 6 query heads over G = 3 key/value heads


@pytest.mark.parametrize("impl", ["reference", "dense", "sorted", "gather", "bag"])
def test_moa_kv_heads_every_expert_kernel_matches_reference(impl):
    layer = make("moa_kv", expert_impl=impl, rotary=True)
    x = torch.randn(2, 5, D)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = layer(x1, is_causal=True).output
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()
    reference_moa(layer, x2, is_causal=True).square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, atol=2e-6, rtol=1e-5)
    for n, p in layer.named_parameters():
        if n in grads:
            torch.testing.assert_close(grads[n], p.grad, atol=5e-6, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.int32])
def test_integer_masks_are_rejected_as_torch_does(kind, dtype):
    # An integer 0/1 mask would be added to the scores as +1 instead of masking: every layer refuses it,
    # as torch.nn.MultiheadAttention does, for each mask argument, in self- and cross-attention.
    layer = make(kind)
    x, mem = torch.randn(2, 3, D), torch.randn(2, 4, D)
    with pytest.raises(ValueError, match=rf"key_padding_mask must be a bool .* or floating-point .* got dtype {dtype}"):
        layer(x, key_padding_mask=torch.zeros(2, 3, dtype=dtype))
    with pytest.raises(ValueError, match=rf"key_padding_mask must be a bool .* got dtype {dtype}"):
        layer(x, mem, key_padding_mask=torch.zeros(2, 4, dtype=dtype))
    with pytest.raises(ValueError, match=rf"attn_mask must be a bool .* or floating-point .* got dtype {dtype}"):
        layer(x, attn_mask=torch.zeros(3, 3, dtype=dtype))
    with pytest.raises(ValueError, match=rf"attn_mask must be a bool .* got dtype {dtype}"):
        layer(x, is_causal=True, attn_mask=torch.zeros(3, 3, dtype=dtype))
    with pytest.raises(ValueError, match=rf"query_padding_mask must be a bool \(True = padding\) tensor, got dtype {dtype}"):
        layer(x, query_padding_mask=torch.zeros(2, 3, dtype=dtype))
    with pytest.raises(ValueError, match="query_padding_mask must be a bool"):
        layer(x, query_padding_mask=torch.zeros(2, 3))  # a float query mask has no meaning either
    # torch agrees that an integer key_padding_mask is an error
    if kind == "mha":
        ref = torch.nn.MultiheadAttention(D, 4, batch_first=True)
        with pytest.raises(AssertionError, match="only bool and floating types of key_padding_mask"):
            ref(x, x, x, key_padding_mask=torch.zeros(2, 3, dtype=dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_bool_and_float_masks_still_agree(kind):
    # The accepted forms mean the same thing: True = masked, and -inf added = masked.
    layer = make(kind)
    x = torch.randn(2, 5, D)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    additive = torch.zeros(2, 5).masked_fill(pad, float("-inf"))
    a = layer(x, key_padding_mask=pad, query_padding_mask=pad).output
    b = layer(x, key_padding_mask=additive, query_padding_mask=pad).output
    torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------- a cache belongs to one layer instance

def decode_step_by_step(layer, x, cache=None, prompt: int = 2):
    """A prompt of ``prompt`` tokens, then one token at a time; returns the outputs and the last cache."""
    out = layer(x[:, :prompt], is_causal=True, use_cache=True, cache=cache)
    steps, cache = [out.output], out.cache
    for t in range(prompt, x.shape[1]):
        out = layer(x[:, t:t + 1], is_causal=True, use_cache=True, cache=cache)
        steps.append(out.output)
        cache = out.cache
    return torch.cat(steps, 1), cache


@pytest.mark.parametrize("kind", KINDS)
def test_cache_of_a_copied_layer_is_rejected(kind):
    import copy
    import io
    import pickle

    layer = make(kind)
    x, mem = torch.randn(2, 4, D), torch.randn(2, 3, D)
    own = layer(x[:, :2], is_causal=True, use_cache=True).cache
    static = layer(x[:, :1], mem, use_cache=True).cache
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    clones = {"deepcopy": copy.deepcopy(layer), "copy": copy.copy(layer), "pickle": pickle.loads(pickle.dumps(layer)),
              "torch.save": torch.load(buffer, weights_only=False)}
    for how, clone in clones.items():
        assert clone.layer_id != layer.layer_id, how
        for cache in (own, static):
            with pytest.raises(ValueError, match="cache belongs to another layer"):
                clone(x[:, 2:3], is_causal=True, cache=cache)
        # the clone computes the same thing with its own caches
        torch.testing.assert_close(decode_step_by_step(clone, x)[0], decode_step_by_step(layer, x)[0])
    assert len({c.layer_id for c in clones.values()}) == len(clones)
    # the original still takes its own caches, also reordered for beam search
    layer(x[:, 2:3], is_causal=True, cache=own.reorder(torch.tensor([1, 0])))
    layer(x[:, 2:3], mem, cache=static)


def test_cache_identity_survives_load_state_dict_and_modules_holding_the_layer():
    # load_state_dict moves weights, not identity: each layer keeps its id (it is not in the state dict).
    a, b = make("moa"), make("moa")
    assert "layer_id" not in str(list(a.state_dict()))
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, 4, D)
    cache_a = decode_step_by_step(a, x)[1]
    with pytest.raises(ValueError, match="cache belongs to another layer"):
        b(x[:, :1], is_causal=True, cache=cache_a)
    # a model deep-copied as a whole gets fresh ids in every layer
    import copy

    from headmix.models import build_model, get_config
    model = build_model(get_config("tiny-moa", task="lm", vocab_size=32))
    clone = copy.deepcopy(model)
    ids = {m.layer_id for m in model.modules() if hasattr(m, "layer_id")}
    clone_ids = {m.layer_id for m in clone.modules() if hasattr(m, "layer_id")}
    assert len(ids) == 2 and len(clone_ids) == 2 and not ids & clone_ids


def test_cache_under_torch_compile():
    layer = make("moa")
    x = torch.randn(2, 3, D)  # a prompt of 2 and one step: each new cache length is a recompile
    compiled = torch.compile(layer, backend="eager", dynamic=False)
    expected, _ = decode_step_by_step(layer, x)
    got, cache = decode_step_by_step(compiled, x)
    torch.testing.assert_close(got, expected)
    import copy
    with pytest.raises(ValueError, match="cache belongs to another layer"):
        torch.compile(copy.deepcopy(layer), backend="eager")(x[:, :1], is_causal=True, cache=cache)


def test_cache_through_ddp_and_fsdp_wrappers():
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.randn(2, 5, D)
        for wrap in ("ddp", "fsdp"):
            layer = make("moa")
            expected, _ = decode_step_by_step(layer, x)
            wrapped = DistributedDataParallel(layer) if wrap == "ddp" else fully_shard(layer)
            got, cache = decode_step_by_step(wrapped, x)
            torch.testing.assert_close(got, expected, msg=wrap)
            with pytest.raises(ValueError, match="cache belongs to another layer"):
                make("moa")(x[:, :1], is_causal=True, cache=cache)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- each option of each layer

@pytest.mark.parametrize("kind", KINDS)
def test_bias_false_has_no_biases_and_matches_reference(kind):
    layer = make(kind, bias=False)
    names = [n for n, _ in layer.named_parameters()]
    assert not [n for n in names if "bias" in n], names
    x = torch.randn(2, 5, D)
    torch.testing.assert_close(layer(x, is_causal=True).output, reference_for(kind)(layer, x, is_causal=True),
                               atol=2e-6, rtol=1e-5)
    with_bias = sum(p.numel() for n, p in make(kind).named_parameters() if "bias" in n)
    assert sum(p.numel() for p in make(kind).parameters()) - sum(p.numel() for p in layer.parameters()) == with_bias > 0


@pytest.mark.parametrize("kind", KINDS)
def test_dropout_applies_in_training_only(kind):
    layer = make(kind, dropout=0.5)
    x = torch.randn(2, 6, D)
    # eval: no dropout, the reference (which has none) holds
    torch.testing.assert_close(layer(x, is_causal=True).output, reference_for(kind)(layer, x, is_causal=True),
                               atol=2e-6, rtol=1e-5)
    layer.train()
    torch.manual_seed(1)
    a = layer(x, is_causal=True).output
    torch.manual_seed(1)
    b = layer(x, is_causal=True).output
    torch.manual_seed(2)
    c = layer(x, is_causal=True).output
    torch.testing.assert_close(a, b)  # the same seed, the same mask
    assert not torch.allclose(a, c)   # another seed, another mask
    layer.eval()
    assert not torch.allclose(a, layer(x, is_causal=True).output)
    with pytest.raises(ValueError, match="dropout must be in"):
        make(kind, dropout=1.0)


@pytest.mark.parametrize("pre,post", [(True, False), (False, True), (False, False)])
def test_talking_heads_pre_and_post_options_match_reference(pre, post):
    torch.manual_seed(0)
    layer = TalkingHeadsAttention(D, 4, pre_softmax=pre, post_softmax=post, head_dim=3, key_dim=7).eval()
    assert (layer.pre_mix is not None, layer.post_mix is not None) == (pre, post)
    with torch.no_grad():
        for m in (layer.pre_mix, layer.post_mix):
            if m is not None:
                m.add_(0.3 * torch.randn(4, 4))
    x = torch.randn(2, 5, D, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out = layer(x, is_causal=True).output
    ref = reference_mha(layer, x2, is_causal=True)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=2e-6, rtol=1e-5)
    if not pre and not post:  # no mixing at all: plain MHA with the same projections
        mha = MultiHeadAttention(D, 4, head_dim=3, key_dim=7).eval()
        copy_projections(layer, mha)
        torch.testing.assert_close(layer(x, is_causal=True).output, mha(x, is_causal=True).output, atol=1e-6, rtol=1e-5)


def test_talking_heads_key_dim_scales_by_key_dim():
    # key_dim != head_dim: the logits are scaled by key_dim ** -0.5, as MHA's
    torch.manual_seed(0)
    th = TalkingHeadsAttention(D, 4, pre_softmax=False, post_softmax=False, head_dim=3, key_dim=7).eval()
    mha = MultiHeadAttention(D, 4, head_dim=3, key_dim=7).eval()
    copy_projections(th, mha)
    x, mem = torch.randn(2, 5, D), torch.randn(2, 4, D)
    assert th.q_proj.weight.shape == (4 * 7, D) and th.v_proj.weight.shape == (4 * 3, D)
    torch.testing.assert_close(th(x, mem).output, mha(x, mem).output, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(th(x, mem).output, reference_mha(th, x, mem), atol=1e-6, rtol=1e-5)


def test_moa_expert_impl_variants_agree_and_the_choice_is_used(monkeypatch):
    x = torch.randn(2, 5, D)
    results = {}
    for impl in ("reference", "dense", "sorted", "gather", "bag", "auto"):
        layer = make("moa", expert_impl=impl)
        xi = x.clone().requires_grad_()
        out = layer(xi, is_causal=True).output
        out.square().sum().backward()
        results[impl] = (out, xi.grad, layer.query_experts.grad, layer.output_experts.grad, layer.router.gate.weight.grad)
    for impl, got in results.items():
        for a, b in zip(got, results["reference"]):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5, msg=lambda m, impl=impl: f"{impl}: {m}")
    # the layer passes its choice to the kernels: gather with a gradient is never auto's choice
    from headmix.kernels import reference as kernel_reference

    calls = []
    for name in ("gather_map", "gather_reduce"):
        original = getattr(kernel_reference, name)
        monkeypatch.setattr(kernel_reference, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    make("moa", expert_impl="gather")(x.clone().requires_grad_())
    assert calls == ["gather_map", "gather_reduce"]
    with pytest.raises(ValueError, match="expert_impl must be one of"):
        make("moa", expert_impl="fast")


def test_moh_options_top_k_and_shared_heads_match_reference():
    for shared, top_k in ((0, 1), (2, 1), (1, 3), (3, 1)):
        torch.manual_seed(0)
        # top 1 "renormalized" and one routed head have no router task gradient: the forward pass is checked
        # as the ablation (tests/test_router_gradients.py checks the gradients)
        layer = MixtureOfHeadsAttention(D, num_heads=4, num_shared_heads=shared, top_k=top_k,
                                        allow_router_without_task_gradient=True).eval()
        with torch.no_grad():
            for lin in (layer.routed_gate, layer.shared_gate, layer.group_gate):
                if lin is not None:
                    lin.weight.normal_()
        x = torch.randn(2, 5, D)
        out = layer(x, is_causal=True)
        torch.testing.assert_close(out.output, reference_moh(layer, x, is_causal=True), atol=2e-6, rtol=1e-5)
        g, _ = layer.head_weights(x, None)
        assert g[..., shared:].ne(0).sum(-1).eq(top_k).all()  # exactly top_k routed heads active per token


def test_moa_auto_kernel_follows_grad_mode(monkeypatch):
    # auto on CPU: without gradients (decoding) and E > 2k a kernel that reads only the selected experts'
    # weights (bag for a few tokens, sorted for many); with gradients and a small batch the dense one
    # (kernels.dispatch.choose_impl)
    from headmix.kernels import grouped_cpu
    from headmix.kernels import reference as kernel_reference

    calls = []
    for module, name in ((grouped_cpu, "sorted_map"), (grouped_cpu, "sorted_reduce"),
                         (kernel_reference, "bag_map"), (kernel_reference, "bag_reduce"),
                         (kernel_reference, "dense_map"), (kernel_reference, "dense_reduce")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    layer = MixtureOfAttentionHeads(D, num_experts=8, top_k=2, head_dim=4)  # E > 2k, N k <= 128
    x = torch.randn(1, 2, D)
    with torch.no_grad():
        layer(x)
        assert calls == ["bag_map", "bag_reduce"]
        calls.clear()
        layer(torch.randn(4, 65, D))  # 520 slots
        assert calls == ["sorted_map", "sorted_reduce"]
    calls.clear()
    layer(x.requires_grad_()).output.sum().backward()
    assert calls == ["dense_map", "dense_reduce"]


# ------------------------------------------------------------------ Talking-Heads in query blocks (memory)
def _saved_for_backward_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for the backward of ``fn()`` (each storage counted once)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


@pytest.mark.parametrize("masks", [dict(is_causal=True), dict(padding=True), dict(padding=True, is_causal=True)])
def test_talking_heads_query_blocks_equal_the_reference_in_float64(masks):
    """Query blocks of 3 over 10 queries (the last block short), with checkpointing: outputs and gradients
    (inputs, projections, both mixing matrices) equal the float64 reference's."""
    torch.manual_seed(0)
    layer = TalkingHeadsAttention(D, 4, head_dim=3, key_dim=5, query_block=3).double().train()
    with torch.no_grad():
        layer.pre_mix.add_(0.3 * torch.randn(4, 4, dtype=torch.float64))
        layer.post_mix.add_(0.3 * torch.randn(4, 4, dtype=torch.float64))
    x = torch.randn(2, 10, D, dtype=torch.float64, requires_grad=True)
    kwargs = {"is_causal": masks.get("is_causal", False)}
    if masks.get("padding"):
        padding = torch.zeros(2, 10, dtype=torch.bool)
        padding[1, 6:] = True
        kwargs["key_padding_mask"] = padding
    out = layer(x, **kwargs).output
    grads = torch.autograd.grad(out.square().sum(), [x, layer.pre_mix, layer.post_mix, layer.q_proj.weight])
    ref = reference_mha(layer, x, **kwargs)
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, layer.pre_mix, layer.post_mix, layer.q_proj.weight])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_talking_heads_query_blocks_bound_the_memory_kept_for_backward():
    """At T = S = 256, 8 heads: the blocked layer keeps far less for its backward than the unblocked one
    (which keeps several (batch, heads, T, S) score tensors), and the results agree."""
    torch.manual_seed(0)
    full = TalkingHeadsAttention(64, 8, query_block=None).train()
    blocked = TalkingHeadsAttention(64, 8, query_block=32).train()
    blocked.load_state_dict(full.state_dict())
    x = torch.randn(2, 256, 64, requires_grad=True)
    full_bytes, full_out = _saved_for_backward_bytes(lambda: full(x, is_causal=True).output)
    blocked_bytes, blocked_out = _saved_for_backward_bytes(lambda: blocked(x, is_causal=True).output)
    scores = 2 * 8 * 256 * 256 * 4  # one float32 (batch, heads, T, S) tensor
    assert full_bytes > 3 * scores
    assert blocked_bytes < scores
    torch.testing.assert_close(blocked_out, full_out)
    with pytest.raises(ValueError, match="query_block must be a positive integer"):
        TalkingHeadsAttention(64, 8, query_block=0)
