"""The C++ grouped GEMM (``impl="grouped_cpp"``, :mod:`headmix.kernels.grouped_cpp`) against the plain
reference (MoA eq. 10, 12 + 6; SwitchHead's gate-weighted values): outputs and gradients of x, W, h and the
gates, odd sizes, empty experts, one expert holding every row, several threads, float64 / float32 / bfloat16;
one custom op under ``torch.compile(fullgraph=True)``, its FLOPs, the Python fallback (forced, or where the
build fails) and the ``auto`` choice. The kernel is built once per machine (cached); the first test builds it."""

from __future__ import annotations

import os
import shutil
import sys
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.utils.flop_counter import FlopCounterMode

from kernel_cases import NAMES, assert_all_close, make_case, run, run_einsum

from headmix.attention import MixtureOfAttentionHeads, SwitchHeadAttention
from headmix.kernels import (choose_impl, cpp_build, expert_map, expert_map_weighted, expert_reduce, expert_routing,
                             grouped_cpp)
from headmix.kernels import grouped_cpu
from headmix.kernels import reference as kernel_reference


@pytest.fixture(scope="module", autouse=True)
def built_kernel():
    """Build (or load the cached) kernel once for this module; where no C++ compiler exists, skip."""
    if os.environ.get(grouped_cpp.ENV_VAR, "").lower() == "python":
        pytest.skip(f"{grouped_cpp.ENV_VAR}=python forces the Python path")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the Python fallback is tested in test_kernels.py's sorted tests")
    assert grouped_cpp.cpp_kernel_available(), "the C++ CPU kernels failed to build (see the warning)"


@pytest.fixture
def threads():
    """Sets torch's thread count for one test, then restores it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def reference_weighted(x, w, gates, idx, groups):
    n, k = idx.shape
    y = kernel_reference.reference_map(x, w, idx) * gates.unsqueeze(-1)
    return y.view(n, groups, k // groups, w.shape[2]).sum(2)


def weighted_outputs_and_grads(impl, idx, num_experts, x, w, gates, groups):
    routing = expert_routing(idx, num_experts)
    if impl == "reference":
        y = reference_weighted(x, w, gates, idx, groups)
    else:
        y = expert_map_weighted(x, w, gates, routing, groups, impl=impl)
    cotangent = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(y.dtype)
    return [y.detach(), *torch.autograd.grad((y * cotangent).sum(), [x, w, gates])]


CASES = {  # n, k, E, d_in, d_out, allowed experts
    "odd sizes": (37, 3, 7, 13, 11, None),
    "empty experts": (29, 2, 9, 6, 5, [1, 4, 8]),
    "one expert holds every row": (23, 1, 5, 7, 3, [2]),
    "k == E": (11, 4, 4, 5, 9, None),
    "no tokens": (0, 2, 4, 3, 5, None),
}


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_map_and_reduce_match_the_einsum_formulas_in_float64(case, num_threads, threads):
    threads(num_threads)
    n, k, e, d_in, d_out, allowed = CASES[case]
    idx, tensors = make_case(n, k, e, d_in, d_out, torch.float64, allowed=allowed)
    assert_all_close(run("grouped_cpp", idx, e, *tensors), run_einsum(idx, *tensors), 1e-12, 1e-12, case)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_weighted_map_matches_the_reference(groups, num_threads, threads):
    threads(num_threads)
    idx, (x, w, _, _, gates) = make_case(67, 4, 9, 10, 6, torch.float64, allowed=[0, 2, 3, 5, 6, 8])
    got = weighted_outputs_and_grads("grouped_cpp", idx, 9, x, w, gates, groups)
    want = weighted_outputs_and_grads("reference", idx, 9, x, w, gates, groups)
    for name, a, b in zip(["out", "grad x", "grad W", "grad gates"], got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def test_several_threads_split_experts_and_sum_shared_rows_in_a_fixed_order(threads):
    """Enough rows for one part per thread: every part but the first adds into its own accumulator; the sum is
    the reference's and the same on every run."""
    threads(2)
    idx, tensors = make_case(300, 4, 12, 24, 20, torch.float64)
    got = run("grouped_cpp", idx, 12, *tensors)
    assert_all_close(got, run_einsum(idx, *tensors), 1e-12, 1e-12, "2 threads")
    idx32, tensors32 = make_case(300, 4, 12, 24, 20, torch.float32)
    first, second = run("grouped_cpp", idx32, 12, *tensors32), run("grouped_cpp", idx32, 12, *tensors32)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), f"{name} differs between two runs"


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_low_precision_within_tol_of_float64(dtype, tol, num_threads, threads):
    """Outputs and gradients within ``tol`` x (max |value|) of the float64 reference, on every thread count."""
    threads(num_threads)
    idx, t64 = make_case(150, 3, 8, 40, 24, torch.float64, allowed=[0, 1, 2, 4, 5, 7])
    want = run("reference", idx, 8, *t64)
    got = run("grouped_cpp", idx, 8, *[t.detach().to(dtype).requires_grad_() for t in t64])
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == dtype, name
        err, scale = (a.double() - b).abs().max().item(), b.abs().max().item()
        assert err <= tol * scale, f"{dtype} {name}: max err {err:.3g} > {tol} * {scale:.3g}"


