"""Issue 32: what a new user hit in the first hour (each defect reproduced here, and the things added for it)."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest

from headmix.models import ModelConfig
from headmix.models.config import AttentionConfig

ROOT = Path(__file__).resolve().parents[1]

KINDS = {"mha": dict(kind="mha", num_heads=4), "moa": dict(kind="moa", num_experts=4, top_k=2, head_dim=8),
         "moh": dict(kind="moh", num_heads=4, num_shared_heads=1, top_k=2),
         "talking_heads": dict(kind="talking_heads", num_heads=4),
         "switchhead": dict(kind="switchhead", num_heads=2, num_experts=4, top_k=2)}

# a field with a non-None default, a value other than that default, and a kind that does not use it
FOREIGN = [("router", "noisy_topk", "moh"), ("renormalize", "live", "mha"), ("load_balance_weight", 0.5, "switchhead"),
           ("z_loss_weight", 0.5, "moh"), ("pre_softmax", False, "moh"), ("post_softmax", False, "mha"),
           ("expert_impl", "sorted", "talking_heads"), ("load_balance_fractions", "per_token", "switchhead")]


# --------------------------------------------------------------------------- options that do nothing

@pytest.mark.parametrize("field,value,kind", FOREIGN)
def test_a_field_the_kind_does_not_use_is_refused(field, value, kind):
    with pytest.raises(ValueError, match=rf"^attention\.{field} applies to kind .* it must be unset \(None\) for kind '{kind}'"):
        AttentionConfig(**KINDS[kind], **{field: value})


def test_the_issues_moh_example_is_refused_naming_the_first_foreign_field():
    with pytest.raises(ValueError, match=r"attention\.router applies to kind 'moa' only"):
        AttentionConfig(kind="moh", num_heads=4, num_shared_heads=1, top_k=2, router="noisy_topk", z_loss_weight=0.5,
                        pre_softmax=False)


@pytest.mark.parametrize("field,value,kind", FOREIGN)
def test_unset_fields_take_their_kinds_default_and_stay_unset_for_other_kinds(field, value, kind):
    from headmix.models.config import _KIND_DEFAULTS, _KIND_FIELDS

    for name, fields in KINDS.items():
        expected = _KIND_DEFAULTS[field] if name in _KIND_FIELDS[field] else None
        assert getattr(AttentionConfig(**fields), field) == expected
    own = _KIND_FIELDS[field][0]
    assert getattr(AttentionConfig(**KINDS[own], **{field: value}), field) == value


def test_defaults_filled_in_are_the_layers_defaults():
    moa = AttentionConfig(**KINDS["moa"]).build(32)
    assert (moa.router.router_type, moa.router.renormalize, moa.load_balance_weight, moa.z_loss_weight) == \
        ("softmax", "detached", 0.01, 0.001)
    th = AttentionConfig(**KINDS["talking_heads"]).build(32)
    assert th.pre_mix is not None and th.post_mix is not None


def test_json_with_a_foreign_field_set_is_refused_naming_the_role():
    data = ModelConfig(task="lm", vocab_size=50, d_model=32, ffn_dim=64, encoder_layers=0, decoder_layers=1).to_dict()
    data["decoder_self_attention"]["z_loss_weight"] = 0.5
    with pytest.raises(ValueError, match=r"^decoder_self_attention\.z_loss_weight applies to kind 'moa' only"):
        ModelConfig.from_dict(data)
    data["decoder_self_attention"]["z_loss_weigth"] = 0.5
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['z_loss_weigth'\] in decoder_self_attention"):
        ModelConfig.from_dict(data)


def test_an_old_json_storing_every_fields_default_still_loads():
    """Before issue 32 every config stored router="softmax", pre_softmax=true, ... for every kind: such a file
    loads, as the config it always meant; a foreign field stored with another value (never used) is refused."""
    old = {"kind": "mha", "num_heads": 4, "router": "softmax", "renormalize": "detached", "load_balance_weight": 0.01,
           "z_loss_weight": 0.001, "pre_softmax": True, "post_softmax": True, "expert_impl": "auto",
           "load_balance_fractions": "normalized"}
    assert AttentionConfig.from_dict(old) == AttentionConfig(kind="mha", num_heads=4)
    for field, value, kind in FOREIGN:
        if field in old:
            with pytest.raises(ValueError, match=rf"attention\.{field} applies to kind"):
                AttentionConfig.from_dict({**old, field: value})
    assert AttentionConfig.from_dict({**old, "kind": "moa", "num_heads": None, "num_experts": 4, "top_k": 2,
                                      "head_dim": 8, "z_loss_weight": 0.0}).z_loss_weight == 0.0


def test_every_stored_model_config_of_the_studies_still_loads_and_round_trips():
    files = [f for f in glob.glob(str(ROOT / "studies" / "**" / "*.json"), recursive=True)]
    configs = [json.loads(Path(f).read_text()) for f in files]
    configs = [c for c in configs if isinstance(c, dict) and "d_model" in c and "task" in c]
    assert len(configs) >= 8
    for data in configs:
        config = ModelConfig.from_dict(data)
        assert ModelConfig.from_dict(json.loads(config.to_json())) == config
