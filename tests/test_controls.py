"""The study controls: the random-routing control of every routed layer (``router="random"``), the static
control (the dense model with the routed row's active compute) and MoSA evaluated with causal selection."""

from __future__ import annotations

import json

import pytest
import torch

from headmix import MixtureOfAttentionHeads, MixtureOfHeadsAttention, SwitchHeadAttention
from headmix.attention.reference import reference_moa, reference_moh, reference_switchhead
from headmix.models import AttentionConfig, analytic_parameters, build_model, count_parameters, get_config
from headmix.models.counting import attention_macs, attention_parameters
from headmix.routing.random import EVAL_SALT, RandomRouter, reference_random_choice, splitmix64, splitmix64_int
from headmix.study import StudySpec, plan, run_study
from headmix.study.spec import RowSpec

D = 32


def moa(**kw):
    return MixtureOfAttentionHeads(D, 6, 2, 8, router="random", **{"router_seed": 11, **kw})


def moh(**kw):
    return MixtureOfHeadsAttention(D, 8, 1, 1, 8, router="random", kv_heads=2, route_per_group=True,
                                   **{"router_seed": 11, **kw})


def switchhead(**kw):
    return SwitchHeadAttention(D, 2, 4, 2, 8, router="random", **{"router_seed": 11, **kw})


LAYERS = {"moa": moa, "moh": moh, "moh_sparse": lambda **kw: moh(impl="sparse", **kw),
          "moh_global": lambda **kw: MixtureOfHeadsAttention(D, 6, 2, 2, 8, router="random",
                                                             **{"router_seed": 11, **kw}),
          "switchhead": switchhead}
REFERENCES = {"moa": reference_moa, "moh": reference_moh, "moh_sparse": reference_moh, "moh_global": reference_moh,
              "switchhead": reference_switchhead}


def _x(seed: int = 0, batch: int = 2, time: int = 7) -> torch.Tensor:
    return torch.randn(batch, time, D, generator=torch.Generator().manual_seed(seed))


def _choice(out) -> torch.Tensor:
    """The experts chosen in one call (SwitchHead: both sides)."""
    routing = out.routing
    if hasattr(routing, "output"):
        return torch.cat([routing.value.expert_index, routing.output.expert_index], dim=1)
    return routing.expert_index


def test_the_hash_and_the_choice_match_plain_integers():
    values = torch.tensor([0, 1, -1, 2 ** 62, -(2 ** 63), 123456789])
    assert [int(v) & (2 ** 64 - 1) for v in splitmix64(values)] == [splitmix64_int(int(v) & (2 ** 64 - 1))
                                                                     for v in values]
    router = RandomRouter(6, 2, groups=2, router_seed=12345)
    for salt in (0, 1):
        index = router.choose(3, 5, offset=4)
        expected = [[reference_random_choice(12345, salt, 0, b, t + 4, g, 6, 2) for g in range(2)]
                    for b in range(3) for t in range(5)]
        assert torch.equal(index, torch.tensor(expected))
    router.eval()
    expected = [[reference_random_choice(12345, EVAL_SALT, 1, b, t, 0, 6, 2)] for b in range(2) for t in range(3)]
    assert torch.equal(RandomRouter(6, 2, router_seed=12345).eval().choose(2, 3, stream=1), torch.tensor(expected))


def test_the_choice_is_uniform():
    """Every expert as often as the others, every pair of experts as often as the others, k distinct experts per
    token."""
    index = RandomRouter(6, 2, router_seed=3).eval().choose(64, 500).view(-1, 2)
    assert (index[:, 0] != index[:, 1]).all()
    share = torch.bincount(index.reshape(-1), minlength=6).double() / index.numel()
    assert torch.allclose(share, torch.full((6,), 1 / 6, dtype=torch.float64), atol=0.005)
    pairs = torch.bincount(index.min(1).values * 6 + index.max(1).values, minlength=36).double()
    pairs = pairs[pairs > 0] / index.shape[0]
    assert len(pairs) == 15 and torch.allclose(pairs, torch.full((15,), 1 / 15, dtype=torch.float64), atol=0.005)


@pytest.mark.parametrize("kind", list(LAYERS))
def test_random_layers_match_the_plain_reference(kind):
    """The output with the randomly chosen experts and the weights the layer gives at equal router scores
    (MoA 1/k, MoH every active head 1, SwitchHead 1/2) equals the plain reference, which builds the choice
    from plain integers; no auxiliary loss; no router parameters."""
    torch.manual_seed(0)
    layer = LAYERS[kind]().double().eval()
    x = _x().double()
    out = layer(x, is_causal=True)
    torch.testing.assert_close(out.output, REFERENCES[kind](layer, x, is_causal=True))
    assert out.aux_loss.item() == 0.0 and not out.aux_loss.requires_grad and not out.losses
    names = [n for n, _ in layer.named_parameters()]
    assert not [n for n in names if "gate" in n or "router" in n or "selector" in n], names


