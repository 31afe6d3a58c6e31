"""Which models headmix's vLLM model splits over tensor-parallel ranks, and the one-line refusal of a
``tensor_parallel_size`` that does not divide what is split (headmix.serving.support.check_tensor_parallel), without
vLLM; tests/test_vllm.py serves each kind on 2 ranks."""

from __future__ import annotations

import dataclasses

import pytest

from headmix.models.presets import get_config
from headmix.serving.support import NotServableError, check_tensor_parallel


def _config(name: str, ffn_dim: int | None = None, **attention):
    config = get_config(name, task="lm")
    config = config.replace(decoder_self_attention=dataclasses.replace(config.decoder_self_attention, **attention))
    return config if ffn_dim is None else config.replace(ffn_dim=ffn_dim)


@pytest.mark.parametrize("name, ranks, attention", [
    ("llama3-tiny-gqa", 2, {}),                            # 8 heads on 2 K/V heads: both split
    ("llama3-tiny-gqa", 4, {}),                            # 2 K/V heads on 4 ranks: each held by 2
    ("llama3-tiny-gqa", 8, {"kv_heads": 1}),               # MQA: the K/V head on every rank
    ("llama3-tiny-moh-per-group", 2, {}),
    ("llama-tiny-moa", 2, {}),                             # one K/V head: its 4 experts split
    ("llama-tiny-moa-kv2", 2, {"num_experts": 3}),         # split by K/V head: any number of experts
    ("llama-tiny-jetmoe", 2, {}),
    ("llama-tiny-switchhead", 2, {}),
    ("llama3-tiny-gqa", 1, {"num_heads": 7, "kv_heads": 7, "head_dim": 16}),  # one rank: nothing split
])
def test_split_over_ranks(name, ranks, attention):
    check_tensor_parallel(_config(name, **attention), ranks)


@pytest.mark.parametrize("name, changes, message", [
    ("llama3-tiny-gqa", {"num_heads": 6, "kv_heads": 3, "head_dim": 16}, "tensor_parallel_size=4 does not divide "
                                                         "decoder_self_attention.num_heads=6"),
    ("llama3-tiny-gqa", {"num_heads": 12, "kv_heads": 3, "head_dim": 16}, "tensor_parallel_size=4 and "
                                                          "decoder_self_attention.kv_heads=3: neither divides"),
    ("llama-tiny-moa", {"num_experts": 6}, "does not divide MoA's decoder_self_attention.kv_heads=1 (split by K/V "
                                           "head) nor its decoder_self_attention.num_experts=6"),
    ("llama-tiny-switchhead", {}, "tensor_parallel_size=4 does not divide decoder_self_attention.num_heads=2"),
    ("llama3-tiny-gqa", {"ffn_dim": 174}, "tensor_parallel_size=4 does not divide ffn_dim=174"),
])
def test_a_size_that_does_not_divide_is_refused_in_one_line(name, changes, message):
    ffn_dim = changes.pop("ffn_dim", None)
    with pytest.raises(NotServableError) as caught:
        check_tensor_parallel(_config(name, ffn_dim, **changes), 4)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_gqe_is_split_by_kv_group():
    """GQE splits over a rank count that divides its K/V groups (2 on 2), and only such a one (2 on 4)."""
    config = get_config("llama3-tiny-gqe", task="lm")
    check_tensor_parallel(config, 2)
    with pytest.raises(NotServableError) as caught:
        check_tensor_parallel(config, 4)
    assert str(caught.value) == ("tensor_parallel_size=4 does not divide the paper's GQE's "
                                 "decoder_self_attention.kv_heads=2 (split by K/V group): serve with a "
                                 "tensor_parallel_size that does (the sizes that work for this model: 1, 2)")


@pytest.mark.parametrize("name, changes, sizes", [
    ("llama3-tiny-gqa", {"num_heads": 6, "kv_heads": 3, "head_dim": 16}, [1, 3, 6]),  # 2 ranks: 3 K/V heads do not split
    ("llama-tiny-moa", {"num_experts": 6}, [1, 2, 3, 6]),                                 # by expert
    ("llama-tiny-switchhead", {}, [1, 2]),
])
def test_a_refused_size_lists_the_sizes_that_work(name, changes, sizes):
    """The refusal names every tensor_parallel_size the model splits over, each of which check_tensor_parallel
    accepts (a feed-forward width of 192 divides by each)."""
    config = _config(name, 192, **changes)
    with pytest.raises(NotServableError) as caught:
        check_tensor_parallel(config, 4)
    assert str(caught.value).endswith(f"(the sizes that work for this model: {', '.join(map(str, sizes))})")
    for ranks in sizes:
        check_tensor_parallel(config, ranks)
