"""The Llama-style decoder: RMSNorm, SwiGLU, rotary positions, no biases, its presets, decoding with the
cache, and a short training run with ``headmix train lm``. RMSNorm and SwiGLU are compared with the
Hugging Face Llama modules themselves (copied weights)."""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from headmix.models import (
    AttentionConfig,
    ModelConfig,
    analytic_parameters,
    build_model,
    count_parameters,
    get_config,
    greedy_decode,
    load_pretrained,
)
from headmix.models.presets import PRESETS, llama_ffn_dim
from headmix.models.transformer import SwiGLU, make_norm

LLAMA_PRESETS = [name for name in PRESETS if name.startswith("llama-")]
V = 61


def llama(name: str = "llama-tiny-moa", **changes) -> ModelConfig:
    cfg = get_config(name, vocab_size=V)
    return cfg.replace(**changes) if changes else cfg


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (batch, length), generator=g)


# --------------------------------------------------------------------------------------------------
# The parts, against Hugging Face Llama's modules
# --------------------------------------------------------------------------------------------------
def hf_llama_config(**kw):
    from transformers import LlamaConfig

    base = dict(vocab_size=V, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                attention_bias=False, mlp_bias=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return LlamaConfig(**base)


def test_swiglu_is_hf_llama_mlp():
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    cfg = get_config("tiny-mha", task="lm", vocab_size=V).replace(ffn="swiglu", ffn_dim=48, bias=False)
    ours, theirs = SwiGLU(cfg).double(), LlamaMLP(hf_llama_config(intermediate_size=48)).double()
    theirs.load_state_dict(ours.state_dict())  # the same names: gate_proj (W1), up_proj (W3), down_proj (W2)
    x = torch.randn(2, 5, 64, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(ours(x), theirs(x))
    # and the formula itself: W2 (silu(x W1) * x W3), three matrices, no biases
    w1, w3, w2 = ours.gate_proj.weight, ours.up_proj.weight, ours.down_proj.weight
    torch.testing.assert_close(ours(x), (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T)
    assert ours.gate_proj.bias is None and count_parameters(ours) == 3 * 64 * 48
    grads = torch.autograd.grad(ours(x).square().sum(), [x, *ours.parameters()])
    theirs_grads = torch.autograd.grad(theirs(x).square().sum(), [x, *theirs.parameters()])
    for a, b in zip(grads, theirs_grads):
        torch.testing.assert_close(a, b)


def test_rmsnorm_is_hf_llama_rmsnorm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    cfg = get_config("tiny-mha", task="lm", vocab_size=V).replace(norm_type="rmsnorm", norm_eps=1e-6, bias=False)
    ours, theirs = make_norm(cfg), LlamaRMSNorm(64, eps=1e-6)
    assert isinstance(ours, torch.nn.RMSNorm) and count_parameters(ours) == 64
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    x = torch.randn(3, 4, 64) * 3
    torch.testing.assert_close(ours(x), theirs(x))
    assert isinstance(make_norm(cfg.replace(norm_type="layernorm")), torch.nn.LayerNorm)
    assert make_norm(cfg.replace(norm_type="layernorm")).bias is None  # bias=False: no LayerNorm bias either


def test_llama_ffn_dim():
    assert llama_ffn_dim(64) == 176 and llama_ffn_dim(128) == 352 and llama_ffn_dim(4096, 256) == 11008  # Llama 2 7B


# --------------------------------------------------------------------------------------------------
# Config and presets
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", LLAMA_PRESETS)
def test_llama_presets_json_round_trip_and_shape(name, tmp_path):
    cfg = get_config(name)
    jetmoe = name.endswith("jetmoe")
    assert cfg.task == "lm" and cfg.norm_type == "rmsnorm" and cfg.positions == "rotary"
    assert cfg.ffn == ("moe_swiglu" if jetmoe else "swiglu")
    assert cfg.decoder_self_attention.rotary and not cfg.decoder_self_attention.bias and cfg.bias == jetmoe
    assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg
    cfg.save_json(tmp_path / "c.json")
    assert get_config(str(tmp_path / "c.json")) == cfg
    model = build_model(cfg, device="meta")
    biases = [n for n, _ in model.named_parameters() if n.endswith("bias")]
    if "kv2" in name or jetmoe:  # JetMoE: the output biases of the MoA (and MoE) layers only
        assert biases and all(n.endswith("self_attn.out_bias") or n.endswith("ffn.out_bias") for n in biases)
    else:
        assert not biases  # Llama: no biases anywhere
    assert model.decoder.embed.positions is None and model.decoder.embed.sinusoids is None
    assert (model.output_proj is None) == jetmoe  # untied as Llama 2/3 8B, tied as JetMoE
    assert analytic_parameters(cfg).total == count_parameters(model)


@pytest.mark.parametrize("task", ["translation", "mlm"])
def test_llama_presets_refuse_other_tasks(task):
    with pytest.raises(ValueError, match=f"preset 'llama-tiny-moa' is for task lm, not '{task}'"):
        get_config("llama-tiny-moa", task=task)


def test_old_json_without_the_new_fields_loads_unchanged():
    cfg = get_config("tiny-moa", task="lm")
    old = cfg.to_dict()
    for name in ("norm_type", "norm_eps", "ffn", "bias"):
        del old[name]
    loaded = ModelConfig.from_dict(old)
    assert loaded == cfg and loaded.norm_type == "layernorm" and loaded.ffn == "mlp" and loaded.bias
    # and a model of the old config has the old parameter names
    names = {n for n, _ in build_model(loaded, device="meta").named_parameters()}
    assert "decoder.layers.0.ffn.fc1.bias" in names and "decoder.layers.0.ffn_norm.norm.bias" in names


def test_rotary_positions_set_the_self_attention_and_not_cross_attention():
    cfg = get_config("tiny-mha", task="translation").replace(positions="rotary")
    assert cfg.encoder_self_attention.rotary and cfg.decoder_self_attention.rotary
    assert not cfg.cross_attention.rotary
    given = AttentionConfig(kind="mha", num_heads=4)
    lm = get_config("tiny-mha", task="lm").replace(positions="rotary", decoder_self_attention=given)
    assert lm.decoder_self_attention.rotary and not given.rotary  # the caller's config is not changed
    with pytest.raises(ValueError, match=r"decoder_self_attention\.rotary must be True with positions='rotary'"):
        lm.decoder_self_attention = given  # set after construction: validate() catches it
        lm.validate()


@pytest.mark.parametrize("changes,message", [
    (dict(norm_type="batchnorm"), "norm_type must be one of"),
    (dict(norm_eps=0.0), "norm_eps must be a number in"),
    (dict(ffn="geglu"), "ffn must be one of"),
    (dict(bias="no"), "bias must be a bool"),
    (dict(positions="alibi"), "positions must be one of"),
])
def test_config_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        llama(**changes)


# --------------------------------------------------------------------------------------------------
# Decoding and training
# --------------------------------------------------------------------------------------------------
# MoSA's training rule (expert-choice top-k) has no cache; its cached generation under the causal threshold rule
# is tested in tests/test_mosa_toolkit.py.
@pytest.mark.parametrize("name", [n for n in LLAMA_PRESETS if n.startswith("llama-tiny") and not n.endswith("-mosa")])
def test_cached_decoding_equals_uncached(name):
    torch.manual_seed(0)
    model = build_model(llama(name)).eval()
    prompt = tokens(3, 5)
    cached = greedy_decode(model, prompt, max_len=12)
    uncached = greedy_decode(model, prompt, max_len=12, use_cache=False)
    assert torch.equal(cached.tokens, uncached.tokens)
    torch.testing.assert_close(cached.scores, uncached.scores)
    # the cached logits step by step equal the full forward's (no padding in the sequence)
    seq = tokens(3, 17, seed=2)
    with torch.no_grad():
        full = model(seq).logits
        out = model(seq[:, :5], use_cache=True)
        steps = [out.logits]
        for t in range(5, seq.shape[1]):
            out = model(seq[:, t:t + 1], state=out.state, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_rotary_model_sees_order_and_is_shift_invariant_in_relative_positions():
    """Without absolute positions, order reaches the model only through rotary: permuting the context
    changes the last logits (a broken rotary, e.g. not applied, would not notice)."""
    torch.manual_seed(0)
    model = build_model(llama("llama-tiny-mha")).eval()
    x = tokens(1, 8)
    with torch.no_grad():
        a = model(x).logits[:, -1]
        b = model(torch.cat([x[:, :-1].flip(1), x[:, -1:]], dim=1)).logits[:, -1]
    assert (a - b).abs().max() > 1e-3


def test_save_and_load_pretrained(tmp_path):
    torch.manual_seed(0)
    model = build_model(llama("llama-tiny-moh")).eval()
    model.save_pretrained(tmp_path)
    loaded = load_pretrained(tmp_path)
    x = tokens(2, 7)
    torch.testing.assert_close(loaded(x).logits, model(x).logits)


def unigram_entropy(run: Path) -> float:
    """The entropy (nats per token) of the validation tokens' own unigram distribution: the lowest loss a
    model that ignores its input can reach on them."""
    from headmix.data.tokenizer import Tokenizer

    tok = Tokenizer.load(run / "tokenizer")
    counts: collections.Counter = collections.Counter()
    for line in (run / "data" / "valid.jsonl").read_text().splitlines():
        counts.update(tok.encode(json.loads(line)["text"], add_eos=True))
    n = sum(counts.values())
    return -sum(c / n * math.log(c / n) for c in counts.values())


def test_headmix_train_lm_with_llama_moa_learns_from_context_and_decodes_with_its_cache(tmp_path, capsys):
    """``headmix train lm --preset llama-tiny-moa`` on the embedded English documents: 20 steps take the
    validation loss (3.71 nats) below the entropy of the validation tokens' own unigram distribution (4.04),
    which a model that does not learn, or ignores its input, cannot do (uniform: log 300 = 5.70); a model
    that sees future tokens would fail the cached == uncached decoding check that follows."""
    from headmix.cli.main import main
    from headmix.data import load_embedded_documents, write_jsonl_documents

    data = tmp_path / "docs.jsonl"
    write_jsonl_documents(load_embedded_documents(sources="kjv-bible")[:30], data)
    run = tmp_path / "run"
    argv = ["train", "lm", "--preset", "llama-tiny-moa", "--out", str(run), "--data", str(data), "--vocab-size", "300",
            "--max-steps", "20", "--max-tokens", "512", "--max-len", "32", "--warmup-steps", "2", "--lr", "5e-3",
            "--log-every", "5", "--save-every", "20", "--eval-every", "20", "--average-last", "1",
            "--valid-size", "0.1", "--test-size", "0.1", "--no-progress"]
    assert main(argv) == 0
    capsys.readouterr()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["valid"]["nll"] < unigram_entropy(run) - 0.2
    model = load_pretrained(run)
    assert model.config.positions == "rotary" and model.config.decoder_self_attention.kind == "moa"
    prompt = torch.tensor([[model.config.bos_id, 40, 41, 42]])
    cached = greedy_decode(model, prompt, max_len=16)
    assert torch.equal(cached.tokens, greedy_decode(model, prompt, max_len=16, use_cache=False).tokens)


# --------------------------------------------------------------------------------------------------
# Mixture of SwiGLU experts (JetMoE's MoE feed-forward), against Hugging Face JetMoeMoE
# --------------------------------------------------------------------------------------------------
def moe_config(**changes) -> ModelConfig:
    base = dict(ffn="moe_swiglu", ffn_experts=4, ffn_top_k=2, ffn_dim=24, bias=True)
    base.update(changes)
    return get_config("tiny-mha", task="lm", vocab_size=V).replace(**base)


def copy_moe_from_jetmoe(ours, theirs) -> None:
    with torch.no_grad():
        ours.input_experts.copy_(theirs.input_linear.weight.transpose(1, 2))  # (E, 2f, d) -> (E, d, [gate | up])
        ours.output_experts.copy_(theirs.output_linear.weight.transpose(1, 2))
        ours.router.gate.weight.copy_(theirs.router.layer.weight)
        ours.out_bias.copy_(theirs.bias)


@pytest.mark.parametrize("impl", ["reference", "dense", "sorted"])
def test_moe_swiglu_is_hf_jetmoe_moe(impl):
    from transformers import JetMoeConfig
    from transformers.models.jetmoe.modeling_jetmoe import JetMoeMoE, load_balancing_loss_func

    from headmix.models.transformer import MixtureOfSwiGLUExperts

    torch.manual_seed(0)
    theirs = JetMoeMoE(JetMoeConfig(hidden_size=64, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                    activation_function="silu")).double()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.2)
    ours = MixtureOfSwiGLUExperts(moe_config(ffn_expert_impl=impl, ffn_load_balance_fractions="per_token")).double()
    copy_moe_from_jetmoe(ours, theirs)
    x = torch.randn(2, 9, 64, dtype=torch.float64, requires_grad=True)
    # JetMoe computes its router softmax in float32 whatever the input's dtype: float32-level tolerance on
    # the gates (relative 1e-7), float64 everywhere else
    tol = dict(rtol=1e-5, atol=1e-5)
    out = ours(x)
    torch.testing.assert_close(out.output, theirs(x), **tol)
    assert out.routing.expert_index.shape == (18, 2) and out.aux_loss > 0
    # their load-balancing loss of this one router (fractions summing to k: "per_token")
    their_lb = load_balancing_loss_func((theirs.router.layer(x.detach().reshape(-1, 64)),), 4, 2)
    torch.testing.assert_close(out.losses["load_balance"], their_lb.to(torch.float64), **tol)
    r = torch.randn_like(out.output)
    g_ours = torch.autograd.grad((out.output * r).sum(), [x, ours.input_experts, ours.output_experts,
                                                          ours.router.gate.weight, ours.out_bias])
    g_theirs = torch.autograd.grad((theirs(x) * r).sum(), [x, theirs.input_linear.weight, theirs.output_linear.weight,
                                                           theirs.router.layer.weight, theirs.bias])
    for a, b in zip(g_ours, [g_theirs[0], g_theirs[1].transpose(1, 2), g_theirs[2].transpose(1, 2), *g_theirs[3:]]):
        torch.testing.assert_close(a, b, **tol)


def test_moe_swiglu_in_a_model_routes_adds_its_loss_and_is_counted():
    torch.manual_seed(0)
    cfg = moe_config()
    model = build_model(cfg).eval()
    x = tokens(2, 7)
    x[1, 5:] = cfg.pad_id
    out = model(x, x)
    names = [name for name, _ in out.routing]
    assert names == ["decoder.layers.0.ffn", "decoder.layers.1.ffn"]  # MHA attention has no routing
    ffn_routing = out.routing[0][1]
    assert ffn_routing.token_mask.tolist() == (~x.eq(cfg.pad_id)).reshape(-1).tolist()
    assert out.aux_loss > 0 and torch.equal(out.total_loss, out.lm_loss + out.aux_loss)
    assert analytic_parameters(cfg).total == count_parameters(model)
    from headmix.models import analytic_macs, measure_macs

    assert measure_macs(cfg, tgt_len=11) == analytic_macs(cfg, tgt_len=11).full
    cached = greedy_decode(model, tokens(2, 3), max_len=6)
    assert torch.equal(cached.tokens, greedy_decode(model, tokens(2, 3), max_len=6, use_cache=False).tokens)


@pytest.mark.parametrize("changes,message", [
    (dict(ffn_experts=None), "ffn_experts is required with ffn='moe_swiglu'"),
    (dict(ffn_top_k=5), r"ffn_top_k \(5\) exceeds ffn_experts \(4\)"),
    (dict(ffn="swiglu"), "ffn_experts applies to ffn='moe_swiglu' only"),
    (dict(ffn_load_balance_weight=-1), "ffn_load_balance_weight must be a non-negative number"),
    (dict(ffn_expert_impl="fast"), "ffn_expert_impl must be one of"),
    (dict(ffn_load_balance_fractions="sum"), "ffn_load_balance_fractions must be one of"),
])
def test_moe_swiglu_config_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        moe_config(**changes)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_cache_bytes_per_token_moa_kv_heads_vs_mha(kv_heads):
    """From the real caches: MoA with G K/V heads holds 2 G d_h numbers per token and layer, MHA with the
    same k G query heads 2 k G d_h (the GQA comparison with Hugging Face Llama is in test_interop)."""
    from headmix.models import cache_bytes_per_token
    from headmix.models.presets import llama_model

    d_h, k, layers = 8, 8 // kv_heads, 2
    moa = AttentionConfig(kind="moa", top_k=k, num_experts=2 * k, head_dim=d_h, kv_heads=kv_heads)
    mha = AttentionConfig(kind="mha", num_heads=8, head_dim=d_h)
    ids = tokens(3, 5)
    per_token = {name: cache_bytes_per_token(build_model(llama_model(att, V, d_model=32, layers=layers,
                                                                     max_positions=16)), ids)
                 for name, att in (("moa", moa), ("mha", mha))}
    assert per_token["moa"] == layers * 2 * kv_heads * d_h * 4  # float32
    assert per_token["mha"] == layers * 2 * 8 * d_h * 4
