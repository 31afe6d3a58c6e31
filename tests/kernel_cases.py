"""Cases and helpers shared by the expert map / reduce tests (MoA eq. 10, 12, 6).

Used by test_kernels.py (CPU implementations), test_kernels_triton.py (Triton interpreter),
test_switchhead.py (every implementation) and test_gpu.py (Triton compiled for a GPU).
"""

from __future__ import annotations

import os

import torch

from headmix.kernels import expert_map, expert_reduce, expert_routing


def define_interpreted_kernels() -> bool:
    """Define headmix's Triton kernels for the Triton interpreter (CPU tensors), if they are not defined
    yet: ``TRITON_INTERPRET=1`` is set only while they are defined (the interpreter is chosen when a
    ``@triton.jit`` function is created) and then restored. False when they were already compiled for a
    GPU in this process."""
    from headmix.kernels import grouped_triton

    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return grouped_triton.kernels_interpreted()  # defines the kernels on first call
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def einsum_map(x, weight, expert_index):
    """eq. 10 written independently: y[n,j,o] = sum_i x[n,i] W[idx[n,j],i,o]."""
    return torch.einsum("ni,nkio->nko", x, weight[expert_index])


def einsum_reduce(h, weight, gates, expert_index):
    """eq. 12 + 6 written independently: y[n,o] = sum_{j,i} g[n,j] h[n,j,i] W[idx[n,j],i,o]."""
    return torch.einsum("nk,nki,nkio->no", gates, h, weight[expert_index])


def random_index(n, k, num_experts, generator, allowed=None):
    """(n, k) distinct experts per row, drawn from ``allowed`` (default all)."""
    allowed = torch.arange(num_experts) if allowed is None else torch.as_tensor(allowed)
    if n == 0:
        return torch.zeros(0, k, dtype=torch.long)
    rows = [allowed[torch.randperm(len(allowed), generator=generator)[:k]] for _ in range(n)]
    return torch.stack(rows)


def make_case(n, k, num_experts, d_in, d_out, dtype=torch.float32, seed=0, allowed=None, device="cpu"):
    """Expert index and (x, W_map, h, W_reduce, gates), drawn in float64 on CPU, then cast and moved."""
    g = torch.Generator().manual_seed(seed)
    idx = random_index(n, k, num_experts, g, allowed)
    x = torch.randn(n, d_in, generator=g, dtype=torch.float64)
    w_map = torch.randn(num_experts, d_in, d_out, generator=g, dtype=torch.float64) / d_in**0.5
    h = torch.randn(n, k, d_in, generator=g, dtype=torch.float64)
    w_red = torch.randn(num_experts, d_in, d_out, generator=g, dtype=torch.float64) / d_in**0.5
    gates = torch.rand(n, k, generator=g, dtype=torch.float64) + 0.1
    tensors = [t.to(device, dtype).requires_grad_() for t in (x, w_map, h, w_red, gates)]
    return idx.to(device), tensors


def run(impl, idx, num_experts, x, w_map, h, w_red, gates, seed=1, block_m=None):
    """Outputs of map and reduce with implementation ``impl``, and the gradients of a fixed random loss."""
    routing = expert_routing(idx, num_experts, block_m=block_m)
    y = expert_map(x, w_map, routing, impl)
    z = expert_reduce(h, w_red, gates, routing, impl)
    return _outputs_and_grads(y, z, [x, w_map, h, w_red, gates], seed)


def run_einsum(idx, x, w_map, h, w_red, gates, seed=1):
    """What :func:`run` returns, from the einsum formulas: the ground truth independent of any impl."""
    y, z = einsum_map(x, w_map, idx), einsum_reduce(h, w_red, gates, idx)
    return _outputs_and_grads(y, z, [x, w_map, h, w_red, gates], seed)


def _outputs_and_grads(y, z, inputs, seed):
    g = torch.Generator().manual_seed(seed)
    cy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.device, y.dtype)
    cz = torch.randn(z.shape, generator=g, dtype=torch.float64).to(z.device, z.dtype)
    loss = (y * cy).sum() + (z * cz).sum()
    grads = torch.autograd.grad(loss, inputs, allow_unused=False)
    return [y.detach(), z.detach(), *grads]


NAMES = ["map out", "reduce out", "grad x", "grad W_map", "grad h", "grad W_reduce", "grad gates"]


def assert_all_close(got, want, atol, rtol, what=""):
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape, f"{what} {name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert a.dtype == b.dtype, f"{what} {name}: dtype {a.dtype} != {b.dtype}"
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m, name=name: f"{what} {name}: {m}")