@pytest.mark.parametrize("kind", list(LAYERS))
def test_uniform_weights(kind):
    routing = LAYERS[kind]().eval()(_x(), is_causal=True).routing
    if kind == "switchhead":
        for side in (routing.value, routing.output):
            assert torch.equal(side.gates, torch.full_like(side.gates, 0.5))
    else:
        expected = 1 / 2 if kind == "moa" else 1.0  # MoA: 1/k; MoH renormalised: every active head 1
        assert torch.equal(routing.gates, torch.full_like(routing.gates, expected))
        per = routing.probs.shape[1] // (2 if kind in ("moh", "moh_sparse") else 1)  # GQE: per group
        assert torch.allclose(routing.probs, torch.full_like(routing.probs, 1 / per))


@pytest.mark.parametrize("kind", list(LAYERS))
def test_the_choice_is_deterministic_per_seed(kind):
    """The same seed chooses the same experts, another seed others; an unseeded layer draws its seed from
    torch's generator (a run's seed fixes it); training calls choose anew, evaluation calls the same."""
    x = _x()
    same = [_choice(LAYERS[kind]().train()(x)) for _ in range(2)]
    assert torch.equal(same[0], same[1])
    assert not torch.equal(same[0], _choice(LAYERS[kind](router_seed=12)(x)))
    drawn = []
    for _ in range(2):
        torch.manual_seed(5)
        drawn.append(_choice(LAYERS[kind](router_seed=None)(x)))
    assert torch.equal(drawn[0], drawn[1])
    layer = LAYERS[kind]().train()
    first, second = _choice(layer(x)), _choice(layer(x))
    assert not torch.equal(first, second)
    layer.eval()
    assert torch.equal(_choice(layer(x)), _choice(layer(x)))


@pytest.mark.parametrize("kind", list(LAYERS))
def test_a_resumed_layer_chooses_what_an_uninterrupted_one_chooses(kind):
    x = _x()
    layer = LAYERS[kind]().train()
    for _ in range(3):
        layer(x)
    resumed = LAYERS[kind](router_seed=99).train()
    resumed.load_state_dict(layer.state_dict())
    assert torch.equal(_choice(resumed(x)), _choice(layer(x)))


@pytest.mark.parametrize("kind", ["moa", "moh", "moh_global", "switchhead"])
def test_cached_decoding_chooses_what_the_full_forward_chooses(kind):
    layer = LAYERS[kind]().eval()
    x = _x(time=6)
    full = layer(x, is_causal=True)
    out = layer(x[:, :4], is_causal=True, use_cache=True)
    outputs = [out.output]
    for t in (4, 5):
        out = layer(x[:, t:t + 1], cache=out.cache, use_cache=True)
        outputs.append(out.output)
    torch.testing.assert_close(torch.cat(outputs, dim=1), full.output)


RANDOM_CONFIGS = {"moa": dict(kind="moa", num_experts=8, top_k=4, kv_heads=2, head_dim=16),
                  "moh": dict(kind="moh", num_heads=8, kv_heads=2, route_per_group=True, num_shared_heads=1, top_k=2,
                              head_dim=16, moh_impl="dense"),
                  "switchhead": dict(kind="switchhead", num_heads=2, num_experts=4, top_k=2, head_dim=16, bias=False)}


@pytest.mark.parametrize("kind", list(RANDOM_CONFIGS))
def test_macs_and_parameters_without_a_router(kind):
    """The random control counts no router: the learned layer's count minus the router's, by hand, and the
    model's measured parameters agree."""
    learned = AttentionConfig(**RANDOM_CONFIGS[kind])
    random = AttentionConfig(**RANDOM_CONFIGS[kind], router="random")
    t, d = 16, 64
    router_width = {"moa": 8, "moh": 6 + 2 + 4, "switchhead": 2 * 2 * 4}[kind]  # outputs of x W per token
    assert attention_macs(learned, d, t, t)[0] - attention_macs(random, d, t, t)[0] == t * d * router_width
    assert attention_parameters(learned, d)[0] - attention_parameters(random, d)[0] == d * router_width
    config = get_config("llama-tiny-mha", task="lm")
    config = config.replace(decoder_self_attention=random)
    assert analytic_parameters(config).total == count_parameters(build_model(config))


