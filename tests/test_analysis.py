"""headmix.analysis: expert load (MoA Figure 3 / Appendix A), token-expert PMI (Table 4), head utilities,
and the ``headmix analyze`` command."""

from __future__ import annotations

import json
import math
import shutil
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from optional_hypothesis import given, settings, st  # hypothesis' own where installed

from headmix.analysis import (
    LayerCounts,
    LoadReport,
    PMIReport,
    as_model_inputs,
    collect_routing,
    expert_load,
    head_utilities,
    load_analysis_run,
    pmi_matrix,
    routed_layers,
    run_batches,
    select_layer,
    talking_heads_matrices,
    token_expert_pmi,
    token_text,
)
from headmix.analysis.heads import HeadUtilityReport, TalkingHeadsReport
from headmix.analysis.layers import RoutedLayer
from headmix.cli.main import main
from headmix.data import (
    Tokenizer,
    load_embedded_documents,
    load_embedded_translation,
    write_jsonl_documents,
    write_tsv_pairs,
)
from headmix.models import AttentionConfig, build_model, get_config
from headmix.routing import Routing
from headmix.training import TrainConfig, train

PAD = 0


def routing(index, num_experts: int, mask=None, gates=None, probs=None) -> Routing:
    """A hand-built Routing: ``index`` (N, k) selected experts, ``mask`` (N,) True = real token."""
    index = torch.as_tensor(index, dtype=torch.long)
    n, k = index.shape
    gates = torch.full((n, k), 1.0 / k) if gates is None else torch.as_tensor(gates, dtype=torch.float32)
    probs = torch.full((n, num_experts), 1.0 / num_experts) if probs is None else torch.as_tensor(probs, dtype=torch.float32)
    mask = None if mask is None else torch.as_tensor(mask, dtype=torch.bool)
    return Routing(probs.log(), probs, index, gates, mask, (1, n))


# ------------------------------------------------------------------------------------------- counting
def test_layer_counts_exact_and_padding_excluded():
    r = routing([[0, 1], [1, 2], [2, 3], [0, 3]], 4, mask=[True, True, False, True],
                gates=[[0.7, 0.3], [0.6, 0.4], [0.9, 0.1], [0.5, 0.5]],
                probs=[[0.4, 0.3, 0.2, 0.1], [0.1, 0.5, 0.3, 0.1], [0.25] * 4, [0.4, 0.1, 0.1, 0.4]])
    c = LayerCounts("l", 4, vocab_size=10)
    c.add(r, torch.tensor([[5, 6, 7, 5]]))
    assert c.counts.tolist() == [2, 2, 1, 1]  # the masked token (experts 2, 3) does not count
    assert c.num_tokens == 3 and c.num_slots == 6
    assert torch.allclose(c.gate_sum, torch.tensor([1.2, 0.9, 0.4, 0.5], dtype=torch.float64), atol=1e-6)
    assert torch.allclose(c.prob_sum, torch.tensor([0.9, 0.9, 0.6, 0.6], dtype=torch.float64), atol=1e-6)
    assert c.token_counts[5] == 2 and c.token_counts[6] == 1 and c.token_counts[7] == 0
    assert c.cooc[5].tolist() == [2, 1, 0, 1] and c.cooc[6].tolist() == [0, 1, 1, 0] and c.cooc.sum() == 6

    # Without a token mask, the pad id excludes positions.
    c2 = LayerCounts("l", 4, vocab_size=10)
    c2.add(routing([[0, 1], [1, 2], [2, 3], [0, 3]], 4), torch.tensor([5, 6, PAD, 5]), pad_id=PAD)
    assert c2.counts.tolist() == [2, 2, 1, 1] and c2.num_tokens == 3


def test_load_report_shares_and_summaries():
    layer = RoutedLayer(0, "encoder.layers.0.self_attn", "moa", 4, 2)
    c = LayerCounts(layer.name, 4)
    c.add(routing([[0, 1]] * 3 + [[0, 2]], 4))  # 4 tokens, slots: E0 4, E1 3, E2 1, E3 0
    from headmix.analysis.counts import RoutingStats

    rep = LoadReport.from_stats(RoutingStats([layer], {layer.name: c}, num_batches=1))
    l = rep[layer.name]
    assert l.counts == [4, 3, 1, 0]
    assert l.share == [0.5, 0.375, 0.125, 0.0]
    assert l.token_fraction == [1.0, 0.75, 0.25, 0.0] and math.isclose(sum(l.token_fraction), 2.0)
    assert l.max_share == 0.5 and l.min_share == 0.0 and l.max_min_ratio == math.inf
    shares = torch.tensor(l.share, dtype=torch.float64)
    assert math.isclose(l.cv, float(shares.std(unbiased=False) / shares.mean()))
    nz = shares[shares > 0]
    assert math.isclose(l.norm_entropy, float(-(nz * nz.log()).sum() / math.log(4)))
    assert math.isclose(sum(l.gate_share), 1.0) and math.isclose(sum(l.mean_prob), 1.0)
    md = rep.to_markdown()
    assert "| 0 | encoder.layers.0.self_attn | moa | 4 | 2 | 4 | 50.00% | 0.00% |" in md
    # the shares table: its headers are the experts' labels, its cells the shares under them
    assert "| layer | uniform | E0 | E1 | E2 | E3 |\n|---|---|---|---|---|---|\n" \
           "| encoder.layers.0.self_attn | 25.0% | 50.0% | 37.5% | 12.5% | 0.0% |" in md
    assert json.loads(rep.to_json())["layers"][0]["share"] == l.share


def test_streaming_equals_one_big_batch():
    g = torch.Generator().manual_seed(0)
    n, k, e, v = 50, 2, 5, 12
    index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    ids = torch.randint(0, v, (n,), generator=g)
    mask = torch.rand(n, generator=g) > 0.2
    gates = torch.rand(n, k, generator=g)
    probs = torch.rand(n, e, generator=g).softmax(-1)
    whole = LayerCounts("l", e, vocab_size=v)
    whole.add(routing(index, e, mask, gates, probs), ids)
    parts = LayerCounts("l", e, vocab_size=v)
    for a, b in ((0, 7), (7, 30), (30, 50)):
        parts.add(routing(index[a:b], e, mask[a:b], gates[a:b], probs[a:b]), ids[a:b])
    assert torch.equal(whole.counts, parts.counts) and torch.equal(whole.cooc, parts.cooc)
    assert torch.equal(whole.token_counts, parts.token_counts) and whole.num_tokens == parts.num_tokens
    assert torch.allclose(whole.gate_sum, parts.gate_sum) and torch.allclose(whole.prob_sum, parts.prob_sum)


