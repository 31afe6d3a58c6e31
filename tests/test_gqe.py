"""Grouped Query Experts (arXiv 2606.20945, ``kind="gqe"``): the slot-form layer against the plain reference
written from the paper's eq. 6, the router's task gradient (present with the weighted slot, absent with hard
slots only, as the paper's Table 2 finds), cached decoding, the random control, compile, config and counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_gqa import assert_decoding_equals_full_forward, assert_preallocated_decoding_equals_full_forward, masks_for
from torch._dynamo.testing import CompileCounter

from headmix import GroupedQueryExpertsAttention
from headmix.attention.reference import reference_gqe, reference_gqe_selection
from headmix.models import AttentionConfig
from headmix.models.counting import _flop_counter, attention_macs, attention_parameters

D = 18

#: Odd sizes: heads of 5, 3 K/V heads of 3 experts each (or 2 of 4), k of 1 and 2, every ablation.
CONFIGS = {
    "paper": dict(num_experts=6, kv_heads=3, top_k=1),
    "top2": dict(num_experts=8, kv_heads=2, top_k=2),
    "top2_rotary_half": dict(num_experts=8, kv_heads=2, top_k=2, rotary=True, rotary_fraction=0.5),
    "hard_only": dict(num_experts=6, kv_heads=3, top_k=1, weighted_slot=False, allow_router_without_task_gradient=True),
    "no_shared": dict(num_experts=8, kv_heads=2, top_k=2, shared_head=False),
    "unnormalized_p_scaled": dict(num_experts=8, kv_heads=2, top_k=2, weighted_slot_renormalize=False,
                                  hard_slot_scale="p", bias=False),
    "random": dict(num_experts=8, kv_heads=2, top_k=2, router="random", router_seed=5, rotary=True),
    "one_group": dict(num_experts=4, kv_heads=1, top_k=2),
}
MASKS = ["none", "padding", "causal", "causal_padding", "float_mask", "fully_masked_row"]


def gqe_layer(dtype=torch.float64, **kw) -> GroupedQueryExpertsAttention:
    torch.manual_seed(0)
    opts = dict(head_dim=5)
    opts.update(kw)
    layer = GroupedQueryExpertsAttention(D, **opts).to(dtype).eval()
    if layer.router_gate is not None:  # a router far from uniform, so that the selections differ
        with torch.no_grad():
            layer.router_gate.weight.normal_(0, 1.0)
    return layer


def check_against_reference(layer, x: torch.Tensor, mem: torch.Tensor | None, masks: dict, atol: float) -> None:
    """The layer and :func:`reference_gqe` give the same outputs and the same gradients of a random projection of
    them: the inputs' and every parameter's (a parameter without a gradient, the router of the hard-only
    ablation, has none in both)."""
    inputs = [x] if mem is None else [x, mem]
    results = []
    for run in (lambda q, m: layer(q, m, **masks).output, lambda q, m: reference_gqe(layer, q, m, **masks)):
        copies = [t.clone().requires_grad_() for t in inputs]
        out = run(copies[0], copies[1] if mem is not None else None)
        weights = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
        params = list(layer.parameters())
        grads = torch.autograd.grad((out * weights).sum(), copies + params, allow_unused=True)
        results.append((out, grads))
    (out, got), (expected, want) = results
    torch.testing.assert_close(out, expected, atol=atol, rtol=1e-7)
    names = ["query", "key"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, got, want):
        if b is None:
            assert a is None, name
        else:
            torch.testing.assert_close(a, b, atol=atol, rtol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def tolerance(layer) -> float:
    # rotary angles are computed in float32 by the layer (as Llama), in float64 by the reference
    return 1e-6 if layer.rotary is not None else 1e-11


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("case", MASKS)
def test_layer_matches_reference_outputs_and_gradients(config, case):
    layer = gqe_layer(**CONFIGS[config])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, D, dtype=torch.float64, generator=gen)
    check_against_reference(layer, x, None, masks_for(case, 2, 7, 7, gen), atol=tolerance(layer))


@pytest.mark.parametrize("config", ["paper", "top2"])
def test_cross_attention_and_batch_masks_match_reference(config):
    layer = gqe_layer(**CONFIGS[config])
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, D, dtype=torch.float64, generator=gen)
    mem = torch.randn(2, 9, D, dtype=torch.float64, generator=gen)
    mask = torch.rand(2, 5, 9, generator=gen) < 0.3  # (batch, tgt, src)
    check_against_reference(layer, x, mem, {"attn_mask": mask}, atol=1e-11)


def test_slots_are_the_selected_experts_in_decreasing_p_order():
    """Slot ``(g, j)`` holds the ``j``-th largest ``p`` of group ``g``: the routing's experts, in slot order, are
    the reference's, and their probabilities decrease along each group."""
    layer = gqe_layer(num_experts=12, kv_heads=3, top_k=3)
    x = torch.randn(2, 6, D, dtype=torch.float64)
    routing = layer(x).routing
    p, chosen = reference_gqe_selection(layer, x)
    want = torch.tensor([[g * 4 + e for g in range(3) for e in chosen[b][t][g]] for b in range(2) for t in range(6)])
    assert torch.equal(routing.expert_index, want)
    picked = routing.probs.gather(1, routing.expert_index).view(12, 3, 3)
    assert (picked[..., :-1] > picked[..., 1:]).all()
    torch.testing.assert_close(routing.probs.view(2, 6, 3, 4), p)
    torch.testing.assert_close(routing.gates.sum(-1), torch.ones(12, dtype=torch.float64))