def test_strided_inputs_read_in_place():
    """MoH's transposed weight views, SwitchHead's stride-0 (N, G, k / G, d) outputs and rows with a row
    stride give what contiguous copies give."""
    idx, (x, w_map, h, w_red, gates) = make_case(19, 4, 6, 8, 5, torch.float64)
    routing = expert_routing(idx, 6)
    w_t = w_map.detach().transpose(1, 2).contiguous().transpose(1, 2)  # (E, d_in, d_out), stride(1) == 1
    torch.testing.assert_close(expert_map(x, w_t, routing, "grouped_cpp"), expert_map(x, w_map, routing, "reference"))
    wide = torch.randn(19, 20, dtype=torch.float64)
    torch.testing.assert_close(expert_map(wide[:, 3:11], w_map, routing, "grouped_cpp"),
                               expert_map(wide[:, 3:11].contiguous(), w_map, routing, "reference"))
    o = torch.randn(19, 2, 1, 5, dtype=torch.float64, requires_grad=True)
    expanded = o.expand(19, 2, 2, 5)  # slot j reads group j // 2
    w5 = torch.randn(6, 5, 7, dtype=torch.float64, requires_grad=True)
    got = expert_reduce(expanded, w5, gates, routing, "grouped_cpp")
    want = expert_reduce(expanded.reshape(19, 4, 5), w5, gates, routing, "reference")
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), [o, w5, gates])
    for a, b in zip(grads, torch.autograd.grad(want.square().sum(), [o, w5, gates])):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kind", ["moa", "switchhead"])
def test_layers_match_the_reference_kernels(kind):
    def make(impl):
        torch.manual_seed(0)
        if kind == "moa":
            return MixtureOfAttentionHeads(16, 6, 2, 8, expert_impl=impl).double()
        return SwitchHeadAttention(16, 2, 3, 2, head_dim=8, expert_impl=impl).double()

    x = torch.randn(2, 9, 16, dtype=torch.float64)
    outs = []
    for impl in ("grouped_cpp", "reference"):
        layer, xi = make(impl), x.clone().requires_grad_()
        out = layer(xi, is_causal=True)
        outs.append([out.output, *torch.autograd.grad(out.output.square().sum(), [xi, *layer.parameters()])])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_fullgraph_compile_sees_one_op_per_projection():
    idx, (x, w_map, h, w_red, gates) = make_case(10, 2, 5, 6, 4, torch.float64)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    def fn(x, w_map, h, w_red, gates, idx):
        routing = expert_routing(idx, 5, check_range=False)
        return expert_map(x, w_map, routing, "grouped_cpp").sum(1) + expert_reduce(h, w_red, gates, routing,
                                                                                   "grouped_cpp")[:, :4]

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(fn, backend=lambda gm, ex: (counter(gm, ex), backend(gm, ex))[1], fullgraph=True)
    got = compiled(x, w_map, h, w_red, gates, idx)
    torch.testing.assert_close(got, fn(x, w_map, h, w_red, gates, idx))
    assert counter.frame_count == 1
    assert sum("headmix.grouped_gemm" in t for t in graphs[0]) == 2
    grads = torch.autograd.grad(got.sum(), [x, w_map, h, w_red, gates])
    want = torch.autograd.grad(fn(x, w_map, h, w_red, gates, idx).sum(), [x, w_map, h, w_red, gates])
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b)