# ------------------------------------------------------------------------------------------------ PMI
def test_pmi_matches_the_definition_by_hand():
    # k = 1. Token A (id 0) -> E0 three times, E1 once; token B (id 1) -> E1 four times. N = S = 8.
    cooc = torch.tensor([[3, 1], [0, 4], [0, 0]])
    pmi, log_pmi = pmi_matrix(cooc)
    # p(A)=1/2, p(B)=1/2, p(E0)=3/8, p(E1)=5/8
    assert math.isclose(pmi[0, 0], (3 / 8) / (1 / 2 * 3 / 8))  # 2
    assert math.isclose(pmi[0, 1], (1 / 8) / (1 / 2 * 5 / 8))  # 0.4
    assert math.isclose(pmi[1, 1], (4 / 8) / (1 / 2 * 5 / 8))  # 1.6
    assert pmi[1, 0] == 0 and log_pmi[1, 0] == -math.inf and pmi[2].tolist() == [0, 0]
    assert math.isclose(log_pmi[0, 0], math.log(2.0))

    # k = 2, 3 experts: p(token) is the share of occurrences (3 of A, 1 of B), p(token, expert) and
    # p(expert) are over the 8 slots.
    cooc2 = torch.tensor([[3, 2, 1], [1, 0, 1]])
    occurrences = torch.tensor([3, 1])
    pmi2, _ = pmi_matrix(cooc2, occurrences)
    for t, e in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 2)]:
        p_te = Fraction(int(cooc2[t, e]), 8)
        p_t = Fraction(int(occurrences[t]), 4)
        p_e = Fraction(int(cooc2[:, e].sum()), 8)
        assert math.isclose(pmi2[t, e], float(p_te / (p_t * p_e)), rel_tol=1e-12)
    # With every token filling k slots, the row sums give the same p(token).
    assert torch.allclose(pmi_matrix(cooc2)[0], pmi2)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), min_size=3, max_size=3), min_size=2, max_size=8))
def test_pmi_marginal_identities(rows):
    cooc = torch.tensor(rows)
    if cooc.sum() == 0:
        return
    pmi, _ = pmi_matrix(cooc)
    c = cooc.double()
    p_t, p_e = c.sum(1) / c.sum(), c.sum(0) / c.sum()
    # sum_t p(t) PMI(t, e) = sum_t p(t, e) / p(e) = 1 for every used expert, and symmetrically.
    used_e, used_t = p_e > 0, p_t > 0
    assert torch.allclose((p_t[:, None] * pmi).sum(0)[used_e], torch.ones(int(used_e.sum()), dtype=torch.float64))
    assert torch.allclose((p_e[None, :] * pmi).sum(1)[used_t], torch.ones(int(used_t.sum()), dtype=torch.float64))


def test_pmi_report_ranks_with_min_count_ties_and_special_tokens():
    c = LayerCounts("encoder.layers.0.self_attn", 2, vocab_size=8)
    # k = 1; id 2 (</s>) is special; id 7 is rare (2 occurrences, always E1).
    seq = [(2, 0)] * 6 + [(5, 0)] * 4 + [(5, 1)] * 1 + [(6, 0)] * 5 + [(6, 1)] * 5 + [(3, 1)] * 10 + [(7, 1)] * 2 + [(4, 0)] * 5
    ids = torch.tensor([t for t, _ in seq])
    c.add(routing([[e] for _, e in seq], 2), ids)
    layer = RoutedLayer(0, c.name, "moa", 2, 1)
    rep = PMIReport.from_counts(c, layer, top=3, min_count=3, exclude_ids=[2])
    pmi, _ = pmi_matrix(c.cooc, c.token_counts)
    e0 = [t.id for t in rep.experts[0].tokens]
    e1 = [t.id for t in rep.experts[1].tokens]
    # E0: id 4 (5/5) before id 5 (4/5) before id 6 (5/10); the special id 2 is not ranked.
    assert e0 == [4, 5, 6]
    # E1: id 3 (10/10), then id 6 (5/10) and id 5 (1/5); id 7 is too rare.
    assert e1 == [3, 6, 5]
    t = rep.experts[0].tokens[0]
    assert math.isclose(t.pmi, float(pmi[4, 0])) and t.joint == 5 and t.count == 5 and t.p_expert_given_token == 1.0
    assert t.token == "#4" and math.isclose(t.log_pmi, math.log(t.pmi))
    assert math.isclose(rep.experts[0].share, 20 / 38) and rep.num_tokens == 38
    # Ties in PMI break by the joint count, then the id.
    c3 = LayerCounts("l", 2, vocab_size=4)
    seq3 = [(1, 0)] * 5 + [(2, 0)] * 8 + [(3, 0)] * 8 + [(0, 1)] * 3
    c3.add(routing([[e] for _, e in seq3], 2), torch.tensor([t for t, _ in seq3]))
    assert [t.id for t in PMIReport.from_counts(c3, top=3, min_count=1).experts[0].tokens] == [2, 3, 1]
    # Tokens always routed to the same expert have exactly equal PMI (1 / (k p(e))), whatever their
    # counts: the most frequent comes first (floating-point noise must not reorder them).
    g = torch.Generator().manual_seed(3)
    c4 = LayerCounts("l", 3, vocab_size=60)
    occ = torch.randint(5, 400, (60,), generator=g)
    seq4 = [(v, v % 3) for v in range(60) for _ in range(int(occ[v]))]
    c4.add(routing([[e] for _, e in seq4], 3), torch.tensor([t for t, _ in seq4]))
    for e, ex in enumerate(PMIReport.from_counts(c4, top=20, min_count=1).experts):
        assert len({t.pmi for t in ex.tokens}) == 1
        expected = sorted((v for v in range(60) if v % 3 == e), key=lambda v: (-int(occ[v]), v))
        assert [t.id for t in ex.tokens] == expected
    md = rep.to_markdown()
    assert "| Expert | Share | Top 3 tokens by PMI |" in md and "| E1 | " in md and "`#3`" in md


def test_token_text_shows_text_with_a_word_start_marker(tmp_path):
    from headmix.data import train_tokenizer

    tok = train_tokenizer(["the house of Berlin", "a house in Paris", "Berlin Berlin Paris"] * 20, 300)
    ids = tok.encode(" Berlin")
    assert token_text(tok, ids[0]).startswith("\u2581")
    assert token_text(tok, tok.eos_id) == "</s>"
    assert token_text(tok, tok.encode("the")[0]) == tok.decode(tok.encode("the")[:1])
    space = tok.token_to_id("\u0120")  # byte-level symbol of a lone space
    if space is not None:
        assert token_text(tok, space) == "\u2581"
    newline = tok.token_to_id("\u010a")
    if newline is not None:
        assert token_text(tok, newline) == "\\n"
    assert token_text(None, 17) == "#17"


# --------------------------------------------------------------------------------------- models in memory
def tiny(preset: str, task: str = "translation", vocab: int = 60):
    torch.manual_seed(0)
    return build_model(get_config(preset, task=task, vocab_size=vocab)).eval()


def sentence_batches(n: int = 6, vocab: int = 60):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        s, t = 3 + i % 4, 2 + (i * 3) % 5
        out.append((torch.randint(5, vocab, (1, s), generator=g), torch.randint(5, vocab, (1, t), generator=g)))
    return out


