"""Conversions between headmix and Hugging Face transformers (the peers themselves, weights copied):
dense -> MoH, Llama -> headmix (MHA and MoH), JetMoe attention <-> MoA. Checkpoints are built offline
from small configs and saved locally (``save_pretrained`` to ``tmp_path``)."""

from __future__ import annotations

import pytest
import torch

from headmix.attention import MixtureOfHeadsAttention, MultiHeadAttention
from headmix.interop import causal_lm_from_llama, load_llama, moh_from_dense
from headmix.models import greedy_decode

transformers = pytest.importorskip("transformers")

V = 61


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (batch, length), generator=g)


# --------------------------------------------------------------------------------------------------
# Dense -> MoH
# --------------------------------------------------------------------------------------------------
def dense_heads(mha: MultiHeadAttention, x: torch.Tensor, **kw) -> torch.Tensor:
    """Each head's contribution ``H^i W_O^i`` ``(batch, time, heads, d)`` (MHA's summation form), computed
    with the layer itself by giving it an output projection that keeps one head at a time."""
    contributions = []
    saved = mha.out_proj.weight.detach().clone(), None if mha.out_proj.bias is None else mha.out_proj.bias.detach().clone()
    hd = mha.head_dim
    with torch.no_grad():
        if mha.out_proj.bias is not None:
            mha.out_proj.bias.zero_()
        for i in range(mha.num_heads):
            mha.out_proj.weight.copy_(saved[0])
            mha.out_proj.weight[:, :i * hd] = 0
            mha.out_proj.weight[:, (i + 1) * hd:] = 0
            contributions.append(mha(x, **kw).output)
        mha.out_proj.weight.copy_(saved[0])
        if saved[1] is not None:
            mha.out_proj.bias.copy_(saved[1])
    return torch.stack(contributions, dim=2)


@pytest.mark.parametrize("shared", [0, 1, 2])
def test_moh_from_dense_with_every_head_active_is_the_dense_layer(shared):
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4).double()
    moh = moh_from_dense(mha, num_shared_heads=shared, top_k=4 - shared)
    assert isinstance(moh, MixtureOfHeadsAttention) and moh.q_proj.weight.dtype == torch.float64
    x = torch.randn(2, 7, 32, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    for kw in (dict(), dict(is_causal=True), dict(key_padding_mask=pad, query_padding_mask=pad)):
        a, b = mha(x, **kw).output, moh(x, **kw).output
        torch.testing.assert_close(b, a)
        ga, = torch.autograd.grad(a.square().sum(), x)
        gb, = torch.autograd.grad(b.square().sum(), x)
        torch.testing.assert_close(gb, ga)  # zero routers: no input gradient through them either


def test_moh_from_dense_with_fewer_heads_drops_exactly_the_unselected_heads():
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4).double()
    moh = moh_from_dense(mha, num_shared_heads=1, top_k=1)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    with torch.no_grad():
        out = moh(x, is_causal=True)
    active = torch.zeros(2 * 6, 4, dtype=torch.float64)
    active[:, 0] = 1  # the shared head
    active.scatter_(1, 1 + out.routing.expert_index, 1.0)  # one routed head per token
    expected = (dense_heads(mha, x, is_causal=True) * active.view(2, 6, 4, 1)).sum(2) + mha.out_proj.bias
    torch.testing.assert_close(out.output, expected)


def test_moh_from_dense_errors():
    with pytest.raises(ValueError, match="key_dim 8 != head_dim 16"):
        moh_from_dense(MultiHeadAttention(32, 2, key_dim=8), 1, 1)
    with pytest.raises(ValueError, match="must be a headmix MultiHeadAttention"):
        moh_from_dense(torch.nn.Linear(2, 2), 1, 1)


# --------------------------------------------------------------------------------------------------
# Hugging Face Llama -> headmix
# --------------------------------------------------------------------------------------------------
def hf_llama(**kw):
    base = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                attention_bias=False, mlp_bias=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    base.update(kw)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**base)).eval()
    with torch.no_grad():  # the default init (std 0.02) makes near-uniform logits: spread them
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    return model


def hf_greedy(hf_model, prompt: torch.Tensor, n: int, pad: int) -> torch.Tensor:
    out = hf_model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, suppress_tokens=[pad],
                            pad_token_id=pad)
    return out[:, prompt.shape[1]:]


@pytest.mark.parametrize("kv_heads,tied,bias", [(2, False, False), (4, True, True)])
def test_llama_to_headmix_mha_equal_logits_and_decoding(kv_heads, tied, bias):
    hf = hf_llama(num_key_value_heads=kv_heads, tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias)
    ours = causal_lm_from_llama(hf).eval()
    assert ours.config.decoder_self_attention.rotary_base == 500000.0
    assert (ours.output_proj is None) == tied
    x = tokens(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x).logits, rtol=1e-5, atol=1e-5)
    prompt = tokens(2, 4, seed=3)
    # equal up to and including the first eos (after it ours pads, Hugging Face's keeps generating)
    mine = greedy_decode(ours, prompt, max_len=10).tokens
    theirs = hf_greedy(hf, prompt, mine.shape[1], pad=0)
    stop = mine.eq(2).cumsum(1).gt(0).roll(1, 1)
    stop[:, 0] = False
    assert torch.equal(mine.masked_fill(stop, 0), theirs.masked_fill(stop, 0))


def test_llama_to_moh_with_every_head_active_keeps_the_logits():
    hf = hf_llama()
    ours = causal_lm_from_llama(hf, attention="moh", num_shared_heads=1, top_k=3).eval()
    assert isinstance(ours.decoder.layers[0].self_attn, MixtureOfHeadsAttention)
    x = tokens(2, 9)
    with torch.no_grad():
        out = ours(x)
        torch.testing.assert_close(out.logits, hf(x).logits, rtol=1e-5, atol=1e-5)
    assert len(out.routing) == 2  # routed, ready for continue-tuning


def test_load_llama_from_a_local_folder(tmp_path):
    hf = hf_llama()
    hf.save_pretrained(tmp_path)
    ours = load_llama(tmp_path).eval()
    x = tokens(1, 6)
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x).logits, rtol=1e-5, atol=1e-5)


def test_llama_conversion_errors():
    with pytest.raises(ValueError, match="rope_type 'llama3'"):
        causal_lm_from_llama(hf_llama(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 64}))
    with pytest.raises(ValueError, match="attention='moh' needs num_shared_heads and top_k"):
        causal_lm_from_llama(hf_llama(), attention="moh")
    with pytest.raises(ValueError, match="attention must be one of"):
        causal_lm_from_llama(hf_llama(), attention="moa")
