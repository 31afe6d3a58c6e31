"""Rotary position embeddings: the module against Hugging Face transformers and x-transformers, and every
attention layer with rotary against the plain references and against its own step-by-step decoding."""

from __future__ import annotations

import pytest
import torch

from headmix import MixtureOfAttentionHeads, MultiHeadAttention, RotaryEmbedding, SwitchHeadAttention
from headmix.attention.reference import reference_rotary, reference_switchhead
from test_attention import make as make_attention  # the layers of the attention tests, gates moved off init
from test_attention import decode_step_by_step
from test_attention import reference_for as attention_reference_for

D = 16


# --------------------------------------------------------------------------- the module against the peers

@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_half_split_matches_transformers(fraction):
    """Hugging Face GPT-NeoX's rotary (Llama's rotate_half layout, with partial_rotary_factor)."""
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb

    config = GPTNeoXConfig(hidden_size=32, num_attention_heads=2,
                           rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": fraction})
    theirs = GPTNeoXRotaryEmbedding(config)
    ours = RotaryEmbedding(16, base=500.0, fraction=fraction)
    q, k = torch.randn(2, 3, 5, 16), torch.randn(2, 3, 5, 16)
    for offset in (0, 7, 1000):
        cos, sin = theirs(q, torch.arange(offset, offset + 5)[None].expand(2, -1))
        q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
        torch.testing.assert_close(ours(q, offset=offset), q_hf, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ours(k, offset=offset), k_hf, atol=1e-6, rtol=1e-6)
    if fraction < 1:
        assert torch.equal(ours(q, offset=3)[..., 8:], q[..., 8:])


def test_half_split_matches_transformers_llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    theirs = LlamaRotaryEmbedding(config)
    ours = RotaryEmbedding(16)
    x = torch.randn(1, 4, 6, 16)
    cos, sin = theirs(x, torch.arange(11, 17)[None])
    expected, _ = apply_rotary_pos_emb(x, x, cos, sin)
    torch.testing.assert_close(ours(x, offset=11), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rot_dim", [16, 8])
def test_interleaved_matches_x_transformers(rot_dim):
    """x-transformers 2.x pairs dimensions (2i, 2i+1) (the GPT-J layout) and rotates the first rot_dim."""
    import x_transformers.x_transformers as xt

    theirs = xt.RotaryEmbedding(rot_dim, base=1000)
    ours = RotaryEmbedding(16, base=1000.0, fraction=rot_dim / 16, interleaved=True)
    x = torch.randn(2, 3, 5, 16)
    for offset in (0, 9):
        freqs, _ = theirs(torch.arange(offset, offset + 5))
        torch.testing.assert_close(ours(x, offset=offset), xt.apply_rotary_pos_emb(x, freqs), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fraction", [1.0, 0.75])
def test_module_matches_reference_and_keeps_relative_scores(interleaved, fraction):
    rotary = RotaryEmbedding(16, base=100.0, fraction=fraction, interleaved=interleaved)
    x = torch.randn(2, 3, 5, 16, dtype=torch.float64)
    # angles in float32 (as Hugging Face Llama), the reference's in float64
    torch.testing.assert_close(rotary(x, offset=4), reference_rotary(x, rotary, offset=4), atol=2e-6, rtol=1e-5)
    # q_m . k_n depends on m - n only (eq. 16): shifting both positions keeps the scores.
    q, k = torch.randn(2, 3, 5, 16, dtype=torch.float64), torch.randn(2, 3, 5, 16, dtype=torch.float64)
    s0 = rotary(q) @ rotary(k).transpose(-1, -2)
    s7 = rotary(q, offset=7) @ rotary(k, offset=7).transpose(-1, -2)
    torch.testing.assert_close(s0, s7, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(s0, q @ k.transpose(-1, -2))


def test_module_checks_its_arguments():
    with pytest.raises(ValueError, match="rotary_fraction"):
        RotaryEmbedding(16, fraction=0.0)
    with pytest.raises(ValueError, match="rotary_base"):
        RotaryEmbedding(16, base=1.0)
    with pytest.raises(ValueError, match="fewer than 2"):
        RotaryEmbedding(4, fraction=0.25)
    with pytest.raises(ValueError, match="head_dim"):
        RotaryEmbedding(0)
    rotary = RotaryEmbedding(8)
    with pytest.raises(ValueError, match=r"shape \(batch, heads, time, 8\)"):
        rotary(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="offset"):
        rotary(torch.randn(1, 1, 2, 8), offset=-1)
    with pytest.raises(ValueError, match="rotary has head_dim 8"):
        MultiHeadAttention(D, 4, rotary=rotary)
    with pytest.raises(ValueError, match="rotary must be a bool"):
        MultiHeadAttention(D, 4, rotary="yes")
    with pytest.raises(ValueError, match="rotary_fraction"):
        MixtureOfAttentionHeads(D, 4, 2, 8, rotary=True, rotary_fraction=1.5)


# --------------------------------------------------------------------------- the layers

KINDS = ["mha", "mha_key", "moa", "moa_kv", "moh", "th", "switchhead"]


def make(kind: str, **kw):
    """The attention tests' layers, and SwitchHead (2 heads of 8, top 2 of 4 value/output experts)."""
    if kind == "switchhead":
        torch.manual_seed(0)
        return SwitchHeadAttention(D, 2, 4, 2, 8, **kw)
    return make_attention(kind, **kw)


def reference_for(kind: str):
    return reference_switchhead if kind == "switchhead" else attention_reference_for(kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_layers_with_rotary_match_reference(kind, fraction):
    layer = make(kind, rotary=True, rotary_base=100.0, rotary_fraction=fraction)
    assert layer.rotary is not None
    x = torch.randn(2, 6, D)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = layer(x1, is_causal=True, key_padding_mask=kpm).output
    w = torch.randn_like(out)
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()
    expected = reference_for(kind)(layer, x2, is_causal=True, key_padding_mask=kpm)
    (expected * w).sum().backward()
    torch.testing.assert_close(out, expected, atol=3e-6, rtol=1e-5)
    torch.testing.assert_close(x1.grad, x2.grad, atol=3e-6, rtol=1e-5)
    for n, p in layer.named_parameters():
        if n in grads:
            torch.testing.assert_close(grads[n], p.grad, atol=5e-6, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    # rotary changes the layer: the same weights without it give another output
    layer.rotary = None
    assert not torch.allclose(layer(x, is_causal=True, key_padding_mask=kpm).output, out, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_with_cache_equals_full_forward(kind):
    layer = make(kind, rotary=True, rotary_fraction=0.5 if kind == "mha" else 1.0)
    x = torch.randn(2, 7, D)
    full = layer(x, is_causal=True).output
    steps, cache = decode_step_by_step(layer, x, prompt=3)
    torch.testing.assert_close(steps, full, atol=2e-6, rtol=1e-5)
    # keys are cached after rotation: the cached keys are the rotated projections
    keys = layer._project_kv(x, x)[0]
    torch.testing.assert_close(cache.key, layer.rotary(keys), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_cross_attention_is_not_rotated(kind):
    layer = make(kind, rotary=True)
    x, mem = torch.randn(2, 4, D), torch.randn(2, 6, D)
    with_rotary = layer(x, mem).output
    first = layer(x, mem, use_cache=True)
    rotary, layer.rotary = layer.rotary, None
    torch.testing.assert_close(with_rotary, layer(x, mem).output)
    layer.rotary = rotary
    # a later decoding step against the static cross-attention cache is not rotated either
    step = layer(x[:, 1:2], cache=first.cache).output
    torch.testing.assert_close(step, with_rotary[:, 1:2], atol=1e-6, rtol=1e-6)


def test_state_dict_has_no_rotary_entries_and_a_module_can_be_shared():
    plain, rotated = make("moa"), make("moa", rotary=True)
    assert plain.state_dict().keys() == rotated.state_dict().keys()
    shared = RotaryEmbedding(4, base=500.0)
    a, b = MultiHeadAttention(D, 4, rotary=shared), MultiHeadAttention(D, 4, rotary=shared)
    assert a.rotary is shared and b.rotary is shared


# --------------------------------------------------------------------------- configuration

def test_attention_config_rotary_fields_build_round_trip_and_validate():
    import json

    from headmix.models.config import AttentionConfig

    cfg = AttentionConfig(kind="moa", num_experts=4, top_k=2, head_dim=8, rotary=True, rotary_base=500.0,
                          rotary_fraction=0.5)
    layer = cfg.build(D)
    assert isinstance(layer.rotary, RotaryEmbedding)
    assert (layer.rotary.base, layer.rotary.rotary_dim) == (500.0, 4)
    assert AttentionConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    for kind, kw in (("mha", {}), ("moh", dict(num_shared_heads=1, top_k=2)), ("talking_heads", {}),
                     ("switchhead", dict(num_experts=4, top_k=2))):
        assert AttentionConfig(kind=kind, num_heads=4, rotary=True, **kw).build(D).rotary is not None
    old = AttentionConfig(kind="mha", num_heads=4).to_dict()
    for field in ("rotary", "rotary_base", "rotary_fraction"):
        del old[field]
    assert AttentionConfig.from_dict(old).build(D).rotary is None  # configs written before rotary load unchanged
    for bad, match in ((dict(rotary=1), "attention.rotary must be"), (dict(rotary_base=0.5), "rotary_base"),
                       (dict(rotary_fraction=0), "rotary_fraction")):
        with pytest.raises(ValueError, match=match):
            AttentionConfig(kind="mha", num_heads=4, **bad)
    with pytest.raises(ValueError, match="cross.rotary_fraction"):
        AttentionConfig.from_dict(dict(kind="mha", num_heads=4, rotary_fraction=2.0), name="cross")
    with pytest.raises(ValueError, match="fewer than 2"):
        AttentionConfig(kind="mha", num_heads=8, rotary=True, rotary_fraction=0.25).build(D)


def test_rotary_layer_built_on_meta_and_materialised_is_correct():
    """The rotary module holds no tensor that a meta-device build would leave uninitialised."""
    with torch.device("meta"):
        layer = MultiHeadAttention(D, 4, rotary=True)
    layer = layer.to_empty(device="cpu")
    reference = MultiHeadAttention(D, 4, rotary=True)
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(1, 5, D)
    torch.testing.assert_close(layer(x, is_causal=True).output, reference(x, is_causal=True).output)
    assert list(layer.rotary.buffers()) == []


# --------------------------------------------------------------------------- self-attention with key/value given

def _token_mask(out):
    """The routing's token mask of a layer output (SwitchHead: its output side), or None."""
    routing = out.routing
    if routing is None:
        return None
    return (routing.output if hasattr(routing, "output") else routing).token_mask


def _decode_explicit(layer, x, prompt: int):
    """:func:`decode_step_by_step` with every call written ``layer(x_t, x_t, x_t, ...)``."""
    chunk = x[:, :prompt]
    out = layer(chunk, chunk, chunk, is_causal=True, use_cache=True)
    steps, cache = [out.output], out.cache
    for t in range(prompt, x.shape[1]):
        chunk = x[:, t:t + 1]
        out = layer(chunk, chunk, chunk, is_causal=True, use_cache=True, cache=cache)
        steps.append(out.output)
        cache = out.cache
    return torch.cat(steps, 1), cache


@pytest.mark.parametrize("kind", KINDS)
def test_explicit_self_attention_is_self_attention(kind):
    """``layer(x, x, x)`` and ``layer(x, x)`` (the query tensor itself as key and value) are ``layer(x)`` in
    every respect: rotary positions, the growing cache, the token mask derived from the padding mask
    (zeroed padded queries, the routing's token mask); another tensor as key is cross-attention."""
    layer = make(kind, rotary=True, rotary_base=100.0, rotary_fraction=0.5, zero_padded_queries=True)
    x = torch.randn(2, 6, D)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    expected = layer(x, is_causal=True, key_padding_mask=kpm)
    for args in ((x, x), (x, x, x)):
        got = layer(*args, is_causal=True, key_padding_mask=kpm)
        torch.testing.assert_close(got.output, expected.output, rtol=0, atol=0)
        torch.testing.assert_close(got.aux_loss, expected.aux_loss, rtol=0, atol=0)
        if _token_mask(expected) is not None:
            assert torch.equal(_token_mask(got), _token_mask(expected))
    assert torch.equal(expected.output[1, 4:], torch.zeros_like(expected.output[1, 4:]))  # padded queries zeroed
    # cached decoding: same outputs, same cache (a growing one, keys rotated at their positions)
    steps, cache = decode_step_by_step(layer, x, prompt=3)
    explicit_steps, explicit_cache = _decode_explicit(layer, x, prompt=3)
    torch.testing.assert_close(explicit_steps, steps, rtol=0, atol=0)
    assert not explicit_cache.static and explicit_cache.length == x.shape[1]
    torch.testing.assert_close(explicit_cache.key, cache.key, rtol=0, atol=0)
    # a copy of x is another tensor: cross-attention, not rotated
    copy = x.clone()
    cross = layer(x, copy, is_causal=True).output
    rotary, layer.rotary = layer.rotary, None
    torch.testing.assert_close(cross, layer(x, x, is_causal=True).output, rtol=0, atol=0)
    layer.rotary = rotary
    assert not torch.allclose(cross, layer(x, is_causal=True).output, atol=1e-4)


@pytest.mark.parametrize("kind", ["mha", "switchhead"])
def test_query_as_key_with_another_value_is_cross_attention(kind):
    layer = make(kind, rotary=True)
    x, v = torch.randn(2, 5, D), torch.randn(2, 5, D)
    got = layer(x, x, v).output
    layer.rotary = None
    torch.testing.assert_close(got, layer(x, x, v).output, rtol=0, atol=0)
