"""Every learned router gets a gradient from the task loss, or is refused (headmix.routing.task_gradient).

For each layer and each learned-router option combination: build the layer (with
``allow_router_without_task_gradient=True`` where the rule refuses it), backpropagate a task loss (a fixed random
projection of the output; no auxiliary loss), and measure each routing parameter's gradient. The expected
outcome is written here from the equations, independently of the code's rule: the test fails when a router that
learns is refused, when a router that cannot learn is accepted, and when a layer's weights stop carrying (or start
carrying) the router's gradient.

Threshold: a routing parameter "learns" when its gradient norm is above ``RELATIVE`` times the mean gradient norm of
the layer's other parameters. Where the gradient vanishes analytically (the probabilities cancel, or a softmax over
one score), float64 rounding leaves at most ~1e-15 of that scale (measured: 1e-17 to 3e-16); where the router
learns, the measured ratio is 7e-3 or more (MoH ``"paper"``, whose weights ``a_r p_i`` are small). 1e-8 sits many
orders of magnitude from both.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from headmix.attention import (GroupedQueryExpertsAttention, MixtureOfAttentionHeads, MixtureOfHeadsAttention,
                               MixtureOfSparseAttention, SwitchHeadAttention)
from headmix.models import AttentionConfig, ModelConfig
from headmix.routing.task_gradient import ALLOW_FLAG

RELATIVE = 1e-8
D = 16
ROOT = Path(__file__).resolve().parents[1]
REFUSED = "gets no gradient from the task loss"
#: The routing parameters of each layer (parameter names ending so).
ROUTING = ("router.gate.weight", "router.noise.weight", "routed_gate.weight", "shared_gate.weight",
           "group_gate.weight", "value_selector.weight", "output_selector.weight", "router.weight", "router_gate.weight")


def routing_gradients(layer: torch.nn.Module, *, causal: bool = True) -> dict[str, float]:
    """Each routing parameter's task-loss gradient norm relative to the mean gradient norm of the layer's other
    parameters (float64, training mode: noisy top-k draws its noise)."""
    torch.manual_seed(0)
    layer = layer.double().train()
    x = torch.randn(2, 7, layer.embed_dim, dtype=torch.float64)
    projection = torch.randn(layer.embed_dim, dtype=torch.float64)
    out = layer(x, is_causal=True) if causal else layer(x)
    (out.output @ projection).square().mean().backward()  # the task loss only: out.aux_loss is left out
    norms = {n: (0.0 if p.grad is None else p.grad.norm().item()) for n, p in layer.named_parameters()}
    others = [v for n, v in norms.items() if not n.endswith(ROUTING)]
    scale = sum(others) / len(others)
    assert scale > 0
    return {n: v / scale for n, v in norms.items() if n.endswith(ROUTING)}


def built_or_refused(make, layer_name: str, learns: bool) -> torch.nn.Module:
    """``make()``'s layer where its router learns from the task loss; where it does not, ``make()`` refused in one line
    naming ``layer_name``, and the same layer asked for as an ablation (``allow_router_without_task_gradient``)."""
    if learns:
        return make()
    with pytest.raises(ValueError, match=f"^{layer_name}: the learned router {REFUSED}"):
        make()
    return make(allow_router_without_task_gradient=True)


def assert_learns(grads: dict[str, float], name: str, learns: bool) -> None:
    assert name in grads, f"{name} is not a parameter of the layer: {sorted(grads)}"
    if learns:
        assert grads[name] > RELATIVE, f"{name} gets no task gradient ({grads[name]:.1e})"
    else:
        assert grads[name] < RELATIVE, f"{name} gets a task gradient ({grads[name]:.1e}) where none was expected"


# --- MoA ---------------------------------------------------------------------------------------------------

def moa_learns(num_experts: int, top_k: int, router: str, renormalize: str) -> bool:
    """From MoA eq. 7-9: the selected weights depend on the router unless they are a constant 1: ``p_i / p_i``
    (``"live"``, k = 1), a softmax over one kept logit (noisy top-k, k = 1) or over one expert (E = 1).
    ``"detached"`` at k = 1 is ``p_i / Detach(p_i)``: 1 in value, the gradient of ``p_i``."""
    if num_experts == 1:
        return False
    return not (top_k == 1 and (renormalize == "live" or router == "noisy_topk"))


MOA_CASES = [(4, k, router, renormalize, kv) for router, renormalize in
             [("softmax", "detached"), ("softmax", "live"), ("softmax", "none"), ("noisy_topk", "detached")]
             for k in (1, 2) for kv in (1, 2)] + [(1, 1, "softmax", r, 1) for r in ("detached", "live", "none")]


@pytest.mark.parametrize("num_experts,top_k,router,renormalize,kv_heads", MOA_CASES)
def test_moa_router_learns_or_is_refused(num_experts, top_k, router, renormalize, kv_heads):
    learns = moa_learns(num_experts, top_k, router, renormalize)
    args = (D, num_experts, top_k, 4)
    options = dict(router=router, renormalize=renormalize, kv_heads=kv_heads)
    layer = built_or_refused(lambda **kw: MixtureOfAttentionHeads(*args, **options, **kw), "MoA", learns)
    grads = routing_gradients(layer)
    assert_learns(grads, "router.gate.weight", learns)
    if router == "noisy_topk":
        assert_learns(grads, "router.noise.weight", learns)


# --- MoH (global and per K/V group) ------------------------------------------------------------------------------------------

def moh_learns(routed_per_group: int, top_k: int, head_weighting: str) -> bool:
    """From MoH eq. 5-6 and the authors' weighting: ``"renormalized"`` at k = 1 weighs ``a_r k p_i / p_i = a_r``
    (the probabilities cancel); one routed head has ``p = softmax`` over one score, the constant 1. ``"paper"``
    (``a_r p_i``) and ``"scaled"`` (``a_r R p_i``) keep ``p_i``."""
    if routed_per_group == 1:
        return False
    return not (head_weighting == "renormalized" and top_k == 1)


MOH_CASES = list(itertools.product(("renormalized", "paper", "scaled"), (1, 2), (0, 1, 2), (False, True),
                                   ("dense", "sparse")))


def _moh(heads: int, shared: int, top_k: int, weighting: str, per_group: bool, impl: str, **kw):
    return MixtureOfHeadsAttention(D, heads, shared, top_k, 4, head_weighting=weighting, impl=impl,
                                   kv_heads=2 if per_group else None, route_per_group=per_group, **kw)


def _check_moh(heads: int, shared: int, top_k: int, weighting: str, per_group: bool, impl: str,
               routed_per_group: int) -> None:
    learns = moh_learns(routed_per_group, top_k, weighting)
    layer = built_or_refused(lambda **kw: _moh(heads, shared, top_k, weighting, per_group, impl, **kw),
                             "MoH routed per K/V group" if per_group else "MoH", learns)
    grads = routing_gradients(layer)
    assert_learns(grads, "routed_gate.weight", learns)
    if shared:
        # [a_s, a_r] = softmax over two scores: always learns; the shared heads' softmax over ONE shared head is
        # the constant 1 (harmless: that head is always on), over two or more it learns
        assert_learns(grads, "group_gate.weight", True)
        assert_learns(grads, "shared_gate.weight", shared >= 2)


@pytest.mark.parametrize("weighting,top_k,shared,per_group,impl", MOH_CASES)
def test_moh_router_learns_or_is_refused(weighting, top_k, shared, per_group, impl):
    heads = 8  # 2 groups of 4 with route_per_group: 4 - shared >= 2 routed heads per group
    routed_per_group = (heads // 2 if per_group else heads) - shared
    _check_moh(heads, shared, top_k, weighting, per_group, impl, routed_per_group)


@pytest.mark.parametrize("weighting,per_group", list(itertools.product(("renormalized", "paper", "scaled"),
                                                                       (False, True))))
def test_moh_with_one_routed_head_is_refused_for_every_weighting(weighting, per_group):
    # 4 heads, 3 shared: one routed head; per group: 2 groups of 4 heads, 3 shared in each
    _check_moh(8 if per_group else 4, 3, 1, weighting, per_group, "dense", routed_per_group=1)


def test_every_head_shared_has_no_router_and_is_not_refused():
    layer = MixtureOfHeadsAttention(D, 4, 4, 0, 4)
    assert layer.routed_gate is None and not any(n.endswith(ROUTING) for n, _ in layer.named_parameters())


# --- GQE (the paper's, kind="gqe"): p reaches the output through the weighted slot or p-scaled hard slots ------

def gqe_learns(per_group: int, slots: int, weighted_slot: bool, renormalize: bool, hard_slot_scale: str) -> bool:
    """From eq. 6: the router's ``p`` reaches the output through the weighted slot (``w = p / sum_selected p``, or
    ``p``) or the hard slots times ``p``; not with one expert per group (``p`` the constant 1), nor when the only
    path is the renormalised slot over one selected head (``k G = 1``: ``w = p / p = 1``)."""
    if per_group == 1:
        return False
    if hard_slot_scale == "p" or (weighted_slot and not renormalize):
        return True
    return weighted_slot and slots > 1


GQE_CASES = [(experts, kv, k, ws, rn, scale, kv_src, init)
             for experts, kv, k in [(8, 2, 1), (8, 2, 2), (4, 1, 1), (4, 1, 2), (4, 4, 1)]
             for ws, rn, scale in [(True, True, "none"), (True, False, "none"), (False, True, "none"),
                                   (False, True, "p")]
             for kv_src in ("mean", "head0") for init in ("normal", "zero")
             if (kv_src, init) == ("mean", "zero") or (ws, rn, scale) == (True, True, "none")]


@pytest.mark.parametrize("experts,kv_heads,top_k,weighted_slot,renormalize,scale,shared_head_kv,router_init", GQE_CASES)
def test_gqe_router_learns_or_is_refused(experts, kv_heads, top_k, weighted_slot, renormalize, scale, shared_head_kv,
                                         router_init):
    """Every option of the paper's GQE, with the shared head over the K/V heads' mean (the default, the authors')
    or K/V head 0, the router initialised as headmix or at zero (the authors')."""
    learns = gqe_learns(experts // kv_heads, kv_heads * top_k, weighted_slot, renormalize, scale)
    args = (D, experts, kv_heads, top_k, 4)
    options = dict(weighted_slot=weighted_slot, weighted_slot_renormalize=renormalize, hard_slot_scale=scale,
                   shared_head_kv=shared_head_kv, router_init=router_init)
    layer = built_or_refused(lambda **kw: GroupedQueryExpertsAttention(*args, **options, **kw), "GQE", learns)
    assert_learns(routing_gradients(layer), "router_gate.weight", learns)


@pytest.mark.parametrize("make", [
    lambda: MixtureOfAttentionHeads(D, 4, 1, 4, router="random"),
    lambda: MixtureOfAttentionHeads(D, 1, 1, 4, router="random"),
    lambda: MixtureOfHeadsAttention(D, 8, 1, 1, 4, router="random", kv_heads=2, route_per_group=True),
    lambda: MixtureOfHeadsAttention(D, 4, 0, 1, 4, router="random"),
    lambda: SwitchHeadAttention(D, 2, 4, 1, 8, router="random"),
], ids=["moa", "moa-one-expert", "gqe", "moh", "switchhead"])
def test_the_random_control_has_no_router_and_is_never_refused(make):
    layer = make()
    assert not any(n.endswith(ROUTING) for n, _ in layer.named_parameters())


# --- SwitchHead and MoSA: sigmoid scores weigh the selected experts / tokens: they always learn -------------

@pytest.mark.parametrize("num_experts,top_k", [(1, 1), (4, 1), (4, 2), (4, 4)])
def test_switchhead_selectors_always_learn(num_experts, top_k):
    grads = routing_gradients(SwitchHeadAttention(D, 2, num_experts, top_k, 8))
    assert_learns(grads, "output_selector.weight", True)
    if num_experts > 1:
        assert_learns(grads, "value_selector.weight", True)


@pytest.mark.parametrize("options", [dict(tokens_per_head=3), dict(tokens_per_head=7),
                                     dict(sparsity=2, include_first=True), dict(tokens_per_head=2, num_dense_heads=1)])
def test_mosa_router_always_learns(options):
    assert_learns(routing_gradients(MixtureOfSparseAttention(D, 2, 8, **options), causal=False), "router.weight", True)


def test_mosa_router_learns_under_the_causal_threshold_rule():
    layer = MixtureOfSparseAttention(D, 2, 8, sparsity=2, selection="threshold")
    with torch.no_grad():
        layer.score_threshold.fill_(0.5)
    assert_learns(routing_gradients(layer, causal=False), "router.weight", True)


# --- the mixture-of-experts feed-forward (ffn="moe_swiglu"): w = softmax over the kept logits ----------------

def _moe_ffn_config(experts: int, top_k: int, **kw) -> ModelConfig:
    return ModelConfig(task="lm", vocab_size=50, d_model=D, ffn_dim=8, encoder_layers=0, decoder_layers=1,
                       ffn="moe_swiglu", ffn_experts=experts, ffn_top_k=top_k, dropout=0.0, **kw)


@pytest.mark.parametrize("experts,top_k", [(4, 1), (4, 2), (1, 1)])
def test_the_feed_forward_router_learns_or_is_refused(experts, top_k):
    from headmix.models.transformer import MixtureOfSwiGLUExperts

    learns = experts > 1 and top_k > 1  # a softmax over one kept logit (or one expert) is the constant 1
    if learns:
        config = _moe_ffn_config(experts, top_k)
    else:
        with pytest.raises(ValueError, match=f"^ffn: the learned router {REFUSED} .*, or set "
                                             f"ffn_allow_router_without_task_gradient=True"):
            _moe_ffn_config(experts, top_k)
        config = _moe_ffn_config(experts, top_k, ffn_allow_router_without_task_gradient=True)
    torch.manual_seed(0)
    layer = MixtureOfSwiGLUExperts(config).double()
    x = torch.randn(2, 7, D, dtype=torch.float64)
    (layer(x).output @ torch.randn(D, dtype=torch.float64)).square().mean().backward()
    norms = {n: p.grad.norm().item() for n, p in layer.named_parameters()}
    scale = sum(v for n, v in norms.items() if n != "router.gate.weight") / (len(norms) - 1)
    assert_learns({"router.gate.weight": norms["router.gate.weight"] / scale}, "router.gate.weight", learns)


def test_a_feed_forward_config_stored_before_the_rule_loads_as_the_ablation():
    stored = _moe_ffn_config(4, 1, ffn_allow_router_without_task_gradient=True).to_dict()
    del stored["ffn_allow_router_without_task_gradient"]
    assert ModelConfig.from_dict(stored).ffn_allow_router_without_task_gradient is True
    hand_written = {k: stored[k] for k in ("task", "vocab_size", "d_model", "ffn_dim", "encoder_layers",
                                           "decoder_layers", "ffn", "ffn_experts", "ffn_top_k")}
    with pytest.raises(ValueError, match=f"^ffn: the learned router {REFUSED}"):
        ModelConfig.from_dict(hand_written)


# --- AttentionConfig: the same rule, the same flag, and stored configs ---------------------------------------

CONFIG_CASES = [
    (dict(kind="moh", num_heads=8, kv_heads=2, route_per_group=True, num_shared_heads=1, top_k=1), True),
    (dict(kind="moh", num_heads=8, num_shared_heads=2, top_k=1), True),
    (dict(kind="moh", num_heads=4, num_shared_heads=3, top_k=1, head_weighting="paper"), True),
    (dict(kind="moh", num_heads=8, num_shared_heads=2, top_k=1, head_weighting="scaled"), False),
    (dict(kind="moh", num_heads=8, num_shared_heads=2, top_k=2), False),
    (dict(kind="moh", num_heads=8, num_shared_heads=1, top_k=1, router="random"), False),
    (dict(kind="moa", num_experts=4, top_k=1, head_dim=8, renormalize="live"), True),
    (dict(kind="moa", num_experts=4, top_k=1, head_dim=8, router="noisy_topk"), True),
    (dict(kind="moa", num_experts=1, top_k=1, head_dim=8), True),
    (dict(kind="moa", num_experts=4, top_k=1, head_dim=8), False),
    (dict(kind="moa", num_experts=4, top_k=2, head_dim=8, renormalize="live"), False),
]


@pytest.mark.parametrize("fields,refused", CONFIG_CASES)
def test_attention_config_refuses_what_the_layers_refuse(fields, refused):
    if refused:
        with pytest.raises(ValueError, match=f"^attention: the learned router {REFUSED} .*; use .*, or set "
                                             f"attention.{ALLOW_FLAG}=True"):
            AttentionConfig(**fields)
        with pytest.raises(ValueError, match=f"^decoder_self_attention: the learned router {REFUSED}"):
            # a dict is read as a stored config; MoH's without head_weighting would read as "scaled" (from_dict)
            weighting = {"head_weighting": "renormalized"} if fields["kind"] == "moh" else {}
            ModelConfig(task="lm", d_model=32, encoder_layers=0, decoder_layers=1,
                        decoder_self_attention={**weighting, **fields})
        config = AttentionConfig(**fields, allow_router_without_task_gradient=True)
        assert config.router_without_task_gradient() is not None
        layer = config.build(32)
        assert layer is not None  # the layer accepts what the config allows
    else:
        config = AttentionConfig(**fields)
        assert config.router_without_task_gradient() is None
        config.build(32)


@pytest.mark.parametrize("value", [1, "yes"])
def test_the_flag_must_be_a_bool(value):
    with pytest.raises(ValueError, match=f"^attention.{ALLOW_FLAG} must be true, false or null"):
        AttentionConfig(kind="moh", num_heads=8, num_shared_heads=2, top_k=2, allow_router_without_task_gradient=value)
    with pytest.raises(ValueError, match=f"^{ALLOW_FLAG} must be true or false"):
        MixtureOfHeadsAttention(D, 8, 2, 2, allow_router_without_task_gradient=value)


def test_the_flag_applies_to_the_kinds_with_such_a_router_only():
    with pytest.raises(ValueError, match=f"^attention.{ALLOW_FLAG} applies to kind 'moa' / 'moh' / 'gqe' only"):
        AttentionConfig(kind="switchhead", num_heads=2, num_experts=4, top_k=1, allow_router_without_task_gradient=True)


def _stored_gqe_configs() -> list[Path]:
    """The configs of the MoH-per-K/V-group rows (1 shared + top 1 per group) that lm-en-contenders and
    lm-en-contenders-long trained before the rule, as those studies stored them (kept here since the paper's GQE
    replaced the rows)."""
    files = sorted((Path(__file__).parent / "data" / "before-the-router-rule").glob("*.json"))
    return [f for f in files if '"top_k": 1,' in f.read_text() and '"router": "random"' not in f.read_text()
            and '"kind": "moh"' in f.read_text()]


def test_the_committed_gqe_configs_are_the_ablation_they_were_trained_as():
    """The committed studies. MoH-per-K/V-group configs (1 shared + top 1 per group, written before the rule) load, build and run
    as the ablation; a dict written by hand with the same options is refused as a new config is."""
    stored = _stored_gqe_configs()
    assert len(stored) >= 2, stored
    for path in stored:
        assert ALLOW_FLAG not in path.read_text()
        config = ModelConfig.load_json(path)
        att = config.decoder_self_attention
        assert att.allow_router_without_task_gradient is True and att.router_without_task_gradient() is not None
        att.build(config.d_model)
        again = ModelConfig.from_dict(json.loads(config.to_json()))  # and as this version writes it
        assert again.decoder_self_attention.allow_router_without_task_gradient is True
    hand_written = dict(kind="moh", num_heads=8, kv_heads=2, route_per_group=True, num_shared_heads=1, top_k=1,
                        head_weighting="renormalized")
    with pytest.raises(ValueError, match=f"^decoder_self_attention: the learned router {REFUSED}"):
        AttentionConfig.from_dict(hand_written, "decoder_self_attention")
    # a stored config written after the rule, with the key, is read as it says
    full = {**AttentionConfig(**hand_written, allow_router_without_task_gradient=True).to_dict(), ALLOW_FLAG: None}
    with pytest.raises(ValueError, match=REFUSED):
        AttentionConfig.from_dict(full)
    # a stored config whose router learns is not marked
    learning = {k: v for k, v in AttentionConfig(**{**hand_written, "top_k": 2}).to_dict().items() if k != ALLOW_FLAG}
    assert AttentionConfig.from_dict(learning).allow_router_without_task_gradient is None


def test_a_model_saved_before_the_rule_loads_and_evaluates(tmp_path):
    """A top-1 MoH-per-K/V-group model folder (weights and config.json) whose config lacks the flag, as written before the rule,
    loads and gives the outputs it gave when saved."""
    from headmix.models import build_model, load_pretrained

    config = ModelConfig.load_json(_stored_gqe_configs()[0]).replace(vocab_size=50, decoder_layers=1)
    torch.manual_seed(0)
    model = build_model(config).eval()
    folder = tmp_path / "old-run"
    model.save_pretrained(folder)
    stored = json.loads((folder / "config.json").read_text())
    att = stored["decoder_self_attention"]
    assert att.pop(ALLOW_FLAG) is True
    (folder / "config.json").write_text(json.dumps(stored))
    loaded = load_pretrained(folder).eval()
    tokens = torch.randint(3, 50, (1, 9))
    assert torch.equal(loaded(tokens).logits, model(tokens).logits)
    assert loaded.config.decoder_self_attention.allow_router_without_task_gradient is True


def test_a_hugging_face_config_written_before_the_rule_loads():
    pytest.importorskip("transformers")
    from headmix.hf.configuration_headmix import HeadmixConfig

    stored = json.loads(_stored_gqe_configs()[0].read_text())
    stored.pop("headmix_version", None)
    config = HeadmixConfig(headmix=stored)
    assert config.headmix["decoder_self_attention"][ALLOW_FLAG] is True


def test_a_study_row_whose_router_cannot_learn_is_refused_with_the_reason():
    from headmix.study import plan
    from headmix.study.spec import RowSpec, StudySpec

    row = {"kind": "moh", "num_heads": 4, "num_shared_heads": 1, "top_k": 1}
    spec = StudySpec(name="s", task="lm", baseline="llama-tiny-mha", seeds=[1], max_steps=1,
                     rows=[RowSpec("MHA"), RowSpec("MoH", row, ["head_dim"])])
    with pytest.raises(ValueError, match=f"^row 'MoH': .*; every candidate is refused, e.g. attention: the learned "
                                         f"router {REFUSED} with head_weighting='renormalized' and top_k=1"):
        plan(spec)
    spec.rows[1] = RowSpec("MoH", {**row, ALLOW_FLAG: True}, ["head_dim"])
    assert plan(spec)[1].config.decoder_self_attention.allow_router_without_task_gradient is True


# --- What will be trained: every preset and every built-in study row -----------------------------------------

def _layers_of(config: ModelConfig):
    for role in config.attention_roles():
        att = getattr(config, role)
        yield role, att


def _check_trained_config(where: str, att: AttentionConfig, d_model: int) -> None:
    if att.allow_router_without_task_gradient and att.router_without_task_gradient():
        return  # an ablation asked for by name (its report labels it)
    layer = att.build(d_model)
    if not any(n.endswith(ROUTING) for n, _ in layer.named_parameters()):
        return  # no learned router (dense, or the random control)
    grads = routing_gradients(layer, causal=att.kind != "mosa")
    for name, value in grads.items():
        if name.endswith("shared_gate.weight") and att.num_shared_heads == 1:
            continue  # a softmax over one shared head: the constant 1, harmless (module docstring)
        assert value > RELATIVE, f"{where}: {name} gets no task gradient ({value:.1e})"


def test_every_presets_routers_get_a_task_gradient():
    from headmix.models.presets import PRESETS, get_config

    checked = 0
    for name, preset in PRESETS.items():
        for task in preset.tasks:
            config = get_config(name, task, 100)
            if config.ffn == "moe_swiglu":
                assert not config.ffn_allow_router_without_task_gradient, f"preset {name}: its FFN router cannot learn"
            for role, att in _layers_of(config):
                if att.routed:
                    _check_trained_config(f"preset {name} ({task}) {role}", att, config.d_model)
                    checked += 1
    assert checked >= 10


def test_every_builtin_study_rows_routers_get_a_task_gradient():
    """Every built-in study row that will be trained has routers that learn, except rows marked as the ablation,
    which the report labels."""
    from headmix.study import get_study, plan
    from headmix.study.builtin import BUILTIN
    from headmix.study.report import _attention_text

    ablations = []
    for study in BUILTIN:
        for row in plan(get_study(study)):
            role = row.config.attention_roles()[0]
            att = getattr(row.config, role)
            if att.allow_router_without_task_gradient and att.router_without_task_gradient():
                ablations.append((study, row.name))
                assert "ablation: router without task gradient" in _attention_text(row.to_dict()["attention"])
            _check_trained_config(f"study {study} row {row.name}", att, row.config.d_model)
    # the paper's Table 2 "hard concat only" rows, asked for by name
    assert sorted(ablations) == [("lm-en-contenders", "GQE hard-only"), ("lm-en-contenders", "GQE mean hard-only"),
                                 ("lm-en-contenders-long", "GQE hard-only"),
                                 ("lm-en-contenders-long", "GQE mean hard-only"), ("lm-en-gpu-contenders", "GQE hard-only")]