@pytest.mark.parametrize("changes,match", [
    (dict(kind="moh", num_heads=4, num_shared_heads=1, top_k=1, router="sigmoid"), r"^attention\.router must be"),
    (dict(kind="switchhead", num_heads=2, num_experts=4, top_k=2, router="softmax"), r"^attention\.router must be"),
    (dict(kind="mha", num_heads=4, router="random"), r"^attention\.router applies to kind"),
])
def test_config_errors_are_one_line_and_name_the_field(changes, match):
    with pytest.raises(ValueError, match=match) as err:
        AttentionConfig(**changes)
    assert "\n" not in str(err.value)


def test_layer_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"^router must be one of"):
        MixtureOfHeadsAttention(D, 4, 1, 1, router="learned")
    with pytest.raises(ValueError, match=r"^router_seed must be"):
        moa(router_seed=-1)
    with pytest.raises(ValueError, match=r"^renormalize applies to learned routers"):
        moa(renormalize="none")
    with pytest.raises(ValueError, match=r"^expert_dropout applies to the learned selectors"):
        switchhead(expert_dropout=0.1)


def test_config_builds_random_layers_and_keeps_the_stored_form():
    for kind, fields in RANDOM_CONFIGS.items():
        att = AttentionConfig(**fields, router="random")
        assert att.build(64).random_routing
        assert AttentionConfig.from_dict(json.loads(json.dumps(att.to_dict()))) == att
        if kind != "moa":  # MoH and SwitchHead keep their learned router unset (the stored form of older files)
            assert AttentionConfig(**fields).router is None
    assert AttentionConfig.from_dict({**RANDOM_CONFIGS["moh"], "router": "softmax"}).router is None


def test_the_static_control_of_gqe_is_gqa_with_its_active_query_heads_at_equal_macs():
    """``lm-en-contenders``' static control of GQE (1 shared + top 1 of each group's 4 heads, 2 K/V heads):
    grouped-query attention with 2 query heads per K/V head, no router, its head size solved to GQE's MACs;
    its attention MACs by hand."""
    from headmix.study import get_study

    spec = get_study("lm-en-contenders")
    rows = {r.name: r for r in plan(spec)}
    static = rows["GQE static"].config.decoder_self_attention
    assert (static.kind, static.num_heads, static.kv_heads) == ("mha", 4, 2)
    assert {r.name: r.control_of for r in spec.rows if r.control_of} == {
        "GQE random": "GQE", "MoA kv2 random": "MoA kv2", "GQE static": ["GQE", "GQE mean"],
        "GQE mean random": "GQE mean"}
    t, d, h, g, dh = 128, 128, 4, 2, static.head_dim
    layers = rows["GQE static"].config.decoder_layers
    by_hand = layers * (t * d * h * dh + t * d * 2 * g * dh + 2 * h * t * t * dh + t * h * dh * d)
    assert rows["GQE static"].attention_macs == by_hand
    assert abs(by_hand / rows["GQA"].attention_macs - 1) <= spec.tolerance


def test_a_study_with_controls_and_causal_mosa_reports_them(tmp_path, docs_file):
    """A tiny study with a routed row, its random twin, its static control and a MoSA row evaluated both ways:
    the report has the controls table (routed minus control, paired by seed) and the causal-selection gap."""
    # per K/V group the top 1 of 2 heads, "scaled" (a router that learns: headmix.routing.task_gradient)
    moh_row = {"kind": "moh", "num_heads": 4, "kv_heads": 2, "route_per_group": True, "num_shared_heads": 0,
               "top_k": 1, "head_weighting": "scaled"}
    rows = [RowSpec("MHA"), RowSpec("GQE", moh_row, ["head_dim"]),
            RowSpec("GQE random", {**moh_row, "router": "random"}, ["head_dim"], control_of="GQE"),
            RowSpec("GQE static", {"kind": "mha", "num_heads": 2, "kv_heads": 2}, ["head_dim"], control_of="GQE"),
            RowSpec("MoSA", {"kind": "mosa", "num_dense_heads": 1, "head_dim": 16, "sparsity": 4, "bias": False},
                    ["num_sparse_heads"], causal_eval=True)]
    spec = StudySpec(name="tiny-controls", task="lm", baseline="llama-tiny-mha", data=[str(docs_file)], seeds=[1, 2],
                     max_steps=4, rows=rows, tolerance=0.1, timing_rounds=6, timing_steps=1, timing_warmup=0,
                     training={"max_len": 32, "max_tokens": 400, "vocab_size": 300, "warmup_steps": 1,
                               "eval_every": 1, "log_every": 1, "save_every": 3, "average_last": 1,
                               "keep_checkpoints": 1, "valid_size": 0.05, "test_size": 0.05})
    spec.validate()
    out = tmp_path / "study"
    results = run_study(spec, out, log=lambda m: None)
    assert len(results) == 10
    mosa = [r for r in results if r.row == "MoSA"]
    assert all(r.evaluation["valid_nll_topk"] == pytest.approx(r.summary["valid"]["nll"], rel=1e-4) for r in mosa)
    assert all(r.evaluation["valid_nll_threshold"] != r.evaluation["valid_nll_topk"] for r in mosa)  # another rule
    from headmix.study.report import write_report

    table = write_report(spec, plan(spec), results, out)
    controls = {c["control"]: c for c in table["controls"]}
    nll = {(r.row, r.seed): r.summary["valid"]["nll"] for r in results}
    expected = sum(nll[("GQE", s)] - nll[("GQE random", s)] for s in (1, 2)) / 2
    assert controls["GQE random"]["equal_macs"]["mean"] == pytest.approx(expected)
    assert controls["GQE static"]["equal_time"] is not None
    gap = table["causal_selection"][0]["gap"]
    assert gap["mean"] == pytest.approx(sum(r.evaluation["valid_nll_threshold"] - r.evaluation["valid_nll_topk"]
                                            for r in mosa) / 2)
    text = (out / "results.md").read_text()
    assert "#### Controls" in text and "| GQE | GQE random |" in text and "#### MoSA: causal selection" in text