def test_flop_counter_counts_the_useful_gemms():
    n, k, e, d_in, d_out = 12, 3, 7, 10, 6
    idx, (x, w_map, h, w_red, gates) = make_case(n, k, e, d_in, d_out)
    routing = expert_routing(idx, e)
    gemm = 2 * n * k * d_in * d_out
    with FlopCounterMode(display=False) as counter:
        y = expert_map(x, w_map, routing, "grouped_cpp")
    assert counter.get_total_flops() == gemm
    with FlopCounterMode(display=False) as counter:
        y.sum().backward()  # grad x and grad W: two GEMMs
    assert counter.get_total_flops() == 2 * gemm
    with FlopCounterMode(display=False) as counter:
        z = expert_reduce(h, w_red, gates, routing, "grouped_cpp")
        z.sum().backward()  # forward, grad (h, gates) in one pass, grad W
    assert counter.get_total_flops() == 3 * gemm
    with FlopCounterMode(display=False) as counter:
        expert_reduce(h.detach(), w_red, gates.detach(), routing, "grouped_cpp").sum().backward()  # grad W only
    assert counter.get_total_flops() == 2 * gemm
    with FlopCounterMode(display=False) as counter:
        expert_reduce(h.detach(), w_red.detach(), gates, routing, "grouped_cpp").sum().backward()  # grad gates only
    assert counter.get_total_flops() == 2 * gemm


def test_opcheck():
    idx, (x, w_map, h, w_red, gates) = make_case(6, 2, 4, 5, 3, torch.float64, allowed=[0, 1, 3])
    r = expert_routing(idx, 4)
    torch.library.opcheck(grouped_cpp.grouped_gemm_op, (x, w_map, None, r.sort_order, r.offsets, 2, 1))
    torch.library.opcheck(grouped_cpp.grouped_gemm_op,
                          (h.reshape(12, 5), w_red, gates.reshape(12), r.sort_order, r.offsets, 1, 2))