def pad_together(items):
    longest = max(x.shape[1] for x in items)
    return torch.cat([torch.nn.functional.pad(x, (0, longest - x.shape[1]), value=PAD) for x in items])


def test_model_streaming_and_padding_do_not_change_the_counts():
    model = tiny("tiny-moa").double()
    sents = sentence_batches()
    one_by_one = collect_routing(model, [{"src": s, "tgt_in": t} for s, t in sents], cooccurrence=["encoder.layers.0.self_attn"])
    big = collect_routing(model, [(pad_together([s for s, _ in sents]), pad_together([t for _, t in sents]))],
                          cooccurrence=["encoder.layers.0.self_attn"])
    assert one_by_one.num_batches == 6 and big.num_batches == 1
    for name, c in one_by_one.counts.items():
        assert torch.equal(c.counts, big.counts[name].counts), name
        assert c.num_tokens == big.counts[name].num_tokens
    n_src = sum(s.numel() for s, _ in sents)
    assert one_by_one.counts["encoder.layers.0.self_attn"].num_tokens == n_src
    assert one_by_one.counts["decoder.layers.0.cross_attn"].num_tokens == sum(t.numel() for _, t in sents)
    name = "encoder.layers.0.self_attn"
    assert torch.equal(one_by_one.counts[name].cooc, big.counts[name].cooc)
    assert one_by_one.counts[name].cooc.sum() == 2 * n_src  # k = 2 slots per real token
    assert one_by_one.counts[name].cooc[PAD].sum() == 0


@pytest.mark.parametrize("task", ["translation", "mlm", "lm"])
def test_routing_without_the_output_projection_is_the_models_routing(task):
    from headmix.analysis.counts import model_routing

    model = tiny("tiny-moa", task)
    s, t = sentence_batches(2)[1]
    inputs = {"src": s, "tgt_in": t} if task == "translation" else {"input_ids": s}
    with torch.no_grad():
        full = model(**inputs).routing
        fast = model_routing(model, inputs)
    assert [n for n, _ in fast] == [n for n, _ in full] and len(full) == (6 if task == "translation" else 2)
    for (_, a), (_, b) in zip(fast, full):
        assert torch.equal(a.expert_index, b.expert_index) and torch.equal(a.probs, b.probs)


def test_expert_load_on_a_model_sums_to_one_per_layer():
    model = tiny("tiny-moa")
    rep = expert_load(model, [(s, t) for s, t in sentence_batches()])
    assert [l.name for l in rep.layers] == [l.name for l in routed_layers(model)]
    assert len(rep.layers) == 6 and model.training is False
    for l in rep.layers:
        assert math.isclose(sum(l.share), 1.0, rel_tol=1e-12) and sum(l.counts) == 2 * l.num_tokens
        assert math.isclose(sum(l.token_fraction), 2.0, rel_tol=1e-12)
    # Language models: tensors of input ids, decoder layers.
    lm = tiny("tiny-moa", "lm")
    rep = expert_load(lm, [torch.randint(5, 60, (2, 7))])
    assert [l.name for l in rep.layers] == ["decoder.layers.0.self_attn", "decoder.layers.1.self_attn"]
    assert all(l.num_tokens == 14 for l in rep.layers)


def test_token_expert_pmi_on_a_model_and_default_layer():
    model = tiny("tiny-moa")
    batches = [(s, t) for s, t in sentence_batches()]
    rep = token_expert_pmi(model, batches, min_count=1, top=3)
    assert rep.name == "encoder.layers.0.self_attn" and rep.num_tokens == sum(s.numel() for s, _ in batches)
    assert math.isclose(sum(e.share for e in rep.experts), 1.0)
    rep2 = token_expert_pmi(model, batches, layer="decoder.layers.1.cross_attn", min_count=1)
    assert rep2.name == "decoder.layers.1.cross_attn" and rep2.num_tokens == sum(t.numel() for _, t in batches)
    assert token_expert_pmi(model, batches, layer=3, min_count=1).name == "decoder.layers.0.cross_attn"
    assert select_layer(tiny("tiny-moa", "lm"), None).name == "decoder.layers.0.self_attn"


def test_bad_layers_and_models_give_clear_errors():
    model = tiny("tiny-moa")
    with pytest.raises(ValueError, match=r"layer 7 is out of range: this model has 6 routed MoA layers: "
                                         r"\[0\] encoder\.layers\.0\.self_attn, \[1\] encoder\.layers\.1\.self_attn"):
        token_expert_pmi(model, [], layer=7)
    with pytest.raises(ValueError, match="out of range"):
        select_layer(model, -1)
    with pytest.raises(ValueError, match=r"no routed layer named 'encoder.layers.9.self_attn'.*decoder\.layers\.1\.cross_attn"):
        select_layer(model, "encoder.layers.9.self_attn")
    mha = tiny("tiny-mha")
    with pytest.raises(ValueError, match=r"has none; its attention layers are: encoder\.layers\.0\.self_attn \(MultiHeadAttention\)"):
        expert_load(mha, [])
    with pytest.raises(ValueError, match="no Talking-Heads layer"):
        talking_heads_matrices(model)
    with pytest.raises(ValueError, match="MoH layer"):
        head_utilities(model, [])
    with pytest.raises(ValueError, match=r"needs \['src', 'tgt_in'\]"):
        as_model_inputs(model, torch.zeros(2, 3, dtype=torch.long))
    assert set(as_model_inputs(model, {"src": 1, "tgt_in": 2, "tgt_out": 3, "src_lengths": 4})) == {"src", "tgt_in"}


def test_moh_head_utilities():
    model = tiny("tiny-moh")
    batches = [(s, t) for s, t in sentence_batches()]
    rep = head_utilities(model, batches)
    load = expert_load(model, batches)
    assert len(rep.layers) == 6
    for l, ll in zip(rep.layers, load.layers):
        assert l.num_heads == 4 and l.num_shared_heads == 1 and l.top_k == 2
        assert l.active_fraction[0] == 1.0
        assert math.isclose(sum(l.active_fraction[1:]), 2.0)  # each token activates k = 2 routed heads
        assert l.routed_share == ll.share and l.num_tokens == ll.num_tokens
        # A fresh MoH layer: W_h = W_s = 0, so the group weights are exactly 1/2 each and the shared
        # head's weight a_s * S * softmax(0) is exactly 1.
        assert l.group_weights == [0.5, 0.5] and math.isclose(l.mean_weight[0], 1.0, rel_tol=1e-6)
        assert math.isclose(sum(l.weight_share), 1.0) and math.isclose(l.shared_weight_fraction, l.weight_share[0])
    assert "group weights shared / routed" in rep.to_markdown()


