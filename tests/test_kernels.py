"""Expert map / reduce kernels (MoA eq. 10, 12, 6): every CPU impl against the reference.

The reference itself is checked against an independent einsum formula, so a
bug shared by the reference and an implementation still fails.  Triton kernels
are tested in tests/test_kernels_triton.py (interpreter, tiny sizes).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from optional_hypothesis import given, settings, st  # hypothesis' own where installed
from kernel_cases import (
    NAMES,
    assert_all_close,
    einsum_map,
    einsum_reduce,
    make_case,
    random_index,
    run,
    run_einsum,
)

from headmix.kernels import (
    ExpertRouting,
    choose_impl,
    expert_map,
    expert_reduce,
    expert_routing,
)
from headmix.kernels import grouped_cpu
from headmix.kernels.routing_info import block_table

CPU_IMPLS = ["dense", "sorted", "gather", "bag", "auto"]


# (N, k, E, d_in, d_out, allowed experts)
CASES = {
    "basic": (13, 2, 5, 17, 9, None),
    "k_eq_E": (7, 4, 4, 8, 6, None),
    "k1": (11, 1, 6, 5, 7, None),
    "empty_experts": (9, 2, 6, 10, 3, [0, 2, 3]),  # experts 1, 4, 5 get no tokens
    "N0": (0, 3, 5, 4, 6, None),
    "odd_sizes": (40, 3, 7, 33, 17, None),
    "single_expert": (5, 1, 1, 3, 2, None),
}


# ----------------------------------------------------------------------------- reference


@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_einsum(case):
    n, k, e, d_in, d_out, allowed = CASES[case]
    idx, (x, w_map, h, w_red, gates) = make_case(n, k, e, d_in, d_out, torch.float64, allowed=allowed)
    routing = expert_routing(idx, e)
    torch.testing.assert_close(expert_map(x, w_map, routing, "reference"), einsum_map(x, w_map, idx))
    torch.testing.assert_close(
        expert_reduce(h, w_red, gates, routing, "reference"), einsum_reduce(h, w_red, gates, idx)
    )


def test_reference_grads_match_einsum():
    n, k, e, d_in, d_out, _ = CASES["basic"]
    idx, tensors = make_case(n, k, e, d_in, d_out, torch.float64)
    got = run("reference", idx, e, *tensors)
    want = run_einsum(idx, *tensors)
    assert_all_close(got, want, 1e-10, 1e-10, "reference vs einsum")


def test_known_values():
    """A hand-computed case: tests fail if both the code and the einsum were wrong the same way."""
    w = torch.stack([torch.eye(2), 2 * torch.eye(2), torch.tensor([[0.0, 1.0], [1.0, 0.0]])])
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    idx = torch.tensor([[2, 0], [1, 2]])
    gates = torch.tensor([[0.5, 0.25], [1.0, 2.0]])
    routing = expert_routing(idx, 3)
    for impl in ["reference", *CPU_IMPLS]:
        y = expert_map(x, w, routing, impl)
        torch.testing.assert_close(y, torch.tensor([[[2.0, 1.0], [1.0, 2.0]], [[6.0, 8.0], [4.0, 3.0]]]))
        z = expert_reduce(y, w, gates, routing, impl)
        # token 0: 0.5 * swap([2,1]) + 0.25 * [1,2] = [0.75, 1.5]; token 1: 1*2*[6,8] + 2*swap([4,3]) = [18, 24]
        torch.testing.assert_close(z, torch.tensor([[0.75, 1.5], [18.0, 24.0]]))


# ----------------------------------------------------------------------------- impls vs reference


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_impl_matches_reference_float32(impl, case):
    n, k, e, d_in, d_out, allowed = CASES[case]
    idx, tensors = make_case(n, k, e, d_in, d_out, torch.float32, allowed=allowed)
    want = run("reference", idx, e, *tensors)
    got = run(impl, idx, e, *tensors)
    assert_all_close(got, want, 2e-5, 2e-5, impl)
    # also against the float64 einsum, so a wrong reference cannot hide a wrong impl
    idx64, t64 = make_case(n, k, e, d_in, d_out, torch.float64, allowed=allowed)
    x, w_map, h, w_red, gates = t64
    torch.testing.assert_close(got[0].double(), einsum_map(x, w_map, idx64).detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1].double(), einsum_reduce(h, w_red, gates, idx64).detach(), atol=1e-5, rtol=1e-5)


def test_empty_experts_have_zero_weight_grad():
    n, k, e, d_in, d_out, allowed = CASES["empty_experts"]
    idx, tensors = make_case(n, k, e, d_in, d_out, torch.float32, allowed=allowed)
    routing = expert_routing(idx, e)
    assert routing.counts.tolist() == [int((idx == i).sum()) for i in range(e)]
    for impl in CPU_IMPLS:
        out = run(impl, idx, e, *tensors)
        for grad_w in (out[3], out[5]):
            assert torch.all(grad_w[[1, 4, 5]] == 0), impl
            assert grad_w[[0, 2, 3]].abs().sum() > 0, impl


@pytest.mark.parametrize("impl", ["reference", *CPU_IMPLS])
def test_zero_tokens(impl):
    idx, tensors = make_case(0, 2, 4, 5, 3)
    routing = expert_routing(idx, 4)
    x, w_map, h, w_red, gates = tensors
    y = expert_map(x, w_map, routing, impl)
    z = expert_reduce(h, w_red, gates, routing, impl)
    assert y.shape == (0, 2, 3) and z.shape == (0, 3)
    (y.sum() + z.sum()).backward()
    for t in tensors:
        assert t.grad is not None and t.grad.shape == t.shape
    assert torch.all(w_map.grad == 0) and torch.all(w_red.grad == 0)


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_non_contiguous_inputs(impl):
    n, k, e, d_in, d_out = 10, 3, 6, 7, 5
    idx, (x, w_map, h, w_red, gates) = make_case(n, k, e, d_in, d_out)
    want = run("reference", idx, e, x, w_map, h, w_red, gates)

    def noncontig(t, perm):
        """Same values, stored permuted: a non-contiguous leaf."""
        stored = t.detach().permute(*perm).contiguous().permute(*torch.argsort(torch.tensor(perm)).tolist())
        assert not stored.is_contiguous()
        return stored.requires_grad_()

    args = [
        noncontig(x, (1, 0)),
        noncontig(w_map, (2, 0, 1)),
        noncontig(h, (1, 2, 0)),
        noncontig(w_red, (0, 2, 1)),
        noncontig(gates, (1, 0)),
    ]
    # and a non-contiguous expert_index (every other column of a wider tensor)
    wide = torch.stack([idx, torch.zeros_like(idx)], dim=-1).reshape(n, 2 * k)[:, ::2]
    assert not wide.is_contiguous()
    got = run(impl, wide, e, *args)
    assert_all_close(got, want, 2e-5, 2e-5, impl)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_low_precision(impl, dtype, tol):
    """bf16 / fp16 outputs and grads within ``tol`` x (max |value|) of the float64 result."""
    n, k, e, d_in, d_out = 24, 2, 5, 16, 8
    idx, t64 = make_case(n, k, e, d_in, d_out, torch.float64)
    want = run("reference", idx, e, *t64)
    low = [t.detach().to(dtype).requires_grad_() for t in t64]
    got = run(impl, idx, e, *low)
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == dtype, name
        scale = b.abs().max().item()
        err = (a.double() - b).abs().max().item()
        assert err <= tol * scale, f"{impl} {dtype} {name}: max err {err:.3g} > {tol} * {scale:.3g}"


def test_repeated_experts_in_a_row():
    """Rows normally hold distinct experts, but repeats must not break any impl."""
    idx = torch.tensor([[1, 1], [0, 2], [2, 2]])
    _, tensors = make_case(3, 2, 3, 4, 5)
    x, w_map, h, w_red, gates = tensors
    want = [einsum_map(x, w_map, idx), einsum_reduce(h, w_red, gates, idx)]
    routing = expert_routing(idx, 3)
    for impl in ["reference", *CPU_IMPLS]:
        torch.testing.assert_close(expert_map(x, w_map, routing, impl), want[0])
        torch.testing.assert_close(expert_reduce(h, w_red, gates, routing, impl), want[1])


def test_gates_dtype_is_cast():
    idx, (_, _, h, w_red, gates) = make_case(6, 2, 4, 5, 3, torch.float32)
    routing = expert_routing(idx, 4)
    g64 = gates.detach().double().requires_grad_()
    z = expert_reduce(h, w_red, g64, routing, "sorted")
    assert z.dtype == torch.float32
    z.sum().backward()
    assert g64.grad.dtype == torch.float64


# ----------------------------------------------------------------------------- gradcheck


@pytest.mark.parametrize("case", ["basic", "empty_experts", "k_eq_E", "k1"])
def test_gradcheck_sorted(case):
    n, k, e, _, _, allowed = CASES[case]
    idx, (x, w_map, h, w_red, gates) = make_case(min(n, 6), k, e, 4, 3, torch.float64, allowed=allowed)
    routing = expert_routing(idx, e)
    assert torch.autograd.gradcheck(lambda a, w: expert_map(a, w, routing, "sorted"), (x, w_map))
    assert torch.autograd.gradcheck(lambda a, w, g: expert_reduce(a, w, g, routing, "sorted"), (h, w_red, gates))


def test_sorted_backward_respects_needs_input_grad():
    """Only the requested gradients are computed, and each one alone is right."""
    idx, (x, w_map, h, w_red, gates) = make_case(8, 2, 4, 5, 3)
    routing = expert_routing(idx, 4)
    for i in range(2):
        args = [x.detach(), w_map.detach()]
        args[i].requires_grad_()
        expert_map(*args, routing, "sorted").square().sum().backward()
        ref = [x.detach(), w_map.detach()]
        ref[i].requires_grad_()
        einsum_map(*ref, idx).square().sum().backward()
        torch.testing.assert_close(args[i].grad, ref[i].grad)
    for i in range(3):
        args = [h.detach(), w_red.detach(), gates.detach()]
        args[i].requires_grad_()
        expert_reduce(*args, routing, "sorted").square().sum().backward()
        ref = [h.detach(), w_red.detach(), gates.detach()]
        ref[i].requires_grad_()
        einsum_reduce(*ref, idx).square().sum().backward()
        torch.testing.assert_close(args[i].grad, ref[i].grad)


# ----------------------------------------------------------------------------- property test


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(0, 12),
    num_experts=st.integers(1, 6),
    k_frac=st.floats(0, 1),
    d_in=st.integers(1, 12),
    d_out=st.integers(1, 12),
    impl=st.sampled_from(CPU_IMPLS),
    seed=st.integers(0, 2**16),
)
def test_property_random_shapes(n, num_experts, k_frac, d_in, d_out, impl, seed):
    k = 1 + int(k_frac * (num_experts - 1))
    idx, tensors = make_case(n, k, num_experts, d_in, d_out, torch.float64, seed=seed)
    got = run(impl, idx, num_experts, *tensors)
    want = run_einsum(idx, *tensors)
    assert_all_close(got, want, 1e-10, 1e-9, impl)


# ----------------------------------------------------------------------------- routing


def check_routing(routing: ExpertRouting, idx: torch.Tensor, num_experts: int):
    n, k = idx.shape
    flat = idx.reshape(-1)
    assert routing.num_experts == num_experts and routing.top_k == k
    assert routing.sort_order.shape == (n * k,) and routing.sort_order.dtype == torch.long
    assert sorted(routing.sort_order.tolist()) == list(range(n * k))
    assert torch.equal(routing.sorted_expert, flat[routing.sort_order])
    assert torch.all(routing.sorted_expert[1:] >= routing.sorted_expert[:-1])
    # stable: slot ids increase within each expert's run
    same = routing.sorted_expert[1:] == routing.sorted_expert[:-1]
    assert torch.all(routing.sort_order[1:][same] > routing.sort_order[:-1][same])
    assert torch.equal(routing.sorted_token, routing.sort_order // k)
    assert routing.counts.tolist() == [int((flat == e).sum()) for e in range(num_experts)]
    assert routing.offsets.tolist() == [0, *torch.cumsum(routing.counts, 0).tolist()]


@pytest.mark.parametrize("n, k, e", [(13, 2, 5), (0, 1, 3), (4, 4, 4), (30, 3, 16)])
def test_routing_fields(n, k, e):
    g = torch.Generator().manual_seed(n + k + e)
    idx = random_index(n, k, e, g, allowed=list(range(0, e, 2)) if k <= (e + 1) // 2 else None)
    check_routing(expert_routing(idx, e), idx, e)


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_block_table_covers_each_slot_once(block_m):
    counts = torch.tensor([0, 5, 16, 17, 0, 40, 1, 0])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    num_slots = int(counts.sum())
    block_expert, block_start = block_table(counts, offsets, num_slots, block_m)
    assert block_expert.shape[0] >= sum(-(-c // block_m) for c in counts.tolist())
    seen = torch.zeros(num_slots, dtype=torch.long)
    for e, s in zip(block_expert.tolist(), block_start.tolist()):
        if e >= len(counts):
            continue  # idle tail block
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        assert lo <= s < hi, (e, s)
        seen[s : min(s + block_m, hi)] += 1
    assert torch.all(seen == 1)
    # valid blocks come first, tail blocks are marked E
    valid = block_expert < len(counts)
    assert torch.all(valid[: int(valid.sum())])


def test_routing_has_no_host_sync_under_compile():
    """fullgraph torch.compile fails on .item() / .tolist() / data-dependent shapes."""
    idx = random_index(9, 2, 5, torch.Generator().manual_seed(0))
    fn = torch.compile(lambda i: expert_routing(i, 5, block_m=16), fullgraph=True, backend="eager")
    got, want = fn(idx), expert_routing(idx, 5, block_m=16)
    for field in ("sort_order", "sorted_expert", "sorted_token", "counts", "offsets", "block_expert", "block_start"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field


def test_routing_is_frozen():
    routing = expert_routing(torch.tensor([[0, 1]]), 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        routing.top_k = 3


# ----------------------------------------------------------------------------- errors and auto rule


def test_bad_shapes_raise_value_error():
    idx = torch.tensor([[0, 1], [2, 3]])
    routing = expert_routing(idx, 8)
    x = torch.randn(2, 512)
    with pytest.raises(ValueError, match=r"weight must have shape \(num_experts, d_in, d_out\) = \(8, 512, \*\)"):
        expert_map(x, torch.randn(8, 511, 64), routing)
    with pytest.raises(ValueError, match=r"weight must have shape"):
        expert_map(x, torch.randn(7, 512, 64), routing)
    with pytest.raises(ValueError, match=r"x must have shape \(2, \*\)"):
        expert_map(torch.randn(3, 512), torch.randn(8, 512, 64), routing)
    with pytest.raises(ValueError, match=r"x must be a 2-d tensor"):
        expert_map(torch.randn(2, 1, 512), torch.randn(8, 512, 64), routing)
    with pytest.raises(ValueError, match=r"impl must be one of"):
        expert_map(x, torch.randn(8, 512, 64), routing, impl="fast")
    with pytest.raises(ValueError, match=r"weight must have the dtype"):
        expert_map(x, torch.randn(8, 512, 64, dtype=torch.float64), routing)
    h = torch.randn(2, 2, 64)
    with pytest.raises(ValueError, match=r"h must have shape \(2, 2, \*\)"):
        expert_reduce(torch.randn(2, 3, 64), torch.randn(8, 64, 512), torch.rand(2, 2), routing)
    with pytest.raises(ValueError, match=r"gates must have shape \(N, k\) = \(2, 2\)"):
        expert_reduce(h, torch.randn(8, 64, 512), torch.rand(2, 3), routing)
    with pytest.raises(TypeError, match=r"routing must be an ExpertRouting"):
        expert_map(x, torch.randn(8, 512, 64), idx)


def test_bad_routing_raises_value_error():
    with pytest.raises(ValueError, match="expert_index must be a 2-d"):
        expert_routing(torch.tensor([0, 1]), 4)
    with pytest.raises(ValueError, match="expert_index values must lie in"):
        expert_routing(torch.tensor([[0, 4]]), 4)
    with pytest.raises(ValueError, match="k <= num_experts"):
        expert_routing(torch.zeros(2, 5, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="integer"):
        expert_routing(torch.zeros(2, 2), 4)
    with pytest.raises(ValueError, match="num_experts"):
        expert_routing(torch.zeros(2, 1, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="block_m"):
        expert_routing(torch.zeros(2, 1, dtype=torch.long), 2, block_m=24)


def test_auto_rule():
    cpu = torch.device("cpu")
    assert choose_impl(cpu, 4096 * 8, 8, 8) == "dense"  # k == E
    assert choose_impl(cpu, 4096 * 8, 12, 8) == "dense"  # E <= 1.5 k
    assert choose_impl(cpu, 4096 * 8, 13, 8, threads=2) == "sorted"
    assert choose_impl(cpu, 4096 * 6, 8, 6) == "dense"  # mini-moa, small-moa
    assert choose_impl(cpu, 4096 * 8, 64, 8, threads=2) == "sorted"
    assert choose_impl(cpu, 4096 * 2, 32, 2, threads=2) == "sorted"
    # decoding (no gradient): read only the selected experts, bag up to 512 slots, then sorted
    assert choose_impl(cpu, 8, 32, 8, needs_grad=False) == "bag"
    assert choose_impl(cpu, 512, 64, 8, needs_grad=False) == "bag"
    assert choose_impl(cpu, 513, 64, 8, needs_grad=False) == "sorted"
    assert choose_impl(cpu, 4096 * 8, 64, 8, needs_grad=False) == "sorted"
    assert choose_impl(cpu, 8, 17, 8, needs_grad=False) == "bag"
    assert choose_impl(cpu, 8, 32, 8, needs_grad=True) == "dense"
    assert choose_impl(cpu, 8, 16, 8, needs_grad=False) == "dense"  # E <= 2k: dense
    assert choose_impl(cpu, 128, 64, 8) == "dense"  # small batch
    assert choose_impl(cpu, 128, 65, 8, threads=2) == "sorted"
    assert choose_impl(cpu, 256, 64, 8, threads=2) == "sorted"


def test_auto_uses_grad_mode():
    """auto picks bag without grad (decoding), dense with it; results agree either way."""
    idx, (x, w_map, *_rest) = make_case(2, 2, 9, 4, 3)
    routing = expert_routing(idx, 9)
    with torch.no_grad():
        y_nograd = expert_map(x, w_map, routing)
    y = expert_map(x, w_map, routing)
    torch.testing.assert_close(y_nograd, y.detach())
    assert y.grad_fn is not None


def test_triton_on_cpu_without_interpreter_is_refused():
    """Without TRITON_INTERPRET, impl='triton' on CPU tensors raises and compiles nothing.

    Run in a fresh interpreter: this pytest process may already hold interpreted kernels.
    """
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        from headmix.kernels import expert_map, expert_routing, grouped_triton
        routing = expert_routing(torch.tensor([[0], [1]]), 2)
        try:
            expert_map(torch.randn(2, 4), torch.randn(2, 4, 3), routing, "triton")
        except RuntimeError as e:
            assert "TRITON_INTERPRET" in str(e), e
        else:
            raise SystemExit("no error")
        assert grouped_triton._kernels.cache_info().currsize == 0
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_package_works_without_triton():
    """headmix.kernels imports and runs its CPU paths when triton cannot be imported."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # any `import triton` now raises ImportError
        import torch
        from headmix.kernels import expert_map, expert_reduce, expert_routing, grouped_triton
        assert not grouped_triton.triton_available()
        routing = expert_routing(torch.tensor([[0, 1], [1, 2]]), 3)
        x, w = torch.randn(2, 4), torch.randn(3, 4, 5)
        for impl in ("auto", "sorted", "dense", "gather", "bag", "reference"):
            expert_reduce(expert_map(x, w, routing, impl), torch.randn(3, 5, 4), torch.rand(2, 2), routing, impl)
        try:
            expert_map(x, w, routing, "triton")
        except RuntimeError as e:
            assert "triton" in str(e), e
        else:
            raise SystemExit("no error")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- sorted: chunks of experts