def _task_gradient_of_router(layer: GroupedQueryExpertsAttention):
    x = torch.randn(2, 9, D, dtype=torch.float64)
    out = layer(x, is_causal=True)
    task = (out.output * torch.randn_like(out.output)).sum()  # the task loss only: aux_loss left out
    (grad,) = torch.autograd.grad(task, [layer.router_gate.weight], allow_unused=True)
    return grad


def test_router_gets_a_task_gradient_at_top1_with_the_weighted_slot():
    grad = _task_gradient_of_router(gqe_layer(num_experts=16, kv_heads=8, top_k=1, head_dim=4))
    assert grad is not None and grad.abs().max() > 1e-3


@pytest.mark.parametrize("shared_head", [True, False])
def test_router_gets_no_task_gradient_from_hard_slots_only(shared_head):
    """The paper's "hard concat only" ablation: the top-k choice is not differentiable and the unscaled hard
    slots carry no ``p``, so the task loss gives the router nothing."""
    layer = gqe_layer(num_experts=16, kv_heads=8, top_k=1, head_dim=4, weighted_slot=False, shared_head=shared_head,
                      allow_router_without_task_gradient=True)
    assert _task_gradient_of_router(layer) is None


def test_hard_slots_only_is_refused_unless_asked_for_as_the_ablation():
    """The rule of issue 42 (``headmix.routing.task_gradient``): the layer and the config refuse the hard-only
    router in one line naming the flag; the flag builds it; the random control needs none."""
    for build in (lambda **kw: GroupedQueryExpertsAttention(D, 6, 3, 1, 5, weighted_slot=False, **kw),
                  lambda **kw: AttentionConfig(kind="gqe", num_experts=6, kv_heads=3, top_k=1, head_dim=5,
                                               weighted_slot=False, **kw).build(D)):
        with pytest.raises(ValueError, match="allow_router_without_task_gradient") as err:
            build()
        assert "\n" not in str(err.value)
        build(allow_router_without_task_gradient=True)
        build(router="random")
    with pytest.raises(ValueError, match="one expert per K/V group"):
        GroupedQueryExpertsAttention(D, 3, 3, 1, 5)


def test_hard_slots_scaled_by_p_give_the_router_a_task_gradient():
    layer = gqe_layer(num_experts=16, kv_heads=8, top_k=1, head_dim=4, weighted_slot=False, hard_slot_scale="p")
    grad = _task_gradient_of_router(layer)
    assert grad is not None and grad.abs().max() > 1e-3


