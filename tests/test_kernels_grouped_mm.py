"""``expert_impl="grouped_mm"`` (PyTorch's grouped GEMM, :mod:`headmix.kernels.grouped_torch`) against the
reference and an independent einsum (MoA eq. 10, 12, 6; SwitchHead's weighted values): outputs and
gradients, empty experts, odd sizes (the 16-byte padding), low precision, the layers that use it, its dtype
rules, and a bfloat16 ``torch.compile(fullgraph=True)`` with no graph break (the rule on CUDA)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import NAMES, assert_all_close, einsum_map, einsum_reduce, make_case, run
from test_kernels import CASES as KERNEL_CASES

from headmix.attention import MixtureOfAttentionHeads, MixtureOfHeadsAttention, SwitchHeadAttention
from headmix.kernels import choose_impl, expert_map, expert_map_weighted, expert_reduce, expert_routing
from headmix.kernels import grouped_torch

# (N, k, E, d_in, d_out, allowed experts): the cases of tests/test_kernels.py, plus sizes whose rows are
# 16-byte aligned only after padding in one operand and not the other
CASES = {
    **KERNEL_CASES,
    "aligned_in_odd_out": (21, 2, 4, 16, 5, None),
    "odd_in_aligned_out": (21, 2, 4, 5, 16, None),
    "first_and_last_empty": (12, 2, 6, 8, 8, [1, 2, 3, 4]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_and_einsum(case):
    n, k, e, d_in, d_out, allowed = CASES[case]
    idx, tensors = make_case(n, k, e, d_in, d_out, torch.float32, allowed=allowed)
    got = run("grouped_mm", idx, e, *tensors)
    assert_all_close(got, run("reference", idx, e, *tensors), 2e-5, 2e-5, "grouped_mm")
    idx64, (x, w_map, h, w_red, gates) = make_case(n, k, e, d_in, d_out, torch.float64, allowed=allowed)
    torch.testing.assert_close(got[0].double(), einsum_map(x, w_map, idx64).detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1].double(), einsum_reduce(h, w_red, gates, idx64).detach(), atol=1e-5, rtol=1e-5)


def test_known_values():
    w = torch.stack([torch.eye(4), 2 * torch.eye(4), torch.eye(4).flip(0)])
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    routing = expert_routing(torch.tensor([[2, 0], [1, 2]]), 3)
    y = expert_map(x, w, routing, "grouped_mm")
    torch.testing.assert_close(y, torch.tensor([[[4.0, 3, 2, 1], [1, 2, 3, 4]], [[10, 12, 14, 16], [8, 7, 6, 5]]]))
    z = expert_reduce(y, w, torch.tensor([[0.5, 0.25], [1.0, 2.0]]), routing, "grouped_mm")
    # token 0: 0.5 * flip([4,3,2,1]) + 0.25 * [1,2,3,4]; token 1: 1 * 2 * [10,12,14,16] + 2 * flip([8,7,6,5])
    torch.testing.assert_close(z, torch.tensor([[0.75, 1.5, 2.25, 3.0], [30.0, 36.0, 42.0, 48.0]]))


@pytest.mark.parametrize("case", ["empty_experts", "first_and_last_empty"])
def test_empty_experts_have_zero_weight_grad(case):
    n, k, e, d_in, d_out, allowed = CASES[case]
    idx, tensors = make_case(n, k, e, d_in, d_out, torch.float32, allowed=allowed)
    out = run("grouped_mm", idx, e, *tensors)
    empty = [i for i in range(e) if i not in allowed]
    for grad_w in (out[3], out[5]):
        assert torch.all(grad_w[empty] == 0)
        assert torch.all(grad_w[allowed].abs().sum((1, 2)) > 0)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_low_precision(dtype, tol):
    """bf16 / fp16 outputs and grads within ``tol`` x (max |value|) of the float64 reference."""
    n, k, e, d_in, d_out = 24, 2, 5, 16, 8
    idx, t64 = make_case(n, k, e, d_in, d_out, torch.float64)
    want = run("reference", idx, e, *t64)
    got = run("grouped_mm", idx, e, *[t.detach().to(dtype).requires_grad_() for t in t64])
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == dtype, name
        err, scale = (a.double() - b).abs().max().item(), b.abs().max().item()
        assert err <= tol * scale, f"{dtype} {name}: max err {err:.3g} > {tol} * {scale:.3g}"


def test_repeated_experts_in_a_row_and_non_contiguous_inputs():
    idx = torch.tensor([[1, 1], [0, 2], [2, 2]])
    _, (x, w_map, h, w_red, gates) = make_case(3, 2, 3, 6, 5)
    routing = expert_routing(idx, 3)
    w_t = w_map.detach().transpose(1, 2).contiguous().transpose(1, 2)  # column-major per expert
    torch.testing.assert_close(expert_map(x, w_t, routing, "grouped_mm"), einsum_map(x, w_map, idx))
    h_t = h.detach().transpose(0, 1).contiguous().transpose(0, 1)
    torch.testing.assert_close(expert_reduce(h_t, w_red, gates, routing, "grouped_mm"),
                               einsum_reduce(h, w_red, gates, idx))


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_map_weighted_and_grouped_reduce_input(groups):
    """SwitchHead's weighted values (gates and group sums in one bmm) and an (N, G, k / G, d) reduce input."""
    n, k, e, d_in, d_out = 11, 4, 7, 6, 9
    idx, (x, w_map, h, w_red, gates) = make_case(n, k, e, d_in, d_out)
    routing = expert_routing(idx, e)
    got = expert_map_weighted(x, w_map, gates, routing, groups, "grouped_mm")
    want = expert_map_weighted(x, w_map, gates, routing, groups, "reference")
    torch.testing.assert_close(got, want)
    cot = torch.randn(got.shape)
    grads = torch.autograd.grad((got * cot).sum(), [x, w_map, gates])
    for a, b in zip(grads, torch.autograd.grad((want * cot).sum(), [x, w_map, gates])):
        torch.testing.assert_close(a, b)
    rows = torch.randn(n, groups, 1, d_in).expand(n, groups, k // groups, d_in)
    torch.testing.assert_close(expert_reduce(rows, w_red, gates, routing, "grouped_mm"),
                               expert_reduce(rows, w_red, gates, routing, "reference"))


def layers():
    torch.manual_seed(0)
    return {
        "moa": MixtureOfAttentionHeads(24, 5, 2, 8, expert_impl="grouped_mm"),
        "switchhead": SwitchHeadAttention(24, 2, 4, 2, head_dim=6, expert_impl="grouped_mm"),
        "moh_sparse": MixtureOfHeadsAttention(24, 6, num_shared_heads=2, top_k=2, impl="sparse",
                                              expert_impl="grouped_mm"),
    }


@pytest.mark.parametrize("kind", ["moa", "switchhead", "moh_sparse"])
def test_layers_match_their_reference_kernels(kind):
    """Every expert projection of the layer (MoA map and reduce, SwitchHead values and outputs, sparse MoH's
    routed heads) on ``grouped_mm`` against the same layer on ``reference``: outputs and gradients."""
    layer = layers()[kind]
    x = torch.randn(2, 7, 24, requires_grad=True)
    mask = torch.tensor([[False] * 7, [False] * 5 + [True] * 2])
    results = []
    for impl in ("grouped_mm", "reference"):
        layer.expert_impl = impl
        out = layer(x, key_padding_mask=mask)
        loss = (out.output * torch.linspace(-1, 1, 24)).sum() + out.aux_loss
        results.append([out.output, *torch.autograd.grad(loss, [x, *layer.parameters()])])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-5)


