"""What headmix's vLLM model serves and the one-line refusals of the rest (headmix.serving.support), without vLLM;
tests/test_vllm.py runs the served kinds in vLLM."""

from __future__ import annotations

import dataclasses

import pytest

from headmix.models.config import AttentionConfig
from headmix.models.presets import get_config
from headmix.serving.support import NotServableError, check_head_size, check_servable

#: Every causal preset vLLM serves (the kinds and decoder options of the lm presets), and the reason each of the
#: others is refused.
SERVED = ["tiny-mha", "tiny-moa", "tiny-moh", "tiny-switchhead", "llama-tiny-mha", "llama-tiny-moa",
          "llama-tiny-moh", "llama-tiny-switchhead", "llama-tiny-moa-kv2", "llama-tiny-jetmoe", "llama3-tiny-gqa",
          "llama3-tiny-gated", "llama3-tiny-moh-per-group", "llama-mini-mha", "mini-moa"]
REFUSED = {"llama-tiny-talking-heads": "Talking-Heads mixes the attention scores across heads",
           "tiny-talking-heads": "Talking-Heads mixes the attention scores across heads",
           "llama-tiny-mosa": "MoSA's heads attend to token subsets",
           "llama3-tiny-gqe": "the paper's GQE"}


@pytest.mark.parametrize("name", SERVED)
def test_causal_presets_are_served(name):
    check_servable(get_config(name, task="lm"))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_presets_name_why_and_where_else(name):
    with pytest.raises(NotServableError) as caught:
        check_servable(get_config(name, task="lm"))
    message = str(caught.value)
    assert REFUSED[name] in message and "headmix generate" in message and "\n" not in message


def _with_attention(name: str, **changes):
    config = get_config(name, task="lm")
    return config.replace(decoder_self_attention=dataclasses.replace(config.decoder_self_attention, **changes))


@pytest.mark.parametrize("name", ["llama-tiny-moa", "llama-tiny-moh", "llama-tiny-switchhead"])
def test_random_routing_controls_are_refused(name):
    with pytest.raises(NotServableError, match=r"random-routing control .* continuous batching .*`headmix generate`"):
        check_servable(_with_attention(name, router="random"))


def test_decoupled_key_size_is_refused():
    with pytest.raises(NotServableError, match=r"decoupled key size \(decoder_self_attention.key_dim=32, head_dim=16\)"):
        check_servable(_with_attention("llama-tiny-mha", key_dim=32))
    check_servable(_with_attention("llama-tiny-mha", key_dim=16))  # equal sizes: not decoupled


def test_other_tasks_are_refused():
    with pytest.raises(NotServableError, match="causal language models .* not task 'translation'"):
        check_servable(get_config("tiny-mha", task="translation"))


def test_head_size_refusal_names_the_accepted_sizes():
    check_head_size(64, [32, 64, 128], "CPU_ATTN")
    check_head_size(16, [], "ANY")  # an empty list: the backend takes any size
    with pytest.raises(NotServableError, match=r"CPU_ATTN attention does not take heads of size 16; it accepts "
                                               r"\[32, 64, 128\]"):
        check_head_size(16, [128, 32, 64], "CPU_ATTN")


def test_noisy_router_is_served():
    check_servable(get_config("llama-tiny-moa", task="lm").replace(
        decoder_self_attention=AttentionConfig(kind="moa", num_experts=4, top_k=2, head_dim=32, router="noisy_topk",
                                               rotary=True)))


def test_the_query_norm_router_is_served():
    """MoH-LLaMA3's parameter-free rule, globally and routed per K/V group (tests/test_vllm.py runs it in vLLM)."""
    check_servable(_with_attention("llama-tiny-moh", router="query_norm"))
    check_servable(_with_attention("llama3-tiny-moh-per-group", router="query_norm", top_k=2, num_shared_heads=0))


def test_the_papers_gqe_is_refused_until_served():
    with pytest.raises(NotServableError) as caught:
        check_servable(get_config("llama3-tiny-gqe", task="lm"))
    message = str(caught.value)
    assert "the paper's GQE" in message and "headmix generate" in message and "\n" not in message