def test_weighted_slot_at_equal_scores_is_the_mean_of_the_hard_slots():
    """With every router score equal (``p = 1/M``) the weights are ``1/(k G)``: reading the weighted slot through a
    block of ``W_O`` gives a quarter of reading each of the 4 hard slots through the same block."""
    layer = gqe_layer(num_experts=8, kv_heads=2, top_k=2, shared_head=False, bias=False)
    x = torch.randn(1, 4, D, dtype=torch.float64)
    d = layer.head_dim
    with torch.no_grad():
        layer.router_gate.weight.zero_()
        block = layer.out_proj.weight[:, :d].clone()
        layer.out_proj.weight.zero_()
        layer.out_proj.weight[:, 4 * d:] = block  # the weighted slot only
        weighted = layer(x).output
        layer.out_proj.weight.zero_()
        for j in range(4):  # the hard slots only, each through the same block
            layer.out_proj.weight[:, j * d:(j + 1) * d] = block
        hard = layer(x).output
    torch.testing.assert_close(weighted, hard / 4, atol=1e-12, rtol=0)
    assert weighted.abs().max() > 1e-3


@pytest.mark.parametrize("config", ["paper", "top2_rotary_half", "random", "no_shared"])
def test_cached_decoding_equals_full_forward(config):
    layer = gqe_layer(**CONFIGS[config])
    cache = assert_decoding_equals_full_forward(layer, torch.randn(2, 7, D, dtype=torch.float64))
    assert tuple(cache.key.shape) == (2, layer.kv_heads, 7, 5)  # GQA's cache: the G K/V heads only


def test_preallocated_cache_decoding_equals_full_forward():
    layer = gqe_layer(**CONFIGS["top2_rotary_half"])
    cache = assert_preallocated_decoding_equals_full_forward(layer, torch.randn(1, 6, D, dtype=torch.float64), capacity=9)
    assert tuple(cache.key.shape) == (1, 2, 9, 5)


def test_random_control_has_no_router_parameters_and_no_aux_loss():
    layer = gqe_layer(**CONFIGS["random"])
    assert not any("router" in n for n, _ in layer.named_parameters())
    out = layer(torch.randn(2, 5, D, dtype=torch.float64))
    assert out.aux_loss.item() == 0.0 and out.losses == {}
    torch.testing.assert_close(out.routing.gates, torch.full((10, 4), 0.25, dtype=torch.float64))


def test_load_balancing_loss_is_the_mean_of_the_groups():
    from headmix.routing import load_balancing_loss

    layer = gqe_layer(num_experts=8, kv_heads=2, top_k=1, load_balance_weight=0.5)
    x = torch.randn(2, 6, D, dtype=torch.float64)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True
    out = layer(x, key_padding_mask=pad)
    r = out.routing
    per_group = [load_balancing_loss(r.probs[:, 4 * g:4 * g + 4], r.expert_index[:, g:g + 1] - 4 * g, ~pad.view(-1))
                 for g in range(2)]
    torch.testing.assert_close(out.losses["load_balance"], torch.stack(per_group).mean())
    torch.testing.assert_close(out.aux_loss, 0.5 * out.losses["load_balance"])


def test_default_is_the_papers_main_setting():
    layer = GroupedQueryExpertsAttention(1024)
    assert (layer.num_experts, layer.kv_heads, layer.top_k, layer.head_dim) == (16, 8, 1, 64)
    assert layer.out_proj.in_features == (1 * 8 + 2) * 64
    assert layer.q_proj.out_features == 17 * 64 and layer.k_proj.out_features == 8 * 64


def test_compiles_fullgraph_forward_and_backward_equal_to_eager():
    layer = gqe_layer(dtype=torch.float32, **CONFIGS["top2_rotary_half"]).train()
    x = torch.randn(2, 9, D, requires_grad=True)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, -3:] = True

    def loss_of(x, pad):
        out = layer(x, key_padding_mask=pad, query_padding_mask=pad, is_causal=True)
        return out.output.square().mean() + out.aux_loss

    def grads(loss):
        return torch.autograd.grad(loss, [x, *layer.parameters()])

    torch._dynamo.reset()
    want = grads(loss_of(x, pad))
    counter = CompileCounter()
    torch.compile(loss_of, backend=counter, fullgraph=True)(x, pad)
    assert counter.frame_count == 1
    got = grads(torch.compile(loss_of, backend="aot_eager", fullgraph=True)(x, pad))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    torch._dynamo.reset()


