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

from kernel_cases import NAMES, assert_all_close, define_interpreted_kernels, make_case, run, run_einsum

from headmix.kernels import expert_map, expert_reduce, expert_routing, grouped_triton

_ENV_BEFORE = os.environ.get("TRITON_INTERPRET")


if not define_interpreted_kernels():
    pytest.skip("Triton kernels were already compiled for a GPU in this process", allow_module_level=True)


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
    want = run("reference", idx, e, *tensors)
    got = run("triton", idx, e, *tensors, block_m=block_m)
    assert_all_close(got, want, 1e-4, 1e-4, case)
    if allowed is not None:
        unused = sorted(set(range(e)) - set(allowed))
        assert torch.all(got[3][unused] == 0) and torch.all(got[5][unused] == 0)


@pytest.mark.parametrize("n, k, e, d_in, d_out", [(7, 2, 4, 5, 6), (5, 2, 3, 70, 4)], ids=["small", "wide_d_in"])
def test_triton_float64_matches_einsum(n, k, e, d_in, d_out):
    # wide_d_in: the reduce's input gradient spans two 64-column tiles, so the gate gradient's row-dot comes
    # in two partial sums
    idx, tensors = make_case(n, k, e, d_in, d_out, torch.float64)
    got = run("triton", idx, e, *tensors, block_m=16)
    want = run_einsum(idx, *tensors)
    assert_all_close(got, want, 1e-10, 1e-10, "triton vs einsum")


def test_triton_bfloat16():
    n, k, e, d_in, d_out = 9, 2, 4, 16, 8
    idx, t64 = make_case(n, k, e, d_in, d_out, torch.float64)
    want = run("reference", idx, e, *t64)
    low = [t.detach().to(torch.bfloat16).requires_grad_() for t in t64]
    got = run("triton", idx, e, *low, block_m=16)
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == torch.bfloat16
        err, scale = (a.double() - b).abs().max().item(), b.abs().max().item()
        assert err <= 3e-2 * scale, f"{name}: {err:.3g} > 3e-2 * {scale:.3g}"


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_weight_gradient_splits(num_splits):
    # uneven loads: expert 0 gets most slots, expert 3 none; chunks of 16-row blocks, some splits empty
    n, k, e, d_in, d_out = 40, 2, 5, 9, 6
    g = torch.Generator().manual_seed(3)
    second = torch.tensor([1, 2, 4])[torch.randint(0, 3, (n,), generator=g)]
    idx = torch.stack([torch.zeros(n, dtype=torch.long), second], dim=1)
    r = expert_routing(idx, e, block_m=16)
    x = torch.randn(n, d_in, generator=g, dtype=torch.float64)
    grad_y = torch.randn(n * k, d_out, generator=g, dtype=torch.float64)
    got = grouped_triton.grouped_mm_wgrad(x, grad_y, r.sort_order, r.offsets, k, 16, num_splits)
    want = torch.einsum("nki,nko->nkio", x[:, None].expand(n, k, d_in), grad_y.view(n, k, d_out))
    want = torch.zeros(e, d_in, d_out, dtype=torch.float64).index_add_(0, idx.flatten(), want.reshape(n * k, d_in, d_out))
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    assert torch.all(got[3] == 0)
    # bf16 input: partials are summed in float32, the result is bf16
    got16 = grouped_triton.grouped_mm_wgrad(x.bfloat16(), grad_y.bfloat16(), r.sort_order, r.offsets, k, 16, num_splits)
    assert got16.dtype == torch.bfloat16
    assert (got16.double() - want).abs().max() <= 3e-2 * want.abs().max()


