"""Parameter and MACs accounting: eq. 18-20 of the MoA paper, the full analytic count, and the count
measured by torch's FlopCounterMode, which must agree exactly."""

from __future__ import annotations

import json

import pytest

from headmix.attention import MixtureOfAttentionHeads, MultiHeadAttention
from headmix.models import analytic_macs, analytic_parameters, build_model, count_parameters, get_config, measure_macs
from headmix.models.config import AttentionConfig
from headmix.models.counting import attention_macs, attention_parameters
from headmix.models.presets import PAPER_MLM, PAPER_TRANSLATION, PRESETS

CPU_PRESETS = [(n, t) for n in ("tiny-mha", "tiny-moa", "tiny-moh", "tiny-talking-heads", "tiny-switchhead", "mini-mha",
                                "mini-moa", "mini-switchhead", "small-mha", "small-moa")
               for t in ("translation", "mlm", "lm")]
PAPER_PRESETS = [(n, "translation") for n in PAPER_TRANSLATION] + [(n, "mlm") for n in PAPER_MLM]
LLAMA_PRESETS = [(n, "lm") for n in PRESETS if n.startswith("llama-")]


@pytest.mark.parametrize("name,task", CPU_PRESETS + PAPER_PRESETS + LLAMA_PRESETS)
def test_parameter_count_is_exact(name, task):
    cfg = get_config(name, task=task)
    model = build_model(cfg, device="meta")  # shapes only: the big presets cost nothing
    assert analytic_parameters(cfg).total == count_parameters(model)


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_parameter_count_variants(share, positions):
    for task in ("translation", "mlm", "lm"):
        cfg = get_config("tiny-moh", task=task).replace(share_embeddings=share, positions=positions, embedding_norm=True)
        assert analytic_parameters(cfg).total == count_parameters(build_model(cfg, device="meta"))


def test_eq20_parameters_of_one_layer():
    d, e, k, dh = 64, 6, 2, 24
    moa = MixtureOfAttentionHeads(d, e, k, dh)
    weights = moa.query_experts.numel() + moa.output_experts.numel() + moa.k_proj.weight.numel() + moa.v_proj.weight.numel()
    assert weights == (2 * e + 2) * dh * d  # eq. 20
    assert count_parameters(moa) == (2 * e + 2) * dh * d + d * e + 2 * dh + d  # + router W_g + biases
    cfg = get_config(f"{k}K{e}E{dh}D").encoder_self_attention
    assert attention_parameters(cfg, d) == (count_parameters(moa), (2 * e + 2) * dh * d)
    mha = MultiHeadAttention(d, 4)
    assert count_parameters(mha) - 4 * d == 4 * d * d  # eq. 20: M_MHA = 4 d_m^2 (+ 4 bias vectors)
    assert attention_parameters(get_config("tiny-mha").encoder_self_attention, d) == (4 * d * d + 4 * d, 4 * d * d)


def test_eq18_eq19_and_the_full_attention_count():
    d, t = 512, 10
    # MoA, eq. 18: k T^2 d_h + 2(k+1) T d_h d_m; the full count adds the attention x values matmul
    # (another k T^2 d_h) and the router (T d_m E).
    for k, e, dh in ((8, 8, 128), (16, 32, 256), (4, 32, 64)):
        att = get_config(f"{k}K{e}E{dh}D").encoder_self_attention
        full, paper = attention_macs(att, d, t, t)
        assert paper == k * t * t * dh + 2 * (k + 1) * t * dh * d
        assert full == paper + k * t * t * dh + t * d * e
    # MHA, eq. 19: T^2 d_m + 4 T d_m^2; the full count adds another T^2 d_m
    full, paper = attention_macs(get_config("transformer-base").encoder_self_attention, d, t, t)
    assert paper == t * t * d + 4 * t * d * d and full == paper + t * t * d
    # cross-attention, S != T: K/V projections run over the S source positions
    att = get_config("moa-base").cross_attention
    full, _ = attention_macs(att, d, 7, 13)
    assert full == 7 * d * 8 + 8 * 7 * d * 128 + 2 * 13 * d * 128 + 2 * 8 * 7 * 13 * 128 + 8 * 7 * 128 * d


def test_model_level_formula_for_transformer_base():
    cfg = get_config("transformer-base")
    d, f, v, t, layers = 512, 2048, 32000, 10, 6
    att = t * t * d + 4 * t * d * d  # eq. 19
    expected_paper = 3 * layers * att + 2 * layers * 2 * t * d * f + t * d * v
    macs = analytic_macs(cfg)
    assert macs.paper_total == expected_paper
    assert macs.total == expected_paper + 3 * layers * t * t * d
    params = analytic_parameters(cfg)
    assert params.paper["encoder.self_attention"] == layers * 4 * d * d
    assert params.full["embeddings"] == v * d  # one joint embedding, tied to the output projection