def spy_sorted(monkeypatch):
    calls = []
    for name in ("sorted_map", "sorted_reduce"):
        original = getattr(grouped_cpu, name)
        monkeypatch.setattr(grouped_cpu, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    return calls


def test_forced_python_fallback_runs_sorted_with_the_same_result(monkeypatch):
    idx, tensors = make_case(31, 3, 7, 9, 5, torch.float64, allowed=[0, 1, 3, 4, 6])
    want = run("grouped_cpp", idx, 7, *tensors)
    calls = spy_sorted(monkeypatch)
    monkeypatch.setenv(grouped_cpp.ENV_VAR, "python")
    assert not grouped_cpp.cpp_kernel_available()
    assert_all_close(run("grouped_cpp", idx, 7, *tensors), want, 1e-12, 1e-12, "forced python")
    assert calls == ["sorted_map", "sorted_reduce"]
    monkeypatch.setenv(grouped_cpp.ENV_VAR, "fortran")
    with pytest.raises(ValueError, match="HEADMIX_CPU_KERNEL must be one of"):
        grouped_cpp.cpp_kernel_available()


def test_failed_build_warns_once_and_runs_sorted(monkeypatch):
    def no_compiler():
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(cpp_build, "_loaded", None)
    monkeypatch.setattr(cpp_build, "_warned", False)
    monkeypatch.setattr(cpp_build, "_build", no_compiler)
    calls = spy_sorted(monkeypatch)
    idx, tensors = make_case(13, 2, 5, 4, 3, torch.float64)
    with pytest.warns(RuntimeWarning, match="could not be built .*command not found.*impl='grouped_cpp' runs 'sorted'"):
        got = run("grouped_cpp", idx, 5, *tensors)
    assert_all_close(got, run_einsum(idx, *tensors), 1e-12, 1e-12, "fallback")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        run("grouped_cpp", idx, 5, *tensors)
    assert calls == ["sorted_map", "sorted_reduce"] * 2


def test_build_directory_honours_the_cache_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert grouped_cpp.build_directory().parent.parent == tmp_path / "ext"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert grouped_cpp.build_directory().parent.parent == tmp_path / "xdg" / "headmix" / "torch_extensions"
    tag = grouped_cpp.build_directory().parent.name
    assert torch.__version__.replace("+", "_") in tag and f"py{sys.version_info[0]}{sys.version_info[1]}_" in tag


def test_build_directory_changes_with_the_sources(monkeypatch, tmp_path):
    """Two versions of the C++ sources (two checkouts) build into two directories, not over each other."""
    from headmix.kernels import cpp_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    before = cpp_build.build_directory()
    assert before == cpp_build.build_directory()
    changed = tmp_path / "routers.cpp"
    changed.write_bytes(cpp_build._SOURCES[-1].read_bytes() + b"// another version\n")
    monkeypatch.setattr(cpp_build, "_SOURCES", (*cpp_build._SOURCES[:-1], changed))
    assert cpp_build.build_directory() != before and cpp_build.build_directory().parent.parent == before.parent.parent


def test_auto_picks_the_cpp_kernel_for_training_at_one_thread(threads):
    cpu = torch.device("cpu")
    assert choose_impl(cpu, 1024 * 8, 32, 8, threads=1) == "grouped_cpp"  # the size
    assert choose_impl(cpu, 2048 * 4, 16, 4, threads=1) == "grouped_cpp"  # the study size
    assert choose_impl(cpu, 2048 * 4, 16, 4, threads=2) == "sorted"  # two threads: not measured yet
    assert choose_impl(cpu, 4096 * 8, 12, 8, threads=1) == "dense"  # E <= 1.5 k
    assert choose_impl(cpu, 513, 64, 8, needs_grad=False, threads=1) == "sorted"  # decoding: not measured
    threads(1)  # the default: torch's thread count
    assert choose_impl(cpu, 1024 * 8, 32, 8) == "grouped_cpp"
    threads(2)
    assert choose_impl(cpu, 1024 * 8, 32, 8) == "sorted"


def test_auto_compiles_fullgraph_at_one_thread(threads):
    """``auto`` reads the thread count as a constant under ``torch.compile``: no graph break."""
    threads(1)
    idx, (x, w_map, *_) = make_case(100, 2, 8, 6, 4, torch.float64)  # 200 slots: past the small-batch rule
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    def fn(x, w, idx):
        return expert_map(x, w, expert_routing(idx, 8, check_range=False))

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, backend=backend, fullgraph=True)(x, w_map, idx), fn(x, w_map, idx))
    assert sum("headmix.grouped_gemm" in t for t in graphs[0]) == 1


def test_bad_device_is_one_line():
    x = torch.empty(4, 3, device="meta")  # any device but the CPU
    routing = expert_routing(torch.zeros(4, 1, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="impl='grouped_cpp' runs on CPU tensors, got a tensor on meta"):
        grouped_cpp.grouped_cpp_map(x, torch.empty(2, 3, 5, device="meta"), routing)


@pytest.mark.parametrize("n, k, num_experts", [(7, 2, 5), (1, 1, 1), (100, 4, 64), (33, 3, 3), (12, 2, 40)])
def test_the_counting_sort_groups_slots_as_torch_sort_does(n, k, num_experts):
    """expert_routing's C++ counting sort (one operation) against the stable sort and searchsorted it replaces:
    empty experts, one expert in every row, more experts than slots."""
    from headmix.kernels.routing_info import sort_by_expert

    idx = torch.randint(0, num_experts, (n, k), generator=torch.Generator().manual_seed(n * k))
    idx[:, 0] = 0
    sorted_expert, sort_order, offsets = sort_by_expert(idx, num_experts)
    want_sorted, want_order = torch.sort(idx.reshape(-1), stable=True)
    assert torch.equal(sort_order, want_order) and torch.equal(sorted_expert, want_sorted)
    assert torch.equal(offsets, torch.searchsorted(want_sorted, torch.arange(num_experts + 1)))
    routing = expert_routing(idx, num_experts)
    assert torch.equal(routing.sort_order, want_order) and torch.equal(routing.offsets, offsets)
    torch.library.opcheck(sort_by_expert, (idx, num_experts))


def test_the_counting_sort_refuses_an_expert_out_of_range():
    from headmix.kernels.routing_info import sort_by_expert

    with pytest.raises(RuntimeError, match=r"expert 7 outside \[0, 5\)"):
        sort_by_expert(torch.tensor([[0, 7]]), 5)