def test_moh_head_utilities_ignore_padding():
    model = tiny("tiny-moh").double()  # float64: padding must not flip a near-tie of the router
    sents = sentence_batches()
    one_by_one = head_utilities(model, sents)
    padded = head_utilities(model, [(pad_together([s for s, _ in sents]), pad_together([t for _, t in sents]))])
    for a, b in zip(one_by_one.layers, padded.layers):
        assert a.num_tokens == b.num_tokens
        assert a.active_fraction == pytest.approx(b.active_fraction, rel=1e-12)
        assert a.mean_weight == pytest.approx(b.mean_weight, rel=1e-9)
        assert a.group_weights == pytest.approx(b.group_weights, rel=1e-9)
        assert a.active_fraction[0] == 1.0  # the shared head: active on every real token, not on padding


def test_talking_heads_matrices(tmp_path):
    model = tiny("tiny-talking-heads")
    layer = model.encoder.layers[0].self_attn
    with torch.no_grad():
        layer.pre_mix.copy_(torch.eye(4) + 0.5 * torch.ones(4, 4))
    rep = talking_heads_matrices(model)
    assert len(rep.layers) == 6
    first = rep.layers[0]
    assert first.name == "encoder.layers.0.self_attn" and first.role == "encoder self-attention"
    assert first.pre.matrix[0] == [1.5, 0.5, 0.5, 0.5]
    assert math.isclose(first.pre.identity_distance, 0.5 * 4)  # ||0.5 * ones(4, 4)||_F = 2
    assert math.isclose(first.pre.off_diagonal_fraction, 6 / 12)
    assert first.post.identity_distance == 0.0 and rep.layers[1].pre.identity_distance == 0.0
    assert "pre-softmax | 2.0000 |" in rep.to_markdown()
    # The heatmaps draw the matrices (rows: layers; columns: pre, post), and M - I with deviation.
    two = TalkingHeadsReport(rep.layers[:2])  # two layers keep the drawing quick
    for deviation in (False, True):
        fig = two.figure(deviation=deviation)
        images = [ax.images[0].get_array() for ax in fig.axes if ax.images]
        assert len(images) == 4
        expected = torch.eye(4) + 0.5 * torch.ones(4, 4) - (torch.eye(4) if deviation else 0)
        assert torch.allclose(torch.tensor(images[0].data), expected)
        assert torch.allclose(torch.tensor(images[1].data), torch.eye(4) * (0 if deviation else 1))
        lim = float(expected.abs().max())
        assert images and fig.axes[0].images[0].get_clim() == (-lim, lim)
    assert is_png(two.plot(tmp_path / "th.png"))


def is_png(path: Path) -> bool:
    """A PNG file that matplotlib reads back as an image of some size."""
    import matplotlib.image

    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and min(matplotlib.image.imread(path).shape[:2]) > 50


def bar_heights(ax) -> list[float]:
    return [p.get_height() for p in ax.patches]


def hand_load_report() -> LoadReport:
    """Two layers with hand-made counts: E0..E3 get 4, 3, 1, 0 slots; 2 experts get 5 and 5."""
    from headmix.analysis.counts import RoutingStats

    a, b = RoutedLayer(0, "encoder.layers.0.self_attn", "moa", 4, 2), RoutedLayer(1, "decoder.layers.0.self_attn", "moh", 2, 1)
    ca, cb = LayerCounts(a.name, 4), LayerCounts(b.name, 2)
    ca.add(routing([[0, 1]] * 3 + [[0, 2]], 4))
    cb.add(routing([[0]] * 5 + [[1]] * 5, 2))
    return LoadReport.from_stats(RoutingStats([a, b], {a.name: ca, b.name: cb}, num_batches=1))


def test_load_markdown_headers_name_each_layers_own_experts():
    """Layers with other experts (MoA's E0..E3, MoH's routed heads h1, h2) get a shares table each, whose
    headers are their labels: no column headed by an index over a cell naming another head."""
    md = hand_load_report().to_markdown()
    assert "| layer | uniform | E0 | E1 | E2 | E3 |\n|---|---|---|---|---|---|\n| encoder.layers.0.self_attn | 25.0% |" in md
    assert "| layer | uniform | h0 | h1 |\n|---|---|---|---|\n| decoder.layers.0.self_attn | 50.0% | 50.0% | 50.0% |" in md


# ---------------------------------------------------------------------- MoH routed per K/V group (GQE)
def gqe_model():
    """``llama3-tiny-moh-per-group``: 8 heads in 2 K/V groups, per group 1 shared head and the top 2 of 3 routed heads.
    The group and shared gates (zero at initialisation) are drawn at random so that the two groups' weights
    differ and a mix-up of groups or heads shows."""
    torch.manual_seed(0)
    model = build_model(get_config("llama3-tiny-moh-per-group", task="lm", vocab_size=60)).double().eval()
    with torch.no_grad():
        for layer in routed_layers(model):
            layer.module.group_gate.weight.normal_(0, 0.5)
            layer.module.shared_gate.weight.normal_(0, 0.5)
    return model


def gqe_ids() -> torch.Tensor:
    return torch.randint(5, 60, (3, 11), generator=torch.Generator().manual_seed(4))


def test_gqe_layers_are_routed_layers_with_a_group_per_kv_head():
    layer = routed_layers(gqe_model())[0]
    assert (layer.kind, layer.num_experts, layer.top_k, layer.num_groups, layer.group_kind) == ("moh", 6, 2, 2, "K/V group")
    assert layer.slots_per_token == 4 and layer.shared_head_ids == [0, 4]
    assert layer.routed_head_ids == layer.module.routed_head_ids == [1, 2, 3, 5, 6, 7]
    assert layer.shared_head_ids == layer.module.shared_head_ids
    assert layer.expert_labels == ["g0.h1", "g0.h2", "g0.h3", "g1.h5", "g1.h6", "g1.h7"]


def load_beside_routing(model) -> tuple[LoadReport, dict[str, Routing], torch.Tensor]:
    """The expert load of ``model`` on :func:`gqe_ids` with one sequence's tail padded, the model's own
    routing of the same ids per layer name, and the real (non-padding) tokens' mask ``(B*T,)``."""
    ids = gqe_ids()
    ids[1, 7:] = 0  # padding: never counted
    report = expert_load(model, [ids])
    with torch.no_grad():
        routing = dict(model.decoder(ids).routing)
    return report, routing, ids.reshape(-1) != PAD


def test_gqe_expert_load_per_kv_group_is_the_models_routing():
    report, routing, real = load_beside_routing(gqe_model())
    for layer in report.layers:
        expected = torch.bincount(routing[layer.name].expert_index[real].reshape(-1), minlength=6)
        assert layer.counts == expected.tolist() and layer.num_tokens == int(real.sum())
        assert (layer.num_groups, layer.top_k) == (2, 2) and len(layer.groups) == 2
        for g, group in enumerate(layer.groups):
            c_g = expected.view(2, 3)[g].double()
            assert int(c_g.sum()) == 2 * layer.num_tokens  # top 2 in each group, every token
            assert group["label"] == f"g{g}" and group["share"] == pytest.approx((c_g / c_g.sum()).tolist(), rel=1e-12)
            assert group["max_share"] == pytest.approx(float(c_g.max() / c_g.sum()), rel=1e-12)
        assert sum(layer.mean_prob) == pytest.approx(2.0)  # a softmax per group
    md = report.to_markdown()
    assert "| layer | uniform | g0.h1 | g0.h2 | g0.h3 | g1.h5 | g1.h6 | g1.h7 |" in md
    assert "Per K/V group (shares of the group's own slots):" in md and "| decoder.layers.1.self_attn | g1 | 3 |" in md
    fig = report.layer_figure(0)
    assert [t.get_text() for t in fig.axes[0].texts] == ["g0", "g1"]
    assert [list(line.get_xdata()) for line in fig.axes[0].lines[1:]] == [[2.5, 2.5]]  # between h3 and h5


