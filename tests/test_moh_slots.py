"""Sparse MoH's slot form (``moh_sparse``'s ``grouped_query`` layout): with ``route_per_group`` (GQE) or one K/V
head, the selected heads are the query heads of one grouped-query attention call. Exact against dense MoH
(float64: outputs, losses, input and parameter gradients), taken wherever it applies (eager, compiled, decoding,
every device's rule), compiled with ``fullgraph=True`` and no host read."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import headmix.attention.moh as moh_module
from headmix.attention import moh_sparse
from headmix.attention.moh import MixtureOfHeadsAttention, choose_moh_impl
from headmix.attention.moh_sparse import routed_layout
from headmix.models import AttentionConfig
from headmix.models.counting import attention_macs
from test_dispatch_counts import SYNC_OPS, OpRecorder
from test_moh_sparse import D, assert_same, both, cross_attention, decode_in_steps, padding_mask

#: (name, layer keywords): GQE on 3 groups of 4 heads, and MoH with one K/V head (7 heads), odd head sizes.
FORMS = {"per_group": dict(heads=12, kv_heads=3, route_per_group=True, head_dim=5),
         "one_kv_head": dict(heads=7, kv_heads=1, head_dim=5)}


def make(form: str, shared: int, top_k: int, **kw) -> MixtureOfHeadsAttention:
    torch.manual_seed(0)
    # every shared / top_k pair, top 1 under the default weighting included: its router gets no task gradient
    # (issue 42's ablation, asked for by name here), but the slot form must compute it exactly all the same
    kw = {**FORMS[form], "allow_router_without_task_gradient": True, **kw}
    layer = MixtureOfHeadsAttention(D, kw.pop("heads"), shared, top_k, impl="dense", **kw).double()
    with torch.no_grad():
        for p in layer.parameters():  # non-zero routers and biases, so every weight matters
            p.normal_(0.0, 0.3)
    return layer


def combinations(form: str) -> list[tuple[int, int]]:
    """Every (shared, top_k) the form allows: shared 0 .. S, top_k 1 .. R (per group with route_per_group)."""
    group = 4 if form == "per_group" else 7
    return [(s, k) for s in range(group) for k in range(1, group - s + 1)]


class LayoutSpy:
    """Counts the calls of the slot form and of the other sparse layouts, so a test knows which one ran."""

    def __init__(self, monkeypatch):
        self.slots = self.other = 0
        real_slots, real_other = moh_module.slot_attention, moh_module.routed_heads_attention

        def slots(*args, **kwargs):
            self.slots += 1
            return real_slots(*args, **kwargs)

        def other(*args, **kwargs):
            self.other += 1
            return real_other(*args, **kwargs)

        monkeypatch.setattr(moh_module, "slot_attention", slots)
        monkeypatch.setattr(moh_module, "routed_heads_attention", other)


def masks(kind: str, batch: int, tgt: int, heads: int) -> dict:
    g = torch.Generator().manual_seed(7)
    if kind == "causal":
        return {"is_causal": True}
    if kind == "padding":
        return {"key_padding_mask": padding_mask()[:batch, :tgt]}
    if kind == "causal+padding":
        return {"is_causal": True, "key_padding_mask": padding_mask()[:batch, :tgt]}
    per_head = torch.rand(batch, heads, tgt, tgt, generator=g) > 0.5  # each head its own mask, some rows empty
    per_head[:, :, 0] = True
    return {"attn_mask": per_head, "key_padding_mask": padding_mask()[:batch, :tgt]}


def self_attention(kw: dict, batch: int = 3, tgt: int = 11):
    def call(m):
        if m.random_router is not None:  # the same draw for the dense and the sparse call (training draws anew)
            m.random_router.calls.zero_()
        x = torch.randn(batch, tgt, D, dtype=torch.double, generator=torch.Generator().manual_seed(1),
                        requires_grad=True)
        return m(x, **kw), [x]

    return call


@pytest.mark.parametrize("form", FORMS)
def test_slot_form_equals_dense_for_every_shared_and_top_k(form, monkeypatch):
    for shared, top_k in combinations(form):
        spy = LayoutSpy(monkeypatch)
        layer = make(form, shared, top_k, rotary=True)
        call = self_attention({"is_causal": True, "key_padding_mask": padding_mask()})
        assert_same(*both(layer, call))
        assert (spy.slots, spy.other) == (1, 0), (shared, top_k)


@pytest.mark.parametrize("router", ["softmax", "random", "query_norm"])
@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("mask", ["causal", "padding", "causal+padding", "per_head"])
@pytest.mark.parametrize("form", FORMS)
def test_slot_form_equals_dense_with_masks_rotary_and_routers(form, mask, rotary, router, monkeypatch):
    spy = LayoutSpy(monkeypatch)
    layer = make(form, 1, 2, rotary=rotary, router=router, qk_norm=True, output_gate="headwise")
    call = self_attention(masks(mask, 3, 11, layer.num_heads))
    dense, sparse = both(layer, call)
    assert_same(dense, sparse)
    assert (spy.slots, spy.other) == (1, 0)


def test_slot_form_equals_dense_in_cross_attention_with_elementwise_gates_and_dropout_off(monkeypatch):
    spy = LayoutSpy(monkeypatch)
    layer = make("per_group", 2, 1, rotary=True, output_gate="elementwise", dropout=0.3).eval()
    assert_same(*both(layer, cross_attention))
    assert (spy.slots, spy.other) == (1, 0)


@pytest.mark.parametrize("preallocated", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_slot_form_cached_decoding_equals_the_full_forward(form, preallocated, monkeypatch):
    layer = make(form, 1, 2, rotary=True, qk_norm=True).eval()
    x = torch.randn(2, 9, D, dtype=torch.double, generator=torch.Generator().manual_seed(6))
    layer.impl = "dense"
    full = layer(x, is_causal=True).output
    spy = LayoutSpy(monkeypatch)
    layer.impl = "sparse"
    torch.testing.assert_close(decode_in_steps(layer, x, preallocated), full, rtol=0, atol=1e-12)
    assert (spy.slots, spy.other) == (7, 0)


def test_layout_rule():
    cpu, meta = torch.empty(1), torch.empty(1, device="meta")  # meta: a device other than the CPU
    for t in (cpu, meta):
        assert routed_layout(True, 512, t) == "grouped_query"
        assert routed_layout(True, 1, t) == "grouped_query"
        assert routed_layout(False, 1, t) == "slots"
    assert routed_layout(False, 512, cpu) == "heads"
    assert routed_layout(False, 512, meta) == "padded"
    assert MixtureOfHeadsAttention(D, 8, 1, 1, allow_router_without_task_gradient=True, kv_heads=2, route_per_group=True).slot_form
    assert MixtureOfHeadsAttention(D, 8, 1, 1, allow_router_without_task_gradient=True, kv_heads=1).slot_form
    assert not MixtureOfHeadsAttention(D, 8, 1, 1, allow_router_without_task_gradient=True, kv_heads=2).slot_form
    assert not MixtureOfHeadsAttention(D, 8, 1, 1, allow_router_without_task_gradient=True).slot_form


def test_auto_picks_the_slot_form_on_every_device_and_under_compile(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for device in (cpu, cuda):
        assert choose_moh_impl(device, 2, 4, 512, slot_form=True) == "sparse"
        assert choose_moh_impl(device, 2, 4, 1, slot_form=True) == "dense"  # decoding: measured no faster
        assert choose_moh_impl(device, 3, 4, 512, slot_form=True) == "dense"  # most routed heads active
        assert choose_moh_impl(device, 2, 4, 256, slot_form=True) == "sparse"
        assert choose_moh_impl(device, 2, 4, 255, slot_form=True) == "dense"  # short sequences: measured slower
    assert choose_moh_impl(cuda, 2, 4, 512) == "dense"  # global routing: the padded layout skips no attention
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert choose_moh_impl(cpu, 2, 4, 512, slot_form=True) == "sparse"
    assert choose_moh_impl(cpu, 2, 4, 512) == "dense"


def test_slot_form_runs_no_host_read(monkeypatch):
    """An eager training step and a decoding step of GQE on the CPU dispatch no operation that reads a value back
    (``.item()``, ``nonzero``, data-dependent shapes), with the kernels ``auto`` picks on CUDA (``grouped_mm``)."""
    monkeypatch.setattr(moh_sparse, "static_shapes", lambda t: True)  # what every device but the CPU does
    torch.manual_seed(0)
    layer = MixtureOfHeadsAttention(D, 8, 1, 1, allow_router_without_task_gradient=True, kv_heads=2, route_per_group=True, impl="sparse",
                                    expert_impl="grouped_mm", rotary=True)
    x = torch.randn(2, 7, D, requires_grad=True)
    with OpRecorder() as rec:
        out = layer(x, is_causal=True, key_padding_mask=padding_mask()[:2, :7])
        (out.output.sum() + out.aux_loss).backward()
        with torch.no_grad():
            cache = layer(x[:, :6], is_causal=True, use_cache=True).cache.preallocate(8)
            layer(x[:, 6:], is_causal=True, use_cache=True, cache=cache)
    assert len(rec.all_ops) > 50
    assert sorted(set(rec.all_ops) & (SYNC_OPS | {"repeat_interleave.Tensor"})) == []


@pytest.mark.parametrize("form", ["per_group", pytest.param("one_kv_head", marks=pytest.mark.slow)])
def test_slot_form_compiles_fullgraph_forward_and_backward_equal_to_eager(form, monkeypatch):
    """``torch.compile(fullgraph=True, dynamic=False)`` of a training step on the sparse path (which ``auto`` picks
    under compile from SPARSE_MIN_QUERIES queries on: test_auto_picks_the_slot_form_on_every_device_and_under_compile):
    no graph break (``torch._dynamo.explain``), one graph, and with AOTAutograd (the backward traced too)
    the eager outputs and gradients. ``fullgraph`` fails on ``.item()``, ``.tolist()`` and data-dependent shapes."""
    torch._dynamo.reset()
    spy = LayoutSpy(monkeypatch)
    layer = make(form, 1, 1, rotary=True, qk_norm=True)
    x = torch.randn(2, 9, D, dtype=torch.double, requires_grad=True)
    padding = padding_mask()[:2, :9]

    def loss_of(x, padding):
        out = layer(x, key_padding_mask=padding, query_padding_mask=padding, is_causal=True)
        return out.output.square().mean() + out.aux_loss

    def grads(loss):
        return [loss, *torch.autograd.grad(loss, [x, *layer.parameters()], allow_unused=True)]

    layer.impl = "dense"
    want = grads(loss_of(x, padding))
    layer.impl = "sparse"
    assert spy.slots == 0
    explained = torch._dynamo.explain(loss_of)(x, padding)  # one graph, no break
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    got = grads(torch.compile(loss_of, backend="aot_eager", fullgraph=True, dynamic=False)(x, padding))
    assert spy.slots >= 2 and spy.other == 0  # traced through the slot form each time, never another layout
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    torch._dynamo.reset()


def test_macs_count_the_slot_form():
    """Sparse MoH in the slot form computes the attention of ``G (S + k)`` query heads (the shared heads and the
    slots), their query and output projections, and every K/V head's keys and values."""
    d, t, dh = 64, 16, 8
    gqe = AttentionConfig(kind="moh", num_heads=12, kv_heads=3, route_per_group=True, num_shared_heads=1, top_k=2,
                          head_dim=dh, moh_impl="sparse")
    kv1 = AttentionConfig(kind="moh", num_heads=7, kv_heads=1, num_shared_heads=2, top_k=3, head_dim=dh,
                          moh_impl="sparse")
    for att, heads, kv, computed, router in ((gqe, 12, 3, 3 * (1 + 2), 3 * 3 + 3 * 1 + 2 * 3),
                                             (kv1, 7, 1, 2 + 3, 5 + 2 + 2)):
        keys_values = 2 * t * d * kv * dh
        per_head = 2 * t * d * dh + 2 * t * t * dh  # query and output projections, scores and weights x values
        assert attention_macs(att, d, t, t)[0] == keys_values + computed * per_head + t * d * router
        dense = dataclasses.replace(att, moh_impl="dense")
        assert attention_macs(dense, d, t, t)[0] == keys_values + heads * per_head + t * d * router