def _assert_measured_equals_analytic(name, task, **lengths):
    cfg = get_config(name, task=task)
    analytic = analytic_macs(cfg, **lengths)
    measured = measure_macs(cfg, **lengths)
    assert measured == analytic.full  # per component, exactly (LayerNorm, softmax: counted by neither)


@pytest.mark.parametrize("name,task", CPU_PRESETS + PAPER_PRESETS + LLAMA_PRESETS)
def test_measured_macs_equal_analytic(name, task):
    """Every preset at the Appendix E sizes, the paper's at their real vocabularies (the big ones are
    built on the meta device and materialised with zero weights: ~1 s each)."""
    _assert_measured_equals_analytic(name, task)


@pytest.mark.parametrize("name", ["tiny-mha", "tiny-moa", "tiny-moh", "tiny-talking-heads", "tiny-switchhead"])
def test_measured_macs_other_lengths_and_batch(name):
    _assert_measured_equals_analytic(name, "translation", src_len=13, tgt_len=6)
    _assert_measured_equals_analytic(name, "mlm", src_len=33)
    _assert_measured_equals_analytic(name, "lm", tgt_len=17)
    cfg = get_config(name)
    assert sum(measure_macs(cfg, 9, 4, batch_size=3).values()) == analytic_macs(cfg, 9, 4, batch_size=3).total == \
        3 * analytic_macs(cfg, 9, 4).total


def test_moa_compute_does_not_grow_with_experts():
    """The paper's point (eq. 18 vs 20): E grows parameters, not MACs (the router aside)."""
    small, big = get_config("8K8E256D"), get_config("8K32E256D")
    assert analytic_macs(small).paper_total == analytic_macs(big).paper_total
    assert analytic_macs(big).total - analytic_macs(small).total == 18 * 10 * 512 * (32 - 8)  # routers
    assert analytic_parameters(big).total > 2 * analytic_parameters(small).total


@pytest.mark.parametrize("size, kind", [("mini", "moa"), ("small", "moa"), ("tiny", "switchhead"), ("mini", "switchhead")])
def test_matched_pairs_have_nearly_equal_macs(size, kind):
    for task, lengths in (("translation", dict(src_len=32, tgt_len=32)), ("lm", dict(tgt_len=64))):
        mha = analytic_macs(get_config(f"{size}-mha", task=task), **lengths).total
        other = analytic_macs(get_config(f"{size}-{kind}", task=task), **lengths).total
        assert abs(other - mha) / mha < 0.05


def test_length_arguments():
    with pytest.raises(ValueError, match="src_len"):
        analytic_macs(get_config("tiny-mha", task="lm"), src_len=5)
    with pytest.raises(ValueError, match="tgt_len"):
        analytic_macs(get_config("tiny-mha", task="mlm"), tgt_len=5)
    with pytest.raises(ValueError, match="src_len must be a positive integer"):
        analytic_macs(get_config("tiny-mha"), src_len=0)
    # Appendix E defaults
    cfg = get_config("roberta-medium")
    assert analytic_macs(cfg).total == analytic_macs(cfg, src_len=128).total