def test_cached_decoding_step_has_no_graph_break():
    from test_compile import decoding_step_breaks

    layer = gqe_layer(dtype=torch.float32, **CONFIGS["top2_rotary_half"])
    x = torch.randn(2, 6, D)
    torch._dynamo.reset()
    assert decoding_step_breaks(layer, x[:, :5], x[:, 5:6]) == []
    torch._dynamo.reset()


def test_training_step_has_no_host_sync():
    from test_compile import HOST_SYNC_OPS, _OpNames

    layer = gqe_layer(dtype=torch.float32, **CONFIGS["paper"]).train()
    x = torch.randn(2, 9, D, requires_grad=True)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[0, -3:] = True
    with _OpNames() as ops:
        out = layer(x, key_padding_mask=pad, query_padding_mask=pad, is_causal=True)
        (out.output.square().mean() + out.aux_loss).backward()
    assert len(ops.names) > 50
    assert [n for n in ops.names if n in HOST_SYNC_OPS] == []


@pytest.mark.parametrize("kw, match", [
    (dict(num_experts=6, kv_heads=4), r"^kv_heads \(4\) must divide num_experts \(6\)"),
    (dict(num_experts=6, kv_heads=3, top_k=3), r"^top_k \(3\) must not exceed the experts per group"),
    (dict(top_k=0), r"^top_k must be a positive integer"),
    (dict(weighted_slot="yes"), r"^weighted_slot must be True or False"),
    (dict(shared_head=None), r"^shared_head must be True or False"),
    (dict(hard_slot_scale="w"), r"^hard_slot_scale must be one of \('none', 'p'\)"),
    (dict(router="noisy_topk"), r"^router must be one of \('softmax', 'random'\)"),
    (dict(load_balance_weight=-1), r"^load_balance_weight must be a non-negative number"),
    (dict(shared_head_kv="first"), r"^shared_head_kv must be one of \('mean', 'head0'\), got 'first'"),
    (dict(router_init="uniform"), r"^router_init must be one of \('normal', 'zero'\)"),
    (dict(weight_init="xavier"), r"^weight_init must be one of \('default', 'xavier_uniform'\)"),
    (dict(head_dim=None, num_experts=4, kv_heads=2), r"^embed_dim \(18\) must be divisible by num_experts \(4\)"),
])
def test_bad_arguments_get_one_line_errors(kw, match):
    opts = dict(num_experts=6, kv_heads=3, top_k=1, head_dim=5)
    opts.update(kw)
    with pytest.raises(ValueError, match=match) as err:
        GroupedQueryExpertsAttention(D, **opts)
    assert "\n" not in str(err.value)


def test_per_head_attn_mask_is_refused_in_one_line():
    layer = gqe_layer(**CONFIGS["paper"])
    with pytest.raises(ValueError, match=r"^attn_mask must have shape") as err:
        layer(torch.randn(2, 4, D, dtype=torch.float64), attn_mask=torch.zeros(2, 3, 4, 4, dtype=torch.bool))
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- config and counts
GQE_CONFIGS = [
    dict(kind="gqe"),
    dict(kind="gqe", num_experts=8, kv_heads=2, top_k=2, weighted_slot=False, shared_head=False, bias=False,
         allow_router_without_task_gradient=True),
    dict(kind="gqe", router="random", hard_slot_scale="p", weighted_slot_renormalize=False),
]


@pytest.mark.parametrize("fields", GQE_CONFIGS)
def test_config_builds_the_layer_and_counts_are_as_computed(fields):
    att = AttentionConfig(**fields)
    layer = att.build(128)
    assert isinstance(layer, GroupedQueryExpertsAttention)
    assert AttentionConfig.from_dict(att.to_dict()) == att
    assert attention_parameters(att, 128)[0] == sum(p.numel() for p in layer.parameters())
    counter = _flop_counter()
    with torch.no_grad(), counter:
        layer(torch.randn(1, 20, 128))
    assert attention_macs(att, 128, 20, 20)[0] == counter.get_total_flops() // 2