def test_dtype_rules():
    idx, (x, w_map, h, w_red, gates) = make_case(4, 2, 3, 8, 8, torch.float64)
    routing = expert_routing(idx, 3)
    with pytest.raises(ValueError, match=r"impl='grouped_mm' needs a dtype in \(float32, bfloat16, float16\)"):
        expert_map(x, w_map, routing, "grouped_mm")
    with pytest.raises(ValueError, match="impl='grouped_mm' needs a dtype"):
        expert_reduce(h, w_red, gates, routing, "grouped_mm")
    # any device but the CPU (a meta tensor here: no GPU needed) takes bfloat16 only
    with pytest.raises(ValueError, match=r"needs a dtype in \(bfloat16\) on meta or under torch.compile, got torch.float32"):
        grouped_torch.check_grouped_mm_dtype(torch.empty(2, device="meta"))
    grouped_torch.check_grouped_mm_dtype(torch.empty(2, device="meta", dtype=torch.bfloat16))


def test_auto_picks_grouped_mm_for_bfloat16_on_cuda():
    cuda = torch.device("cuda")
    assert choose_impl(cuda, 4096, 32, 8, True, torch.bfloat16) == "grouped_mm"
    assert choose_impl(cuda, 4096, 32, 8, True, torch.float32) in ("triton", "sorted")
    assert choose_impl(torch.device("cpu"), 4096, 32, 8, True, torch.bfloat16, threads=2) == "sorted"


@pytest.mark.parametrize("kind", ["moa", "switchhead"])
def test_bfloat16_compiles_fullgraph_with_no_graph_break(kind):
    """The CUDA rule (bfloat16) traced on the CPU: no graph break, and AOT autograd's outputs and gradients
    are eager's."""
    layer = layers()[kind].to(torch.bfloat16)
    x = torch.randn(2, 6, 24, dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(x, is_causal=True)
    assert explained.graph_break_count == 0, [str(b.reason).split("\n")[0] for b in explained.break_reasons]
    assert_aot_equals_eager(layer, x)


def assert_aot_equals_eager(layer: torch.nn.Module, x: torch.Tensor) -> None:
    """``torch.compile(fullgraph=True)`` with AOT autograd gives eager's causal output and gradients."""
    aot = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=False)
    got, want = aot(x, is_causal=True), layer(x, is_causal=True)
    torch.testing.assert_close(got.output, want.output)
    params = [x, *layer.parameters()]
    for a, b in zip(torch.autograd.grad(got.output.float().sum(), params),
                    torch.autograd.grad(want.output.float().sum(), params)):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_bfloat16_against_float64_with_no_host_sync():
    """What ``auto`` picks on CUDA for bfloat16: PyTorch's CUTLASS grouped GEMM, against the float64 reference
    (outputs and gradients, empty experts), with CUDA's sync debug mode set to error."""
    n, k, e, d_in, d_out = 512, 4, 16, 64, 48
    idx, t64 = make_case(n, k, e, d_in, d_out, torch.float64, allowed=list(range(12)))
    want = run("reference", idx, e, *t64)
    low = [t.detach().to("cuda", torch.bfloat16).requires_grad_() for t in t64]
    assert choose_impl(torch.device("cuda"), n * k, e, k, True, torch.bfloat16) == "grouped_mm"
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = run("grouped_mm", idx.cuda(), e, *low)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name, a, b in zip(NAMES, got, want):
        err, scale = (a.double().cpu() - b).abs().max().item(), b.abs().max().item()
        assert err <= 3e-2 * scale, f"{name}: max err {err:.3g} > 3e-2 * {scale:.3g}"
