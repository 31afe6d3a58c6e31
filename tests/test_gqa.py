"""Grouped-query K/V heads (``kv_heads``), QK-norm (``qk_norm``) and output gates (``output_gate``) on the
MHA family, against the plain references, torch's SDPA ``enable_gqa`` and Hugging Face's ``LlamaAttention``
and ``Qwen3Attention`` (tiny configs, copied weights)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headmix.attention import MultiHeadAttention
from headmix.attention.reference import reference_mha

D = 18


def gqa_layer(dtype=torch.float64, **kw) -> MultiHeadAttention:
    """6 query heads of value size 5 and query/key size 4 (odd sizes) on ``kv_heads`` K/V heads, with the
    norm weights and gate moved off their initial values so that they are exercised."""
    torch.manual_seed(0)
    opts = dict(head_dim=5, key_dim=4, kv_heads=2)
    opts.update(kw)
    layer = MultiHeadAttention(D, 6, **opts).to(dtype).eval()
    with torch.no_grad():
        for norm in (layer.q_norm, layer.k_norm):
            if norm is not None:
                norm.weight.add_(0.5 * torch.randn_like(norm.weight))
    return layer


def masks_for(case: str, batch: int, tgt: int, src: int, generator: torch.Generator) -> dict:
    if case == "padding":
        kpm = torch.zeros(batch, src, dtype=torch.bool)
        kpm[1, src - 2:] = True
        return {"key_padding_mask": kpm}
    if case == "causal":
        return {"is_causal": True}
    if case == "causal_padding":
        kpm = torch.zeros(batch, src, dtype=torch.bool)
        kpm[0, src - 3:] = True
        return {"is_causal": True, "key_padding_mask": kpm}
    if case == "float_mask":
        return {"attn_mask": torch.randn(tgt, src, generator=generator, dtype=torch.float64)}
    if case == "per_head_mask":  # (batch * heads, tgt, src): one mask per query head
        m = torch.rand(batch * 6, tgt, src, generator=generator) < 0.3
        m[..., 0] = False
        return {"attn_mask": m}
    if case == "fully_masked_row":
        m = torch.zeros(tgt, src, dtype=torch.bool)
        m[1] = True
        return {"attn_mask": m}
    assert case == "none"
    return {}


CONFIGS = {
    "gqa": dict(kv_heads=2),
    "mqa": dict(kv_heads=1),
    "gqa3": dict(kv_heads=3, rotary=True),
    "qk_norm": dict(kv_heads=2, qk_norm=True, rotary=True),
    "headwise": dict(kv_heads=2, output_gate="headwise"),
    "elementwise": dict(kv_heads=3, output_gate="elementwise", qk_norm=True, rotary=True),
    "all_mha": dict(kv_heads=None, qk_norm=True, output_gate="headwise", rotary=True),
}
MASKS = ["none", "padding", "causal", "causal_padding", "float_mask", "per_head_mask", "fully_masked_row"]


def check_against(layer, reference, x: torch.Tensor, mem: torch.Tensor | None, masks: dict, atol=1e-5):
    """``layer`` and ``reference`` (same call signature) give the same outputs and gradients (inputs and
    every parameter)."""
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    m1 = None if mem is None else mem.clone().requires_grad_()
    m2 = None if mem is None else mem.clone().requires_grad_()
    layer.zero_grad()
    out = layer(x1, m1, **masks).output
    w = torch.randn_like(out)
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    expected = reference(layer, x2, m2, **masks)
    (expected * w).sum().backward()
    torch.testing.assert_close(out, expected, atol=atol, rtol=1e-5)
    torch.testing.assert_close(x1.grad, x2.grad, atol=atol, rtol=1e-5)
    if mem is not None:
        torch.testing.assert_close(m1.grad, m2.grad, atol=atol, rtol=1e-5)
    for n, p in layer.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=atol, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    return out


def assert_decoding_equals_full_forward(layer, x: torch.Tensor, prompt: int = 3):
    """A prompt of ``prompt`` tokens, then one token at a time with the cache, gives the full causal forward's
    outputs; returns the last cache."""
    full = layer(x, is_causal=True).output
    out = layer(x[:, :prompt], is_causal=True, use_cache=True)
    steps, cache = [out.output], out.cache
    for t in range(prompt, x.shape[1]):
        out = layer(x[:, t:t + 1], is_causal=True, use_cache=True, cache=cache)
        steps.append(out.output)
        cache = out.cache
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    return cache


# --------------------------------------------------------------------------- the agreed API


def test_default_kv_heads_is_todays_layer_bit_for_bit():
    torch.manual_seed(3)
    old = MultiHeadAttention(D, 6, rotary=True)
    torch.manual_seed(3)
    new = MultiHeadAttention(D, 6, rotary=True, kv_heads=None, qk_norm=False, output_gate=None)
    assert [(n, p.shape) for n, p in old.named_parameters()] == [(n, p.shape) for n, p in new.named_parameters()]
    assert new.kv_heads == 6 and new.q_norm is None and new.gate_proj is None
    x = torch.randn(2, 5, D)
    assert torch.equal(old(x, is_causal=True).output, new(x, is_causal=True).output)


def test_parameter_names_and_shapes():
    layer = MultiHeadAttention(D, 6, head_dim=5, key_dim=4, kv_heads=2, qk_norm=True, qk_norm_eps=1e-5,
                               output_gate="elementwise", q_bias=False)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {"q_proj.weight": (24, D), "k_proj.weight": (8, D), "k_proj.bias": (8,), "v_proj.weight": (10, D),
                      "v_proj.bias": (10,), "out_proj.weight": (D, 30), "out_proj.bias": (D,), "q_norm.weight": (4,),
                      "k_norm.weight": (4,), "gate_proj.weight": (30, D)}
    assert layer.q_norm.eps == 1e-5 and layer.k_norm.eps == 1e-5
    headwise = MultiHeadAttention(D, 6, output_gate="headwise")
    assert tuple(headwise.gate_proj.weight.shape) == (6, D) and headwise.gate_proj.bias is not None


@pytest.mark.parametrize("kw, match", [
    (dict(kv_heads=4), r"^kv_heads \(4\) must divide num_heads \(6\)"),
    (dict(kv_heads=0), r"^kv_heads must be a positive integer"),
    (dict(kv_heads=2.0), r"^kv_heads must be a positive integer"),
    (dict(output_gate="sigmoid"), r"^output_gate must be None or one of \('headwise', 'elementwise'\)"),
    (dict(qk_norm=1), r"^qk_norm must be True or False"),
    (dict(qk_norm=True, qk_norm_eps=0.0), r"^qk_norm_eps must be a positive number"),
])
def test_bad_arguments_get_one_line_errors(kw, match):
    with pytest.raises(ValueError, match=match) as err:
        MultiHeadAttention(D, 6, **kw)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("case", MASKS)
def test_mha_options_match_reference(config, case):
    layer = gqa_layer(**CONFIGS[config])
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, D, generator=g, dtype=torch.float64)
    out = check_against(layer, reference_mha, x, None, masks_for(case, 2, 5, 5, g))
    if case == "fully_masked_row":  # no allowed key: the row is the output bias
        assert out[:, 1].eq(layer.out_proj.bias).all()


@pytest.mark.parametrize("config", ["gqa", "mqa", "elementwise"])
def test_mha_options_cross_attention_match_reference(config):
    layer = gqa_layer(**CONFIGS[config])
    g = torch.Generator().manual_seed(6)
    x, mem = torch.randn(2, 4, D, generator=g, dtype=torch.float64), torch.randn(2, 7, D, generator=g, dtype=torch.float64)
    check_against(layer, reference_mha, x, mem, masks_for("padding", 2, 4, 7, g))


def test_gates_and_norms_change_the_output():
    """The gate and the norms are applied (a layer that skipped them would match a layer without them)."""
    x = torch.randn(2, 5, D, dtype=torch.float64)
    plain = gqa_layer(kv_heads=2)
    for option in (dict(qk_norm=True), dict(output_gate="headwise"), dict(output_gate="elementwise")):
        layer = gqa_layer(kv_heads=2, **option)
        layer.load_state_dict(plain.state_dict(), strict=False)
        assert not torch.allclose(layer(x).output, plain(x).output)


# --------------------------------------------------------------------------- against torch SDPA enable_gqa


@pytest.mark.parametrize("kv_heads", [1, 2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_mha_kv_heads_is_sdpa_enable_gqa(kv_heads, causal):
    torch.manual_seed(1)
    layer = MultiHeadAttention(24, 6, kv_heads=kv_heads).eval()
    x = torch.randn(2, 9, 24, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out = layer(x, is_causal=causal).output
    q = layer.q_proj(x2).view(2, 9, 6, 4).transpose(1, 2)
    k = layer.k_proj(x2).view(2, 9, kv_heads, 4).transpose(1, 2)
    v = layer.v_proj(x2).view(2, 9, kv_heads, 4).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    expected = layer.out_proj(o.transpose(1, 2).reshape(2, 9, 24))
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    w = torch.randn_like(out)
    ga = torch.autograd.grad((out * w).sum(), [x, layer.k_proj.weight, layer.v_proj.weight])
    gb = torch.autograd.grad((expected * w).sum(), [x2, layer.k_proj.weight, layer.v_proj.weight])
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------- cached decoding


@pytest.mark.parametrize("config", ["gqa", "mqa", "qk_norm", "elementwise", "all_mha"])
def test_cached_decoding_step_by_step_equals_full_forward(config):
    layer = gqa_layer(**CONFIGS[config])
    cache = assert_decoding_equals_full_forward(layer, torch.randn(2, 7, D, dtype=torch.float64))
    assert tuple(cache.key.shape) == (2, layer.kv_heads, 7, 4) and tuple(cache.value.shape) == (2, layer.kv_heads, 7, 5)
    assert cache.nbytes == 2 * 7 * layer.kv_heads * (4 + 5) * 8


def assert_preallocated_decoding_equals_full_forward(layer, x: torch.Tensor, prompt: int = 2, capacity: int = 8):
    """As :func:`assert_decoding_equals_full_forward`, with the prompt's cache preallocated to ``capacity``
    positions (fixed shapes, written in place); returns the last cache."""
    full = layer(x, is_causal=True).output
    out = layer(x[:, :prompt], is_causal=True, use_cache=True)
    cache, steps = out.cache.preallocate(capacity), [out.output]
    for t in range(prompt, x.shape[1]):
        out = layer(x[:, t:t + 1], is_causal=True, use_cache=True, cache=cache)
        steps.append(out.output)
        cache = out.cache
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    return cache


def test_preallocated_cache_decoding_equals_full_forward():
    layer = gqa_layer(**CONFIGS["elementwise"])
    cache = assert_preallocated_decoding_equals_full_forward(layer, torch.randn(1, 5, D, dtype=torch.float64))
    assert cache.key.shape[1] == 3


# --------------------------------------------------------------------------- Hugging Face peers


def _hf_rotary_and_mask(rotary_cls, config, batch: int, length: int, pad: torch.Tensor):
    positions = torch.arange(length)[None].expand(batch, -1)
    cos, sin = rotary_cls(config=config)(torch.zeros(1, dtype=torch.float64), positions)
    allowed = torch.ones(length, length, dtype=torch.bool).tril()[None, None] & ~pad[:, None, None, :]
    mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    return (cos.double(), sin.double()), mask


def _compare_with_hf(ours: MultiHeadAttention, theirs, rotary_cls, config):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 6, config.hidden_size, generator=g, dtype=torch.float64)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True
    position_embeddings, mask = _hf_rotary_and_mask(rotary_cls, config, 2, 6, pad)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = ours(x1, is_causal=True, key_padding_mask=pad).output
    expected = theirs(x2, position_embeddings=position_embeddings, attention_mask=mask)[0]
    real = ~pad  # padded query rows: HF attends them to their allowed keys as we do, compare real rows only
    torch.testing.assert_close(out[real], expected[real], atol=1e-5, rtol=1e-5)
    w = torch.randn_like(out) * real[..., None]
    (out * w).sum().backward()
    (expected * w).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-5, rtol=1e-5)
    names = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "out_proj": "o_proj",
             "q_norm": "q_norm", "k_norm": "k_norm"}
    for mine, hf in names.items():
        if getattr(ours, mine) is None:
            continue
        torch.testing.assert_close(getattr(ours, mine).weight.grad, getattr(theirs, hf).weight.grad, atol=1e-6,
                                   rtol=1e-5, msg=lambda m, mine=mine: f"{mine}: {m}")


def _copy_from_hf(ours: MultiHeadAttention, theirs) -> None:
    with torch.no_grad():
        for mine, hf in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("out_proj", "o_proj"),
                         ("q_norm", "q_norm"), ("k_norm", "k_norm")):
            if getattr(ours, mine) is None:
                continue
            for part in ("weight", "bias"):
                src = getattr(getattr(theirs, hf), part, None)
                if src is not None:
                    getattr(getattr(ours, mine), part).copy_(src)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_mha_kv_heads_is_hf_llama_attention(kv_heads):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=8,
                         attention_bias=False, max_position_embeddings=64, rope_theta=10000.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = LlamaAttention(config, layer_idx=0).double().eval()
    ours = MultiHeadAttention(32, 4, kv_heads=kv_heads, bias=False, rotary=True).double().eval()
    _copy_from_hf(ours, theirs)
    _compare_with_hf(ours, theirs, LlamaRotaryEmbedding, config)


def test_mha_qk_norm_is_hf_qwen3_attention():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

    config = Qwen3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                         attention_bias=False, max_position_embeddings=64, rope_theta=1000.0, rms_norm_eps=1e-6)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = Qwen3Attention(config, layer_idx=0).double().eval()
    with torch.no_grad():
        theirs.q_norm.weight.normal_(1.0, 0.3)
        theirs.k_norm.weight.normal_(1.0, 0.3)
    ours = MultiHeadAttention(32, 4, head_dim=12, kv_heads=2, bias=False, rotary=True, rotary_base=1000.0,
                              qk_norm=True, qk_norm_eps=1e-6).double().eval()
    _copy_from_hf(ours, theirs)
    _compare_with_hf(ours, theirs, Qwen3RotaryEmbedding, config)


# --------------------------------------------------------------------------- MoH and Talking-Heads

from headmix.attention import MixtureOfHeadsAttention, TalkingHeadsAttention  # noqa: E402
from headmix.attention.reference import reference_moh  # noqa: E402
from headmix.models.config import AttentionConfig  # noqa: E402


def moh_layer(impl: str, dtype=torch.float64, **kw) -> MixtureOfHeadsAttention:
    """8 heads of 3 (odd) with random router weights (so that the routing is not uniform) and norm weights off 1."""
    torch.manual_seed(0)
    opts = dict(num_heads=8, num_shared_heads=1, top_k=2, head_dim=3)
    opts.update(kw)
    layer = MixtureOfHeadsAttention(D, impl=impl, **opts).to(dtype).eval()
    with torch.no_grad():
        for lin in (layer.routed_gate, layer.shared_gate, layer.group_gate):
            if lin is not None:
                lin.weight.normal_()
        for norm in (layer.q_norm, layer.k_norm):
            if norm is not None:
                norm.weight.add_(0.5 * torch.randn_like(norm.weight))
    return layer


MOH_CONFIGS = {
    "gqa_aligned": dict(kv_heads=2, num_shared_heads=4),  # shared heads fill group 0: K/V read in place
    "gqa_split": dict(kv_heads=2),  # shared head 0 splits group 0: the sparse path gathers K/V
    # global sparse: the shared heads 0-2 read K/V heads 0, 0, 1 and the routed heads 3-7 K/V heads 1, 2, 2, 3, 3
    # (each K/V head repeated for its query heads); the shared heads run apart, with their own QK-norm call
    "gqa_split_two_groups": dict(kv_heads=4, num_shared_heads=3, qk_norm=True),
    "mqa_norm_gate": dict(kv_heads=1, qk_norm=True, output_gate="headwise", rotary=True),
    "elementwise": dict(kv_heads=4, output_gate="elementwise", rotary=True, num_shared_heads=0, top_k=3),
    "gqe": dict(kv_heads=2, route_per_group=True, num_shared_heads=1, top_k=2, rotary=True),
    "gqe_norm_gate": dict(kv_heads=4, route_per_group=True, num_shared_heads=0, top_k=1, qk_norm=True,
                          output_gate="elementwise", head_weighting="paper"),
    "gqe_scaled": dict(kv_heads=2, route_per_group=True, num_shared_heads=2, top_k=1, head_weighting="scaled",
                       output_gate="headwise"),
}


@pytest.mark.parametrize("impl", ["dense", "sparse"])
@pytest.mark.parametrize("config", list(MOH_CONFIGS))
@pytest.mark.parametrize("case", ["none", "causal_padding", "per_head_mask", "fully_masked_row"])
def test_moh_options_match_reference(impl, config, case):
    layer = moh_layer(impl, **MOH_CONFIGS[config])
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 5, D, generator=g, dtype=torch.float64)
    masks = masks_for(case, 2, 5, 5, g)
    if case == "per_head_mask":
        masks["attn_mask"] = torch.rand(2 * 8, 5, 5, generator=g) < 0.3
        masks["attn_mask"][..., 0] = False
    check_against(layer, reference_moh, x, None, masks)


@pytest.mark.parametrize("config", ["gqa_split", "gqa_aligned", "mqa_norm_gate", "gqe", "gqe_norm_gate"])
def test_moh_options_cached_decoding_equals_full_forward(config):
    for impl in ("dense", "sparse"):
        layer = moh_layer(impl, **MOH_CONFIGS[config])
        cache = assert_decoding_equals_full_forward(layer, torch.randn(2, 6, D, dtype=torch.float64))
        assert cache.key.shape[1] == layer.kv_heads


def test_moh_sparse_and_dense_give_the_same_routing_and_loss():
    dense, sparse = moh_layer("dense", **MOH_CONFIGS["gqe"]), moh_layer("sparse", **MOH_CONFIGS["gqe"])
    x = torch.randn(2, 5, D, dtype=torch.float64)
    a, b = dense(x, is_causal=True), sparse(x, is_causal=True)
    assert torch.equal(a.routing.expert_index, b.routing.expert_index)
    torch.testing.assert_close(a.aux_loss, b.aux_loss)


@pytest.mark.parametrize("weighting", ["renormalized", "paper", "scaled"])
def test_gqe_routes_inside_every_group(weighting):
    """Each token: in every K/V group its shared heads and exactly top_k of the group's routed heads are active;
    the routed weights are renormalised within the group (renormalized: they sum to a_r * top_k per group)."""
    layer = moh_layer("dense", num_heads=12, kv_heads=3, route_per_group=True, num_shared_heads=1, top_k=2,
                      head_weighting=weighting)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    g, routing = layer.head_weights(x, None)
    groups = g.view(2, 5, 3, 4)
    assert (groups[..., 0] > 0).all()  # the shared head of each group
    assert ((groups[..., 1:] > 0).sum(-1) == 2).all()  # top 2 of each group's 3 routed heads
    assert routing.expert_index.shape == (10, 6)
    assert ((routing.expert_index.view(10, 3, 2) // 3) == torch.arange(3)[:, None]).all()
    a = torch.softmax((x.reshape(10, D) @ layer.group_gate.weight.double().T).view(10, 3, 2), -1)  # a pair per group
    routed_sum = groups[..., 1:].reshape(10, 3, 3).sum(-1)
    if weighting == "renormalized":
        torch.testing.assert_close(routed_sum, 2 * a[..., 1] * 2)  # [a_s, a_r] = 2 softmax, times top_k
    elif weighting == "paper":
        assert (routed_sum < a[..., 1] + 1e-12).all()  # a_r times the selected p, which sum below 1
    probs = routing.probs.view(10, 3, 3)
    torch.testing.assert_close(probs.sum(-1), torch.ones(10, 3, dtype=torch.float64))  # softmax per group


def test_gqe_with_one_group_is_global_moh():
    x = torch.randn(2, 5, D, dtype=torch.float64)
    for impl in ("dense", "sparse"):
        gqe = moh_layer(impl, kv_heads=1, route_per_group=True)
        moh = moh_layer(impl, kv_heads=1)
        assert [(n, p.shape) for n, p in gqe.named_parameters()] == [(n, p.shape) for n, p in moh.named_parameters()]
        moh.load_state_dict(gqe.state_dict())
        a, b = gqe(x, is_causal=True), moh(x, is_causal=True)
        torch.testing.assert_close(a.output, b.output)
        torch.testing.assert_close(a.aux_loss, b.aux_loss)


def test_gqe_load_balance_is_the_mean_of_the_groups_losses():
    layer = moh_layer("sparse", num_heads=12, kv_heads=3, route_per_group=True, num_shared_heads=0, top_k=2)
    x = torch.randn(2, 7, D, dtype=torch.float64)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    out = layer(x, key_padding_mask=pad)
    keep = ~pad.reshape(-1)
    p = torch.softmax(x.reshape(14, D) @ layer.routed_gate.weight.double().T, -1)  # W_r rows, group by group
    expected = []
    for j in range(3):
        pj = torch.softmax((x.reshape(14, D) @ layer.routed_gate.weight.double()[4 * j:4 * j + 4].T), -1)
        chosen = torch.zeros_like(pj).scatter(-1, pj.topk(2, -1).indices, 1.0)
        f = chosen[keep].sum(0) / (keep.sum() * 2)  # MoA eq. 13-15 within the group (4 experts)
        big_p = pj[keep].mean(0)
        expected.append(4 * (f * big_p).sum())
    assert p.shape == (14, 12)
    torch.testing.assert_close(out.losses["load_balance"], torch.stack(expected).mean())
    torch.testing.assert_close(out.aux_loss, layer.load_balance_weight * torch.stack(expected).mean())


@pytest.mark.parametrize("config", ["gqa", "mqa", "qk_norm", "elementwise"])
def test_talking_heads_options_match_reference(config):
    opts = CONFIGS[config]
    torch.manual_seed(0)
    layer = TalkingHeadsAttention(D, 6, head_dim=5, key_dim=4, query_block=2, **opts).double().eval()
    with torch.no_grad():
        layer.pre_mix.add_(0.3 * torch.randn(6, 6, dtype=torch.float64))
        layer.post_mix.add_(0.3 * torch.randn(6, 6, dtype=torch.float64))
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 5, D, generator=g, dtype=torch.float64)
    layer.train()  # query blocks with checkpointing (dropout is 0)
    check_against(layer, reference_mha, x, None, masks_for("causal_padding", 2, 5, 5, g))
    layer.eval()
    check_against(layer, reference_mha, x, None, masks_for("per_head_mask", 2, 5, 5, g))
    cache = assert_decoding_equals_full_forward(layer, x)
    assert cache.key.shape[1] == layer.kv_heads


# --------------------------------------------------------------------------- AttentionConfig


@pytest.mark.parametrize("kind", ["mha", "moh", "talking_heads"])
def test_config_builds_the_options(kind):
    extra = dict(num_shared_heads=1, top_k=2, route_per_group=True) if kind == "moh" else {}
    cfg = AttentionConfig(kind=kind, num_heads=8, kv_heads=2, qk_norm=True, output_gate="elementwise", **extra)
    layer = cfg.build(32)
    assert layer.kv_heads == 2 and layer.q_norm is not None and layer.output_gate == "elementwise"
    assert tuple(layer.k_proj.weight.shape) == (8, 32) and tuple(layer.gate_proj.weight.shape) == (32, 32)
    if kind == "moh":
        assert layer.route_per_group and layer.top_k == 2
    assert AttentionConfig.from_dict(cfg.to_dict()) == cfg
    plain = AttentionConfig(kind=kind, num_heads=8, **({k: v for k, v in extra.items() if k != "route_per_group"}))
    layer = plain.build(32)
    assert layer.kv_heads == 8 and layer.q_norm is None and layer.gate_proj is None


@pytest.mark.parametrize("kw, match", [
    (dict(kind="mha", num_heads=8, kv_heads=3), r"^attention\.kv_heads \(3\) must divide attention\.num_heads \(8\)$"),
    (dict(kind="mha", num_heads=8, kv_heads=0), r"^attention\.kv_heads must be a positive integer"),
    (dict(kind="talking_heads", num_heads=8, output_gate="sigmoid"), r"^attention\.output_gate must be one of"),
    (dict(kind="moh", num_heads=8, num_shared_heads=1, top_k=1, qk_norm=1), r"^attention\.qk_norm must be true, false"),
    (dict(kind="switchhead", num_heads=4, num_experts=2, top_k=1, output_gate="headwise"),
     r"^attention\.output_gate applies to kind"),
    (dict(kind="mha", num_heads=8, route_per_group=True), r"^attention\.route_per_group applies to kind 'moh'"),
    (dict(kind="moh", num_heads=8, num_shared_heads=1, top_k=1, route_per_group=True),
     r"^attention\.route_per_group needs attention\.kv_heads"),
    (dict(kind="moh", num_heads=8, kv_heads=2, num_shared_heads=4, top_k=1, route_per_group=True),
     r"^attention\.num_shared_heads must be in \[0, num_heads / kv_heads=4\)"),
    (dict(kind="moh", num_heads=8, kv_heads=2, num_shared_heads=1, top_k=4, route_per_group=True),
     r"^attention\.top_k K=4 exceeds the 3 routed heads"),
])
def test_config_bad_options_get_one_line_errors(kw, match):
    with pytest.raises(ValueError, match=match) as err:
        AttentionConfig(**kw)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- counting, presets, studies

import dataclasses  # noqa: E402

from headmix.models import (analytic_macs, analytic_parameters, build_model, count_parameters,  # noqa: E402
                            get_config, measure_macs)
from headmix.models.counting import attention_macs, attention_parameters  # noqa: E402

LLAMA3_PRESETS = ["llama3-tiny-gqa", "llama3-tiny-gated", "llama3-tiny-gqe", "llama3-tiny-moh-per-group"]


def _with_decoder_attention(name: str, **changes):
    cfg = get_config(name, task="lm")
    return cfg.replace(decoder_self_attention=dataclasses.replace(cfg.decoder_self_attention, **changes))


@pytest.mark.parametrize("changes", [
    dict(kind="mha", kv_heads=2), dict(kind="mha", kv_heads=1, qk_norm=True, output_gate="elementwise"),
    dict(kind="talking_heads", kv_heads=2, output_gate="headwise"),
    dict(kind="moh", num_shared_heads=1, top_k=2, kv_heads=2, qk_norm=True, output_gate="headwise"),
    # GQE, sparse: 2 groups of 2 heads, both routed and both selected per group (every routed head in use, so
    # the padded sparse layout computes no padding rows and the measured count is the selected heads')
    dict(kind="moh", num_shared_heads=0, top_k=2, kv_heads=2, route_per_group=True, moh_impl="sparse",
         output_gate="elementwise"),
])
def test_counts_are_exact_for_the_options(changes):
    cfg = _with_decoder_attention("tiny-mha", **changes)
    assert analytic_parameters(cfg).total == count_parameters(build_model(cfg, device="meta"))
    assert measure_macs(cfg) == analytic_macs(cfg).full


@pytest.mark.parametrize("name", LLAMA3_PRESETS)
def test_llama3_presets_counts_are_exact(name):
    cfg = get_config(name)
    assert analytic_parameters(cfg).total == count_parameters(build_model(cfg, device="meta"))
    if name != "llama3-tiny-moh-per-group":  # auto MoH: measured as whatever impl runs; the analytic count is dense
        assert measure_macs(cfg) == analytic_macs(cfg).full


def test_attention_formulas_for_the_options():
    d, t, s, h, dh, g = 64, 10, 7, 8, 8, 2
    base = AttentionConfig(kind="mha", num_heads=h)
    gqa = dataclasses.replace(base, kv_heads=g)
    full, _ = attention_macs(gqa, d, t, s)
    assert full == t * d * h * dh + 2 * s * d * g * dh + 2 * h * t * s * dh + t * h * dh * d
    assert attention_parameters(gqa, d)[0] == d * h * dh * 2 + 2 * d * g * dh + h * dh + 2 * g * dh + d
    gated = dataclasses.replace(gqa, output_gate="elementwise", qk_norm=True, bias=False)
    assert attention_macs(gated, d, t, s)[0] == full + t * d * h * dh
    assert attention_parameters(gated, d)[0] == 2 * d * h * dh + 2 * d * g * dh + d * h * dh + 2 * dh
    headwise = dataclasses.replace(gqa, output_gate="headwise")
    assert attention_parameters(headwise, d)[0] == attention_parameters(gqa, d)[0] + d * h + h
    # GQE, sparse: per group 1 shared + top 2 of 3; routers W_r (6), W_s (2) and W_h (2 per group)
    gqe = AttentionConfig(kind="moh", num_heads=h, kv_heads=g, route_per_group=True, num_shared_heads=1, top_k=2,
                          moh_impl="sparse", bias=False)
    active = g * (1 + 2)
    assert attention_macs(gqe, d, t, s)[0] == (t * d * active * dh + 2 * s * d * g * dh + 2 * active * t * s * dh
                                               + t * active * dh * d + t * d * (6 + 2 + 2 * g))
    assert attention_parameters(gqe, d)[0] == 2 * d * h * dh + 2 * d * g * dh + d * (6 + 2 + 2 * g)


def test_llama3_presets_use_grouped_query_attention():
    gqa, gated, gqe, moh_per_group = (get_config(n) for n in LLAMA3_PRESETS)
    model = build_model(gated)
    att = model.decoder.layers[0].self_attn
    assert att.kv_heads == 2 and att.num_heads == 8 and att.q_norm is not None and att.output_gate == "elementwise"
    assert att.rotary is not None and att.rotary.base == 500000.0 and att.k_proj.bias is None
    layer = build_model(moh_per_group).decoder.layers[0].self_attn
    assert layer.route_per_group and layer.kv_heads == 2 and layer.top_k == 2
    # the paper's GQE: the GQA presets' 8 query heads as experts on its 2 K/V heads, top 2 of 4 per group
    papers = build_model(gqe).decoder.layers[0].self_attn
    assert type(papers).__name__ == "GroupedQueryExpertsAttention"
    assert (papers.num_experts, papers.kv_heads, papers.top_k, papers.head_dim) == (8, 2, 2, 8)
    assert papers.weighted_slot and papers.shared_head
    assert build_model(gqa).decoder.layers[0].self_attn.gate_proj is None
    # the cache of a GQA model holds 2 K/V heads per layer: a quarter of the 8-head model's
    tokens = torch.randint(3, 100, (1, 5))
    m = build_model(gqa).eval()
    caches = m(tokens, use_cache=True).state.self_attn
    assert len(caches) == 2 and all(c.key.shape[1] == 2 for c in caches)


def test_study_matching_solves_and_counts_kv_heads():
    from headmix.study.matching import attention_macs_of, match_attention

    baseline = get_config("llama3-tiny-gqa")
    # an MHA row with 8 heads of 8 solving for kv_heads must find the baseline's 2
    match = match_attention(baseline, {"kind": "mha", "num_heads": 8}, ["kv_heads"], tolerance=0.001)
    assert match.attention.kv_heads == 2 and match.attention.rotary_base == 500000.0
    # the gated baseline's conventions go to MoH rows, not to MoA rows (which have none)
    gated = get_config("llama3-tiny-gated")
    row = match_attention(gated, {"kind": "moh", "num_heads": 8, "kv_heads": 2, "num_shared_heads": 1,
                                  "route_per_group": True}, ["top_k"], tolerance=0.5)
    assert row.attention.qk_norm and row.attention.output_gate == "elementwise"
    moa = match_attention(gated, {"kind": "moa", "num_experts": 8, "head_dim": 8}, ["top_k"], tolerance=0.5)
    assert moa.attention.qk_norm is None and moa.attention.output_gate is None
    fewer = attention_macs_of(baseline.replace(decoder_self_attention=dataclasses.replace(
        baseline.decoder_self_attention, kv_heads=1)), None, None)
    assert fewer < attention_macs_of(baseline, None, None)


# --------------------------------------------------------------------------- headmix bench gqa (not timed)


def test_bench_gqa_baseline_computes_what_the_layer_computes():
    from headmix.bench.gqa import TorchGroupedAttention

    torch.manual_seed(0)
    baseline, ours = TorchGroupedAttention(32, 8, 2), MultiHeadAttention(32, 8, kv_heads=2)
    ours.load_state_dict(baseline.state_dict())  # the same parameter names and shapes
    x = torch.randn(2, 9, 32)
    torch.testing.assert_close(baseline(x), ours(x, is_causal=True).output)


def test_bench_gqa_cli_prints_every_comparison_against_its_baseline(capsys):
    from headmix.cli.main import main

    threads = torch.get_num_threads()  # --threads sets torch's thread count for the process: restore it
    try:
        code = main(["bench", "gqa", "--embed-dim", "32", "--heads", "8", "--kv-heads", "2", "--batch", "1",
                     "--seq", "8", "--prefill-seq", "16", "--repeats", "1", "--warmup", "0", "--threads", "1",
                     "--clock", "cpu"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0 and "CPU time of this process" in out and "8 query heads on 2 K/V heads" in out
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith(("| g", "| m"))]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("gqa", "fwd+bwd 1x8", "torch SDPA enable_gqa"), ("gqa", "fwd+bwd 1x8", "headmix MHA"),
        ("moh-per-group", "fwd+bwd 1x8", "MHA"),
        ("moh-per-group", "fwd+bwd 1x8", "MoH per K/V group sparse (top 2 of 4 per group)"),
        ("moh-per-group", "fwd+bwd 1x8", "MoH sparse (top 4 of 8)"),
        ("moh-per-group", "prefill 1x16", "MHA"),
        ("moh-per-group", "prefill 1x16", "MoH per K/V group sparse (top 2 of 4 per group)"),
        ("moh-per-group", "prefill 1x16", "MoH sparse (top 4 of 8)"),
        ("gates", "fwd+bwd 1x8", "MHA"), ("gates", "fwd+bwd 1x8", "+ qk_norm"),
        ("gates", "fwd+bwd 1x8", "+ qk_norm + headwise gate"), ("gates", "fwd+bwd 1x8", "+ qk_norm + elementwise gate")]
    assert [r[4] for r in rows if r[2] in ("torch SDPA enable_gqa", "MHA")] == ["1.000"] * 4
    assert main(["bench", "gqa", "--heads", "8", "--kv-heads", "3"]) == 2
    assert "--kv-heads must divide --heads" in capsys.readouterr().err


def test_routing_analyses_take_moh_per_kv_group_and_the_papers_gqe_per_kv_group():
    from headmix.analysis import routed_layers

    assert [l.kind for l in routed_layers(build_model(get_config("tiny-moh", task="lm")))] == ["moh", "moh"]
    per_group = routed_layers(build_model(get_config("llama3-tiny-moh-per-group")))
    assert [(l.kind, l.num_groups, l.group_kind) for l in per_group] == [("moh", 2, "K/V group")] * 2
    config = get_config("llama3-tiny-gqe")  # the paper's GQE, 8 experts on 2 K/V heads, top 2
    assert [(l.kind, l.num_experts, l.top_k, l.num_groups) for l in routed_layers(build_model(config))] == \
        [("gqe", 8, 2, 2)] * 2
    gqe = config.replace(decoder_self_attention=AttentionConfig(kind="gqe", num_experts=4, kv_heads=2, top_k=1,
                                                                 bias=False, rotary=True))
    papers = routed_layers(build_model(gqe))
    described = [(l.kind, l.num_experts, l.top_k, l.num_groups, l.group_kind) for l in papers]
    assert described == [("gqe", 4, 1, 2, "K/V group")] * 2
    assert papers[0].expert_labels == ["g0.E0", "g0.E1", "g1.E0", "g1.E1"]


@pytest.mark.slow
def test_options_compile_without_graph_breaks():
    layers = [MultiHeadAttention(32, 8, kv_heads=2, qk_norm=True, output_gate="elementwise", rotary=True),
              MixtureOfHeadsAttention(32, 8, 1, 2, kv_heads=2, route_per_group=True, qk_norm=True,
                                      output_gate="headwise", rotary=True, impl="dense")]
    x = torch.randn(2, 9, 32)
    for layer in layers:
        compiled = torch.compile(layer, fullgraph=True)
        torch.testing.assert_close(compiled(x, is_causal=True).output, layer(x, is_causal=True).output)


# --------------------------------------------------------------------------- SDPA's fast kernels on CUDA

from headmix.attention.base import attention_bias, cuda_flash_reads_grouped_kv, repeat_kv_heads  # noqa: E402


def test_cuda_flash_takes_grouped_kv_only_without_a_mask_in_half_precision():
    """CUDA's flash kernel is the only one that reads grouped K/V (``enable_gqa``); it takes no mask and no
    fp32, so there the K/V heads are repeated for the memory-efficient kernel instead of SDPA's math kernel."""
    q = torch.zeros(1, 8, 4, 64, dtype=torch.bfloat16)
    v = torch.zeros(1, 2, 4, 64, dtype=torch.bfloat16)
    bias = torch.zeros(1, 1, 4, 4, dtype=torch.bfloat16)
    assert cuda_flash_reads_grouped_kv(q, v, None)
    assert cuda_flash_reads_grouped_kv(q.half(), v.half(), None)
    assert not cuda_flash_reads_grouped_kv(q, v, bias)
    assert not cuda_flash_reads_grouped_kv(q.float(), v.float(), None)
    assert not cuda_flash_reads_grouped_kv(q, v[..., :32], None)         # value size != key size
    assert not cuda_flash_reads_grouped_kv(q.new_zeros(1, 8, 4, 288), v.new_zeros(1, 2, 4, 288), None)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_repeated_kv_heads_give_grouped_attention(kv_heads):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8 if i == 0 else kv_heads, 5, 16, generator=g, dtype=torch.float64) for i in range(3))
    bias = torch.randn(2, 1, 5, 5, generator=g, dtype=torch.float64)
    k_rep, v_rep = repeat_kv_heads(q, k, v)
    assert k_rep.shape == v_rep.shape == (2, 8, 5, 16) and k_rep.is_contiguous()
    got = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=bias)
    per_group = 8 // kv_heads
    for h in range(8):  # query head h reads K/V head h // (heads / G)
        want = F.scaled_dot_product_attention(q[:, h], k[:, h // per_group], v[:, h // per_group], attn_mask=bias[:, 0])
        torch.testing.assert_close(got[:, h], want)


def test_a_decoding_step_after_its_whole_cache_builds_no_mask():
    """One query after a growing cache sees every key: no bias, so flash (which takes no mask) can run."""
    kw = dict(key_padding_mask=None, attn_mask=None, is_causal=True, dtype=torch.float32, device=torch.device("cpu"))
    assert attention_bias(2, 4, 1, 7, past_len=6, **kw) == (None, None, False)
    bias, _, _ = attention_bias(2, 4, 2, 7, past_len=5, **kw)              # two new queries: the first sees 6 keys
    assert bias is not None and torch.isinf(bias[..., 0, 6]).all() and not torch.isinf(bias[..., 1, :]).any()
    bias, _, _ = attention_bias(2, 4, 1, 7, past_len=torch.tensor(3), **kw)  # a preallocated cache: slots past 3
    assert bias is not None and torch.isinf(bias[..., 0, 4:]).all() and not torch.isinf(bias[..., 0, :4]).any()