def test_counts_at_the_papers_setting():
    """16 experts of 64 on 8 K/V heads, k = 1, d_model 1024: 9 attention heads, W_O of 10 blocks of 64."""
    att = AttentionConfig(kind="gqe", bias=False)
    d, t = 1024, 100
    full, _ = attention_macs(att, d, t, t)
    want = t * d * 16 + t * d * 17 * 64 + 2 * t * d * 8 * 64 + 9 * t * t * 2 * 64 + t * 10 * 64 * d
    assert full == want
    causal, _ = attention_macs(att, d, 300, 300, causal=True)
    assert causal < attention_macs(att, d, 300, 300)[0]
    params, _ = attention_parameters(att, d)
    assert params == d * 17 * 64 + 2 * d * 8 * 64 + 10 * 64 * d + d * 16


@pytest.mark.parametrize("fields, match", [
    (dict(kind="gqe", num_heads=8), r"^attention\.num_heads applies to kind"),
    (dict(kind="mha", num_heads=8, shared_head=False), r"^attention\.shared_head applies to kind 'gqe' only"),
    (dict(kind="gqe", num_experts=12, kv_heads=8), r"^attention\.kv_heads \(8\) must divide attention\.num_experts"),
    (dict(kind="gqe", top_k=3), r"^attention\.top_k K=3 exceeds the 2 experts per group"),
    (dict(kind="gqe", hard_slot_scale="q"), r"^attention\.hard_slot_scale must be one of"),
    (dict(kind="gqe", weighted_slot=1), r"^attention\.weighted_slot must be true, false or null"),
    (dict(kind="gqe", router="noisy_topk"), r"^attention\.router must be one of \('softmax', 'random'\)"),
    (dict(kind="gqe", shared_head_kv="head1"), r"^attention\.shared_head_kv must be one of \('mean', 'head0'\)"),
    (dict(kind="gqe", router_init="zeros"), r"^attention\.router_init must be one of \('normal', 'zero'\)"),
    (dict(kind="gqe", weight_init="xavier"), r"^attention\.weight_init must be one of"),
    (dict(kind="mha", num_heads=8, shared_head_kv="mean"), r"^attention\.shared_head_kv applies to kind 'gqe' only"),
])
def test_config_bad_options_get_one_line_errors(fields, match):
    with pytest.raises(ValueError, match=match) as err:
        AttentionConfig(**fields)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- the shared head's K/V
#: A GQE model config that lm-en-contenders stored before ``shared_head_kv`` existed (its shared head read K/V head 0),
#: with that study's study.json beside it: copied at f09f8eb, before the study's next run rewrote both with the key.
STORED_GQE = Path(__file__).resolve().parent / "data" / "before-shared-head-kv" / "configs" / "GQE.json"