def _run_sorted(idx, num_experts, x, w_map, h, w_red, gates, chunk_rows):
    """Like kernel_cases.run, through grouped_cpu with a forced chunk size."""
    routing = expert_routing(idx, num_experts)
    y = grouped_cpu.sorted_map(x, w_map, routing, chunk_rows=chunk_rows)
    z = grouped_cpu.sorted_reduce(h, w_red, gates, routing, chunk_rows=chunk_rows)
    g = torch.Generator().manual_seed(1)
    cy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.dtype)
    cz = torch.randn(z.shape, generator=g, dtype=torch.float64).to(z.dtype)
    grads = torch.autograd.grad((y * cy).sum() + (z * cz).sum(), [x, w_map, h, w_red, gates])
    return [y.detach(), z.detach(), *grads]


def _skewed_index(n, k, num_experts, generator):
    """Every token picks expert 0, the rest of its k from experts 1..3 only: a skewed load with one
    expert holding n rows and the others empty."""
    rest = torch.stack([torch.randperm(3, generator=generator)[: k - 1] + 1 for _ in range(n)])
    return torch.cat([torch.zeros(n, 1, dtype=torch.long), rest], dim=1)


@pytest.mark.parametrize("chunk_rows", [1, 3, 8, 40, 10_000])
@pytest.mark.parametrize("case", ["basic", "empty_experts", "odd_sizes", "k1"])
def test_sorted_chunks_match_reference(case, chunk_rows):
    """Chunks holding one expert, several experts, experts larger than a chunk, and everything at once:
    outputs and every gradient against the float64 reference."""
    n, k, e, d_in, d_out, allowed = CASES[case]
    idx, tensors = make_case(n, k, e, d_in, d_out, torch.float64, allowed=allowed)
    want = run("reference", idx, e, *tensors)
    got = _run_sorted(idx, e, *tensors, chunk_rows=chunk_rows)
    assert_all_close(got, want, 1e-10, 1e-10, f"sorted chunk_rows={chunk_rows}")


