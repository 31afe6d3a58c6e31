"""Triton grouped-matmul kernels, run by the Triton interpreter on CPU tensors.

``TRITON_INTERPRET=1`` is set only while this module defines the kernels (the
interpreter is chosen when a ``@triton.jit`` function is created) and is then
restored, so other tests in the same pytest process see the environment they
started with.  Sizes are tiny: the interpreter is slow.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from headmix.kernels import (
    expert_map,
    expert_reduce,
    expert_routing,
    grouped_triton,
)

_ENV_BEFORE = os.environ.get("TRITON_INTERPRET")


def _define_interpreted_kernels() -> bool:
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return grouped_triton.kernels_interpreted()  # defines the kernels on first call
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


if not _define_interpreted_kernels():
    pytest.skip("Triton kernels were already compiled for a GPU in this process", allow_module_level=True)


def einsum_map(x, weight, idx):
    return torch.einsum("ni,nkio->nko", x, weight[idx])


def einsum_reduce(h, weight, gates, idx):
    return torch.einsum("nk,nki,nkio->no", gates, h, weight[idx])


def make_case(n, k, e, d_in, d_out, dtype, seed=0, allowed=None):
    g = torch.Generator().manual_seed(seed)
    allowed = torch.arange(e) if allowed is None else torch.tensor(allowed)
    rows = [allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(n)]
    idx = torch.stack(rows) if n else torch.zeros(0, k, dtype=torch.long)
    shapes = [(n, d_in), (e, d_in, d_out), (n, k, d_in), (e, d_in, d_out), (n, k)]
    tensors = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    tensors[4] = tensors[4].abs() + 0.1
    return idx, [t.to(dtype).requires_grad_() for t in tensors]


def run(impl, idx, e, tensors, block_m=None):
    routing = expert_routing(idx, e, block_m=block_m)
    x, w_map, h, w_red, gates = tensors
    y = expert_map(x, w_map, routing, impl)
    z = expert_reduce(h, w_red, gates, routing, impl)
    g = torch.Generator().manual_seed(1)
    cy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.dtype)
    cz = torch.randn(z.shape, generator=g, dtype=torch.float64).to(z.dtype)
    grads = torch.autograd.grad((y * cy).sum() + (z * cz).sum(), tensors)
    return [y.detach(), z.detach(), *grads]


NAMES = ["map out", "reduce out", "grad x", "grad W_map", "grad h", "grad W_reduce", "grad gates"]


# (N, k, E, d_in, d_out, allowed experts, block_m)
CASES = {
    "basic_multi_block": (13, 2, 5, 17, 9, None, 16),  # 26 slots, several 16-row blocks per expert
    "default_block": (13, 2, 5, 17, 9, None, None),
    "empty_experts": (9, 2, 6, 10, 3, [0, 2, 3], 16),
    "k_eq_E": (5, 3, 3, 6, 20, None, 16),
    "N0": (0, 2, 4, 5, 3, None, 16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference_float32(case):
    n, k, e, d_in, d_out, allowed, block_m = CASES[case]
    idx, tensors = make_case(n, k, e, d_in, d_out, torch.float32, allowed=allowed)
    want = run("reference", idx, e, tensors)
    got = run("triton", idx, e, tensors, block_m)
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, name=name: f"{case} {name}: {m}")
    if allowed is not None:
        unused = sorted(set(range(e)) - set(allowed))
        assert torch.all(got[3][unused] == 0) and torch.all(got[5][unused] == 0)


def test_triton_float64_matches_einsum():
    n, k, e, d_in, d_out = 7, 2, 4, 5, 6
    idx, tensors = make_case(n, k, e, d_in, d_out, torch.float64)
    got = run("triton", idx, e, tensors, 16)
    x, w_map, h, w_red, gates = tensors
    y, z = einsum_map(x, w_map, idx), einsum_reduce(h, w_red, gates, idx)
    g = torch.Generator().manual_seed(1)
    cy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    cz = torch.randn(z.shape, generator=g, dtype=torch.float64)
    want = [y.detach(), z.detach(), *torch.autograd.grad((y * cy).sum() + (z * cz).sum(), tensors)]
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=lambda m, name=name: f"{name}: {m}")


def test_triton_bfloat16():
    n, k, e, d_in, d_out = 9, 2, 4, 16, 8
    idx, t64 = make_case(n, k, e, d_in, d_out, torch.float64)
    want = run("reference", idx, e, t64)
    low = [t.detach().to(torch.bfloat16).requires_grad_() for t in t64]
    got = run("triton", idx, e, low, 16)
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == torch.bfloat16
        err, scale = (a.double() - b).abs().max().item(), b.abs().max().item()
        assert err <= 3e-2 * scale, f"{name}: {err:.3g} > 3e-2 * {scale:.3g}"


def test_custom_ops_opcheck():
    n, k, e, d_in, d_out = 6, 2, 3, 5, 4
    idx, (x, w_map, *_rest) = make_case(n, k, e, d_in, d_out, torch.float32)
    r = expert_routing(idx, e, block_m=16)
    args = (x, w_map, r.sort_order, r.block_expert, r.block_start, r.offsets, k, 16)
    torch.library.opcheck(grouped_triton.grouped_mm, args)
    grad_y = torch.randn(n * k, d_out)
    torch.library.opcheck(grouped_triton.grouped_mm_wgrad, (x.detach(), grad_y, r.sort_order, r.offsets, k, 16))


def test_torch_compile_traces_custom_ops():
    n, k, e, d_in, d_out = 6, 2, 3, 5, 4
    idx, tensors = make_case(n, k, e, d_in, d_out, torch.float32)

    def layer(x, w_map, h, w_red, gates, idx):
        routing = expert_routing(idx, e, block_m=16)
        return expert_map(x, w_map, routing, "triton").sum() + expert_reduce(h, w_red, gates, routing, "triton").sum()

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    got = compiled(*tensors, idx)
    got_grads = torch.autograd.grad(got, tensors)
    want = layer(*tensors, idx)
    want_grads = torch.autograd.grad(want, tensors)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)


def test_env_restored():
    assert grouped_triton.kernels_interpreted()
    # defining the kernels must not leave TRITON_INTERPRET changed for the rest of the session
    assert os.environ.get("TRITON_INTERPRET") == _ENV_BEFORE