def test_gqe_head_utilities_per_kv_group():
    model, ids = gqe_model(), gqe_ids()
    report = head_utilities(model, [ids])
    load = expert_load(model, [ids])
    for layer, loaded in zip(report.layers, load.layers):
        module = dict(model.named_modules())[layer.name]
        x = {}
        handle = module.register_forward_hook(lambda m, a, kw, out: x.update(q=a[0] if a else kw["query"]),
                                              with_kwargs=True)
        with torch.no_grad():
            model.decoder(ids)
            handle.remove()
            g, routing = module.head_weights(x["q"], None)
            pairs = torch.nn.functional.linear(x["q"], module.group_gate.weight).view(-1, 2, 2).softmax(-1)
        g = g.reshape(-1, 8)
        assert layer.head_labels == ["h0*", "h1", "h2", "h3", "h4*", "h5", "h6", "h7"] and layer.num_groups == 2
        assert layer.mean_weight == pytest.approx(g.mean(0).tolist(), rel=1e-9)
        active = torch.zeros(8, dtype=torch.float64)
        active[[0, 4]] = 1.0
        active[[1, 2, 3, 5, 6, 7]] = torch.tensor(loaded.counts, dtype=torch.float64) / ids.numel()
        assert layer.active_fraction == pytest.approx(active.tolist(), rel=1e-12)
        for group, heads in zip(layer.groups, ([0, 1, 2, 3], [4, 5, 6, 7])):
            assert group["heads"] == heads
            assert group["group_weights"] == pytest.approx(pairs[:, group["group"]].mean(0).tolist(), rel=1e-9)
            assert group["shared_weight_fraction"] == pytest.approx(float(g[:, heads[0]].sum() / g[:, heads].sum()))
            assert group["routed_share"] == pytest.approx(loaded.groups[group["group"]]["share"], rel=1e-12)
        assert layer.groups[0]["group_weights"] != pytest.approx(layer.groups[1]["group_weights"], abs=1e-3)
        assert layer.group_weights == pytest.approx(pairs.mean((0, 1)).tolist(), rel=1e-9)
    md = report.to_markdown()
    assert "2 + 6 in 2 K/V groups" in md and "| decoder.layers.0.self_attn | g1 | h4*, h5, h6, h7 |" in md
    assert [t.get_text() for t in report.figure().axes[0].texts] == ["g0", "g1"]


def test_gqe_token_expert_pmi_shares_per_kv_group():
    from headmix.analysis import pmi_matrix

    model, ids = gqe_model(), gqe_ids()
    report = token_expert_pmi(model, [ids], layer=1, min_count=1, top=3)
    counts = collect_routing(model, [ids], layers=[report.name], cooccurrence=[report.name]).counts[report.name]
    pmi, _ = pmi_matrix(counts.cooc, counts.token_counts)
    slots = counts.cooc.sum(0).view(2, 3).double()
    assert [e.group for e in report.experts] == [0, 0, 0, 1, 1, 1]
    assert [e.share for e in report.experts] == pytest.approx((slots / slots.sum(1, keepdim=True)).reshape(-1).tolist())
    for e in report.experts:
        assert [t.pmi for t in e.tokens] == pytest.approx([float(pmi[t.id, e.expert]) for t in e.tokens], rel=1e-12)
    md = report.to_markdown()
    assert "top-2 in each of 2 K/V groups" in md and "| Routed head | Share of its group |" in md and "| g1.h7 |" in md


# ------------------------------------------------------------ the paper's Grouped Query Experts (kind "gqe")
#: 6 query-head experts on 2 K/V heads: per group the top 2 of 3 (k > 1, so slot order and groups both show).
PAPERS_GQE = AttentionConfig(kind="gqe", num_experts=6, kv_heads=2, top_k=2, head_dim=8, bias=False, rotary=True)


def papers_gqe_config(vocab: int = 60):
    return get_config("llama3-tiny-gqe", task="lm", vocab_size=vocab).replace(decoder_self_attention=PAPERS_GQE)


def papers_gqe_model():
    """``llama3-tiny-gqe`` with a smaller GQE as its self-attention (6 experts of 8); the routers (near uniform at
    initialisation) drawn large so that the experts' loads and the two groups differ."""
    torch.manual_seed(0)
    model = build_model(papers_gqe_config()).double().eval()
    with torch.no_grad():
        for layer in routed_layers(model):
            layer.module.router_gate.weight.normal_(0, 0.5)
    return model


def test_papers_gqe_layers_are_routed_layers_with_a_group_per_kv_head():
    from headmix.analysis.layers import describe_routed

    layers = routed_layers(papers_gqe_model())
    layer = layers[0]
    assert (layer.kind, layer.num_experts, layer.top_k) == ("gqe", 6, 2)
    assert (layer.num_groups, layer.group_kind) == (2, "K/V group")
    assert layer.slots_per_token == 4 and [layer.group_of(e) for e in range(6)] == [0, 0, 0, 1, 1, 1]
    assert layer.expert_labels == ["g0.E0", "g0.E1", "g0.E2", "g1.E0", "g1.E1", "g1.E2"]
    assert describe_routed(layers).startswith("2 routed GQE layers: [0] decoder.layers.0.self_attn")