@pytest.mark.parametrize("chunk_rows", [2, 16, None])
def test_sorted_skewed_load_and_repeated_experts(chunk_rows):
    g = torch.Generator().manual_seed(3)
    n, k, e, d_in, d_out = 33, 3, 9, 11, 6
    for idx in (_skewed_index(n, k, e, g), torch.randint(0, e, (n, k), generator=g)):  # the second repeats experts
        _, tensors = make_case(n, k, e, d_in, d_out, torch.float64)
        want = run("reference", idx, e, *tensors)
        got = _run_sorted(idx, e, *tensors, chunk_rows=chunk_rows)
        assert_all_close(got, want, 1e-10, 1e-10, f"sorted chunk_rows={chunk_rows}")


def test_sorted_chunk_packing():
    """Consecutive experts share a chunk up to chunk_rows; a larger expert gets its own; empty ones none."""
    # experts: 0 has 2 rows, 1 has 0, 2 has 3, 3 has 7, 4 has 1
    offsets = [0, 2, 2, 5, 12, 13]
    chunks = grouped_cpu._chunks(offsets, 5)
    assert [(c.start, c.stop, c.experts, c.bounds) for c in chunks] == [
        (0, 5, [0, 2], [0, 2, 5]), (5, 12, [3], [0, 7]), (12, 13, [4], [0, 1])]
    assert grouped_cpu._chunks([0, 0, 0], 4) == []
    one = grouped_cpu._chunks(offsets, 100)
    assert len(one) == 1 and one[0].experts == [0, 2, 3, 4] and one[0].bounds == [0, 2, 5, 12, 13]


def test_sorted_bad_chunk_rows():
    idx, (x, w_map, *_rest) = make_case(4, 2, 3, 5, 2)
    with pytest.raises(ValueError, match="chunk_rows must be a positive int"):
        grouped_cpu.sorted_map(x, w_map, expert_routing(idx, 3), chunk_rows=0)
