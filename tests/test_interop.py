"""Conversions between headmix and Hugging Face transformers (the peers themselves, weights copied):
dense -> MoH, Llama -> headmix (MHA and MoH), JetMoe attention <-> MoA. Checkpoints are built offline
from small configs and saved locally (``save_pretrained`` to ``tmp_path``)."""

from __future__ import annotations

import pytest
import torch

from headmix.attention import MixtureOfHeadsAttention, MultiHeadAttention
from headmix.interop import (
    attention_from_llama,
    causal_lm_from_jetmoe,
    causal_lm_from_llama,
    causal_lm_to_jetmoe,
    from_pretrained,
    jetmoe_attention_from_moa,
    load_jetmoe,
    load_llama,
    moa_from_jetmoe_attention,
    moh_from_dense,
)
from headmix.models import build_model, greedy_decode

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


@pytest.mark.parametrize("weighting", ["renormalized", "scaled"])
@pytest.mark.parametrize("shared", [0, 1, 2])
def test_moh_from_dense_with_every_head_active_is_the_dense_layer(shared, weighting):
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, rotary=True, q_bias=False).double()  # biases on K, V and output only
    moh = moh_from_dense(mha, num_shared_heads=shared, top_k=4 - shared, head_weighting=weighting)
    assert moh.q_proj.bias is None and moh.k_proj.bias is not None
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


@pytest.mark.parametrize("top_k,options", [(2, {}), (1, {"head_weighting": "scaled"})])
def test_moh_from_dense_with_fewer_heads_drops_exactly_the_unselected_heads(top_k, options):
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4).double()
    moh = moh_from_dense(mha, num_shared_heads=1, top_k=top_k, **options)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    with torch.no_grad():
        out = moh(x, is_causal=True)
    active = torch.zeros(2 * 6, 4, dtype=torch.float64)
    active[:, 0] = 1  # the shared head
    active.scatter_(1, 1 + out.routing.expert_index, 1.0)  # top_k of the three routed heads per token
    expected = (dense_heads(mha, x, is_causal=True) * active.view(2, 6, 4, 1)).sum(2) + mha.out_proj.bias
    torch.testing.assert_close(out.output, expected)


def test_moh_from_dense_errors():
    with pytest.raises(ValueError, match="^MoH: the learned router gets no gradient from the task loss with "
                                         "head_weighting='renormalized' and top_k=1"):
        moh_from_dense(MultiHeadAttention(32, 4), 1, 1)
    with pytest.raises(ValueError, match="key_dim 8 != head_dim 16"):
        moh_from_dense(MultiHeadAttention(32, 2, key_dim=8), 1, 1)
    with pytest.raises(ValueError, match="must be a headmix MultiHeadAttention"):
        moh_from_dense(torch.nn.Linear(2, 2), 1, 1)
    with pytest.raises(ValueError, match=r"with 'paper' a zero router weights each head 1/\(2R\)"):
        moh_from_dense(MultiHeadAttention(32, 4), 1, 3, head_weighting="paper")


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


def assert_same_greedy(ours, hf_model, prompt: torch.Tensor, pad: int = 0, eos: int = 2) -> None:
    """headmix's greedy decoding with its cache == Hugging Face ``generate`` (greedy, padding banned as ours
    bans it): both stop a row at its eos and pad it after (``min_new_tokens`` would ban Hugging Face's eos)."""
    mine = greedy_decode(ours, prompt, max_len=10).tokens
    theirs = hf_model.generate(prompt, max_new_tokens=10, do_sample=False, suppress_tokens=[pad], eos_token_id=eos,
                               pad_token_id=pad)[:, prompt.shape[1]:]
    assert torch.equal(mine, theirs)


def assert_same_logits(ours, hf_model, x: torch.Tensor, tol: float = 1e-4):
    """Equal logits (float32; ``tol`` relative); returns our model's output."""
    with torch.no_grad():
        out = ours(x)
        torch.testing.assert_close(out.logits, hf_model(x).logits, rtol=tol, atol=1e-5)
    return out


