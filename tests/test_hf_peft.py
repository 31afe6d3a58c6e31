"""PEFT LoRA on headmix models inside transformers: the attention projections (nn.Linear modules) and the
per-expert weights (3-D parameters, PEFT's ``target_parameters``) adapt, train, and merge back exactly."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from headmix.hf import HeadmixForCausalLM  # noqa: E402
from headmix.models import build_model, get_config  # noqa: E402

TARGETS = {  # name -> (preset, target_modules, target_parameters). PEFT 0.21 cannot adapt a module's own 3-D
    # parameters and its child Linear layers in one LoraConfig (merge_and_unload leaves the children's adapters, and
    # a parameter target hides the children from target_modules): the expert weights and the projections are
    # adapted in separate configs.
    "moa-experts": ("llama-tiny-moa", [], ["self_attn.query_experts", "self_attn.output_experts"]),
    "moa-kv": ("llama-tiny-moa-kv2", ["k_proj", "v_proj"], []),
    "switchhead-experts": ("llama-tiny-switchhead", [], ["self_attn.value_experts", "self_attn.output_experts"]),
    "moh": ("llama-tiny-moh", ["q_proj", "k_proj", "v_proj", "out_proj"], []),
}


@pytest.mark.parametrize("case", sorted(TARGETS))
def test_lora_adapts_the_attention_trains_and_merges_exactly(case):
    preset, modules, parameters = TARGETS[case]
    torch.manual_seed(0)
    model = HeadmixForCausalLM.from_headmix(build_model(get_config(preset, task="lm", vocab_size=50))).eval()
    ids = torch.randint(3, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    base = model(ids).logits
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=modules or None, target_parameters=parameters or None,
                             init_lora_weights=False)  # random B: the adapter changes the function at once
    adapted = peft.get_peft_model(model, config)
    trainable = {name for name, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    wrapped = [m.parameter_name for m in adapted.modules() if isinstance(m, peft.tuners.lora.ParamWrapper)]
    expected = sorted(p.split(".")[-1] for p in parameters) * 2  # both layers, each expert weight once
    assert sorted(wrapped) == sorted(expected)
    for target in modules:  # every projection got an adapter in both layers
        assert sum(f".{target}.lora_A." in name for name in trainable) == 2, target
    with torch.no_grad():
        adapted_logits = adapted(ids).logits
    assert not torch.allclose(adapted_logits, base, atol=1e-3)
    loss = adapted(ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapted.parameters() if p.requires_grad)
    merged = adapted.merge_and_unload()
    assert type(merged) is HeadmixForCausalLM
    assert set(merged.state_dict()) == set(before)
    with torch.no_grad():
        # W x + B (A x) and (W + B A) x round differently in float32 (2e-6 seen): the same function
        torch.testing.assert_close(merged(ids).logits, adapted_logits, rtol=0, atol=1e-5)
    changed = [k for k in before if not torch.equal(before[k], merged.state_dict()[k])]
    assert changed and all(any(t.split(".")[-1] in k for t in modules + parameters) for k in changed)


def test_lora_on_the_lm_head_changes_the_logits_and_merges_exactly():
    """A LoRA adapter on ``output_proj`` (the untied LM head) takes part in the logits before merging (the head
    is called as a module), trains, and ``merge_and_unload`` gives the same logits."""
    torch.manual_seed(0)
    model = HeadmixForCausalLM.from_headmix(build_model(get_config("llama-tiny-mha", task="lm", vocab_size=50))).eval()
    assert model.get_output_embeddings() is model.model.output_proj
    ids = torch.randint(3, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(ids).logits
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["output_proj"],
                                                         init_lora_weights=False))
    with torch.no_grad():
        adapted_logits = adapted(ids).logits
    assert (adapted_logits - base).abs().max() > 1e-2
    adapted(ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapted.parameters() if p.requires_grad)
    merged = adapted.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted_logits, rtol=0, atol=1e-5)


def test_peft_wrapped_model_refuses_pre_shifted_labels():
    """The PEFT route: the adapted model passes labels through to the wrapper, which refuses pre-shifted ones
    (``labels = x[:, 1:]`` for ``input_ids = x[:, :-1]``) with the plain model's message."""
    torch.manual_seed(0)
    model = HeadmixForCausalLM.from_headmix(build_model(get_config("llama-tiny-moh", task="lm", vocab_size=50)))
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    x = torch.randint(3, 50, (2, 10), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"^labels are input_ids shifted by one: labels are now the inputs themselves"):
        adapted(x[:, :-1], labels=x[:, 1:])
    assert torch.isfinite(adapted(x, labels=x).loss)
