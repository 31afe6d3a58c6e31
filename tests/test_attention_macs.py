"""The two MAC conventions of attention (``headmix macs --attention-macs``, a study's ``attention_macs``): ``full``
(every query-key pair, the papers' count, unchanged) and ``causal`` (the decoder's self-attention as a causal flash
kernel computes it, in 128 x 128 tiles, a diagonal tile whole), each against a count by hand; the matcher and the
report under each."""

from __future__ import annotations

import json

import pytest

from headmix.models import AttentionConfig, analytic_macs, get_config
from headmix.models.counting import FLASH_TILE, attention_macs, causal_pairs, mosa_macs
from headmix.models.presets import llama_model, mha
from headmix.study import StudySpec, plan
from headmix.study.spec import RowSpec


def test_causal_pairs_by_hand():
    # 5 tokens in tiles of 2 x 2: rows 0-1 see the first key tile (2 x 2), rows 2-3 two tiles (2 x 4), row 4
    # the three tiles up to the end (1 x 5): 4 + 8 + 5 = 17, against the exact causal 15 and the square 25
    assert causal_pairs(5, (2, 2)) == 17
    # tiles of 2 queries x 4 keys: a key tile reaching past the query tile is computed whole: 2x4 + 2x4 + 1x5
    assert causal_pairs(5, (2, 4)) == 21
    assert FLASH_TILE == (128, 128)
    assert causal_pairs(128) == 128 * 128  # one diagonal tile: the whole square
    assert causal_pairs(300) == 128 * 128 + 128 * 256 + 44 * 300  # the last tile has 44 rows, keys to the end
    assert causal_pairs(1024) == 128 * 128 * (1 + 2 + 3 + 4 + 5 + 6 + 7 + 8)  # 36 of the 64 tiles
    assert causal_pairs(0) == 0
    with pytest.raises(ValueError, match="^length must be a non-negative integer"):
        causal_pairs(-1)


D, T = 64, 300
P = causal_pairs(T)  # the (query, key) pairs computed causally


@pytest.mark.parametrize("att,attention_products", [
    # MHA 4 heads of 16: queries, K/V of 2 K/V heads, scores and weights x values, outputs
    (AttentionConfig(kind="mha", num_heads=4, head_dim=16, kv_heads=2), lambda pairs: 4 * pairs * 32),
    (AttentionConfig(kind="talking_heads", num_heads=4, head_dim=16),  # + its two 4 x 4 mixings per pair
     lambda pairs: 4 * pairs * 32 + 2 * 16 * pairs),
    (AttentionConfig(kind="moa", num_experts=8, top_k=2, head_dim=16), lambda pairs: 2 * 2 * pairs * 16),
    (AttentionConfig(kind="switchhead", num_heads=2, num_experts=4, top_k=2, head_dim=16),
     lambda pairs: 2 * 2 * pairs * 16),
    (AttentionConfig(kind="moh", num_heads=8, head_dim=8, kv_heads=2, route_per_group=True, num_shared_heads=1,
                     top_k=1, head_weighting="scaled", moh_impl="sparse"), lambda pairs: 2 * (1 + 1) * pairs * 16),
])
def test_each_kind_counts_its_attention_products_causally_and_nothing_else(att, attention_products):
    """The causal count is the full count with the score and weights x values products over the causal pairs:
    projections and routers do not change; the paper's column is unchanged."""
    full, paper = attention_macs(att, D, T, T)
    causal, causal_paper = attention_macs(att, D, T, T, causal=True)
    assert full - causal == attention_products(T * T) - attention_products(P) > 0
    assert causal_paper == paper


def test_mosa_sparse_heads_attend_causally_among_their_chosen_tokens():
    att = AttentionConfig(kind="mosa", num_sparse_heads=3, num_dense_heads=1, head_dim=16, sparsity=8, bias=False)
    t = 2048
    k = t // 8  # 256 chosen tokens: two tiles, causal_pairs(256) = 3 tiles of 128 x 128
    assert causal_pairs(k) == 3 * 128 * 128
    by_hand = 3 * (t * D + 4 * k * D * 16 + 2 * causal_pairs(k) * 16) + (4 * t * D * 16 + 2 * causal_pairs(t) * 16)
    assert mosa_macs(att, D, t, causal=True) == by_hand
    assert mosa_macs(att, D, t) == 3 * (t * D + 4 * k * D * 16 + 2 * k * k * 16) + (4 * t * D * 16 + 2 * t * t * 16)
    assert attention_macs(att, D, t, t, causal=True) == (by_hand, mosa_macs(att, D, t))


