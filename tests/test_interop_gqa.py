"""Conversions that keep the structure of today's decoders (issue 27): Hugging Face Llama with grouped K/V
heads, Qwen3 (grouped K/V heads and QK-norm) and the Gated Attention authors' gated Qwen3 (headwise and
elementwise output gates) -> headmix MHA or MoH with the same ``kv_heads``. Against ``transformers`` itself,
built offline from tiny configs: equal logits (float32), equal greedy tokens (headmix ``greedy_decode`` vs
Hugging Face ``generate``), padding, and the same KV-cache bytes per token (``DynamicCache`` tensors vs the
headmix caches' ``nbytes``)."""

from __future__ import annotations

import math

import pytest
import torch

from headmix.attention import MixtureOfHeadsAttention
from headmix.interop import (
    attention_from_llama,
    causal_lm_from_llama,
    causal_lm_from_qwen3,
    causal_lm_to_llama,
    causal_lm_to_qwen3,
    from_pretrained,
    load_qwen3,
    moh_from_dense,
)
from headmix.models import cache_bytes_per_token, count_parameters

from test_interop import V, assert_same_greedy, assert_same_logits, hf_llama, tokens

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402


def spread(model: torch.nn.Module) -> None:
    """Weights that make a difference: projections N(0, 0.15) (the default init gives near-uniform logits),
    every norm weight in [0.5, 1.5] (the default ones would hide a norm weight not copied)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.15)


def qwen3_config(**kw):
    base = dict(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
                tie_word_embeddings=False, attention_bias=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    base.update(kw)
    return transformers.Qwen3Config(**base)


def hf_qwen3(**kw):
    """A tiny ``Qwen3ForCausalLM``: 4 query heads of 16 on 2 K/V heads, ``hidden_size`` 48 (so
    ``head_dim != hidden_size / heads``, as in Qwen3-0.6B)."""
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(qwen3_config(**kw)).eval()
    spread(model)
    return model


# --------------------------------------------------------------------------------------------------
# The Gated Attention authors' gated Qwen3 attention, re-implemented from
# qiuzh20/gated_attention, modeling_qwen3.py, class Qwen3Attention.forward, commit
# 49645df63aafe9e680bc44a9c0ca280d4aefa8e9 (read, not vendored; their file targets transformers 4.x, so the
# same math sits here in a subclass of transformers 5's Qwen3Attention, with its cache).
# --------------------------------------------------------------------------------------------------
class AuthorsGatedQwen3Attention(modeling_qwen3.Qwen3Attention):
    """``q_proj`` holds, per K/V group, the group's query rows then its gate rows (``num_heads`` extra rows
    headwise, ``num_heads * head_dim`` elementwise); ``attn_output * sigmoid(gate_score)`` before ``o_proj``;
    the four projections' bias flag is ``config.qkv_bias``, as their code reads it."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.headwise = bool(getattr(config, "headwise_attn_output_gate", False))
        self.elementwise = bool(getattr(config, "elementwise_attn_output_gate", False))
        heads, kv_heads, d, bias = config.num_attention_heads, config.num_key_value_heads, self.head_dim, config.qkv_bias
        extra = heads if self.headwise else heads * d if self.elementwise else 0
        self.q_proj = torch.nn.Linear(config.hidden_size, heads * d + extra, bias=bias)
        self.k_proj = torch.nn.Linear(config.hidden_size, kv_heads * d, bias=bias)
        self.v_proj = torch.nn.Linear(config.hidden_size, kv_heads * d, bias=bias)
        self.o_proj = torch.nn.Linear(heads * d, config.hidden_size, bias=bias)
        self.num_heads, self.num_key_value_heads = heads, kv_heads

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, past_key_values=None, **kwargs):
        cache = past_key_values if cache is None else cache  # the cache's name before transformers 5.24
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)
        groups = self.num_key_value_groups
        if self.headwise:
            query_states = query_states.view(bsz, q_len, self.num_key_value_heads, -1)
            query_states, gate_score = torch.split(query_states, [self.head_dim * groups, groups], dim=-1)
            gate_score = gate_score.reshape(bsz, q_len, -1, 1)
            query_states = query_states.reshape(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        elif self.elementwise:
            query_states = query_states.view(bsz, q_len, self.num_key_value_heads, -1)
            query_states, gate_score = torch.split(query_states, [self.head_dim * groups, self.head_dim * groups], dim=-1)
            gate_score = gate_score.reshape(bsz, q_len, -1, self.head_dim)
            query_states = query_states.reshape(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        else:
            query_states = query_states.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        query_states = self.q_norm(query_states)  # use_qk_norm=True, their default
        key_states = self.k_norm(key_states)
        cos, sin = position_embeddings
        query_states, key_states = modeling_qwen3.apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)
        key_states = modeling_qwen3.repeat_kv(key_states, groups)
        value_states = modeling_qwen3.repeat_kv(value_states, groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
        if self.headwise or self.elementwise:
            attn_output = attn_output * torch.sigmoid(gate_score)
        attn_output = self.o_proj(attn_output.reshape(bsz, q_len, -1))
        return attn_output, attn_weights


def gated_qwen3(gate: str, qkv_bias: bool = False, **kw):
    """A tiny gated Qwen3 of the authors (their config flags set, each layer's attention theirs)."""
    cfg = qwen3_config(**kw)
    setattr(cfg, f"{gate}_attn_output_gate", True)
    cfg.qkv_bias = qkv_bias
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    for i, layer in enumerate(model.model.layers):
        layer.self_attn = AuthorsGatedQwen3Attention(cfg, i)
    spread(model)
    return model


# --------------------------------------------------------------------------------------------------
# KV-cache bytes
# --------------------------------------------------------------------------------------------------
def hf_cache_bytes_per_token(hf_model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        out = hf_model(ids, use_cache=True)
    # the output's cache field: `cache` from transformers 5.24, `past_key_values` before
    cache = out.cache if "cache" in out.__dataclass_fields__ else out.past_key_values
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)) / ids.numel()


def assert_same_cache_bytes(ours, hf_model, kv_heads: int, head_dim: int) -> None:
    ids = tokens(2, 6)
    layers = hf_model.config.num_hidden_layers
    assert cache_bytes_per_token(ours, ids) == hf_cache_bytes_per_token(hf_model, ids) == layers * 2 * kv_heads * head_dim * 4


def kv_projection_rows(model) -> int:
    return sum(layer.self_attn.k_proj.weight.shape[0] + layer.self_attn.v_proj.weight.shape[0]
               for layer in model.decoder.layers)


# --------------------------------------------------------------------------------------------------
# Llama with grouped K/V heads
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_llama_gqa_to_mha_keeps_kv_heads_logits_decoding_and_cache_bytes(kv_heads):
    hf = hf_llama(num_key_value_heads=kv_heads)
    ours = causal_lm_from_llama(hf).eval()
    assert ours.config.decoder_self_attention.kv_heads == kv_heads
    assert count_parameters(ours) == sum(p.numel() for p in hf.parameters())  # no repeated K/V rows
    assert_same_logits(ours, hf, tokens(2, 9), tol=1e-5)
    assert_same_greedy(ours, hf, tokens(2, 4, seed=3))
    assert_same_cache_bytes(ours, hf, kv_heads, 16)


def test_llama_expand_kv_repeats_the_heads_same_logits_and_h_over_g_times_the_cache():
    hf = hf_llama(num_key_value_heads=2)
    ours = causal_lm_from_llama(hf, expand_kv=True).eval()
    assert ours.config.decoder_self_attention.kv_heads in (None, 4)
    assert kv_projection_rows(ours) == 2 * kv_projection_rows(causal_lm_from_llama(hf))
    assert_same_logits(ours, hf, tokens(2, 9), tol=1e-5)
    ids = tokens(2, 6)
    assert cache_bytes_per_token(ours, ids) == 2 * hf_cache_bytes_per_token(hf, ids)


@pytest.mark.parametrize("options", [dict(num_shared_heads=1, top_k=3),
                                     dict(num_shared_heads=0, top_k=2, route_per_group=True)],
                         ids=["global", "per-group"])
def test_llama_gqa_to_moh_with_every_head_active_keeps_logits_and_kv_heads(options):
    """MoH of the same 4 query heads on the source's 2 K/V heads (globally routed, and GQE-routed within each
    group: both heads of each group routed and selected), every head active: the logits are Llama's."""
    hf = hf_llama(num_key_value_heads=2)
    ours = causal_lm_from_llama(hf, attention="moh", **options).eval()
    layer = ours.decoder.layers[0].self_attn
    assert isinstance(layer, MixtureOfHeadsAttention) and layer.k_proj.weight.shape[0] == 2 * 16
    out = assert_same_logits(ours, hf, tokens(2, 9), tol=1e-5)
    assert len(out.routing) == 2
    assert_same_cache_bytes(ours, hf, 2, 16)


def test_llama_gqa_attention_layer_equal_outputs_and_gradients():
    """One ``LlamaAttention`` with 1 K/V head (multi-query) as headmix MHA and as MoH (every head active):
    equal outputs and input gradients (float64, causal mask)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = hf_llama(num_key_value_heads=1, attention_bias=True)
    hf.config._attn_implementation = "eager"
    attn = hf.model.layers[0].self_attn.double()
    x = torch.randn(2, 7, 64, dtype=torch.float64, requires_grad=True)
    rope = LlamaRotaryEmbedding(hf.config)(x, torch.arange(7)[None])
    mask = torch.zeros(1, 1, 7, 7, dtype=torch.float64).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    theirs = attn(x, position_embeddings=rope, attention_mask=mask)[0]
    r = torch.randn_like(theirs)
    g_theirs, = torch.autograd.grad((theirs * r).sum(), x)
    for layer in (attention_from_llama(attn), attention_from_llama(attn, attention="moh", num_shared_heads=2, top_k=2)):
        assert layer.k_proj.weight.shape == attn.k_proj.weight.shape
        ours = layer(x, is_causal=True).output
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.autograd.grad((ours * r).sum(), x)[0], g_theirs, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Qwen3
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_heads,tied,bias", [(2, False, False), (1, True, True), (4, False, True)])
def test_qwen3_to_mha_equal_logits_decoding_and_cache_bytes(kv_heads, tied, bias):
    hf = hf_qwen3(num_key_value_heads=kv_heads, tie_word_embeddings=tied, attention_bias=bias)
    ours = causal_lm_from_qwen3(hf).eval()
    att = ours.config.decoder_self_attention
    assert att.qk_norm and att.head_dim == 16 and att.rotary_base == 1e6 and (ours.output_proj is None) == tied
    assert att.kv_heads in ((None, 4) if kv_heads == 4 else (kv_heads,))
    assert count_parameters(ours) == sum(p.numel() for p in hf.parameters())
    assert_same_logits(ours, hf, tokens(2, 9), tol=1e-5)
    assert_same_greedy(ours, hf, tokens(2, 4, seed=3))
    assert_same_cache_bytes(ours, hf, kv_heads, 16)


@pytest.mark.parametrize("gate", [None, "headwise"])
def test_qwen3_left_padding_equals_hf_attention_mask(gate):
    """A left-padded batch: headmix masks the keys of ``pad_id``, Hugging Face those its ``attention_mask``
    zeroes; the logits of the real positions are equal (rotary scores depend on relative positions only)."""
    hf = hf_qwen3() if gate is None else gated_qwen3(gate)
    hf.config._attn_implementation = "eager"
    ours = causal_lm_from_qwen3(hf).eval()
    ids = tokens(2, 9)
    ids[0, :3] = 0
    mask = ids.ne(0)
    with torch.no_grad():
        mine = ours(ids).logits
        theirs = hf(ids, attention_mask=mask.long()).logits
        unmasked = hf(ids).logits
    torch.testing.assert_close(mine[mask], theirs[mask], rtol=1e-5, atol=1e-5)
    assert (mine[0, 3:] - unmasked[0, 3:]).abs().max() > 1e-3  # the padding mattered


@pytest.mark.parametrize("options", [dict(num_shared_heads=2, top_k=2),
                                     dict(num_shared_heads=0, top_k=2, route_per_group=True)],
                         ids=["global", "per-group"])
def test_qwen3_to_moh_with_every_head_active_keeps_logits(options):
    hf = hf_qwen3()
    ours = causal_lm_from_qwen3(hf, attention="moh", **options).eval()
    layer = ours.decoder.layers[0].self_attn
    assert isinstance(layer, MixtureOfHeadsAttention) and layer.q_norm is not None
    assert_same_logits(ours, hf, tokens(2, 9), tol=1e-5)
    assert_same_greedy(ours, hf, tokens(2, 4, seed=3))  # MoH's own cached decoding
    assert_same_cache_bytes(ours, hf, 2, 16)


def test_qwen3_load_from_a_local_folder(tmp_path):
    hf = hf_qwen3(tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)
    assert_same_logits(load_qwen3(tmp_path).eval(), hf, tokens(1, 6), tol=1e-5)
    ours = from_pretrained(tmp_path, attention="moh", num_shared_heads=2, top_k=2).eval()  # by model_type
    assert_same_logits(ours, hf, tokens(1, 6), tol=1e-5)


# --------------------------------------------------------------------------------------------------
# The Gated Attention authors' gated Qwen3
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_gated_qwen3_attention_layer_equal_outputs_and_gradients(gate):
    """One of their attention layers as a headmix MHA layer (float64): equal outputs, and equal gradients
    for the input and for the query / gate rows of their ``q_proj`` (split into ``q_proj`` / ``gate_proj``)."""
    from headmix.interop.qwen3 import split_gated_q_rows

    hf = gated_qwen3(gate, qkv_bias=True).double()  # their bias flag (attention_bias stays False)
    layer = causal_lm_from_qwen3(hf).decoder.layers[1].self_attn
    assert layer.gate_proj.weight.shape == ((4 if gate == "headwise" else 64), 48)
    attn = hf.model.layers[1].self_attn
    x = torch.randn(2, 7, 48, dtype=torch.float64, requires_grad=True)
    rope = hf.model.rotary_emb(x, torch.arange(7)[None])
    mask = torch.zeros(1, 1, 7, 7, dtype=torch.float64).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    theirs = attn(x, rope, mask)[0]
    ours = layer(x, is_causal=True).output
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    r = torch.randn_like(ours)
    g_ours = torch.autograd.grad((ours * r).sum(), [x, layer.q_proj.weight, layer.gate_proj.weight, layer.gate_proj.bias])
    g_theirs = torch.autograd.grad((theirs * r).sum(), [x, attn.q_proj.weight, attn.q_proj.bias])
    q_w, gate_w = split_gated_q_rows(g_theirs[1], 4, 2, 16, gate)
    _, gate_b = split_gated_q_rows(g_theirs[2], 4, 2, 16, gate)
    for a, b in zip(g_ours, [g_theirs[0], q_w, gate_w, gate_b]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_gated_qwen3_to_mha_and_moh_equal_logits_decoding_and_cache_bytes(gate, tmp_path):
    hf = gated_qwen3(gate)
    ours = causal_lm_from_qwen3(hf).eval()
    assert ours.config.decoder_self_attention.output_gate == gate
    assert count_parameters(ours) == sum(p.numel() for p in hf.parameters())
    assert_same_logits(ours, hf, tokens(2, 9), tol=1e-5)
    assert_same_greedy(ours, hf, tokens(2, 4, seed=3))
    assert_same_cache_bytes(ours, hf, 2, 16)
    moh = causal_lm_from_qwen3(hf, attention="moh", num_shared_heads=0, top_k=2, route_per_group=True).eval()
    assert_same_logits(moh, hf, tokens(2, 9), tol=1e-5)
    # their checkpoint folder (config with the gate flag, the wider q_proj): read without their code
    hf.save_pretrained(tmp_path)
    assert_same_logits(from_pretrained(tmp_path).eval(), hf, tokens(1, 6), tol=1e-5)


# --------------------------------------------------------------------------------------------------
# Dense -> MoH keeps kv_heads, QK-norm and gates
# --------------------------------------------------------------------------------------------------
def test_moh_from_dense_keeps_kv_heads_qk_norm_and_gate():
    from headmix.attention import MultiHeadAttention

    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, kv_heads=2, qk_norm=True, output_gate="elementwise", rotary=True).double()
    spread(mha)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    for options in (dict(num_shared_heads=1, top_k=3), dict(num_shared_heads=0, top_k=2, route_per_group=True)):
        moh = moh_from_dense(mha, **options)
        assert moh.k_proj.weight.shape == mha.k_proj.weight.shape and moh.gate_proj.weight.shape == mha.gate_proj.weight.shape
        torch.testing.assert_close(moh(x, is_causal=True).output, mha(x, is_causal=True).output)


# --------------------------------------------------------------------------------------------------
# And back: headmix -> Hugging Face Llama / Qwen3
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen3", True), ("qwen3", False)])
def test_back_to_hf_is_the_source_parameter_for_parameter(family, tied):
    hf = hf_llama(num_key_value_heads=2, tie_word_embeddings=tied) if family == "llama" else hf_qwen3(tie_word_embeddings=tied)
    ours = (causal_lm_from_llama if family == "llama" else causal_lm_from_qwen3)(hf)
    back = (causal_lm_to_llama if family == "llama" else causal_lm_to_qwen3)(ours)
    assert type(back) is type(hf) and back.config.num_key_value_heads == 2
    theirs = dict(hf.named_parameters())
    assert sorted(n for n, _ in back.named_parameters()) == sorted(theirs)
    for name, p in back.named_parameters():
        assert torch.equal(p, theirs[name]), name
    assert_same_logits(ours.eval(), back, tokens(2, 7), tol=1e-5)


def test_the_llama3_gqa_preset_converts_to_hf_llama_with_its_kv_heads():
    """A freshly built ``llama3-tiny-gqa`` (8 query heads on 2 K/V heads) as a Hugging Face Llama: the same
    logits, greedy tokens and KV-cache bytes per token."""
    from headmix.models import build_model, get_config

    torch.manual_seed(0)
    ours = build_model(get_config("llama3-tiny-gqa", vocab_size=V)).eval()
    spread(ours)
    hf = causal_lm_to_llama(ours)
    assert hf.config.num_key_value_heads == 2 and hf.config.num_attention_heads == 8
    assert_same_logits(ours, hf, tokens(2, 9), tol=1e-5)
    assert_same_greedy(ours, hf, tokens(2, 4, seed=3))
    assert_same_cache_bytes(ours, hf, 2, hf.config.head_dim)


def test_back_to_hf_refuses_what_it_cannot_hold():
    hf = hf_qwen3()
    with pytest.raises(ValueError, match="not in qwen3's form: it needs MHA attention, not 'moh'"):
        causal_lm_to_qwen3(causal_lm_from_qwen3(hf, attention="moh", num_shared_heads=2, top_k=2))
    with pytest.raises(ValueError, match="not in llama's form: it needs qk_norm=False"):
        causal_lm_to_llama(causal_lm_from_qwen3(hf))
    with pytest.raises(ValueError, match="not in qwen3's form: it needs no output_gate"):
        causal_lm_to_qwen3(causal_lm_from_qwen3(gated_qwen3("headwise")))
    with pytest.raises(ValueError, match="not in qwen3's form: it needs qk_norm=True with qk_norm_eps == norm_eps"):
        causal_lm_to_qwen3(causal_lm_from_llama(hf_llama()))
    from headmix.models import build_model, get_config

    with pytest.raises(ValueError, match="not in llama's form: it needs MHA attention, not 'moa'"):
        causal_lm_to_llama(build_model(get_config("llama-tiny-moa", vocab_size=V)))


# --------------------------------------------------------------------------------------------------
# What the conversions refuse
# --------------------------------------------------------------------------------------------------
def test_qwen3_conversion_errors():
    with pytest.raises(ValueError, match=r"layer_types: layers \[1\] use sliding-window attention"):
        causal_lm_from_qwen3(hf_qwen3(layer_types=["full_attention", "sliding_attention"], sliding_window=4))
    with pytest.raises(ValueError, match=r"layer_types: layers \[1\] use sliding-window attention"):
        causal_lm_from_qwen3(hf_qwen3(use_sliding_window=True, sliding_window=4, max_window_layers=1))
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        causal_lm_from_qwen3(hf_qwen3(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                       "original_max_position_embeddings": 32}))
    with pytest.raises(ValueError, match="hidden_act must be 'silu'"):
        causal_lm_from_qwen3(hf_qwen3(hidden_act="gelu"))
    with pytest.raises(ValueError, match="rms_norm_eps must be 1e-06 .* got 1e-05"):
        causal_lm_from_qwen3(hf_qwen3(rms_norm_eps=1e-5))
    hf = hf_qwen3()
    with pytest.raises(ValueError, match="kv_heads comes from the checkpoint's num_key_value_heads"):
        causal_lm_from_qwen3(hf, kv_heads=4)
    with pytest.raises(ValueError, match="output_gate comes from the checkpoint's config"):
        causal_lm_from_qwen3(hf, output_gate="headwise")
    with pytest.raises(ValueError, match="expand_kv must be a bool"):
        causal_lm_from_qwen3(hf, expand_kv="yes")
    hf.config.headwise_attn_output_gate = hf.config.elementwise_attn_output_gate = True
    with pytest.raises(ValueError, match="headwise_attn_output_gate and elementwise_attn_output_gate are both set"):
        causal_lm_from_qwen3(hf)


def test_every_source_tensor_is_taken_once():
    """A source tensor the mapping does not take is an error, and so is a missing one: a Qwen3 read as if it
    had no QK-norm, a state dict with an extra tensor, a Llama read as a Qwen3."""
    from headmix.interop.qwen3 import causal_lm_from_qwen3_state

    hf = hf_qwen3()
    state = dict(hf.state_dict())
    state["model.layers.1.self_attn.sinks"] = torch.zeros(4)
    with pytest.raises(ValueError, match=r"no place in the headmix model: \['model.layers.1.self_attn.sinks'\]"):
        causal_lm_from_qwen3_state(hf.config, state)
    hf.config.use_qk_norm = False
    with pytest.raises(ValueError, match=r"layers.0.self_attn.q_norm.weight: the source has QK-norm, the headmix layer has not"):
        causal_lm_from_qwen3(hf)
    llama = hf_llama(rms_norm_eps=1e-6)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_norm.weight: missing from the source checkpoint"):
        causal_lm_from_qwen3_state(llama.config, llama.state_dict())
