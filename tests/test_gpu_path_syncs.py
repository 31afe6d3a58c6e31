"""Every layer's CUDA path, traced on the CPU: no host synchronisation in a training step or a cached decoding
step, and sparse MoH's routing-independent shapes (:func:`headmix.attention.moh_sparse.static_shapes`, the
rule on every device but the CPU and under ``torch.compile``) equal to its eager CPU path and compiling with
``fullgraph=True`` and no graph break.

"CUDA path" here: MoA and SwitchHead on ``expert_impl="triton"`` (Triton interpreter, as
tests/test_dispatch_counts.py) and ``"grouped_mm"`` (what ``auto`` picks on CUDA in float32 and bfloat16),
MoH dense and sparse with the static shapes forced, MHA and Talking-Heads. ``.cpu()`` copies cannot be seen
on the CPU; tests/test_gpu.py checks those under CUDA's sync debug mode on a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_dispatch_counts import SYNC_OPS, OpRecorder, composed_router  # noqa: F401  (autouse: the router a GPU runs)
from test_kernels_grouped_mm import assert_aot_equals_eager

from headmix.attention import (
    MixtureOfAttentionHeads,
    MixtureOfHeadsAttention,
    MixtureOfSparseAttention,
    MultiHeadAttention,
    SwitchHeadAttention,
    TalkingHeadsAttention,
)
from headmix.attention import moh_sparse

D = 32

SLOW = pytest.mark.slow  # the Triton interpreter: 5-20 s each on the shared 2-core machine
LAYERS = ["mha", "talking_heads", pytest.param("moa_triton", marks=SLOW), "moa_grouped_mm",
          pytest.param("switchhead_triton", marks=SLOW), "switchhead_grouped_mm", "moh_dense", "moh_sparse",
          "gqa_gated", "gqe_dense", "gqe_sparse", "mosa"]


def make(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    kind, _, impl = name.partition("_")
    if kind == "mha":
        return MultiHeadAttention(D, 4)
    if name == "talking_heads":
        return TalkingHeadsAttention(D, 4)
    if kind == "moa":
        return MixtureOfAttentionHeads(D, 8, 2, 8, expert_impl=impl)
    if kind == "switchhead":
        return SwitchHeadAttention(D, 2, 4, 2, head_dim=8, expert_impl=impl)
    if name == "gqa_gated":
        return MultiHeadAttention(D, 4, kv_heads=2, qk_norm=True, output_gate="headwise")
    if kind == "gqe":
        return MixtureOfHeadsAttention(D, 8, num_shared_heads=1, top_k=2, kv_heads=2, route_per_group=True, impl=impl,
                                       expert_impl="grouped_mm")
    if kind == "moh":
        return MixtureOfHeadsAttention(D, 8, num_shared_heads=2, top_k=2, impl=impl, expert_impl="grouped_mm")
    return MixtureOfSparseAttention(D, 4, 8, tokens_per_head=3, num_dense_heads=1)


@pytest.fixture
def cuda_shapes(monkeypatch):
    """Sparse MoH's static shapes (its rule off the CPU) forced on CPU tensors."""
    monkeypatch.setattr(moh_sparse, "static_shapes", lambda t: True)


def syncs(rec: OpRecorder) -> list[str]:
    return sorted(set(rec.all_ops) & (SYNC_OPS | {"repeat_interleave.Tensor"}))


@pytest.mark.parametrize("name", LAYERS)
def test_no_host_sync_in_training_and_decoding(name, cuda_shapes):
    layer = make(name)
    x = torch.randn(2, 7, D, requires_grad=True)
    mask = torch.tensor([[False] * 7, [False] * 5 + [True] * 2])
    with OpRecorder() as rec:
        out = layer(x, is_causal=True)
        (out.output.sum() + out.aux_loss).backward()
        layer(x, key_padding_mask=mask).output.sum().backward()
    assert not syncs(rec), f"{name} training: {syncs(rec)}"
    layer.eval()
    if name == "mosa":  # training takes its top-k; decoding its causal threshold rule (top-k has no cache)
        layer.calibrate_thresholds([layer(x).routing])
        layer.selection = "threshold"
    with torch.no_grad():
        cache = layer(x[:, :6], is_causal=True, use_cache=True).cache
        with OpRecorder() as rec:
            layer(x[:, 6:], use_cache=True, cache=cache)
    if name == "mosa":  # its cache keeps only the chosen tokens: one read of their count per step (documented)
        assert syncs(rec) == ["_local_scalar_dense"], f"{name} decoding: {syncs(rec)}"
        assert rec.all_ops.count("_local_scalar_dense") == 1, rec.all_ops
        return
    assert not syncs(rec), f"{name} decoding: {syncs(rec)}"


def test_eager_sparse_moh_reads_group_sizes_on_the_cpu():
    """The recorder sees the CPU path's host reads, so the test above is not blind to them."""
    layer = make("moh_sparse")
    with OpRecorder() as rec:
        layer(torch.randn(2, 7, D), is_causal=True)
    assert "_local_scalar_dense" in syncs(rec)


def test_static_shapes_rule():
    assert moh_sparse.static_shapes(torch.empty(1, device="meta"))
    assert not moh_sparse.static_shapes(torch.empty(1))


MASKS = {
    "causal": dict(is_causal=True),
    "key_padding": dict(key_padding_mask=torch.tensor([[False] * 9, [False] * 6 + [True] * 3])),
    "attn_mask": dict(attn_mask=torch.rand(9, 9, generator=torch.Generator().manual_seed(3)) < 0.3),
}


@pytest.mark.parametrize("top_k", [2, 6])  # 6 of 6 routed heads: groups as long as the sequence
@pytest.mark.parametrize("masks", list(MASKS))
def test_static_shapes_equal_the_eager_path_with_gradients(masks, top_k, monkeypatch):
    layer = MixtureOfHeadsAttention(D, 8, num_shared_heads=2, top_k=top_k, impl="sparse", expert_impl="grouped_mm",
                                    rotary=True)
    x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    results = []
    for static in (False, True):
        monkeypatch.setattr(moh_sparse, "static_shapes", lambda t, static=static: static)
        out = layer(x, **MASKS[masks])
        loss = (out.output * torch.linspace(-1, 1, D)).sum() + out.aux_loss
        results.append([out.output, *torch.autograd.grad(loss, [x, *layer.parameters()])])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_sparse_moh_compiles_fullgraph_with_no_graph_break():
    """In bfloat16: grouped_mm compiles in bfloat16 only (its meta function's rule)."""
    layer_bf16 = MixtureOfHeadsAttention(D, 8, num_shared_heads=2, top_k=2, impl="sparse",
                                         expert_impl="grouped_mm").to(torch.bfloat16)
    xb = torch.randn(2, 7, D, dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer_bf16)(xb, is_causal=True)
    assert explained.graph_break_count == 0, [str(b.reason).split("\n")[0] for b in explained.break_reasons]


@pytest.mark.slow  # 10-20 s on the shared machine
def test_sparse_moh_fullgraph_aot_equals_eager():
    layer_bf16 = MixtureOfHeadsAttention(D, 8, num_shared_heads=2, top_k=2, impl="sparse",
                                         expert_impl="grouped_mm").to(torch.bfloat16)
    xb = torch.randn(2, 7, D, dtype=torch.bfloat16, requires_grad=True)
    assert_aot_equals_eager(layer_bf16, xb)
