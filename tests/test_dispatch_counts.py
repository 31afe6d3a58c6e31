"""What one training step of MoA / SwitchHead dispatches on its GPU path, counted on the CPU (issue 20's
proxies for a GPU): no host synchronisation, and few ATen operations against multi-head attention's.

The layers run ``expert_impl="triton"`` with the Triton kernels in the interpreter (``TRITON_INTERPRET=1``
only while they are defined, see :func:`kernel_cases.define_interpreted_kernels`); a
``TorchDispatchMode`` records every ATen operation of one forward + backward, each custom op (a Triton
kernel launch) once, the parameters' gradients being None before the step. Two counts: every operation
(views included), and the operations that may launch a kernel, i.e. all but views (``view``,
``transpose``, ``expand``, ...: metadata only).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from kernel_cases import define_interpreted_kernels

from headmix.attention import MixtureOfAttentionHeads, MultiHeadAttention, SwitchHeadAttention
from headmix.kernels import expert_routing

if not define_interpreted_kernels():
    pytest.skip("Triton kernels were already compiled for a GPU in this process", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def composed_router():
    """The routers as a GPU runs them: their composed form (the fused router, kernels/fused_router.py, is the
    CPU's)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HEADMIX_CPU_KERNEL", "python")
        yield


#: Operations that read device data back to the host (``.item()``, ``.tolist()``, ``bool(t)``, ...) or have
#: a data-dependent output shape (``nonzero``, boolean indexing, ``bincount``, ``repeat_interleave`` with a
#: tensor of repeats, ``unique``): each one is a host synchronisation on a GPU.
SYNC_OPS = {
    "_local_scalar_dense", "item", "nonzero", "nonzero_static", "masked_select", "bincount", "histc", "unique",
    "_unique", "_unique2", "unique_consecutive", "unique_dim", "equal", "is_nonzero", "argwhere",
}

#: The shape of issue 20 is d_model 128, batch 2 x 64; the counts depend on neither (no data- or size-dependent
#: dispatch: the same counts at d_model 128, batch 2 x 64 and 2 x 8, and at d_model 32, batch 2 x 8, checked
#: at this commit), and the small shape keeps the interpreter fast.
D_MODEL, BATCH, TIME = 32, 2, 8


class OpRecorder(TorchDispatchMode):
    """Records the name of every ATen operation dispatched while active: ``all_ops``, and ``ops`` without
    the views."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.all_ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "repeat_interleave" and func._overloadname == "Tensor":
            name = "repeat_interleave.Tensor"  # repeats from a tensor: the output length is data dependent
        self.all_ops.append(name)
        if not func.is_view:
            self.ops.append(name)
        return func(*args, **kwargs)


def training_step_ops(layer: torch.nn.Module, seed: int = 0) -> OpRecorder:
    """The ATen operations of one forward + backward of ``layer`` (causal self-attention, loss = sum of the
    output + the auxiliary loss, as a model adds it)."""
    x = torch.randn(BATCH, TIME, D_MODEL, generator=torch.Generator().manual_seed(seed), requires_grad=True)

    def step():
        out = layer(x, is_causal=True)
        loss = out.output.sum() + out.aux_loss
        loss.backward()

    with OpRecorder() as rec:
        step()
    return rec


def make_layers() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "mha": MultiHeadAttention(D_MODEL, 4),
        "moa": MixtureOfAttentionHeads(D_MODEL, 16, 4, 32, expert_impl="triton"),  # 4K16E32D
        "switchhead": SwitchHeadAttention(D_MODEL, 2, 4, 2, expert_impl="triton"),
    }


@pytest.fixture(scope="module")
def step_ops() -> dict[str, OpRecorder]:
    return {name: training_step_ops(layer) for name, layer in make_layers().items()}


@pytest.mark.parametrize("name", ["moa", "switchhead"])
def test_training_step_has_no_host_sync(step_ops, name):
    syncs = sorted(set(step_ops[name].all_ops) & (SYNC_OPS | {"repeat_interleave.Tensor"}))
    assert not syncs, f"{name}: host-synchronising operations in a training step: {syncs}"


def test_the_gpu_path_runs_the_composed_router(step_ops):
    """The fused router is a CPU operation: what is counted here is the router a GPU runs."""
    assert "softmax_topk_route" not in step_ops["moa"].all_ops


def test_recorder_sees_host_syncs():
    # the recorder itself: a .item() and a nonzero are seen
    with OpRecorder() as rec:
        t = torch.arange(4)
        t.sum().item()
        t.nonzero()
    assert {"_local_scalar_dense", "nonzero"} <= set(rec.ops)


# Issue 20's targets, MoA 4K16E32D at most 2x MHA's operations and SwitchHead 2H4E2K at most 2.5x (MHA: 4 heads
# of 32). Counted with the views (at this commit 163 and 154 against 92: 1.77x and 1.67x; before, 206 and 213:
# 2.24x and 2.32x) they are met. Without the views (the operations that can launch a kernel) MoA is at 72
# against 24 (3.0x; before, 108: 4.5x), about 30 of them the auxiliary losses (routing/losses.py, eq. 13-17),
# SwitchHead at 58 (2.4x; before, 106: 4.4x): the second bound keeps what was gained.
MAX_RATIO_ALL = {"moa": 2.0, "switchhead": 2.5}
# Issue 31 fused the losses' arithmetic and wrote their backward into the logits by hand (routing/losses.py,
# _FusedRouterLosses): MoA 62 against 24 (2.58x; the target of 2.0x is not reached, docs/performance.md, "Kernel counts").
MAX_RATIO_LAUNCHING = {"moa": 2.6, "switchhead": 2.5}


@pytest.mark.parametrize("name", ["moa", "switchhead"])
def test_training_step_dispatches_few_operations(step_ops, name):
    for what, bound in (("all_ops", MAX_RATIO_ALL), ("ops", MAX_RATIO_LAUNCHING)):
        got, mha = getattr(step_ops[name], what), getattr(step_ops["mha"], what)
        ratio = len(got) / len(mha)
        assert ratio <= bound[name], (
            f"{name}: {len(got)} ATen operations ({what}) per fwd+bwd, {ratio:.2f}x MHA's {len(mha)} "
            f"(at most {bound[name]}x): {got}")


@pytest.mark.parametrize("name", ["moa", "switchhead"])
def test_gate_weighting_is_in_the_kernels(step_ops, name):
    """Issue 19: no batched GEMM of inner size k for the gate-weighted sum (eq. 6), no per-slot products with
    the gates: the weighting, its gradient and the per-slot gathers are in the grouped kernels."""
    ops = step_ops[name].ops
    assert "bmm" not in ops, ops
    assert ops.count("grouped_mm") == 2 and ops.count("grouped_mm_input_grad") == 2, ops
    assert ops.count("grouped_mm_wgrad") == 2, ops


def test_routing_is_a_sort_and_a_search():
    idx = torch.randint(0, 16, (128, 4))
    with OpRecorder() as rec:
        expert_routing(idx, 16, check_range=False)
    assert sorted(rec.ops) == ["arange", "searchsorted", "sort"], rec.ops