def test_papers_gqe_expert_load_per_kv_group_is_the_models_routing():
    report, routing, real = load_beside_routing(papers_gqe_model())
    for layer in report.layers:
        r = routing[layer.name]
        expected = torch.bincount(r.expert_index[real].reshape(-1), minlength=6)
        assert layer.counts == expected.tolist() and layer.num_tokens == int(real.sum())
        assert (layer.kind, layer.num_groups, layer.top_k) == ("gqe", 2, 2) and len(layer.groups) == 2
        gates = torch.zeros(6, dtype=torch.float64).index_add_(0, r.expert_index[real].reshape(-1),
                                                                r.gates[real].reshape(-1).double())
        for g, group in enumerate(layer.groups):
            c_g, w_g = expected.view(2, 3)[g].double(), gates.view(2, 3)[g]
            assert int(c_g.sum()) == 2 * layer.num_tokens  # top 2 in each group, every token
            assert group["label"] == f"g{g}" and group["share"] == pytest.approx((c_g / c_g.sum()).tolist(), rel=1e-12)
            assert group["max_share"] == pytest.approx(float(c_g.max() / c_g.sum()), rel=1e-12)
            assert group["gate_share"] == pytest.approx((w_g / w_g.sum()).tolist(), rel=1e-9)
            assert group["gate_fraction"] == pytest.approx(float(w_g.sum() / layer.num_tokens), rel=1e-9)  # w sums to 1
        assert layer.groups[0]["share"] != pytest.approx(layer.groups[1]["share"], abs=1e-3)
        assert layer.mean_prob == pytest.approx(r.probs[real].mean(0).tolist(), rel=1e-9)
        assert sum(layer.mean_prob) == pytest.approx(2.0)  # a softmax per group
    md = report.to_markdown()
    assert "| layer | uniform | g0.E0 | g0.E1 | g0.E2 | g1.E0 | g1.E1 | g1.E2 |" in md
    assert "| 0 | decoder.layers.0.self_attn | gqe | 6 | 2 |" in md
    row = report.layers[1].groups[1]
    assert f"| decoder.layers.1.self_attn | g1 | 3 | {100 * row['max_share']:.2f}% |" in md
    assert md.split("\n")[-2].endswith(f" | {100 * row['gate_fraction']:.1f}% |")
    fig = report.layer_figure(0)
    assert [t.get_text() for t in fig.axes[0].texts] == ["g0", "g1"] and fig.axes[0].get_xlabel() == "expert"


def test_papers_gqe_token_expert_pmi_shares_per_kv_group():
    model, ids = papers_gqe_model(), gqe_ids()
    report = token_expert_pmi(model, [ids], layer=1, min_count=1, top=3)
    counts = collect_routing(model, [ids], layers=[report.name], cooccurrence=[report.name]).counts[report.name]
    with torch.no_grad():
        index = dict(model.decoder(ids).routing)[report.name].expert_index
    cooc = torch.zeros(60, 6, dtype=torch.long).index_put_((ids.reshape(-1, 1).expand_as(index), index),
                                                           torch.tensor(1), accumulate=True)
    assert torch.equal(counts.cooc, cooc)
    pmi, _ = pmi_matrix(cooc, torch.bincount(ids.reshape(-1), minlength=60))
    slots = cooc.sum(0).view(2, 3).double()
    assert [e.group for e in report.experts] == [0, 0, 0, 1, 1, 1]
    assert [e.label for e in report.experts] == ["g0.E0", "g0.E1", "g0.E2", "g1.E0", "g1.E1", "g1.E2"]
    assert [e.share for e in report.experts] == pytest.approx((slots / slots.sum(1, keepdim=True)).reshape(-1).tolist())
    for e in report.experts:
        assert [t.pmi for t in e.tokens] == pytest.approx([float(pmi[t.id, e.expert]) for t in e.tokens], rel=1e-12)
    md = report.to_markdown()
    assert "GQE layer with 6 experts, top-2 in each of 2 K/V groups" in md
    assert "| Expert | Share of its group |" in md and "| g1.E2 |" in md


def test_papers_gqe_head_utilities_refused_in_one_line_naming_load_and_pmi():
    with pytest.raises(ValueError, match=r"Grouped Query Experts layers decoder\.layers\.0\.self_attn, "
                                         r"decoder\.layers\.1\.self_attn have no MoH head weights: use "
                                         r"`headmix analyze load` .* `headmix analyze pmi`") as err:
        head_utilities(papers_gqe_model(), [gqe_ids()])
    assert "\n" not in str(err.value)


def test_load_plots_draw_the_shares(tmp_path):
    rep = hand_load_report()
    fig = rep.figure()
    assert fig.__class__.__name__ == "Figure"
    first, second = fig.axes[:2]
    assert bar_heights(first) == [50.0, 37.5, 12.5, 0.0] and bar_heights(second) == [50.0, 50.0]
    colors = [p.get_facecolor() for p in first.patches]
    from matplotlib.colors import to_rgba
    assert colors == [to_rgba(c) for c in ("tab:red", "tab:blue", "tab:blue", "tab:orange")]
    assert [p.get_facecolor() for p in second.patches] == [to_rgba("tab:blue")] * 2  # even: no max/min colour
    assert list(first.lines[0].get_ydata()) == [25.0, 25.0] and list(second.lines[0].get_ydata()) == [50.0, 50.0]
    assert [t.get_text() for t in first.get_xticklabels()] == rep.layers[0].labels
    assert len(fig.axes) == 2
    single = rep.layer_figure(1)
    assert bar_heights(single.axes[0]) == [50.0, 50.0] and "routed head" in single.axes[0].get_xlabel()

    summary = rep.summary_figure()
    shares, cv, entropy = summary.axes
    assert [list(line.get_ydata()) for line in shares.lines] == [[50.0, 50.0], [0.0, 50.0], [25.0, 50.0]]
    assert bar_heights(cv) == [rep.layers[0].cv, 0.0]
    assert bar_heights(entropy) == [rep.layers[0].norm_entropy, 1.0]
    assert [t.get_text() for t in cv.get_xticklabels()] == [l.name for l in rep.layers]

    assert is_png(rep.plot(tmp_path / "a.png")) and is_png(rep.plot_summary(tmp_path / "s.png"))
    paths = rep.plot_layers(tmp_path / "layers")
    assert [p.name for p in paths] == ["00_encoder.layers.0.self_attn.png", "01_decoder.layers.0.self_attn.png"]
    assert all(is_png(p) for p in paths)


def test_pmi_plot_draws_the_log_pmi_of_the_top_tokens(tmp_path):
    c = LayerCounts("encoder.layers.0.self_attn", 2, vocab_size=6)
    seq = [(3, 0)] * 4 + [(4, 0)] * 2 + [(4, 1)] * 2 + [(5, 1)] * 6
    c.add(routing([[e] for _, e in seq], 2), torch.tensor([t for t, _ in seq]))
    rep = PMIReport.from_counts(c, top=2, min_count=1)
    fig = rep.figure()
    for ax, expert in zip(fig.axes, rep.experts):
        # best token at the top: the bars are drawn bottom-up
        assert [p.get_width() for p in ax.patches] == [t.log_pmi for t in reversed(expert.tokens)]
        assert [t.get_text() for t in ax.get_yticklabels()] == [t.token for t in reversed(expert.tokens)]
        assert [t.get_text() for t in ax.texts] == [f" n={t.count}" for t in reversed(expert.tokens)]
    # by hand: p(3) = 4/14, p(E0) = 6/14, p(3, E0) = 4/14 -> PMI 14/6; token 4 on E0: (2/14) / (4/14 * 6/14) = 7/6
    assert [t.id for t in rep.experts[0].tokens] == [3, 4]
    widths = [p.get_width() for p in fig.axes[0].patches]
    assert widths == pytest.approx([math.log(7 / 6), math.log(14 / 6)], rel=1e-12)
    assert is_png(rep.plot(tmp_path / "p.png"))