@pytest.mark.parametrize("attention,options", [("mha", {}), ("moh", dict(num_shared_heads=1, top_k=3))])
def test_llama_attention_to_mha_and_moh_equal_outputs_and_gradients(attention, options):
    """One LlamaAttention (GQA, 2 K/V heads for 4 query heads, rotary base 500000) as headmix MHA, and as MoH
    with every head active: equal outputs and input gradients, causal mask, positions from 0."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = hf_llama(attention_bias=True)
    hf.config._attn_implementation = "eager"
    attn = hf.model.layers[0].self_attn.double()
    layer = attention_from_llama(attn, attention=attention, **options)
    assert isinstance(layer, MixtureOfHeadsAttention) == (attention == "moh")
    x = torch.randn(2, 7, 64, dtype=torch.float64, requires_grad=True)
    rope = LlamaRotaryEmbedding(hf.config)(x, torch.arange(7)[None])
    mask = torch.zeros(1, 1, 7, 7, dtype=torch.float64).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    theirs = attn(x, position_embeddings=rope, attention_mask=mask)[0]
    ours = layer(x, is_causal=True).output
    tol = dict(rtol=1e-5, atol=1e-6)  # both compute the rotary angles in float32 (not bit-identically)
    torch.testing.assert_close(ours, theirs, **tol)
    r = torch.randn_like(ours)
    torch.testing.assert_close(torch.autograd.grad((ours * r).sum(), x)[0], torch.autograd.grad((theirs * r).sum(), x)[0],
                               **tol)


@pytest.mark.parametrize("kv_heads,tied,bias", [(2, False, False), (4, True, True)])
def test_llama_to_headmix_mha_equal_logits_and_decoding(kv_heads, tied, bias):
    hf = hf_llama(num_key_value_heads=kv_heads, tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias)
    ours = causal_lm_from_llama(hf).eval()
    assert ours.config.decoder_self_attention.rotary_base == 500000.0
    assert (ours.output_proj is None) == tied
    assert_same_logits(ours, hf, tokens(2, 9), tol=1e-5)
    assert_same_greedy(ours, hf, tokens(2, 4, seed=3))


def test_llama_to_moh_with_every_head_active_keeps_the_logits():
    hf = hf_llama()
    ours = causal_lm_from_llama(hf, attention="moh", num_shared_heads=1, top_k=3).eval()
    assert isinstance(ours.decoder.layers[0].self_attn, MixtureOfHeadsAttention)
    out = assert_same_logits(ours, hf, tokens(2, 9), tol=1e-5)
    assert len(out.routing) == 2  # routed, ready for continue-tuning


def test_llama_without_pad_token_masks_no_token_by_value(tmp_path):
    """A Llama config with ``pad_token_id=None`` (Llama 3, Qwen): the converted model has no padding token, so
    token 0, an ordinary token there, is attended to: equal logits with id 0 in the input, equal greedy
    decoding; a given ``pad_id``, the source's own ``pad_token_id`` or its folder's tokenizer's is kept."""
    hf = hf_llama(pad_token_id=None)
    ours = causal_lm_from_llama(hf).eval()
    assert ours.config.pad_id is None
    x = tokens(2, 9)
    x[:, 2] = 0
    x[1, 5] = 0
    assert_same_logits(ours, hf, x, tol=1e-5)
    mine = greedy_decode(ours, x[:, :4], max_len=6).tokens
    theirs = hf.generate(x[:, :4], max_new_tokens=6, do_sample=False, eos_token_id=2, pad_token_id=2)[:, 4:]
    assert torch.equal(mine, theirs)
    assert causal_lm_from_llama(hf, pad_id=7).config.pad_id == 7
    assert causal_lm_from_llama(hf_llama(pad_token_id=5)).config.pad_id == 5
    hf.save_pretrained(tmp_path)
    assert load_llama(tmp_path).config.pad_id is None
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"w{i}": i for i in range(V)}  # the folder's tokenizer names a padding token: it is taken
    transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="w3")),
                                         pad_token="w9").save_pretrained(tmp_path)
    assert load_llama(tmp_path).config.pad_id == 9
    with pytest.raises(ValueError, match="pad_id must be a token id for task 'translation'"):
        ours.config.replace(task="translation", encoder_layers=1)