def test_a_study_folder_takes_new_rows_but_not_changed_ones(tmp_path):
    from headmix.study.runner import _write_plan, check_plan

    spec = StudySpec(name="s", task="lm", baseline="llama-tiny-mha", rows=[RowSpec("MHA")], max_steps=3)
    _write_plan(spec, plan(spec), tmp_path)
    spec.rows.append(RowSpec("MoH", {"kind": "moh", "num_heads": 4, "num_shared_heads": 1, "top_k": 2},
                             ["head_dim"], control_of="MHA"))
    check_plan(spec, plan(spec), tmp_path)
    _write_plan(spec, plan(spec), tmp_path)
    # which rows a control serves is how the report pairs runs, not what they train: it may change
    spec.rows.append(RowSpec("MoH random", {**spec.rows[1].attention, "router": "random"}, ["head_dim"]))
    _write_plan(spec, plan(spec), tmp_path)
    spec.rows[2] = RowSpec("MoH random", spec.rows[2].attention, ["head_dim"], control_of="MoH")
    check_plan(spec, plan(spec), tmp_path)
    for changed in (RowSpec("MoH random", {**spec.rows[1].attention, "top_k": 1, "router": "random"}, ["head_dim"],
                            control_of="MoH"),
                    RowSpec("MoH random", spec.rows[2].attention, ["head_dim"], causal_eval=True, control_of="MoH")):
        moved = StudySpec(name="s", task="lm", baseline="llama-tiny-mha", rows=[*spec.rows[:2], changed], max_steps=3)
        with pytest.raises(ValueError, match="holds another study"):
            check_plan(moved, plan(moved), tmp_path)


def test_spec_errors_name_the_row():
    base = dict(name="s", task="lm", baseline="llama-tiny-mha", max_steps=3)
    with pytest.raises(ValueError, match=r"rows\['X'\]\.control_of must name a row of the study"):
        StudySpec(rows=[RowSpec("MHA"), RowSpec("X", {"kind": "mha", "num_heads": 2}, control_of="Y")], **base).validate()
    with pytest.raises(ValueError, match=r"rows\['X'\]\.causal_eval applies to MoSA rows"):
        StudySpec(rows=[RowSpec("MHA"), RowSpec("X", {"kind": "mha", "num_heads": 2}, causal_eval=True)],
                  **base).validate()


def test_averaged_checkpoints_keep_the_random_routers_seed(tmp_path):
    """Averaging the final weights (``average_last``) averages weights only: the random control's seed (an
    integer beyond float64's 53-bit mantissa) stays exact, its call counter is the last checkpoint's."""
    from safetensors.torch import save_file

    from headmix.runs.checkpoints import MODEL_FILE, average_checkpoints

    layer = moa(router_seed=2 ** 62 - 1)
    paths = []
    for i in range(2):
        layer.train()(_x())
        (tmp_path / str(i)).mkdir()
        save_file({k: v.contiguous() for k, v in layer.state_dict().items()}, str(tmp_path / str(i) / MODEL_FILE))
        paths.append(tmp_path / str(i))
    averaged = average_checkpoints(paths)
    assert averaged["router.seed"].item() == 2 ** 62 - 1 and averaged["router.calls"].item() == 2


def test_the_report_names_the_random_routing_control():
    from headmix.study.report import _attention_text

    assert _attention_text({"kind": "moa", "num_experts": 8, "top_k": 4, "head_dim": 16, "kv_heads": 2,
                            "router": "random"}) == "MoA 4K8E16D, 2 K/V heads, random routing"