def test_moh_heads_plot_draws_weights_and_active_fractions(tmp_path):
    model = tiny("tiny-moh")
    rep = head_utilities(model, sentence_batches(3))
    rep = HeadUtilityReport(rep.layers[:2])
    fig = rep.figure()
    bars = [ax for ax in fig.axes if ax.patches]
    assert len(bars) == len(rep.layers)
    for ax, layer in zip(bars, rep.layers):
        assert bar_heights(ax) == pytest.approx(layer.mean_weight, rel=1e-12)
    dots = [ax for ax in fig.axes if ax.lines]
    for ax, layer in zip(dots, rep.layers):
        assert list(ax.lines[0].get_ydata()) == pytest.approx([100 * a for a in layer.active_fraction], rel=1e-12)
    assert is_png(rep.plot(tmp_path / "h.png"))


def test_plotting_leaves_the_backend_and_pyplot_alone(tmp_path):
    # A notebook's backend must not change, and no figure is left open in pyplot.
    import matplotlib
    import matplotlib.pyplot as plt

    before = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        open_figures = plt.get_fignums()
        rep = hand_load_report()
        rep.plot(tmp_path / "a.png")
        rep.plot_summary(tmp_path / "s.png")
        rep.plot_layers(tmp_path / "layers")
        TalkingHeadsReport(talking_heads_matrices(tiny("tiny-talking-heads")).layers[:1]).plot(tmp_path / "th.png")
        c = LayerCounts("l", 2, vocab_size=4)
        c.add(routing([[0], [1], [1]], 2), torch.tensor([1, 2, 2]))
        PMIReport.from_counts(c, min_count=1).plot(tmp_path / "p.png")
        moh = head_utilities(tiny("tiny-moh"), sentence_batches(2))
        HeadUtilityReport(moh.layers[:1]).plot(tmp_path / "h.png")
        assert matplotlib.get_backend() == "svg"
        assert plt.get_fignums() == open_figures
    finally:
        matplotlib.use(before)


def test_reports_serialise(tmp_path):
    model = tiny("tiny-moa")
    batches = [(s, t) for s, t in sentence_batches()]
    pmi = token_expert_pmi(model, batches, min_count=1)
    data = json.loads(pmi.to_json(tmp_path / "p.json"))
    assert data["layer"]["name"] == "encoder.layers.0.self_attn" and len(data["experts"]) == 4
    assert json.loads((tmp_path / "p.json").read_text()) == data


# ------------------------------------------------------------------------------------ runs and the CLI
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A tiny MoA and a tiny MoH translation run (4 training steps each), plus untrained runs for
    Talking-Heads and the language models that reuse the MoA run's tokenizer."""
    root = tmp_path_factory.mktemp("analysis_runs")
    pairs = root / "pairs.tsv"
    write_tsv_pairs(load_embedded_translation()[:600], pairs)
    out = {}
    for preset in ("tiny-moa", "tiny-moh"):
        cfg = TrainConfig(task="translation", preset=preset, out=str(root / preset), data=[str(pairs)], vocab_size=300,
                          max_steps=4, max_tokens=600, max_len=32, warmup_steps=2, log_every=2, eval_every=4,
                          save_every=4, average_last=1, valid_size=0.05, test_size=0.05, progress=False)
        train(cfg)
        out[preset] = root / preset
    tok = Tokenizer.load(out["tiny-moa"] / "tokenizer")
    docs = load_embedded_documents(sources="kjv-bible")[:8]
    for name, preset, task in (("talking", "tiny-talking-heads", "translation"), ("lm", "tiny-moa", "lm"),
                               ("mlm", "tiny-moa", "mlm"), ("switchhead", "tiny-switchhead", "translation"),
                               ("gqe", "llama3-tiny-moh-per-group", "lm"), ("papers-gqe", None, "lm")):
        run = root / name
        torch.manual_seed(0)
        config = papers_gqe_config(tok.vocab_size) if preset is None else get_config(preset, task=task,
                                                                                     vocab_size=tok.vocab_size)
        build_model(config).save_pretrained(run)
        shutil.copytree(out["tiny-moa"] / "tokenizer", run / "tokenizer")
        (run / "data").mkdir()
        if task == "translation":
            shutil.copy(out["tiny-moa"] / "data" / "valid.tsv", run / "data" / "valid.tsv")
        else:
            write_jsonl_documents(docs, run / "data" / "valid.jsonl")
            (run / "train_config.json").write_text(json.dumps({"task": task, "max_len": 32, "seed": 1}))
        out[name] = run
    return out


def test_cli_load_writes_json_markdown_and_pngs(runs, tmp_path, capsys):
    out = tmp_path / "load"
    assert main(["analyze", "load", str(runs["tiny-moa"]), "--out", str(out)]) == 0
    data = json.loads((out / "load.json").read_text())
    assert data["source"].endswith("valid.tsv") and len(data["layers"]) == 6
    for layer in data["layers"]:
        assert math.isclose(sum(layer["share"]), 1.0, rel_tol=1e-9) and layer["num_tokens"] > 0
    assert (out / "load.md").read_text().startswith("| # | layer |")
    assert is_png(out / "load.png") and is_png(out / "load_summary.png")
    layer_pngs = sorted((out / "load_layers").glob("*.png"))
    assert len(layer_pngs) == 6 and all(is_png(p) for p in layer_pngs)
    assert "encoder.layers.0.self_attn" in capsys.readouterr().out
    # --data and --limit: the same run on the first 5 pairs of its test split.
    out2 = tmp_path / "load2"
    assert main(["analyze", "load", str(runs["tiny-moa"]), "--data", str(runs["tiny-moa"] / "data" / "test.tsv"),
                 "--limit", "5", "--out", str(out2)]) == 0
    data2 = json.loads((out2 / "load.json").read_text())
    assert data2["layers"][0]["num_tokens"] < data["layers"][0]["num_tokens"]


def test_cli_load_switchhead_per_head_and_side(runs, tmp_path, capsys):
    out = tmp_path / "load_sh"
    assert main(["analyze", "load", str(runs["switchhead"]), "--out", str(out)]) == 0
    data = json.loads((out / "load.json").read_text())
    # 6 attention layers, each with a value and an output side, 2 heads of 4 experts
    assert len(data["layers"]) == 12 and data["layers"][1]["name"] == "encoder.layers.0.self_attn:output"
    for layer in data["layers"]:
        assert layer["kind"] == "switchhead" and len(layer["groups"]) == 2 and layer["num_tokens"] > 0
        assert sum(layer["counts"]) == 2 * 2 * layer["num_tokens"]  # k = 2 slots per head per token
        for head in layer["groups"]:
            assert math.isclose(sum(head["share"]), 1.0, rel_tol=1e-9)
    assert len(list((out / "load_layers").glob("*.png"))) == 12
    assert "decoder.layers.0.cross_attn:value" in capsys.readouterr().out


