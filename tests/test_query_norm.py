"""MoH's ``router="query_norm"``, the parameter-free rule of the MoH authors' MoH-LLaMA3: each token's routed heads
ranked by the L2 norm of their queries (before rotary and QK-norm) over its standard deviation, the top k and the
shared heads weighted 1. Checked against the plain reference (float64, outputs and gradients) on the dense and
sparse paths, globally and per K/V group, with rotary, QK-norm, biases, padding, cached decoding,
torch.compile(fullgraph=True), the config, the MACs count, the Hugging Face wrapper, export-hf and the
conversions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from headmix.attention import MixtureOfHeadsAttention
from headmix.attention.reference import reference_moh, reference_query_norm_weights
from headmix.models import AttentionConfig, build_model, get_config
from headmix.models.counting import attention_macs, attention_parameters

D = 32


def make(heads=8, shared=2, top_k=2, seed=0, **kw) -> MixtureOfHeadsAttention:
    torch.manual_seed(seed)
    layer = MixtureOfHeadsAttention(D, heads, shared, top_k, 4, router="query_norm", **kw).double().eval()
    with torch.no_grad():
        for p in layer.parameters():  # biases and norm weights away from their initial values, so each matters
            p.normal_(0.0, 0.3)
    return layer


def padding() -> torch.Tensor:
    mask = torch.zeros(3, 9, dtype=torch.bool)
    mask[1, 6:] = True
    mask[2, 2:] = True
    return mask


LAYOUTS = {
    "global": dict(heads=8, shared=2, top_k=3),
    "global-gqa": dict(heads=8, shared=3, top_k=2, kv_heads=2),  # the shared heads end inside a K/V group
    "per-group": dict(heads=8, shared=1, top_k=2, kv_heads=2, route_per_group=True),
    "no-shared": dict(heads=6, shared=0, top_k=2, kv_heads=3),
}


@pytest.mark.parametrize("impl", ["dense", "sparse"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("extras", ["plain", "rotary+qk_norm+bias", "gate"])
@pytest.mark.parametrize("masks", ["causal", "causal+padding"])
def test_outputs_and_gradients_match_the_plain_reference(impl, layout, extras, masks):
    options = {"plain": {"bias": False}, "rotary+qk_norm+bias": {"rotary": True, "qk_norm": True, "bias": True},
               "gate": {"output_gate": "headwise"}}[extras]
    layer = make(**LAYOUTS[layout], **options, impl=impl)
    x = torch.randn(3, 9, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    kw = {"is_causal": True, **({"key_padding_mask": padding()} if "padding" in masks else {})}
    out = layer(x, **kw)
    expected = reference_moh(layer, x, **kw)
    # the layer's rotary tables are float32 (as Llama's), the reference's float64: 2e-6 with rotary
    tol, rtol = (2e-6, 1e-6) if "rotary" in extras else (1e-10, 0)
    torch.testing.assert_close(out.output, expected, rtol=rtol, atol=tol)
    weights = torch.linspace(-1, 1, D, dtype=torch.float64)
    params = [p for p in layer.parameters()]
    got = torch.autograd.grad((out.output * weights).square().sum(), [x, *params])
    want = torch.autograd.grad((expected * weights).square().sum(), [x, *params])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=rtol, atol=tol)
    assert out.aux_loss.item() == 0.0 and not out.losses


def test_the_choice_is_the_authors_softmax_of_norm_over_std_and_every_active_head_weighs_one():
    """The routing the layer returns: its chosen heads are the top k of ``softmax(||q|| / std)`` computed as
    the authors' code does, its scores ``||q|| / std`` and its probabilities their softmax; every active head
    (shared and selected) weighs 1; no router parameters."""
    layer = make(**LAYOUTS["global"], rotary=True)
    x = torch.randn(2, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out = layer(x, is_causal=True)
    q = layer.q_proj(x).view(10, 8, 4)[:, 2:]                     # the routed heads' queries, before rotary
    norms = torch.stack([torch.norm(q[:, i], p=2, dim=1) for i in range(6)], dim=1)
    scores = norms / norms.std(dim=1, keepdim=True)
    torch.testing.assert_close(out.routing.logits, scores)
    torch.testing.assert_close(out.routing.probs, scores.softmax(-1))
    chosen = torch.topk(scores.softmax(-1), k=3, dim=1).indices
    assert torch.equal(out.routing.expert_index.sort(1).values, chosen.sort(1).values)
    assert torch.equal(out.routing.gates, torch.ones(10, 3, dtype=torch.float64))
    g, _ = layer.head_weights(x, None)
    assert set(g.unique().tolist()) == {0.0, 1.0} and (g[..., :2] == 1).all() and (g.sum(-1) == 5).all()
    assert [n for n, _ in layer.named_parameters() if "gate" in n or "router" in n] == []


def test_equal_norms_and_a_single_routed_head():
    """Equal norms (standard deviation 0): scores 0, uniform probabilities, and torch.topk's choice among equal
    values (the first heads); one routed head per group: no standard deviation, the head always selected. Both
    as the reference says, without NaN."""
    layer = make(heads=6, shared=1, top_k=2)
    with torch.no_grad():
        layer.q_proj.weight.zero_()
        layer.q_proj.bias.fill_(0.5)  # every head's query is the same vector: equal norms
    x = torch.randn(2, 4, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out = layer(x, is_causal=True)
    assert torch.equal(out.routing.logits, torch.zeros(8, 5, dtype=torch.float64))
    assert torch.equal(out.routing.expert_index, torch.topk(torch.zeros(8, 5), 2).indices)
    torch.testing.assert_close(out.output, reference_moh(layer, x, is_causal=True), rtol=0, atol=1e-12)
    single = make(heads=4, shared=1, top_k=1, kv_heads=2, route_per_group=True)  # 1 routed head per group
    out = single(x, is_causal=True)
    assert torch.isfinite(out.routing.logits).all() and torch.equal(out.routing.expert_index, torch.tensor([[0, 1]] * 8))
    assert (reference_query_norm_weights(single, x) == 1).all()
    torch.testing.assert_close(out.output, reference_moh(single, x, is_causal=True), rtol=0, atol=1e-12)


@pytest.mark.parametrize("impl", ["dense", "sparse"])
def test_the_norm_is_taken_before_qk_norm(impl):
    """With QK-norm every normalised query has about the same norm: the rule must read the raw ones. Scaling one
    routed head's query projection up makes it every token's first choice."""
    layer = make(heads=6, shared=2, top_k=1, qk_norm=True, bias=False, impl=impl)
    with torch.no_grad():
        layer.q_proj.weight[5 * 4:6 * 4] *= 100.0
    x = torch.randn(2, 4, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    assert (layer(x, is_causal=True).routing.expert_index == 3).all()


@pytest.mark.parametrize("impl", ["dense", "sparse"])
@pytest.mark.parametrize("layout", ["global-gqa", "per-group"])
def test_cached_decoding_equals_the_full_forward(impl, layout):
    layer = make(**LAYOUTS[layout], rotary=True, impl=impl)
    x = torch.randn(2, 7, D, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    full = layer(x, is_causal=True)
    out = layer(x[:, :4], is_causal=True, use_cache=True)
    outputs, chosen = [out.output], [out.routing.expert_index.view(2, 4, -1)]
    for t in range(4, 7):
        out = layer(x[:, t:t + 1], cache=out.cache, use_cache=True)
        outputs.append(out.output)
        chosen.append(out.routing.expert_index.view(2, 1, -1))
    torch.testing.assert_close(torch.cat(outputs, dim=1), full.output, rtol=0, atol=1e-12)
    assert torch.equal(torch.cat(chosen, dim=1), full.routing.expert_index.view(2, 7, -1))


@pytest.mark.parametrize("impl", ["dense", "sparse"])
def test_compiles_fullgraph_and_computes_the_same(impl):
    layer = make(**LAYOUTS["per-group"], rotary=True, impl=impl)
    x = torch.randn(2, 6, D, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, is_causal=True, key_padding_mask=padding()[:2, :6]).output,
                               layer(x, is_causal=True, key_padding_mask=padding()[:2, :6]).output, rtol=0, atol=1e-12)


def test_refusals_are_one_line_and_name_the_argument():
    with pytest.raises(ValueError, match=r"^head_weighting must be 'renormalized' with router='query_norm'"):
        MixtureOfHeadsAttention(D, 8, 2, 2, router="query_norm", head_weighting="paper")
    with pytest.raises(ValueError, match=r"^router must be one of \('softmax', 'random', 'query_norm'\)"):
        MixtureOfHeadsAttention(D, 8, 2, 2, router="norm")
    base = dict(kind="moh", num_heads=8, num_shared_heads=2, top_k=2, router="query_norm")
    with pytest.raises(ValueError, match=r"^attention\.head_weighting must be 'renormalized' \(or unset\) with router"):
        AttentionConfig(**base, head_weighting="scaled").validate(D)
    layer = AttentionConfig(**base).build(D)
    assert layer.query_norm_routing and layer.routed_gate is None


def test_macs_count_the_whole_query_projection_and_no_router():
    """Sparse MoH with the query-norm rule computes every head's query (the rule reads them) but attention rows and
    output projections only for the active heads; no router projection and no router parameters."""
    common = dict(kind="moh", num_heads=8, num_shared_heads=2, top_k=2, moh_impl="sparse")
    learned, norm = AttentionConfig(**common), AttentionConfig(**common, router="query_norm")
    t, d, dh = 16, D, 4
    router = t * d * (6 + 2 + 2)  # W_r over the routed heads, W_s over the shared ones, W_h's two
    queries = t * d * (8 - 4) * dh  # the unselected heads' queries, which the rule reads
    assert attention_macs(norm, d, t, t)[0] == attention_macs(learned, d, t, t)[0] - router + queries
    assert attention_parameters(norm, d)[0] == attention_parameters(learned, d)[0] - d * (6 + 2 + 2)


def _norm_model(preset="llama-tiny-moh", **changes):
    torch.manual_seed(0)
    config = get_config(preset, task="lm", vocab_size=60)
    att = dataclasses.replace(config.decoder_self_attention, router="query_norm", **changes)
    return build_model(config.replace(decoder_self_attention=att)).eval()


def test_the_hugging_face_wrapper_and_export_hf_keep_the_rule(tmp_path):
    pytest.importorskip("transformers")
    from headmix.cli.main import main as cli_main
    from headmix.hf import HeadmixForCausalLM, hf_to_headmix

    model = _norm_model()
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(7))
    expected = model(ids).logits
    hf = HeadmixForCausalLM.from_headmix(model).eval()
    assert torch.equal(hf(ids).logits, expected)
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    model.save_pretrained(tmp_path / "run")
    (tmp_path / "run" / "tokenizer").mkdir()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 60)}}
    Tokenizer(WordLevel(vocab, unk_token="<pad>")).save(str(tmp_path / "run" / "tokenizer" / "tokenizer.json"))
    assert cli_main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    back = hf_to_headmix(tmp_path / "hf")
    assert back.config.decoder_self_attention.router == "query_norm"
    assert torch.equal(back.eval()(ids).logits, expected)
    import transformers

    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(auto(ids).logits, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("route_per_group", [False, True])
def test_moh_from_dense_with_the_rule_is_the_dense_layer_when_every_head_is_active(route_per_group):
    """The conversion of one dense layer (headmix.interop.moh_from_dense) with router='query_norm': no router to
    zero, the dense layer's output when top_k is every routed head, the reference's when it is fewer."""
    from headmix.attention import MultiHeadAttention
    from headmix.interop import moh_from_dense

    torch.manual_seed(0)
    dense = MultiHeadAttention(D, 8, kv_heads=2, rotary=True, qk_norm=True).double().eval()
    x = torch.randn(2, 6, D, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    shared = 1 if route_per_group else 2
    routed = 3 if route_per_group else 6
    every = moh_from_dense(dense, shared, routed, router="query_norm", route_per_group=route_per_group).eval()
    torch.testing.assert_close(every(x, is_causal=True).output, dense(x, is_causal=True).output, rtol=0, atol=1e-12)
    fewer = moh_from_dense(dense, shared, 1, router="query_norm", route_per_group=route_per_group).eval()
    torch.testing.assert_close(fewer(x, is_causal=True).output, reference_moh(fewer, x, is_causal=True),
                               rtol=1e-6, atol=2e-6)
