"""ATen operations per training step of every routed layer against its dense baseline, on the CPU eager path users
run (the default ``expert_impl``; the fused router, kernels/fused_router.py, built here as the CPU builds it), and
what a step under autocast copies (issue 58, items 2 and 4).

Each routed layer is paired with its dense baseline as ``headmix bench layers --compute`` pairs them
(:data:`headmix.bench.compute.ROWS`: the dense layer of the same width, heads and K/V heads with every head on), at
d_model 128 (8 heads of 16, the width of the ``lm-en`` study rows). A ``TorchDispatchMode`` records every ATen
operation of one forward + backward (loss = the output's sum + the auxiliary loss, as a model adds it); the counted
operations are those that may launch a kernel on a GPU (views excluded, as :func:`headmix.bench.timing.count_aten_ops`
counts them). Two sizes: batch 2 x 16 tokens (the grouped projections' ``auto`` choice is ``dense`` there) and the
study's batch 16 x 128 (``sorted``).

Under CPU autocast (bfloat16, float32 parameters, as mixed-precision training runs) a step must build no tensor from
Python values (``torch.tensor([...])`` dispatches ``lift_fresh``: a host-to-device copy on a GPU) and cast no
parameter but whole, once: autocast casts each whole parameter a dense layer uses once per step (its weight cache),
so the casts a routed layer adds per call are those of a part of a parameter (a head's rows) or of one parameter
twice.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from headmix.kernels.cpp_build import cpp_kernel_available
from headmix.models import AttentionConfig

D_MODEL, HEADS, HEAD = 128, 8, 16
SIZES = {"2x16": (2, 16), "16x128": (16, 128)}


def _mha(heads: int = HEADS, kv: int | None = None) -> AttentionConfig:
    return AttentionConfig(kind="mha", num_heads=heads, kv_heads=kv, head_dim=HEAD)


def _moh(impl: str, shared: int, top: int, kv: int | None = None, per_group: bool = False, **kw) -> AttentionConfig:
    return AttentionConfig(kind="moh", num_heads=HEADS, head_dim=HEAD, moh_impl=impl, num_shared_heads=shared,
                           top_k=top, kv_heads=kv, route_per_group=per_group or None, **kw)


#: name: (routed layer, its dense baseline), at d_model 128 (H = 8 heads of 16): the rows of
#: :data:`headmix.bench.compute.ROWS`, and the MoH forms they do not list (per group with a shared head, dense MoH).
LAYERS: dict[str, tuple[AttentionConfig, AttentionConfig]] = {
    "gqe H on H/2, top 1": (AttentionConfig(kind="gqe", num_experts=8, kv_heads=4, top_k=1, head_dim=HEAD),
                            _mha(8, 4)),
    "gqe H/2 on H/8, top 2": (AttentionConfig(kind="gqe", num_experts=4, kv_heads=1, top_k=2, head_dim=HEAD),
                              _mha(4, 1)),
    "moh per group, top 2 of 4": (_moh("sparse", 0, 2, kv=2, per_group=True), _mha(8, 2)),
    "moh per group, 1 shared + top 1 of 3": (_moh("sparse", 1, 1, kv=2, per_group=True,
                                                  allow_router_without_task_gradient=True), _mha(8, 2)),
    "moh one K/V head, 2 shared + top 2": (_moh("sparse", 2, 2, kv=1), _mha(8, 1)),
    "moh global sparse, 2 shared + top 2": (_moh("sparse", 2, 2), _mha(8)),
    "moh global dense, 2 shared + top 2": (_moh("dense", 2, 2), _mha(8)),
    # the shared heads end inside K/V group 0: the sparse path copies the K/V heads the shared and routed heads read
    "moh global sparse on 2 K/V, 3 shared + top 2": (_moh("sparse", 3, 2, kv=2), _mha(8, 2)),
    "moa H/2 of 2H, 1 K/V": (AttentionConfig(kind="moa", num_experts=16, top_k=4, head_dim=HEAD, kv_heads=1),
                             _mha(4, 1)),
    "moa H/4 of H, 2 K/V": (AttentionConfig(kind="moa", num_experts=8, top_k=2, head_dim=HEAD, kv_heads=2),
                            _mha(4, 2)),
    "switchhead 2H4E2K": (AttentionConfig(kind="switchhead", num_heads=2, num_experts=4, top_k=2,
                                          head_dim=-(-D_MODEL // 3)), _mha(8)),
}

#: More routed layers for the checks under autocast: the random and query-norm routers, rotary embeddings.
ROUTED_VARIANTS: dict[str, AttentionConfig] = {
    "moa random router, rotary": AttentionConfig(kind="moa", num_experts=16, top_k=4, head_dim=HEAD, router="random",
                                                 rotary=True),
    "moh random router": _moh("sparse", 2, 2, router="random"),
    "moh query-norm router": _moh("sparse", 2, 2, router="query_norm"),
    "moh per group query-norm router, rotary": _moh("sparse", 1, 2, kv=2, per_group=True, router="query_norm",
                                                    rotary=True),
    "gqe random router": AttentionConfig(kind="gqe", num_experts=8, kv_heads=4, top_k=1, head_dim=HEAD,
                                         router="random"),
    "switchhead random router": AttentionConfig(kind="switchhead", num_heads=2, num_experts=4, top_k=2,
                                                head_dim=-(-D_MODEL // 3), router="random"),
}
ROUTED = {name: routed for name, (routed, _) in LAYERS.items()} | ROUTED_VARIANTS

#: Issue 58's target: at most 2x the dense baseline's operations per training step.
TARGET = 2.0
#: The layers that do not reach it yet, per size: the ratio measured at this commit (the larger of 1 and 2 threads:
#: SwitchHead's grouped projections are one custom operation each at 1 thread), which they must not exceed (one
#: operation more breaks it; docs/performance.md, "ATen operations per training step", says what remains and why).
#: Before issue 58 (operations / baseline's, 2x16 and 16x128): GQE 89/24 and 87/26 at both sizes, MoH per group 91
#: and 81/24, with a shared head 171 and 161/24, one K/V head 144 and 134/26, global sparse 194 and 184/24, global
#: dense 104/24, MoA 74 and 58/26, 80 and 64/24, SwitchHead 78 and 62/24. MoA 4 of 16 and MoH per group at both
#: sizes, MoA 2 of 8 and SwitchHead at 16x128 meet the target since the fused routers (kernels/fused_router.py) and
#: the counting sort (kernels/routing_info.py); dense MoH and every MoH form with shared heads but global sparse
#: since MoH's router is one operation (moh_route) on one GEMM of its gates and sparse MoH's shared heads are
#: slots of the grouped projections (before: dense 66/24, per group with a shared head 99 and 89/24, one K/V head
#: 97 and 87/26, global sparse 147 and 137/24, on 2 K/V 157 and 147/24); GQE on one K/V head since its weighted
#: slot's renormalisation is the fused router's (61/26 before; on 4 K/V heads 63/24 before, 54/24 since).
BOUNDS: dict[tuple[str, str], float] = {
    ("gqe H on H/2, top 1", "2x16"): 54 / 24,
    ("moh global sparse, 2 shared + top 2", "2x16"): 128 / 24,
    ("moh global sparse on 2 K/V, 3 shared + top 2", "2x16"): 138 / 24,
    ("moa H/4 of H, 2 K/V", "2x16"): 50 / 24,
    ("switchhead 2H4E2K", "2x16"): 62 / 24,
    ("gqe H on H/2, top 1", "16x128"): 54 / 24,
    ("moh global sparse, 2 shared + top 2", "16x128"): 120 / 24,
    ("moh global sparse on 2 K/V, 3 shared + top 2", "16x128"): 130 / 24,
}


class OpRecorder(TorchDispatchMode):
    """Every ATen operation dispatched while active: ``ops`` (views excluded), ``all_ops`` (views included: e.g.
    ``lift_fresh`` is one) and ``calls`` (the function, its arguments) for the checks that look at what an operation
    reads."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.all_ops: list[str] = []
        self.calls: list[tuple[object, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view:
            self.ops.append(name)
        self.all_ops.append(name)
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


def build(config: AttentionConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return config.build(D_MODEL).train()


def training_step(layer: torch.nn.Module, batch: int, time: int, autocast: bool = False,
                  padded: bool = False) -> OpRecorder:
    """The operations of one forward + backward of ``layer`` (causal self-attention; loss: the output's sum plus
    the auxiliary loss); ``autocast``: under CPU autocast to bfloat16; ``padded``: the last row's last 3 tokens are
    padding (key and query padding masks)."""
    x = torch.randn(batch, time, D_MODEL, generator=torch.Generator().manual_seed(1), requires_grad=True)
    masks = {}
    if padded:
        pad = torch.zeros(batch, time, dtype=torch.bool)
        pad[-1, -3:] = True
        masks = {"key_padding_mask": pad, "query_padding_mask": pad}
    with OpRecorder() as rec:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = layer(x, is_causal=True, **masks)
            loss = out.output.float().sum() + out.aux_loss.float()
        loss.backward()
    return rec


@pytest.fixture(scope="module")
def counts() -> dict[tuple[str, str], tuple[int, int]]:
    """(layer, size): (the routed layer's operations, its baseline's); the table is printed (``pytest -s``)."""
    if not cpp_kernel_available():
        pytest.skip("the counts are the CPU path's with its C++ kernels (not built, or HEADMIX_CPU_KERNEL=python)")
    table = {}
    for size, (batch, time) in SIZES.items():
        for name, (routed, baseline) in LAYERS.items():
            table[name, size] = (len(training_step(build(routed), batch, time).ops),
                                 len(training_step(build(baseline), batch, time).ops))
    print(f"\n{'layer':40s} {'size':>7s} {'ops':>5s} {'base':>5s} {'ratio':>6s}")
    for (name, size), (ops, base) in table.items():
        print(f"{name:40s} {size:>7s} {ops:5d} {base:5d} {ops / base:6.2f}")
    return table


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", LAYERS)
def test_training_step_dispatches_at_most_twice_the_baseline(counts, name, size):
    ops, base = counts[name, size]
    bound = BOUNDS.get((name, size), TARGET)
    assert ops / base <= bound + 1e-12, (f"{name} at {size}: {ops} ATen operations per forward+backward, "
                                         f"{ops / base:.2f}x its dense baseline's {base} (at most {bound:.2f}x)")


#: The GPU path (``expert_impl="triton"``: the Triton kernels, here in the interpreter) of the layers that
#: tests/test_dispatch_counts.py does not count (it counts MoA's and SwitchHead's), at 2x16, with the ratio measured
#: at this commit (the Triton kernels are one operation each; MoA 62/26 and 66/24, SwitchHead 60/24 here).
TRITON_BOUNDS = {"moh per group, top 2 of 4": 67 / 24, "moh one K/V head, 2 shared + top 2": 93 / 26,
                 "moh global sparse, 2 shared + top 2": 174 / 24}


@pytest.mark.parametrize("name", TRITON_BOUNDS)
def test_training_step_on_the_gpu_path(name, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("HEADMIX_CPU_KERNEL", "python")  # a GPU runs the composed router (the fused one is the CPU's)
    from kernel_cases import define_interpreted_kernels

    if not define_interpreted_kernels():
        pytest.skip("Triton kernels were already compiled for a GPU in this process")
    routed, baseline = LAYERS[name]
    batch, time = SIZES["2x16"]
    ops = len(training_step(build(dataclasses.replace(routed, expert_impl="triton")), batch, time).ops)
    base = len(training_step(build(baseline), batch, time).ops)
    assert ops / base <= TRITON_BOUNDS[name] + 1e-12, (
        f"{name}, expert_impl='triton': {ops} ATen operations per forward+backward, {ops / base:.2f}x its dense "
        f"baseline's {base} (at most {TRITON_BOUNDS[name]:.2f}x)")


def test_recorder_counts_launching_operations():
    with OpRecorder() as rec:
        t = torch.ones(2, 3)
        t.t().sum()
    assert rec.ops == ["ones", "sum"]  # the transpose is a view


#: What ``torch.tensor(...)`` / ``torch.as_tensor`` of Python values dispatch (``lift_fresh``; the copy variant
#: under some modes), and ``scalar_tensor`` (a tensor of a Python number built by an operation itself).
FROM_PYTHON = {"lift_fresh", "lift_fresh_copy", "scalar_tensor"}


def test_recorder_sees_tensors_from_python_values():
    with OpRecorder() as rec:
        torch.tensor([1, 2, 3])
        torch.tensor(2.0)
    assert rec.all_ops == ["lift_fresh", "lift_fresh"]


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("name", ROUTED)
def test_step_under_autocast_builds_no_tensor_from_python_values(name, padded):
    rec = training_step(build(ROUTED[name]), *SIZES["2x16"], autocast=True, padded=padded)
    built = [op for op in rec.all_ops if op in FROM_PYTHON]
    assert not built, f"{name}: a step under autocast builds tensors from Python values: {built}"


@pytest.mark.parametrize("name", ROUTED)
def test_decoding_under_autocast_builds_no_tensor_from_python_values(name):
    """A prefill, a cached step, the cache preallocated and two steps more: each step on the device only."""
    layer = build(ROUTED[name]).eval()
    x = torch.randn(2, 12, D_MODEL, generator=torch.Generator().manual_seed(2))
    with OpRecorder() as rec, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache = layer(x[:, :8], is_causal=True, use_cache=True).cache
        cache = layer(x[:, 8:9], cache=cache, use_cache=True).cache.preallocate(12)
        for t in (9, 10):
            cache = layer(x[:, t:t + 1], cache=cache, use_cache=True).cache
    built = [op for op in rec.all_ops if op in FROM_PYTHON]
    assert not built, f"{name}: cached decoding under autocast builds tensors from Python values: {built}"


def parameter_casts(layer: torch.nn.Module, rec: OpRecorder) -> tuple[list[str], list[str]]:
    """The dtype casts of a parameter's memory in ``rec``: those of a part of a parameter (a view smaller than it)
    and the repeated casts of a whole parameter (after its first), each as ``name shape``."""
    params = {p.untyped_storage().data_ptr(): (n, p) for n, p in layer.named_parameters()}
    partial, seen, repeated = [], collections.Counter(), []
    for func, args in rec.calls:
        if func.overloadpacket.__name__ not in ("_to_copy", "to") or not isinstance(args[0], torch.Tensor):
            continue
        src = args[0]
        hit = params.get(src.untyped_storage().data_ptr()) if src.device.type != "meta" else None
        if hit is None:
            continue
        pname, p = hit
        if src.shape != p.shape:
            partial.append(f"{pname}{tuple(src.shape)}")
            continue
        seen[pname] += 1
        if seen[pname] > 1:
            repeated.append(f"{pname}{tuple(src.shape)}")
    return partial, repeated


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("name", ROUTED)
def test_step_under_autocast_casts_each_parameter_whole_once(name, padded):
    layer = build(ROUTED[name])
    rec = training_step(layer, *SIZES["2x16"], autocast=True, padded=padded)
    partial, repeated = parameter_casts(layer, rec)
    assert not partial and not repeated, (f"{name}: under autocast a step casts parts of parameters {partial} and "
                                          f"parameters again {repeated}")


def test_parameter_casts_sees_a_head_slice_and_a_second_cast():
    layer = torch.nn.Linear(4, 4)
    with OpRecorder() as rec:
        layer.weight[:2].to(torch.bfloat16)
        layer.weight.to(torch.bfloat16)
        layer.weight.to(torch.bfloat16)
    assert parameter_casts(layer, rec) == (["weight(2, 4)"], ["weight(4, 4)"])