def test_cli_macs(capsys):
    from headmix.cli.main import main

    assert main(["macs", "tiny-moa", "--task", "lm", "--vocab", "500", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = get_config("tiny-moa", task="lm", vocab_size=500)
    assert out["params"] == analytic_parameters(cfg).total and out["macs"] == analytic_macs(cfg).total
    assert out["macs_measured"] == out["macs"] and out["macs_paper"] < out["macs"]
    assert main(["macs", "moa-base"]) == 0
    text = capsys.readouterr().out
    assert "total" in text and f"{analytic_macs(get_config('moa-base')).total:,}" in text
    assert main(["macs", "--table"]) == 0
    table = capsys.readouterr().out
    assert table.count("\n") == 2 + len(PAPER_TRANSLATION) + len(PAPER_MLM)
    assert "| MoA 8K32E256D | translation | 8 | 32 | 256 |" in table
    assert main(["macs", "16K8E64D"]) == 2
    assert "top_k K=16 exceeds num_experts E=8 in '16K8E64D'" in capsys.readouterr().err


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("ffn", ["mlp", "swiglu"])
@pytest.mark.parametrize("bias", [True, False])
def test_llama_style_options_counted(norm_type, ffn, bias):
    """Parameters exact and MACs equal to the measured count for every combination of the new options, in
    every task (rotary positions too: elementwise, counted by neither side)."""
    for task in ("translation", "mlm", "lm"):
        cfg = get_config("tiny-moh", task=task).replace(norm_type=norm_type, ffn=ffn, bias=bias, positions="rotary",
                                                        embedding_norm=True)
        assert analytic_parameters(cfg).total == count_parameters(build_model(cfg, device="meta"))
        assert measure_macs(cfg) == analytic_macs(cfg).full


def test_swiglu_and_rmsnorm_formulas():
    """SwiGLU is three d_m x d_ffn matrices (3 T d_m d_ffn MACs), RMSNorm has a gain and no bias."""
    cfg = get_config("llama-tiny-mha")
    d, f, t, n = 64, 176, 128, 2
    assert analytic_macs(cfg).full["decoder.ffn"] == n * 3 * t * d * f
    params = analytic_parameters(cfg)
    assert params.full["decoder.ffn"] == n * 3 * d * f
    assert params.full["decoder.norms"] == (2 * n + 1) * d  # two per layer and the final one, gain only
    mlp = analytic_parameters(get_config("tiny-mha", task="lm"))
    assert mlp.full["decoder.ffn"] == n * (2 * d * 256 + 256 + d) and mlp.full["decoder.norms"] == (2 * n + 1) * 2 * d


@pytest.mark.parametrize("task", ["translation", "lm"])
def test_moa_kv_heads_counts_are_exact(task):
    """kv_heads G: parameters (2E + 2) G d_h d_m (+ router and biases), MACs measured == analytic."""
    import dataclasses

    cfg = get_config("tiny-moa", task=task)
    roles = [f.name for f in dataclasses.fields(cfg) if isinstance(getattr(cfg, f.name), type(cfg.decoder_self_attention))]
    cfg = cfg.replace(**{r: dataclasses.replace(getattr(cfg, r), kv_heads=2) for r in roles
                         if getattr(cfg, r) is not None and getattr(cfg, r).kind == "moa"})
    assert analytic_parameters(cfg).total == count_parameters(build_model(cfg, device="meta"))
    assert measure_macs(cfg) == analytic_macs(cfg).full
    att = cfg.decoder_self_attention
    assert attention_parameters(att, cfg.d_model)[1] == (2 * att.num_experts + 2) * 2 * att.head_dim * cfg.d_model


# --------------------------------------------------------------------------- SwitchHead: the authors' count

def authors_attention_flops(state_size, n_heads, unroll, hps, att_k, n_experts, cblocks=0, q_e=0, k_e=0, v_e=1,
                            o_e=1):
    """Transcribed from RobertCsordas/moe_attention, ``paper/common.py``, ``get_attention_flops``, the
    ``preln_moeatt`` branch with ``moe.att.variant`` ``full_rope`` (SwitchHead: value and output experts,
    ``v_e = o_e = 1``); ``unroll`` is the sequence length, ``hps`` the head size, ``cblocks`` the context
    blocks (0 here: no Transformer-XL memory)."""
    n_exp = int(q_e) + int(k_e) + int(v_e) + int(o_e)
    n_total_proj = n_exp * att_k + 4 - n_exp
    n_sels = min(1, int(k_e) + int(v_e)) + min(1, int(q_e) + int(o_e))
    return n_heads * hps * unroll ** 2 * (1 + cblocks) * 2 + n_total_proj * state_size * n_heads * hps * unroll \
        + n_exp * n_heads * att_k * unroll * hps + n_sels * n_experts * state_size * unroll * (1 + cblocks)


@pytest.mark.parametrize("d, h, dh, e, k, t", [
    (1024, 4, 100, 4, 2, 1024),   # the size
    (512, 2, 64, 8, 3, 256),
    (64, 2, 22, 4, 2, 10),        # tiny-switchhead at Appendix E's length
    (128, 3, 17, 5, 1, 33),
    (96, 2, 48, 1, 1, 7),         # one expert per head
])
def test_switchhead_paper_macs_are_the_authors_count(d, h, dh, e, k, t):
    att = AttentionConfig(kind="switchhead", num_heads=h, num_experts=e, top_k=k, head_dim=dh, bias=False)
    assert attention_macs(att, d, t, t)[1] == authors_attention_flops(d, h, t, dh, k, e)


def test_switchhead_paper_column_of_a_model_is_the_authors_count():
    cfg = get_config("llama-tiny-switchhead")
    att = cfg.decoder_self_attention
    paper = analytic_macs(cfg, tgt_len=40).paper["decoder.self_attention"]
    assert paper == cfg.decoder_layers * authors_attention_flops(cfg.d_model, att.num_heads, 40, att.head_dim,
                                                                 att.top_k, att.num_experts)