@pytest.mark.parametrize("config", ["paper", "top2", "random"])
def test_shared_head_over_k_v_head_0_matches_reference(config):
    layer = gqe_layer(**CONFIGS[config], shared_head_kv="head0")
    x = torch.randn(2, 6, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    check_against_reference(layer, x, None, masks_for("causal_padding", 2, 6, 6, torch.Generator().manual_seed(5)),
                            atol=tolerance(layer))


def test_shared_head_kv_default_is_the_mean_and_head0_differs():
    layer = gqe_layer(**CONFIGS["top2"])
    assert layer.shared_head_kv == "mean" and AttentionConfig(kind="gqe").build(64).shared_head_kv == "mean"
    x = torch.randn(1, 5, D, dtype=torch.float64)
    mean = layer(x, is_causal=True).output
    layer.shared_head_kv = "head0"
    assert (layer(x, is_causal=True).output - mean).abs().max() > 1e-3


@pytest.mark.parametrize("kv", ["mean", "head0"])
def test_cached_decoding_equals_full_forward_for_each_shared_head_kv(kv):
    layer = gqe_layer(**CONFIGS["top2_rotary_half"], shared_head_kv=kv)
    assert_decoding_equals_full_forward(layer, torch.randn(2, 7, D, dtype=torch.float64))
    assert_preallocated_decoding_equals_full_forward(layer, torch.randn(1, 6, D, dtype=torch.float64), capacity=9)


def test_a_config_stored_without_shared_head_kv_loads_as_trained_over_k_v_head_0():
    """A stored config (every field written but the new one) reads ``"head0"``; written again by this version it
    says so; a dict written by hand, or one stored with the key, reads as it says (unset: the mean, resolved on
    construction, so that a new config is stored with ``"mean"``, not a ``null`` a later default would change)."""
    from headmix.models import ModelConfig

    assert "shared_head_kv" not in STORED_GQE.read_text()
    config = ModelConfig.load_json(STORED_GQE)
    assert config.decoder_self_attention.shared_head_kv == "head0"
    assert config.decoder_self_attention.build(config.d_model).shared_head_kv == "head0"
    again = ModelConfig.from_dict(json.loads(config.to_json()))
    assert again.decoder_self_attention.shared_head_kv == "head0"
    assert AttentionConfig.from_dict({"kind": "gqe", "num_experts": 4, "kv_heads": 2}).shared_head_kv == "mean"
    new = AttentionConfig(kind="gqe").to_dict()
    assert new["shared_head_kv"] == "mean" and AttentionConfig.from_dict(new).build(64).shared_head_kv == "mean"
    stored_null = {**new, "shared_head_kv": None}  # stored by a version that wrote null: the mean, as trained then
    assert AttentionConfig.from_dict(stored_null).shared_head_kv == "mean"


def test_a_run_stored_without_shared_head_kv_gives_the_outputs_it_was_trained_with(tmp_path):
    """A GQE model folder whose config.json lacks the key (as written before the option) loads with the shared
    head over K/V head 0: the logits of the model it saved; the same weights over the mean give others."""
    from headmix.models import ModelConfig, build_model, load_pretrained

    config = ModelConfig.load_json(STORED_GQE).replace(vocab_size=50, decoder_layers=1)
    torch.manual_seed(0)
    model = build_model(config).eval()
    folder = tmp_path / "old-run"
    model.save_pretrained(folder)
    stored = json.loads((folder / "config.json").read_text())
    assert stored["decoder_self_attention"].pop("shared_head_kv") == "head0"
    (folder / "config.json").write_text(json.dumps(stored))
    loaded = load_pretrained(folder).eval()
    tokens = torch.randint(3, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    assert torch.equal(loaded(tokens).logits, model(tokens).logits)
    assert loaded.config.decoder_self_attention.shared_head_kv == "head0"
    loaded.decoder.layers[0].self_attn.shared_head_kv = "mean"
    assert not torch.allclose(loaded(tokens).logits, model(tokens).logits)


def test_a_hugging_face_config_stored_without_shared_head_kv_loads_over_k_v_head_0():
    pytest.importorskip("transformers")
    from headmix.hf.configuration_headmix import HeadmixConfig

    stored = json.loads(STORED_GQE.read_text())
    stored.pop("headmix_version", None)
    assert HeadmixConfig(headmix=stored).model_config().decoder_self_attention.shared_head_kv == "head0"


def test_a_study_stored_before_shared_head_kv_is_still_that_study():
    """lm-en-contenders' study.json (GQE rows stored without the key) reads its GQE rows as ``"head0"``, and the
    built-in spec, which keeps them at head 0 as they ran, extends it; the rows with the mean would not."""
    from dataclasses import replace

    from headmix.study import get_study, plan
    from headmix.study.runner import _with_new_defaults, check_plan

    folder = STORED_GQE.parents[1]
    assert "shared_head_kv" not in (folder / "study.json").read_text()
    stored = _with_new_defaults(json.loads((folder / "study.json").read_text()))
    gqe_rows = [r for r in stored["rows"] if r["attention"]["kind"] == "gqe"]
    assert len(gqe_rows) == 3 and {r["attention"]["shared_head_kv"] for r in gqe_rows} == {"head0"}
    assert {r["attention"].get("shared_head_kv") for r in stored["spec"]["rows"] if r["attention"].get("kind") == "gqe"} \
        == {"head0"}
    spec = get_study("lm-en-contenders")
    check_plan(spec, plan(spec), folder)
    mean_rows = [replace(r, attention={k: v for k, v in r.attention.items() if k != "shared_head_kv"}) for r in spec.rows]
    moved = replace(spec, rows=mean_rows)
    with pytest.raises(ValueError, match="holds another study"):
        check_plan(moved, plan(moved), folder)


# --------------------------------------------------------------------------- Hugging Face
def test_hugging_face_round_trip_and_generate_equal_headmix(tmp_path):
    """A GQE causal LM through save_pretrained / AutoModelForCausalLM (bit-identical logits), its cache of the G
    K/V heads, and greedy generate = headmix's greedy decoding."""
    transformers = pytest.importorskip("transformers")
    from headmix.hf import HeadmixForCausalLM
    from headmix.models import build_model, get_config
    from headmix.models.generation import greedy_decode

    torch.manual_seed(0)
    att = AttentionConfig(kind="gqe", num_experts=8, kv_heads=4, top_k=1, bias=False, rotary=True)
    config = get_config("llama-tiny-mha", task="lm", vocab_size=50).replace(decoder_self_attention=att)
    model = build_model(config).eval()
    hf = HeadmixForCausalLM.from_headmix(model).eval()
    assert (hf.config.num_key_value_heads, hf.config.num_attention_heads, hf.config.head_dim) == (4, 5, 8)
    assert hf.config.aux_loss_weights == {"load_balance_weight": 0.01}
    hf.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    cache = loaded(ids, use_cache=True).cache
    assert {c.key.shape[1] for c in cache.state.self_attn} == {4}
    expected = greedy_decode(model, ids[:, :5], 8).tokens
    out = loaded.generate(ids[:, :5], max_new_tokens=8, do_sample=False, suppress_tokens=[0])  # headmix never emits pad
    new = out[:, 5:]
    assert new.shape[1] > 0 and torch.equal(new, expected[:, :new.shape[1]])


def test_study_solver_sizes_a_gqe_row_by_its_head_size():
    """A GQE row fixes its experts, groups and k and solves ``head_dim`` to the baseline's attention MACs: with 5 of
    GQA's 8 heads' attention computed (4 slots and the shared head) its heads come out larger than GQA's 16."""
    from headmix.models import get_config
    from headmix.models.matching import attention_macs_of, match_attention, with_attention

    base = get_config("llama3-mini-gqa", task="lm")
    match = match_attention(base, {"kind": "gqe", "num_experts": 8, "kv_heads": 4, "top_k": 1}, ["head_dim"],
                            prefer={"head_dim": 16}, tgt_len=256)
    att = match.attention
    assert (att.kind, att.num_experts, att.kv_heads, att.top_k, att.bias, att.rotary) == ("gqe", 8, 4, 1, False, True)
    assert att.head_dim > 16 and abs(match.ratio - 1) <= 0.02
    assert match.macs == attention_macs_of(with_attention(base, att), None, 256)


def test_routing_analyses_take_gqe_layers_per_kv_group():
    """The analyses' side (load, PMI per K/V group) is tested in tests/test_analysis.py."""
    from headmix.analysis import routed_layers
    from headmix.models import build_model, get_config

    att = AttentionConfig(kind="gqe", num_experts=8, kv_heads=4, bias=False)
    model = build_model(get_config("llama-tiny-mha", task="lm", vocab_size=50).replace(decoder_self_attention=att))
    layer = routed_layers(model)[0]
    assert (layer.name, layer.kind, layer.num_experts, layer.top_k) == ("decoder.layers.0.self_attn", "gqe", 8, 1)
    assert (layer.num_groups, layer.group_kind, layer.slots_per_token) == (4, "K/V group", 4)