def test_full_is_the_default_and_only_causal_layers_change():
    lm = get_config("llama3-mini-gqa", task="lm")
    assert analytic_macs(lm, tgt_len=T).full == analytic_macs(lm, tgt_len=T, attention="full").full
    full, causal = analytic_macs(lm, tgt_len=T), analytic_macs(lm, tgt_len=T, attention="causal")
    gqa = lm.decoder_self_attention
    layer = attention_macs(gqa, lm.d_model, T, T)[0] - 8 * (T * T - P) * 32  # 8 heads of 16: q.k and w.v
    assert causal.full["decoder.self_attention"] == lm.decoder_layers * layer
    assert {k: v for k, v in causal.full.items() if k != "decoder.self_attention"} == \
        {k: v for k, v in full.full.items() if k != "decoder.self_attention"}
    assert causal.paper == full.paper
    # translation: the encoder's self-attention and the cross-attention see every token, in both conventions
    mt = get_config("tiny-mha", task="translation")
    full, causal = analytic_macs(mt, 300, 300), analytic_macs(mt, 300, 300, attention="causal")
    for name in ("encoder.self_attention", "decoder.cross_attention", "decoder.ffn"):
        assert causal.full[name] == full.full[name]
    assert causal.full["decoder.self_attention"] < full.full["decoder.self_attention"]
    with pytest.raises(ValueError, match="^attention_macs must be one of"):
        analytic_macs(lm, attention="half")


def _gpu_spec(attention_macs: str) -> StudySpec:
    baseline = llama_model(mha(8), 1000, d_model=512, layers=2, max_positions=1024).to_dict()
    baseline["decoder_self_attention"]["kv_heads"] = 2
    rows = [RowSpec("GQA"),
            RowSpec("MoSA", {"kind": "mosa", "num_dense_heads": 2, "head_dim": 64, "sparsity": 8},
                    ["num_sparse_heads"])]
    return StudySpec(name="s", task="lm", baseline=baseline, rows=rows, attention_macs=attention_macs,
                     training={"max_len": 1024})


def test_the_matcher_sizes_rows_under_the_studys_convention():
    """MoSA's sparse heads cost mostly projections, the dense ones attention: counted causally, attention is
    cheaper, so more sparse heads match the same compute."""
    from headmix.study.matching import attention_macs_of

    heads = {}
    for convention in ("full", "causal"):
        rows = plan(_gpu_spec(convention))
        other = "causal" if convention == "full" else "full"
        base = attention_macs_of(rows[0].config, None, 1024, attention=convention)
        assert rows[1].attention_macs == attention_macs_of(rows[1].config, None, 1024, attention=convention)
        assert abs(rows[1].attention_macs / base - 1) <= 0.02 and rows[1].macs_ratio == rows[1].attention_macs / base
        off = attention_macs_of(rows[1].config, None, 1024, attention=other) / \
            attention_macs_of(rows[0].config, None, 1024, attention=other)
        assert abs(off - 1) > 0.02  # the other convention would not have matched this row
        heads[convention] = rows[1].config.decoder_self_attention.num_sparse_heads
    assert heads["causal"] < heads["full"]  # dense heads' attention is cheaper causally: fewer sparse heads fit
    with pytest.raises(ValueError, match="^attention_macs must be one of"):
        StudySpec.from_dict({"name": "s", "task": "lm", "baseline": "tiny-mha", "rows": [{"name": "MHA"}],
                             "attention_macs": "flash"})


def test_the_report_names_its_convention_and_shows_the_other():
    from headmix.study.report import aggregate, to_markdown

    for convention, other in (("full", "causal"), ("causal", "full")):
        spec = _gpu_spec(convention)
        planned = plan(spec)
        table = aggregate(spec, planned, [])
        assert table["attention_macs"] == convention and table["attention_macs_other"] == other
        from headmix.study.matching import attention_macs_of

        by_other = [attention_macs_of(p.config, None, 1024, attention=other) for p in planned]
        assert [r["attention_macs_ratio_other"] for r in table["rows"]] == [m / by_other[0] for m in by_other]
        md = to_markdown(table)
        assert f"counted `{convention}`" in md and f"| ratio, {other} count |" in md
        assert f"| {table['rows'][1]['attention_macs_ratio_other']:.3f}x |" in md


def test_cli_macs_counts_either_convention(capsys):
    from headmix.cli.main import main

    assert main(["macs", "llama3-mini-gqa", "--tgt-len", "1024", "--no-measure", "--json",
                 "--attention-macs", "causal"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = get_config("llama3-mini-gqa", task="lm")
    assert out["attention_macs"] == "causal" and out["flash_tile"] == [128, 128]
    assert out["macs"] == analytic_macs(cfg, tgt_len=1024, attention="causal").total
    assert out["macs_other"] == {"attention_macs": "full", "macs": analytic_macs(cfg, tgt_len=1024).total}
    assert main(["macs", "llama3-mini-gqa", "--tgt-len", "1024", "--no-measure", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["macs"] == analytic_macs(cfg, tgt_len=1024).total
    assert main(["macs", "llama3-mini-gqa", "--no-measure", "--attention-macs", "causal"]) == 0
    assert "attention counted causal (causal self-attention as a flash kernel computes it" in capsys.readouterr().out