def test_causal_lm_labels_follow_transformers_convention():
    """``CausalLanguageModel(input_ids, labels=input_ids)`` shifts as ``LlamaForCausalLM`` does: the same loss
    (``-100`` ignored) on the same weights; ``loss = lm_loss + aux_loss`` (MoH routers add one); labels
    shifted already (the old convention) are refused in one line, ``targets`` are aligned with the logits."""
    hf = hf_llama(pad_token_id=None)
    x = tokens(2, 9)
    labels = x.clone()
    labels[1, 6:] = -100
    for ours in (causal_lm_from_llama(hf).eval(),
                 causal_lm_from_llama(hf, attention="moh", num_shared_heads=1, top_k=3, load_balance_weight=0.1)):
        out = ours(x, labels=labels)
        with torch.no_grad():
            torch.testing.assert_close(out.lm_loss, hf(x, labels=labels).loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.loss, out.lm_loss + out.aux_loss)
        assert torch.equal(out.loss, out.total_loss) and out.num_tokens == 8 + 5
        torch.testing.assert_close(ours(x[:, :-1], targets=x[:, 1:]).lm_loss, ours(x, labels=x).lm_loss)
    assert float(out.aux_loss.detach()) > 0
    with pytest.raises(ValueError, match=r"^labels are input_ids shifted by one: labels are now the inputs themselves"):
        ours(x[:, :-1], labels=x[:, 1:])
    with pytest.raises(ValueError, match=r"labels must have the shape of input_ids \(2, 9\)"):
        ours(x, labels=x[:, 1:])


def test_llama_conversion_errors():
    with pytest.raises(ValueError, match="rope_type 'llama3'"):
        causal_lm_from_llama(hf_llama(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 64}))
    with pytest.raises(ValueError, match="attention='moh' needs num_shared_heads, a non-negative integer, got None"):
        causal_lm_from_llama(hf_llama(), attention="moh")
    with pytest.raises(ValueError, match="attention must be one of"):
        causal_lm_from_llama(hf_llama(), attention="moa")