def test_weight_gradient_split_rule(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(grouped_triton, "_multiprocessors", lambda index: 132)
    # E=8 map weight 512 x 64 in 64 x 64 tiles: 64 programs, so split to ~4 per SM
    assert grouped_triton.wgrad_splits(16 * 2048 * 8, 8, 8, 64, cuda) == 9
    # many experts already fill the GPU
    assert grouped_triton.wgrad_splits(16 * 2048 * 8, 64, 8, 64, cuda) == 2
    assert grouped_triton.wgrad_splits(16 * 2048 * 8, 256, 8, 64, cuda) == 1
    # few slots: each split keeps at least 4 blocks on average
    assert grouped_triton.wgrad_splits(8 * 64 * 4 * 3, 8, 8, 64, cuda) == 3
    assert grouped_triton.wgrad_splits(100, 8, 8, 64, cuda) == 1
    assert grouped_triton.wgrad_splits(16 * 2048 * 8, 8, 8, 64, torch.device("cpu")) == 1
    with pytest.raises(ValueError, match="num_splits"):
        grouped_triton.grouped_mm_wgrad(torch.ones(2, 3), torch.ones(2, 3), torch.arange(2), torch.tensor([0, 2]), 1, 16, -1)


def test_custom_ops_opcheck():
    n, k, e, d_in, d_out = 6, 2, 3, 5, 4
    idx, (x, w_map, *_rest) = make_case(n, k, e, d_in, d_out, torch.float32)
    r = expert_routing(idx, e, block_m=16)
    args = (x, w_map, r.sort_order, r.offsets, k, 16)
    torch.library.opcheck(grouped_triton.grouped_mm, args)
    grad_y = torch.randn(n * k, d_out)
    torch.library.opcheck(grouped_triton.grouped_mm_wgrad, (x.detach(), grad_y, r.sort_order, r.offsets, k, 16))
    torch.library.opcheck(grouped_triton.grouped_mm_wgrad, (x.detach(), grad_y, r.sort_order, r.offsets, k, 16, 2))
    # the reduce's form: gates as the per-slot scale (their gradient a row-dot), h (N, k, d_in) read in place
    h, w_red, gates = _rest
    torch.library.opcheck(grouped_triton.grouped_mm, (h, w_red, r.sort_order, r.offsets, 1, 16, gates.reshape(-1)))
    torch.library.opcheck(grouped_triton.grouped_mm_input_grad,
                          (grad_y, w_red.detach(), r.sort_order, r.offsets, 16, gates.detach().reshape(-1), h.detach()))


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
    # defining the kernels must not leave TRITON_INTERPRET changed for the rest of the test run
    assert os.environ.get("TRITON_INTERPRET") == _ENV_BEFORE


def test_tuning_space_and_pruning():
    """Issue 19's Hopper space (BLOCK_M {64,128} x BLOCK_N {64,128} x BLOCK_K {32,64} x warps {4,8} x stages
    {3,4}) and the small row blocks for few slots (decoding)."""
    full = grouped_triton.tuning_space(vary_n=True, vary_k=True)
    large = [c for c in full if c["meta"]["BLOCK_M"] in (64, 128)]
    assert len(large) == 32 and len(full) == 64
    assert {(c["meta"]["BLOCK_N"], c["meta"]["BLOCK_K"], c["num_warps"], c["num_stages"]) for c in large} == {
        (n, k, w, s) for n in (64, 128) for k in (32, 64) for w in (4, 8) for s in (3, 4)}
    assert all("BLOCK_N" not in c["meta"] for c in grouped_triton.tuning_space(vary_n=False, vary_k=True))
    assert all(set(c["meta"]) == {"BLOCK_M"} for c in grouped_triton.tuning_space(vary_n=False, vary_k=False))
    ms = [16, 32, 64, 128]
    assert grouped_triton.prune_for_slots(ms, grouped_triton.slots_bucket(8 * 8)) == [True, True, True, False]
    assert grouped_triton.prune_for_slots(ms, grouped_triton.slots_bucket(16 * 2048 * 8)) == [False, False, True, True]
    assert grouped_triton.prune_for_slots(ms, 16) == [True, True, True, False]  # always one large block
    assert grouped_triton.slots_bucket(1000) == 1024 and grouped_triton.slots_bucket(1024) == 1024


def test_interpreter_runs_one_configuration(monkeypatch):
    # no autotuning in the interpreter (it would time numpy), and HEADMIX_TRITON_AUTOTUNE=0 turns it off
    assert grouped_triton._tuned("mm") is None and grouped_triton._tuned("wgrad") is None
    monkeypatch.setenv("HEADMIX_TRITON_AUTOTUNE", "0")
    assert not grouped_triton.autotune_enabled()
    monkeypatch.setenv("HEADMIX_TRITON_AUTOTUNE", "1")
    assert grouped_triton.autotune_enabled()


def test_autotuned_launch_path(monkeypatch):
    """The compiled-kernel launch path through triton.autotune (grids from the chosen meta-parameters,
    BLOCK_N kept for the row-dot, BLOCK_M only for the weight gradient), run in the interpreter with the
    space cut to one configuration (so nothing is timed): against the reference, float64 and float32."""
    mm, wgrad, _, tl = grouped_triton._kernels()
    one = [{"meta": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16}, "num_warps": 4, "num_stages": 3}]

    def space(vary_n, vary_k):
        meta = {k: v for k, v in one[0]["meta"].items() if k == "BLOCK_M" or (k == "BLOCK_N" and vary_n)
                or (k == "BLOCK_K" and vary_k)}
        return [{**one[0], "meta": meta}]

    pretend_compiled = lambda: (mm, wgrad, False, tl)  # noqa: E731
    pretend_compiled.cache_info = grouped_triton._kernels.cache_info
    monkeypatch.setattr(grouped_triton, "_kernels", pretend_compiled)
    monkeypatch.setattr(grouped_triton, "tuning_space", space)
    monkeypatch.setattr(grouped_triton, "_check_device", lambda t: None)
    monkeypatch.setattr(grouped_triton, "can_run_on_cpu", lambda: True)
    grouped_triton._tuned.cache_clear()
    try:
        assert grouped_triton._tuned("mm") is not None
        for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
            idx, tensors = make_case(13, 2, 5, 17, 40, dtype, allowed=[0, 1, 3, 4])
            want = run("reference", idx, 5, *tensors)
            got = run("triton", idx, 5, *tensors)  # routing without block_m: the autotuner's choice
            assert_all_close(got, want, tol, tol, f"autotuned {dtype}")
    finally:
        grouped_triton._tuned.cache_clear()