def test_cli_pmi_table_shows_token_text(runs, tmp_path, capsys):
    out = tmp_path / "pmi"
    assert main(["analyze", "pmi", str(runs["tiny-moa"]), "--top", "5", "--min-count", "3", "--out", str(out)]) == 0
    md = (out / "pmi.md").read_text()
    assert "`encoder.layers.0.self_attn`" in md and "| Expert | Share | Top 5 tokens by PMI |" in md
    rows = [line for line in md.splitlines() if line.startswith("| E")]
    assert len(rows) >= 4
    data = json.loads((out / "pmi.json").read_text())
    tokens = [t for e in data["experts"] for t in e["tokens"]]
    assert tokens and data["min_count"] == 3 and all(t["count"] >= 3 for t in tokens)
    tok = Tokenizer.load(runs["tiny-moa"] / "tokenizer")
    for t in tokens:  # shown as text (word starts marked), not as ids
        assert t["token"] == token_text(tok, t["id"]) and t["token"] != f"#{t['id']}"
        assert "|" in t["token"] or "`" in t["token"] or f"`{t['token']}`" in md
    assert is_png(out / "pmi.png")
    capsys.readouterr()
    assert main(["analyze", "pmi", str(runs["tiny-moa"]), "--layer", "7", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "layer 7 is out of range: this model has 6 routed MoA layers: [0] encoder.layers.0.self_attn" in err
    assert main(["analyze", "pmi", str(runs["tiny-moa"]), "--layer", "decoder.layers.0.cross_attn", "--min-count", "1",
                 "--out", str(out)]) == 0
    assert json.loads((out / "pmi.json").read_text())["layer"]["name"] == "decoder.layers.0.cross_attn"


def test_cli_heads_for_moh_and_talking_heads(runs, tmp_path, capsys):
    out = tmp_path / "heads"
    assert main(["analyze", "heads", str(runs["tiny-moh"]), "--out", str(out)]) == 0
    data = json.loads((out / "moh_heads.json").read_text())
    assert len(data["layers"]) == 6 and math.isclose(sum(data["layers"][0]["group_weights"]), 1.0, rel_tol=1e-6)  # float32 means
    assert is_png(out / "moh_heads.png") and (out / "moh_heads.md").is_file()
    out2 = tmp_path / "th"
    assert main(["analyze", "heads", str(runs["talking"]), "--out", str(out2)]) == 0
    assert json.loads((out2 / "talking_heads.json").read_text())["layers"] and (out2 / "talking_heads.md").is_file()
    assert is_png(out2 / "talking_heads.png") and is_png(out2 / "talking_heads_deviation.png")
    capsys.readouterr()
    assert main(["analyze", "heads", str(runs["tiny-moa"]), "--out", str(out2)]) == 2
    assert "MixtureOfAttentionHeads" in capsys.readouterr().err
    assert main(["analyze", "load", str(runs["talking"]), "--out", str(out2)]) == 2
    assert "TalkingHeadsAttention" in capsys.readouterr().err


def test_not_a_run_is_file_not_found(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_analysis_run(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors not found"):
        load_analysis_run(tmp_path)
    assert main(["analyze", "load", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    assert "run folder not found" in capsys.readouterr().err


def test_missing_split_is_file_not_found(runs, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"test\.tsv not found"):
        next(run_batches(runs["talking"], split="test"))


def test_language_model_runs(runs, tmp_path):
    model, tok = load_analysis_run(runs["mlm"])
    batches = list(run_batches(runs["mlm"], tok))
    assert batches and all(not (b["input_ids"] == tok.mask_id).any() for b in batches)  # unmasked text
    masked = list(run_batches(runs["mlm"], tok, mlm_masking=True))
    assert any((b["input_ids"] == tok.mask_id).any() for b in masked)
    rep = token_expert_pmi(model, batches, tokenizer=tok, min_count=2)
    real = sum(int(b["input_ids"].ne(tok.pad_id).sum()) for b in batches)
    assert rep.name == "encoder.layers.0.self_attn" and rep.num_tokens == real
    assert main(["analyze", "load", str(runs["lm"]), "--out", str(tmp_path / "lm")]) == 0
    data = json.loads((tmp_path / "lm" / "load.json").read_text())
    assert [l["name"] for l in data["layers"]] == ["decoder.layers.0.self_attn", "decoder.layers.1.self_attn"]


def test_cli_analyses_a_papers_gqe_run_per_kv_group(runs, tmp_path, capsys):
    """The paper's GQE (kind "gqe"): load and PMI per K/V group; the MoH head utilities refused, naming them."""
    out = tmp_path / "papers-gqe"
    assert main(["analyze", "load", str(runs["papers-gqe"]), "--out", str(out)]) == 0
    data = json.loads((out / "load.json").read_text())
    assert [(l["kind"], len(l["groups"])) for l in data["layers"]] == [("gqe", 2)] * 2
    assert all(math.isclose(sum(g["share"]), 1.0, rel_tol=1e-9) for l in data["layers"] for g in l["groups"])
    assert all(math.isclose(sum(g["gate_fraction"] for g in l["groups"]), 1.0, rel_tol=1e-6) for l in data["layers"])
    assert "Per K/V group" in (out / "load.md").read_text() and is_png(out / "load.png")
    assert main(["analyze", "pmi", str(runs["papers-gqe"]), "--min-count", "1", "--out", str(out)]) == 0
    pmi = json.loads((out / "pmi.json").read_text())
    assert [e["label"] for e in pmi["experts"]] == ["g0.E0", "g0.E1", "g0.E2", "g1.E0", "g1.E1", "g1.E2"]
    assert is_png(out / "pmi.png")
    capsys.readouterr()
    assert main(["analyze", "heads", str(runs["papers-gqe"]), "--out", str(out)]) == 2
    assert "have no MoH head weights: use `headmix analyze load`" in capsys.readouterr().err


def test_cli_analyses_a_run_routed_per_kv_group(runs, tmp_path, capsys):
    """MoH routed per K/V group (GQE): load, heads and PMI per group, where they were refused before."""
    out = tmp_path / "gqe"
    assert main(["analyze", "load", str(runs["gqe"]), "--out", str(out)]) == 0
    data = json.loads((out / "load.json").read_text())
    assert [len(l["groups"]) for l in data["layers"]] == [2, 2]
    assert all(math.isclose(sum(g["share"]), 1.0, rel_tol=1e-9) for l in data["layers"] for g in l["groups"])
    assert "Per K/V group" in (out / "load.md").read_text() and is_png(out / "load.png")
    assert main(["analyze", "heads", str(runs["gqe"]), "--out", str(out)]) == 0
    heads = json.loads((out / "moh_heads.json").read_text())
    assert [[g["heads"] for g in l["groups"]] for l in heads["layers"]] == [[[0, 1, 2, 3], [4, 5, 6, 7]]] * 2
    assert main(["analyze", "pmi", str(runs["gqe"]), "--min-count", "1", "--out", str(out)]) == 0
    pmi = json.loads((out / "pmi.json").read_text())
    assert [e["group"] for e in pmi["experts"]] == [0, 0, 0, 1, 1, 1] and is_png(out / "pmi.png")
