"""torch.compile sees every expert kernel (issue 20's CPU proxies): MoA and SwitchHead with every
``expert_impl`` trace with no graph break, in training and in cached decoding; the CPU ``sorted`` kernels and
the Triton kernels (interpreter) are custom ops with fake implementations and autograd formulas; routings
with empty experts do not recompile."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

pytest.importorskip("triton")

from kernel_cases import define_interpreted_kernels, make_case

from headmix.attention import MixtureOfAttentionHeads, SwitchHeadAttention
from headmix.kernels import IMPLS, expert_routing, grouped_cpu

if not define_interpreted_kernels():
    pytest.skip("Triton kernels were already compiled for a GPU in this process", allow_module_level=True)

D = 16


def make_layer(kind: str, impl: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "moa":
        return MixtureOfAttentionHeads(D, 5, 2, 8, expert_impl=impl)
    return SwitchHeadAttention(D, 2, 3, 2, head_dim=8, expert_impl=impl)


def graph_breaks(fn, *args, **kwargs) -> list[str]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args, **kwargs)
    return [str(b.reason).split("\n")[0] for b in explained.break_reasons]


@pytest.mark.parametrize("kind", ["moa", "switchhead"])
@pytest.mark.parametrize("impl", [i for i in IMPLS if i not in ("auto", "grouped_mm")])  # auto runs one of the others; grouped_mm compiles in bfloat16 only (test_kernels_grouped_mm.py)
def test_no_graph_break_in_training_and_decoding(kind, impl):
    layer = make_layer(kind, impl)
    x = torch.randn(2, 6, D)
    assert graph_breaks(layer, x, is_causal=True) == [], "training"
    layer.eval()
    with torch.no_grad():
        cache = layer(x[:, :5], is_causal=True, use_cache=True).cache
        assert graph_breaks(layer, x[:, 5:], use_cache=True, cache=cache) == [], "cached decoding"


@pytest.mark.parametrize("kind", ["moa", "switchhead"])
@pytest.mark.parametrize("impl", ["sorted", pytest.param("triton", marks=pytest.mark.slow)])  # interpreter: 4-6 s
def test_fullgraph_compile_matches_eager_with_gradients(kind, impl):
    """The custom ops' fake implementations and autograd formulas under AOT autograd; a second routing (other
    experts, some with no token) runs the same graph: no recompile."""
    layer = make_layer(kind, impl).double()
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=False)
    aot = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=False)
    for seed in (0, 1):
        x = torch.randn(2, 6, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed),
                        requires_grad=True)
        compiled(x, is_causal=True)
        want = layer(x, is_causal=True)
        want_grads = torch.autograd.grad(want.output.sum() + want.aux_loss, [x, *layer.parameters()],
                                         allow_unused=True)
        got = aot(x, is_causal=True)
        got_grads = torch.autograd.grad(got.output.sum() + got.aux_loss, [x, *layer.parameters()], allow_unused=True)
        torch.testing.assert_close(got.output, want.output, atol=1e-12, rtol=1e-12)
        for a, b in zip(got_grads, want_grads):
            if b is None:
                assert a is None
            else:
                torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    assert counter.frame_count == 1


def test_empty_experts_do_not_recompile():
    """Routings that leave different experts empty (shapes depend on N, k and E only) reuse one graph."""
    counter = CompileCounter()
    torch._dynamo.reset()

    def fn(x, w, idx):
        return grouped_cpu.sorted_map(x, w, expert_routing(idx, 4))

    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=False)
    x, w = torch.randn(6, 3), torch.randn(4, 3, 5)
    for idx in ([[0, 1]] * 6, [[2, 3]] * 6, [[0, 3], [1, 3], [0, 2], [1, 2], [0, 1], [2, 3]]):
        idx = torch.tensor(idx)
        torch.testing.assert_close(compiled(x, w, idx), fn(x, w, idx))
    assert counter.frame_count == 1


def test_sorted_custom_ops_opcheck():
    n, k, e, d_in, d_out = 6, 2, 4, 5, 3
    idx, (x, w_map, h, w_red, gates) = make_case(n, k, e, d_in, d_out, torch.float64, allowed=[0, 1, 3])
    r = expert_routing(idx, e)
    torch.library.opcheck(grouped_cpu.sorted_map_op, (x, w_map, r.sort_order, r.offsets, k, None))
    torch.library.opcheck(grouped_cpu.sorted_reduce_op, (h, w_red, gates, r.sort_order, r.offsets, 2))


@pytest.mark.parametrize("kind, impl", [("moa", "triton"), ("switchhead", "sorted")])
def test_dynamic_shapes_compile_once(kind, impl):
    """With dynamic shapes (what torch.compile switches to after a shape change) three sequence lengths run
    one graph: the kernels' fake implementations take symbolic sizes."""
    layer = make_layer(kind, impl)
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for time in (5, 7, 9):
        x = torch.randn(2, time, D)
        torch.testing.assert_close(compiled(x, is_causal=True).output, layer(x, is_causal=True).output)
    assert counter.frame_count == 1
