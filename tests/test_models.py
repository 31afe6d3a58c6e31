"""headmix.models: configs, presets, the three Transformers, save/load and decoding."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from headmix.models import (
    AttentionConfig,
    CausalLanguageModel,
    EncoderDecoderModel,
    MaskedLanguageModel,
    ModelConfig,
    beam_search,
    build_model,
    count_parameters,
    get_config,
    greedy_decode,
    load_pretrained,
)
from headmix.models.presets import PAPER_MLM, PAPER_TRANSLATION

KINDS = ["tiny-mha", "tiny-moa", "tiny-moh", "tiny-talking-heads"]
V = 61  # small vocabulary: fast, and every test token id is valid
PAD, BOS, EOS = 0, 1, 2


def tiny(name: str = "tiny-moa", task: str = "translation", **changes) -> ModelConfig:
    cfg = get_config(name, task=task, vocab_size=V)
    return cfg.replace(**changes) if changes else cfg


def model_for(cfg: ModelConfig, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(cfg).eval()


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (batch, length), generator=g)


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,task", [(n, "translation") for n in PAPER_TRANSLATION] + [(n, "mlm") for n in PAPER_MLM]
                         + [(n, t) for n in KINDS + ["mini-mha", "mini-moa", "small-mha", "small-moa"] for t in ("translation", "mlm", "lm")])
def test_config_json_round_trip(name, task, tmp_path):
    cfg = get_config(name, task=task)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    path = tmp_path / "cfg.json"
    cfg.save_json(path)
    assert ModelConfig.load_json(path) == cfg
    assert get_config(str(path)) == cfg
    assert [p.name for p in tmp_path.iterdir()] == ["cfg.json"]  # no temp files left behind


def test_a_causal_lm_config_stores_its_sequence_start_and_one_stored_before_reads_eos_first(tmp_path):
    """A causal LM's ``sequence_start`` is stored resolved (unset: ``"bos"``); a stored config without it (every run
    before the option) reads as ``"eos"``, the stream it was trained on, while a dict written by hand takes the
    default; another task has none; a wrong value is refused naming the field."""
    from headmix.models.config import sequence_prefix

    cfg = get_config("tiny-mha", task="lm")
    assert cfg.sequence_start == "bos" and cfg.to_dict()["sequence_start"] == "bos"
    assert sequence_prefix(cfg) == [cfg.bos_id]
    stored = {k: v for k, v in cfg.to_dict().items() if k != "sequence_start"}
    old = ModelConfig.from_dict(stored)
    assert old.sequence_start == "eos" and sequence_prefix(old) == [old.eos_id]
    (tmp_path / "config.json").write_text(json.dumps(stored))
    assert ModelConfig.load_json(tmp_path / "config.json").sequence_start == "eos"
    hand = {k: stored[k] for k in ("task", "vocab_size", "d_model", "ffn_dim", "encoder_layers", "decoder_layers")}
    assert ModelConfig.from_dict(hand).sequence_start == "bos"
    assert sequence_prefix(cfg.replace(sequence_start="none")) == []
    assert get_config("tiny-mha", task="translation").sequence_start is None
    with pytest.raises(ValueError, match="^sequence_start must be one of"):
        cfg.replace(sequence_start="BOS")
    with pytest.raises(ValueError, match="^sequence_start applies to task 'lm' only"):
        get_config("tiny-mha", task="mlm").replace(sequence_start="bos")


@pytest.mark.parametrize("changes,field", [
    (dict(d_model=0), "d_model"),
    (dict(vocab_size=-3), "vocab_size"),
    (dict(norm="middle"), "norm"),
    (dict(positions="alibi"), "positions"),
    (dict(activation="tanh"), "activation"),
    (dict(dropout=1.0), "dropout"),
    (dict(label_smoothing=-0.1), "label_smoothing"),
    (dict(pad_id=V), "pad_id"),
    (dict(decoder_layers=0), "decoder_layers"),
    (dict(task="mlm"), "decoder_layers"),
    (dict(encoder_self_attention=AttentionConfig(kind="mha", num_heads=5)), "encoder_self_attention.num_heads"),
    (dict(cross_attention=dict(kind="moa", num_experts=4, top_k=2)), "cross_attention.head_dim"),
])
def test_config_errors_name_the_field(changes, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        tiny().replace(**changes)


def test_attention_config_errors():
    with pytest.raises(ValueError, match=r"top_k K=9 exceeds num_experts E=8"):
        AttentionConfig(kind="moa", top_k=9, num_experts=8, head_dim=16)
    with pytest.raises(ValueError, match="num_experts applies to kind 'moa' / 'switchhead' / 'gqe' only"):
        AttentionConfig(kind="mha", num_heads=4, num_experts=8)
    with pytest.raises(ValueError, match="kind"):
        AttentionConfig(kind="linear", num_heads=4)
    with pytest.raises(ValueError, match="top_k K=4 exceeds the 3 routed heads"):
        AttentionConfig(kind="moh", num_heads=4, num_shared_heads=1, top_k=4)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['heads'\]"):
        ModelConfig.from_dict({**tiny().to_dict(), "heads": 3})
    with pytest.raises(ValueError, match="cross_attention must be None for task 'lm'"):
        ModelConfig(task="lm", encoder_layers=0, decoder_layers=2, cross_attention=AttentionConfig(num_heads=8))


# --------------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------------
def test_paper_presets_have_the_paper_sizes():
    base, big = get_config("transformer-base"), get_config("transformer-big")
    assert (base.d_model, base.ffn_dim, base.encoder_self_attention.num_heads, base.encoder_layers, base.decoder_layers) == (512, 2048, 8, 6, 6)
    assert (big.d_model, big.ffn_dim, big.encoder_self_attention.num_heads, big.dropout) == (1024, 4096, 16, 0.3)
    assert base.vocab_size == big.vocab_size == 32000 and base.share_embeddings
    for name, kek in (("moa-base", (8, 8, 128)), ("moa-big", (16, 32, 256)), ("4K32E256D", (4, 32, 256))):
        cfg = get_config(name)
        assert cfg.d_model == 512 and cfg.ffn_dim == 2048 and (cfg.encoder_layers, cfg.decoder_layers) == (6, 6)
        for role in ("encoder_self_attention", "decoder_self_attention", "cross_attention"):
            att = getattr(cfg, role)
            assert (att.kind, att.top_k, att.num_experts, att.head_dim) == ("moa", *kek)
    rob = get_config("roberta-medium")
    assert (rob.task, rob.vocab_size, rob.d_model, rob.ffn_dim, rob.encoder_layers, rob.decoder_layers) == ("mlm", 50265, 512, 2048, 8, 0)
    assert rob.encoder_self_attention.num_heads == 8
    moa_mlm = get_config("8K16E128D", task="mlm")
    assert moa_mlm.replace(encoder_self_attention=rob.encoder_self_attention) == rob
    assert get_config("tiny-moa", task="lm", vocab_size=123).vocab_size == 123


@pytest.mark.parametrize("bad", ["8K8E", "8k8e128d", "K8E128D", "8K8E128DD", "transformer-huge", ""])
def test_unknown_or_malformed_preset_lists_valid_forms(bad):
    with pytest.raises(ValueError) as err:
        get_config(bad)
    msg = str(err.value)
    assert "{K}K{E}E{D}D" in msg and "transformer-base" in msg and "tiny-moa" in msg


def test_moa_string_errors():
    with pytest.raises(ValueError, match=r"top_k K=16 exceeds num_experts E=8 in '16K8E64D'"):
        get_config("16K8E64D")
    with pytest.raises(ValueError, match=r"K=0 must be positive"):
        get_config("0K8E64D")
    with pytest.raises(ValueError, match="is for task translation"):
        get_config("transformer-base", task="mlm")
    with pytest.raises(ValueError, match="task"):
        get_config("8K8E64D", task="lm")
    with pytest.raises(ValueError, match="not found"):
        get_config("/nonexistent/model.json")


# --------------------------------------------------------------------------------------------------
# Forward passes
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", KINDS)
def test_shapes_losses_and_routing(name):
    routed = name in ("tiny-moa", "tiny-moh")
    model = model_for(tiny(name)).train()
    src, tgt = tokens(3, 7), tokens(3, 5, seed=2)
    out = model(src, tgt, tgt)
    assert out.logits.shape == (3, 5, V) and out.num_tokens == 15
    assert torch.allclose(out.total_loss, out.loss + out.aux_loss)
    assert [n for n, _ in out.routing] == ([] if not routed else [
        "encoder.layers.0.self_attn", "encoder.layers.1.self_attn", "decoder.layers.0.self_attn",
        "decoder.layers.0.cross_attn", "decoder.layers.1.self_attn", "decoder.layers.1.cross_attn"])
    assert (out.aux_loss > 0) == routed
    out.total_loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)

    mlm = model_for(tiny(name, "mlm"))
    ids = tokens(2, 9)
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    out = mlm(ids, labels)
    assert out.logits.shape == (2, 9, V) and out.num_tokens == 2 and len(out.routing) == (2 if routed else 0)
    lm = model_for(tiny(name, "lm"))
    out = lm(ids, labels=ids)
    assert out.logits.shape == (2, 9, V) and out.num_tokens == 16
    assert torch.equal(out.loss, out.total_loss) and torch.allclose(out.total_loss, out.lm_loss + out.aux_loss)


def test_loss_is_label_smoothed_cross_entropy_over_target_tokens():
    model = model_for(tiny("tiny-mha"))
    src, tgt_in = tokens(2, 6), tokens(2, 5, seed=3)
    tgt_out = tgt_in.clone()
    tgt_out[0, 3:] = PAD
    out = model(src, tgt_in, tgt_out)
    keep = tgt_out.ne(PAD)
    logp = out.logits.float().log_softmax(-1)[keep]
    target = tgt_out[keep]
    nll = -logp.gather(1, target[:, None]).squeeze(1)
    expected = (0.9 * nll - 0.1 * logp.mean(-1)).mean()
    assert out.num_tokens == keep.sum()
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(out.nll_loss, nll.mean())


@pytest.mark.parametrize("name", KINDS)
def test_padding_does_not_change_the_loss(name):
    """A padded batch's loss is the token-weighted mean of the unpadded sentences' losses, and tokens
    at ignored positions do not matter."""
    model = model_for(tiny(name, label_smoothing=0.0))
    src, tgt = tokens(2, 7), tokens(2, 6, seed=4)
    src[0, 4:] = PAD
    tgt_in, tgt_out = tgt.clone(), tgt.clone()
    tgt_in[0, 3:] = PAD
    tgt_out[0, 3:] = PAD
    padded = model(src, tgt_in, tgt_out)
    single0 = model(src[:1, :4], tgt_in[:1, :3], tgt_out[:1, :3])
    single1 = model(src[1:], tgt_in[1:], tgt_out[1:])
    expected = (single0.loss * 3 + single1.loss * 6) / 9
    torch.testing.assert_close(padded.loss, expected, rtol=1e-5, atol=1e-5)
    # tokens at positions whose target is ignored: the decoder is causal, so nothing else changes
    tgt_in2 = tgt_in.clone()
    tgt_in2[0, 3:] = torch.tensor([5, 6, 7])
    torch.testing.assert_close(model(src, tgt_in2, tgt_out).loss, padded.loss)

    lm = model_for(tiny(name, "lm", label_smoothing=0.0))
    ids, labels = tokens(2, 8, seed=5), tokens(2, 8, seed=6)
    labels[1, 5:] = -100
    base = lm(ids, labels).lm_loss
    ids2 = ids.clone()
    ids2[1, 5:] = 7
    torch.testing.assert_close(lm(ids2, labels).lm_loss, base)


@pytest.mark.parametrize("name", KINDS)
def test_causal_lm_cannot_see_the_future(name):
    model = model_for(tiny(name, "lm"))
    ids = tokens(2, 10)
    changed = ids.clone()
    changed[:, 6] = (changed[:, 6] + 1 - 3) % (V - 3) + 3
    a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


@pytest.mark.parametrize("name", KINDS)
def test_translation_decoder_is_causal_and_encoder_is_not(name):
    model = model_for(tiny(name))
    src, tgt = tokens(2, 8), tokens(2, 7, seed=2)
    base = model(src, tgt).logits
    tgt2 = tgt.clone()
    tgt2[:, 4] = (tgt2[:, 4] + 1 - 3) % (V - 3) + 3
    later = model(src, tgt2).logits
    torch.testing.assert_close(base[:, :4], later[:, :4])
    assert not torch.allclose(base[:, 4:], later[:, 4:])
    src2 = src.clone()
    src2[:, -1] = (src2[:, -1] + 1 - 3) % (V - 3) + 3
    assert not torch.allclose(model(src2, tgt).logits[:, 0], base[:, 0])  # every target position sees all of src
    # the masked LM's encoder is bidirectional too
    mlm = model_for(tiny(name, "mlm"))
    a = mlm(src).logits
    assert not torch.allclose(mlm(src2).logits[:, 0], a[:, 0])


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
@pytest.mark.parametrize("task", ["translation", "mlm", "lm"])
def test_norms_and_positions(norm, positions, task):
    cfg = tiny("tiny-moa", task, norm=norm, positions=positions, activation="gelu", embedding_norm=task == "mlm")
    model = model_for(cfg).train()
    ids = tokens(2, 6)
    out = model(ids, ids, ids) if task == "translation" else model(ids, ids)
    out.total_loss.backward()
    assert torch.isfinite(out.total_loss)
    assert count_parameters(model) == sum(p.numel() for p in model.parameters())
    has_final_norm = [m.final_norm is not None for m in (getattr(model, "encoder", None), getattr(model, "decoder", None)) if m]
    assert all(f == (norm == "pre") for f in has_final_norm)
    with pytest.raises(ValueError, match="max_positions"):
        too_long = torch.full((1, cfg.max_positions + 1), 5)
        model(too_long, too_long, too_long) if task == "translation" else model(too_long)


def test_position_and_embedding_details():
    cfg = tiny("tiny-mha", positions="sinusoidal")
    model = model_for(cfg)
    emb = model.encoder.embed
    assert emb.scale == math.sqrt(cfg.d_model)
    ids = tokens(1, 5)
    expected = model.encoder.embed.tokens(ids) * math.sqrt(cfg.d_model) + emb.sinusoids[:5]
    torch.testing.assert_close(emb(ids), expected)  # eval mode: no dropout
    # shifting a token by one position changes its embedding (positions are added)
    assert not torch.allclose(emb(ids[:, 1:2]), emb(ids)[:, 1:2])
    assert "encoder.embed.sinusoids" not in model.state_dict()  # computed, not saved


def test_embeddings_are_tied():
    model = model_for(tiny())
    assert model.encoder.embed.tokens.weight is model.decoder.embed.tokens.weight
    assert model._output_weight() is model.encoder.embed.tokens.weight
    untied = model_for(tiny(share_embeddings=False))
    assert count_parameters(untied) - count_parameters(model) == 2 * V * 64


# --------------------------------------------------------------------------------------------------
# Save / load
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,task,share", [("tiny-moa", "translation", True), ("tiny-moh", "translation", False),
                                             ("tiny-talking-heads", "mlm", True), ("tiny-moa", "lm", True)])
def test_save_load_round_trip(name, task, share, tmp_path):
    from safetensors import safe_open

    cfg = tiny(name, task, share_embeddings=share, positions="learned")
    model = model_for(cfg, seed=3)
    model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        stored = set(f.keys())
    tied = set(model.state_dict()) - stored
    assert tied == ({"decoder.embed.tokens.weight"} if task == "translation" and share else set())
    loaded = load_pretrained(tmp_path)
    assert type(loaded) is type(model) and loaded.config == cfg
    cls = {"translation": EncoderDecoderModel, "mlm": MaskedLanguageModel, "lm": CausalLanguageModel}[task]
    assert type(cls.from_pretrained(tmp_path)) is cls
    if task == "translation" and share:
        assert loaded.encoder.embed.tokens.weight is loaded.decoder.embed.tokens.weight
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    ids = tokens(2, 6)
    args = (ids, ids) if task == "translation" else (ids,)
    assert torch.equal(model(*args).logits, loaded.eval()(*args).logits)
    other = EncoderDecoderModel if task != "translation" else CausalLanguageModel
    with pytest.raises(ValueError, match="not a"):
        other.from_pretrained(tmp_path)


# --------------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------------
def _eos_prone(model, boost: float):
    """Raise the eos logit by ``3 h_0 + boost`` (a function of the hidden state only, so cached and
    uncached decoding see the same logits) so that some hypotheses finish early and some do not."""
    project = model.compute_logits

    def compute_logits(hidden):
        return project(hidden) + F.one_hot(torch.tensor(EOS), V) * (3.0 * hidden[..., :1] + boost)

    model.compute_logits = compute_logits
    return model


@pytest.mark.parametrize("name", KINDS)
def test_cached_and_uncached_decoding_agree(name):
    model = _eos_prone(model_for(tiny(name).replace(dropout=0.3), seed=7), boost=2.0)
    model.train()  # generation must switch to eval itself (dropout off) and restore the mode
    src = tokens(3, 6, seed=8)
    src[1, 4:] = PAD
    cached = greedy_decode(model, src, max_len=9)
    assert model.training
    uncached = greedy_decode(model, src, max_len=9, use_cache=False)
    assert torch.equal(cached.tokens, uncached.tokens)
    torch.testing.assert_close(cached.scores, uncached.scores)
    beam = beam_search(model, src, beam_size=3, max_len=9)
    beam_uncached = beam_search(model, src, beam_size=3, max_len=9, use_cache=False)
    assert torch.equal(beam.tokens, beam_uncached.tokens)
    torch.testing.assert_close(beam.scores, beam_uncached.scores)
    one = beam_search(model, src, beam_size=1, max_len=9)
    assert torch.equal(one.tokens, cached.tokens)  # greedy == beam size 1
    assert bool(cached.tokens.eq(EOS).any() | beam.tokens.eq(EOS).any())  # finishing early was exercised

    lm = _eos_prone(model_for(tiny(name, "lm"), seed=9), boost=3.0)
    prompt = tokens(2, 4, seed=10)
    a = greedy_decode(lm, prompt, max_len=6)
    b = greedy_decode(lm, prompt, max_len=6, use_cache=False)
    assert torch.equal(a.tokens, b.tokens) and a.tokens.shape[0] == 2
    assert torch.equal(beam_search(lm, prompt, 1, 6).tokens, a.tokens)
    assert torch.equal(beam_search(lm, prompt, 2, 6).tokens, beam_search(lm, prompt, 2, 6, use_cache=False).tokens)


@pytest.mark.parametrize("task", ["translation", "lm"])
def test_cached_decoding_post_norm_learned_positions(task):
    cfg = tiny("tiny-moa", task, norm="post", positions="learned")
    model = _eos_prone(model_for(cfg, seed=5), boost=2.0)
    src = tokens(3, 5, seed=6)
    for search in (lambda **kw: greedy_decode(model, src, 7, **kw), lambda **kw: beam_search(model, src, 2, 7, **kw)):
        assert torch.equal(search().tokens, search(use_cache=False).tokens)


def test_greedy_matches_step_by_step_argmax():
    model = model_for(tiny("tiny-moa"), seed=11)
    src = tokens(2, 5)
    out = greedy_decode(model, src, max_len=4)
    prefix = torch.full((2, 1), BOS)
    for step in range(out.tokens.shape[1]):
        nxt = model(src, prefix).logits[:, -1].argmax(-1)
        alive = prefix[:, 1:].ne(EOS).all(1) if step else torch.ones(2, dtype=torch.bool)
        assert torch.equal(out.tokens[alive, step], nxt[alive])
        prefix = torch.cat([prefix, out.tokens[:, step:step + 1]], 1)


def test_beam_search_scores_and_length_penalty():
    model = _eos_prone(model_for(tiny("tiny-mha"), seed=12), boost=1.0)
    src = tokens(4, 6, seed=13)
    for alpha in (0.0, 1.0):
        res = beam_search(model, src, beam_size=4, max_len=8, length_penalty=alpha)
        for b in range(4):
            seq = res.tokens[b]
            n = int(seq.ne(PAD).sum())
            seq = seq[:n]
            # rescore the returned hypothesis with the model: sum log p / n ** alpha
            tgt_in = torch.cat([torch.tensor([BOS]), seq[:-1]])[None]
            logp = model(src[b:b + 1], tgt_in).logits.float().log_softmax(-1)[0]
            score = logp.gather(1, seq[:, None]).sum() / n ** alpha
            torch.testing.assert_close(res.scores[b], score, rtol=1e-4, atol=1e-4)


def test_generation_input_errors():
    lm = model_for(tiny("tiny-mha", "lm"))
    with pytest.raises(ValueError, match="padding"):
        greedy_decode(lm, torch.tensor([[5, PAD, 6]]), max_len=3)
    with pytest.raises(ValueError, match="max_len"):
        greedy_decode(lm, tokens(1, 3), max_len=0)
    with pytest.raises(ValueError, match="EncoderDecoderModel or a CausalLanguageModel"):
        greedy_decode(model_for(tiny("tiny-mha", "mlm")), tokens(1, 3), max_len=3)


def test_moh_config_saved_before_head_weighting_keeps_its_weighting():
    """A MoH model saved before head_weighting existed was trained with today's "scaled" weights: loading
    its config must not switch it to the new default."""
    from headmix.models.config import AttentionConfig

    saved = AttentionConfig(kind="moh", num_heads=4, num_shared_heads=1, top_k=2).to_dict()
    assert AttentionConfig.from_dict(saved).build(16).head_weighting == "renormalized"
    del saved["head_weighting"]
    assert AttentionConfig.from_dict(saved).build(16).head_weighting == "scaled"


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_label_smoothing_value_and_gradient_by_hand(smoothing):
    # loss = mean_t [(1 - eps) (-log p_t[y_t]) + eps * mean_v (-log p_t[v])] over target tokens (pad ignored);
    # d loss / d logits_t = (softmax_t - (1 - eps) onehot(y_t) - eps / V) / n.
    model = model_for(tiny("tiny-mha", label_smoothing=smoothing))
    src, tgt_in = tokens(2, 6), tokens(2, 5, seed=3)
    tgt_out = tokens(2, 5, seed=4)
    tgt_out[1, 2:] = PAD
    logits = model(src, tgt_in).logits.detach().requires_grad_()
    from headmix.models.transformer import token_loss

    loss, nll_loss, n = token_loss(logits, tgt_out, PAD, smoothing)
    keep = tgt_out.ne(PAD)
    logp = logits.detach().log_softmax(-1)[keep]
    nll = -logp.gather(1, tgt_out[keep][:, None])[:, 0]
    uniform = -logp.mean(-1)
    assert int(n) == 7
    torch.testing.assert_close(loss, ((1 - smoothing) * nll + smoothing * uniform).mean())
    torch.testing.assert_close(nll_loss, nll.mean())  # the plain NLL, whatever the smoothing
    torch.testing.assert_close(model(src, tgt_in, tgt_out).loss, loss)
    loss.backward()
    target = (1 - smoothing) * F.one_hot(tgt_out[keep], V) + smoothing / V
    expected = torch.zeros_like(logits)
    expected[keep] = (logits.detach()[keep].softmax(-1) - target) / 7
    torch.testing.assert_close(logits.grad, expected)


def test_label_smoothing_0_and_01_differ_as_the_formula_says():
    src, tgt_in, tgt_out = tokens(2, 6), tokens(2, 5, seed=3), tokens(2, 5, seed=5)
    plain = model_for(tiny("tiny-mha", label_smoothing=0.0))(src, tgt_in, tgt_out)
    smooth = model_for(tiny("tiny-mha", label_smoothing=0.1))(src, tgt_in, tgt_out)
    assert torch.equal(plain.logits, smooth.logits)  # the same weights (same seed): only the loss differs
    logp = plain.logits.log_softmax(-1)
    nll = -logp.gather(-1, tgt_out[..., None])[..., 0]
    # smoothed - plain = 0.1 * mean_t (mean_v(-log p_t) - (-log p_t[y_t]))
    torch.testing.assert_close(smooth.loss - plain.loss, 0.1 * (-logp.mean(-1) - nll).mean())
    torch.testing.assert_close(smooth.nll_loss, plain.loss)


@pytest.mark.parametrize("att", [
    AttentionConfig(kind="moa", num_experts=6, top_k=2, head_dim=8, router="noisy_topk"),
    AttentionConfig(kind="moa", num_experts=6, top_k=2, head_dim=8, bias=False),
    AttentionConfig(kind="mha", num_heads=4, head_dim=4, key_dim=12, bias=False),
    AttentionConfig(kind="moh", num_heads=4, num_shared_heads=1, top_k=2),
    AttentionConfig(kind="moh", num_heads=4, num_shared_heads=0, top_k=2),
    AttentionConfig(kind="talking_heads", num_heads=4, pre_softmax=False),
])
def test_parameter_formula_matches_every_layer_option(att):
    from headmix.models.counting import attention_parameters

    layer = att.build(32)
    assert attention_parameters(att, 32)[0] == count_parameters(layer)


@pytest.mark.parametrize("kind, sizes", [("moa", dict(num_experts=4, top_k=2, head_dim=16)),
                                         ("moh", dict(num_heads=4, num_shared_heads=1, top_k=2)), ("gqe", {}),
                                         ("switchhead", dict(num_heads=2, num_experts=4, top_k=2)),
                                         ("talking_heads", dict(num_heads=4))])
def test_a_stored_config_holds_the_resolved_value_of_every_defaulted_field_its_kind_uses(kind, sizes, tmp_path):
    """A field whose unset value means "today's default" is stored resolved (MoH's head_weighting, GQE's
    hard_slot_scale and shared_head_kv, SwitchHead's dropout_on, ...), never as a null a later default would
    change; the config reads back equal."""
    from headmix.models.config import _KIND_DEFAULTS, field_applies

    config = get_config("tiny-mha", task="lm").replace(decoder_self_attention=AttentionConfig(kind=kind, **sizes))
    config.save_json(tmp_path / "config.json")
    stored = json.loads((tmp_path / "config.json").read_text())["decoder_self_attention"]
    used = [name for name in _KIND_DEFAULTS if field_applies(name, kind) and name != "router"]
    assert used and None not in [stored[name] for name in used], stored
    resolved = {"moh": {"head_weighting": "renormalized"}, "gqe": {"hard_slot_scale": "none", "shared_head_kv": "mean"},
                "switchhead": {"dropout_on": "attention"}}.get(kind, {})
    assert {name: stored[name] for name in resolved} == resolved
    assert ModelConfig.load_json(tmp_path / "config.json") == config