# --------------------------------------------------------------------------------------------------
# Hugging Face JetMoe <-> headmix MoA (kv_heads) and the whole causal LM
# --------------------------------------------------------------------------------------------------
def jetmoe_config(**kw):
    base = dict(vocab_size=V, hidden_size=48, num_hidden_layers=2, num_key_value_heads=2, kv_channels=12,
                intermediate_size=40, max_position_embeddings=128, num_local_experts=4, num_experts_per_tok=2,
                tie_word_embeddings=True, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    base.update(kw)
    return transformers.JetMoeConfig(**base)


def spread(module, std: float = 0.2) -> None:
    """JetMoe's init (std 0.01, zero biases) makes near-uniform routers: spread the weights."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" not in name:
                p.normal_(0, std)


def hf_jetmoe_attention(dtype=torch.float64):
    from transformers.models.jetmoe.modeling_jetmoe import JetMoeAttention, JetMoeRotaryEmbedding

    cfg = jetmoe_config()
    cfg._attn_implementation = "eager"
    attn = JetMoeAttention(cfg, layer_idx=0).to(dtype).eval()
    spread(attn)
    rope = JetMoeRotaryEmbedding(cfg)

    def run(x, mask=None):
        pos = torch.arange(x.shape[1])[None]
        return attn(x, attention_mask=mask, position_embeddings=rope(x, pos))[0]

    return attn, run


def causal_float_mask(t: int, pad: torch.Tensor | None = None, dtype=torch.float64) -> torch.Tensor:
    forbidden = torch.ones(t, t, dtype=torch.bool).triu(1)[None, None]
    if pad is not None:
        forbidden = forbidden | pad[:, None, None, :]
    return torch.zeros(forbidden.shape, dtype=dtype).masked_fill(forbidden, torch.finfo(dtype).min)


def test_jetmoe_attention_to_moa_equal_outputs_and_gradients():
    attn, run = hf_jetmoe_attention()
    moa = moa_from_jetmoe_attention(attn)
    assert moa.kv_heads == 2 and moa.top_k == 2 and moa.k_proj.bias is None and moa.out_bias is not None
    x = torch.randn(2, 7, 48, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True  # right padding: every query keeps a real key to see
    ours = moa(x, is_causal=True, key_padding_mask=pad).output
    theirs = run(x, causal_float_mask(7, pad))
    tol = dict(rtol=1e-5, atol=1e-6)  # JetMoe's router softmax runs in float32
    torch.testing.assert_close(ours, theirs, **tol)
    r = torch.randn_like(ours)
    mine = dict(moa.named_parameters())
    names = ["query_experts", "output_experts", "router.gate.weight", "k_proj.weight", "v_proj.weight", "out_bias"]
    g_ours = torch.autograd.grad((ours * r).sum(), [x] + [mine[n] for n in names])
    g_theirs = torch.autograd.grad((theirs * r).sum(), [x, attn.experts.input_linear.weight,
                                                        attn.experts.output_linear.weight,
                                                        attn.experts.router.layer.weight, attn.kv_proj.weight,
                                                        attn.experts.bias])
    kv = 2 * 12
    expected = [g_theirs[0], g_theirs[1].transpose(1, 2), g_theirs[2].transpose(1, 2), g_theirs[3],
                g_theirs[4][:kv], g_theirs[4][kv:], g_theirs[5]]
    for name, a, b in zip(["x"] + names, g_ours, expected):
        torch.testing.assert_close(a, b, **tol, msg=name)


def test_moa_to_jetmoe_attention_and_back():
    from headmix.attention import MixtureOfAttentionHeads
    from transformers.models.jetmoe.modeling_jetmoe import JetMoeRotaryEmbedding

    torch.manual_seed(1)
    moa = MixtureOfAttentionHeads(48, 4, 2, 12, kv_heads=2, renormalize="live", kv_bias=False, out_bias=True,
                                  rotary=True).double()
    spread(moa)
    attn = jetmoe_attention_from_moa(moa).double().eval()
    attn.config._attn_implementation = "eager"
    rope = JetMoeRotaryEmbedding(attn.config)
    x = torch.randn(2, 6, 48, dtype=torch.float64)
    theirs = attn(x, attention_mask=causal_float_mask(6), position_embeddings=rope(x, torch.arange(6)[None]))[0]
    torch.testing.assert_close(moa(x, is_causal=True).output, theirs, rtol=1e-5, atol=1e-6)
    back = moa_from_jetmoe_attention(attn)
    for name, p in moa.named_parameters():
        assert torch.equal(dict(back.named_parameters())[name], p), name
    with pytest.raises(ValueError, match="renormalize='live'"):
        jetmoe_attention_from_moa(MixtureOfAttentionHeads(48, 4, 2, 12, kv_heads=2, rotary=True))
    with pytest.raises(ValueError, match="kv_bias=False"):
        jetmoe_attention_from_moa(MixtureOfAttentionHeads(48, 4, 2, 12, renormalize="live", rotary=True))
    with pytest.raises(ValueError, match="rotary=True"):
        jetmoe_attention_from_moa(MixtureOfAttentionHeads(48, 4, 2, 12, renormalize="live", kv_bias=False))


def hf_jetmoe_model(**kw):
    model = transformers.JetMoeForCausalLM(jetmoe_config(**kw)).eval()
    spread(model, 0.15)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_jetmoe_model_to_headmix_and_back_equal_logits_and_decoding(tied):
    hf = hf_jetmoe_model(tie_word_embeddings=tied)
    ours = causal_lm_from_jetmoe(hf).eval()
    cfg = ours.config
    assert cfg.ffn == "moe_swiglu" and cfg.decoder_self_attention.kv_heads == 2 and cfg.share_embeddings == tied
    out = assert_same_logits(ours, hf, tokens(2, 9))
    assert [n for n, _ in out.routing] == ["decoder.layers.0.self_attn", "decoder.layers.0.ffn",
                                           "decoder.layers.1.self_attn", "decoder.layers.1.ffn"]
    assert_same_greedy(ours, hf, tokens(2, 4, seed=3))
    # and back: a JetMoeForCausalLM with the same logits, parameter for parameter the original
    back = causal_lm_to_jetmoe(ours)
    theirs_params = dict(hf.named_parameters())
    for name, p in back.named_parameters():
        assert torch.equal(p, theirs_params[name]), name


def test_jetmoe_conversion_errors():
    with pytest.raises(ValueError, match="activation_function must be 'silu'"):
        causal_lm_from_jetmoe(hf_jetmoe_model(activation_function="gelu"))
    ours = causal_lm_from_jetmoe(hf_jetmoe_model())
    with pytest.raises(ValueError, match="norm_eps=1e-06"):
        causal_lm_to_jetmoe(build_model(ours.config.replace(norm_eps=1e-5)))
    with pytest.raises(ValueError, match="must be a transformers JetMoeAttention"):
        moa_from_jetmoe_attention(torch.nn.Linear(2, 2))


def test_the_jetmoe_preset_converts_to_hf_jetmoe():
    from headmix.models import get_config

    torch.manual_seed(0)
    ours = build_model(get_config("llama-tiny-jetmoe", vocab_size=V)).eval()
    spread(ours, 0.1)
    hf = causal_lm_to_jetmoe(ours)
    hf.config._attn_implementation = "eager"
    assert_same_logits(ours, hf, tokens(2, 8))


def test_moa_kv_heads_cache_equals_hf_gqa_cache_of_the_same_query_heads():
    """MoA with kv_heads=G and k G query heads per token caches what grouped-query attention with G K/V heads
    caches (Hugging Face Llama's DynamicCache), bytes per token."""
    from headmix.models import AttentionConfig, cache_bytes_per_token
    from headmix.models.presets import llama_model

    ids = tokens(2, 6)
    for g in (1, 2, 4):
        hf = transformers.LlamaModel(transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=16,
                                                              num_hidden_layers=1, num_attention_heads=8,
                                                              num_key_value_heads=g, head_dim=8)).eval()
        with torch.no_grad():
            cache = hf(ids, use_cache=True).past_key_values
        hf_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        att = AttentionConfig(kind="moa", top_k=8 // g, num_experts=16 // g, head_dim=8, kv_heads=g)
        ours = cache_bytes_per_token(build_model(llama_model(att, V, d_model=32, layers=1, max_positions=16)), ids)
        assert ours == hf_bytes / ids.numel() == 2 * g * 8 * 4


@pytest.mark.parametrize("make,load", [(lambda: hf_llama(), load_llama), (lambda: hf_jetmoe_model(), load_jetmoe)],
                         ids=["llama", "jetmoe"])
def test_load_from_a_local_folder(tmp_path, make, load):
    """The from_pretrained path (a Hub name needs the network) on a checkpoint saved locally."""
    hf = make()
    hf.save_pretrained(tmp_path)
    assert_same_logits(load(tmp_path).eval(), hf, tokens(1, 6))
    assert_same_logits(from_pretrained(tmp_path).eval(), hf, tokens(1, 6))  # dispatched by model_type


def test_from_pretrained_refuses_other_model_types(tmp_path):
    transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="is a 'gpt2' checkpoint; headmix converts \\['jetmoe', 'llama', 'qwen3'\\]"):
        from_pretrained(tmp_path)
