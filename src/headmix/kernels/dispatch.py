"""Public entry points ``expert_map`` / ``expert_reduce``: checks and implementation choice.

MoA (Zhang et al. 2022, arXiv 2210.05144), with ``e = expert_index[n, j]``:

* :func:`expert_map`, eq. 10 (per-expert query projection):
  ``y[n, j] = x[n] @ W[e]`` -> (N, k, d_out)
* :func:`expert_reduce`, eq. 12 + eq. 6 (per-expert output projection, then the
  gate-weighted sum over the k selected heads):
  ``y[n] = sum_j gates[n, j] * (h[n, j] @ W[e])`` -> (N, d_out)

Implementations (``impl=``):

=========== =================================================================
reference   loop over experts with boolean masks (ground truth; E dense GEMMs)
dense       one GEMM over all E experts then gather / gate-weighted scatter;
            ``E/k`` x the useful FLOPs, but one big GEMM
sorted      slots sorted by expert, one GEMM per expert, hand-written backward
            (:mod:`.grouped_cpu`); cost ~ N*k, not E
gather      per-slot weights ``W[expert_index]`` + batched mat-vec (forced only)
bag         one ``embedding_bag`` over the selected experts' weight rows (decoding)
triton      Triton grouped GEMM (:mod:`.grouped_triton`); CUDA, or CPU tensors
            under ``TRITON_INTERPRET=1`` (tests only)
grouped_cpp C++ grouped GEMM on the CPU, experts across cores, each expert's GEMM whole on
            one core, rows read in place, outputs gated into the tokens' rows
            (:mod:`.grouped_cpp`); the ``sorted`` path where it cannot be built
grouped_mm  PyTorch's grouped GEMM ``torch.nn.functional.grouped_mm``
            (:mod:`.grouped_torch`); bfloat16 on CUDA / under compile,
            float32/bfloat16/float16 on the CPU in eager mode
auto        see :func:`choose_impl`
=========== =================================================================
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import grouped_cpp, grouped_cpu, grouped_torch, reference
from .routing_info import ExpertRouting

__all__ = ["IMPLS", "choose_impl", "expert_map", "expert_map_weighted", "expert_reduce"]

IMPLS = ("auto", "reference", "dense", "sorted", "gather", "bag", "triton", "grouped_mm", "grouped_cpp")

# CPU ``auto`` thresholds, measured with ``headmix bench grouped --sweep`` on a
# 2-core CPU (float32, d_model 512, d_head 64, map + reduce, min of 5-15 runs):
#
# * dense vs sorted, N = 4096 tokens, fwd+bwd ms:
#   k=8: E=8 91 vs 124, E=10 108 vs 122, E=12 126 vs 123, E=16 173 vs 123;
#   k=2: E=2 25 vs 37, E=3 35 vs 35, E=4 45 vs 34  -> dense up to E = 1.25 k.
#   With N*k <= 128 slots sorted's per-expert overhead dominates and dense wins
#   up to E = 8 k (N=16, k=8, E=64: fwd 3.6 vs 4.1 ms, fwd+bwd 8.8 vs 11.6 ms);
#   at 256 slots the two tie.
# * gather (no-grad decoding only: its backward scatters N*k weight copies and is
#   2-10x slower than dense/sorted): N=1, k=8, E=32 fwd 0.33 ms vs dense 0.76,
#   sorted 0.70; N=8, k=2, E=16 0.61 vs 0.77; it loses once E <= 2k or N*k >= 32.
#   Since sorted packs experts into chunks (one gather and one scatter per chunk, one GEMM per expert),
#   sorted and then bag beat gather at decoding sizes (see DECODE_MIN_EXPERTS_PER_K); ``auto`` no
#   longer picks gather.

#: ``dense`` when ``E <= DENSE_MAX_EXPERTS_PER_K * k`` (any N): the sweep above ties at E = 1.5 k for
#: d_model 512, and at d_model 128 (mini-moa, 6K8E32D, 2688 tokens, map + reduce fwd+bwd, one thread,
#: CPU time, 2026-11-22) dense takes 22.2 ms against sorted's 26.6.
DENSE_MAX_EXPERTS_PER_K = 1.5

#: ``dense`` also when ``N*k <= DENSE_SMALL_SLOTS`` and ``E <= DENSE_SMALL_MAX_EXPERTS_PER_K * k``.
DENSE_SMALL_SLOTS = 128
DENSE_SMALL_MAX_EXPERTS_PER_K = 8

#: No gradient (decoding) and ``E > DECODE_MIN_EXPERTS_PER_K * k``: an implementation that reads only the
#: selected experts' weights, ``bag`` for ``N*k <= BAG_MAX_SLOTS`` and ``sorted`` above. ``headmix bench
#: decode --threads 1 --clock cpu`` (k 8, embed 512, 2026-11-22, load 4-5), us per step before ``bag``:
#: batch 8, E 64: sorted 3101, dense 4970, gather 5185; E 32: sorted 2520, dense 2478, gather 5315;
#: batch 1, E 64: sorted 1087, gather 1156, dense 3497.
DECODE_MIN_EXPERTS_PER_K = 2

#: ``bag`` up to this many slots (``N*k``) in decoding. ``headmix bench grouped --sweep
#: --sweep-tokens 1 8 32 64 128 --sweep-k 8 --sweep-experts-per-k 1 4 8`` (embed 512, k 8, map + reduce
#: without gradient, 2 threads, min of 5, idle, 2026-11-22), ms, bag / sorted: E 64: 8 slots 0.30 / 0.60,
#: 64 slots 0.93 / 2.32, 256 slots 1.73 / 3.68, 512 slots 2.33 / 3.76, 1024 slots 3.76 / 4.45; E 32: 512
#: slots 2.08 / 2.43, 1024 slots 3.95 / 4.01. With one thread under load bag's lead ends near 512 slots
#: (E 32: 4.40 against sorted's 4.13 ms; E 64: 5.09 against 5.59), hence 512. With ``E <= 1.5 k`` dense
#: stays the choice (E 8, 64 slots: dense 0.51, bag 0.56).
BAG_MAX_SLOTS = 512

# grouped_cpp vs sorted with gradients (``headmix bench grouped-cpu --threads 1 --clock cpu``: MoA's map
# then reduce, forward + backward, float32, one thread, CPU time, median of 9, the 2-core Xeon shared with other
# work, 2026-12-07), time / sorted's: d_model 1024, 1024 tokens, top 8 of 32, heads of 64: 0.77; d_model 128,
# 2048 tokens, top 4 of 16, heads of 16: 0.62. Both under the dense rules above where those apply. At two
# threads, idle, wall clock, median of 15 (``--threads 2 --rounds 15``, 2026-12-07): 0.95 [0.89-1.05] and
# 0.97 [0.76-1.08], level with sorted, which auto keeps there (docs/performance.md); without gradients it was not
# measured: sorted there until it is.


def choose_impl(
    device: torch.device, num_slots: int, num_experts: int, top_k: int, needs_grad: bool = True,
    dtype: torch.dtype | None = None, threads: int | None = None,
) -> str:
    """The ``auto`` rule (``num_slots = N*k``).

    * CUDA: ``grouped_mm`` for bfloat16 (PyTorch's CUTLASS grouped GEMM: vendor-tuned, no host sync; not
      yet measured against ``triton`` on a GPU, see docs/performance.md), else ``triton`` if Triton is
      importable, else ``sorted``.
    * CPU, first match (thresholds measured on a 2-core CPU, see the comment above):

      1. ``dense``  if ``k == E`` or ``E <= 1.5 k``
      2. no gradient needed and ``E > 2k`` (decoding: read only the selected experts): ``bag`` if
         ``N*k <= 512``, else ``sorted``
      3. ``dense``  if ``N*k <= 128`` and ``E <= 8k`` (small batches)
      4. otherwise (cost ~ N*k, independent of E): ``grouped_cpp`` with gradients at one thread (forward +
         backward measured faster than ``sorted`` there, see the comment above; ``sorted`` runs where it
         cannot be built), else ``sorted``

    ``threads``: torch's CPU threads (default ``torch.get_num_threads()``, a constant under ``torch.compile``).
    """
    if device.type == "cuda":
        if dtype == torch.bfloat16:
            return "grouped_mm"
        from .grouped_triton import triton_available

        return "triton" if triton_available() else "sorted"
    if top_k == num_experts or num_experts <= DENSE_MAX_EXPERTS_PER_K * top_k:
        return "dense"
    if not needs_grad and num_experts > DECODE_MIN_EXPERTS_PER_K * top_k:
        return "bag" if num_slots <= BAG_MAX_SLOTS else "sorted"
    if num_slots <= DENSE_SMALL_SLOTS and num_experts <= DENSE_SMALL_MAX_EXPERTS_PER_K * top_k:
        return "dense"
    if threads is None:
        threads = _cpu_threads()
    return "grouped_cpp" if needs_grad and threads == 1 else "sorted"


@torch.compiler.assume_constant_result
def _cpu_threads() -> int:
    return torch.get_num_threads()


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, Tensor) else type(t).__name__


def _check_common(name: str, inp, weight, routing, impl: str, want_dim: int) -> None:
    if not isinstance(routing, ExpertRouting):
        raise TypeError(f"routing must be an ExpertRouting from expert_routing(), got {type(routing).__name__}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    n, k, num_experts = routing.num_tokens, routing.top_k, routing.num_experts
    grouped = want_dim == 3 and isinstance(inp, Tensor) and inp.dim() == 4  # (N, G, k / G, d_in)
    if not isinstance(inp, Tensor) or (inp.dim() != want_dim and not grouped):
        want = "(N, d_in)" if want_dim == 2 else "(N, k, d_in)"
        raise ValueError(f"{name} must be a {want_dim}-d tensor {want}, got {_shape(inp)}")
    if inp.shape[0] != n or (want_dim == 3 and inp.shape[1] * (inp.shape[2] if grouped else 1) != k):
        want = f"({n}, *)" if want_dim == 2 else f"({n}, {k}, *)"
        raise ValueError(f"{name} must have shape {want} to match expert_index (N, k) = ({n}, {k}), got {_shape(inp)}")
    if not inp.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {inp.dtype}")
    d_in = inp.shape[-1]
    if not isinstance(weight, Tensor) or weight.dim() != 3 or weight.shape[0] != num_experts or weight.shape[1] != d_in:
        raise ValueError(
            f"weight must have shape (num_experts, d_in, d_out) = ({num_experts}, {d_in}, *), got {_shape(weight)}"
        )
    if weight.dtype != inp.dtype:
        raise ValueError(f"weight must have the dtype of {name} ({inp.dtype}), got {weight.dtype}")
    if weight.device != inp.device or routing.device != inp.device:
        raise ValueError(
            f"{name}, weight and routing must be on one device, got {inp.device}, {weight.device}, {routing.device}"
        )


def _checked_gates(gates, inp: Tensor, n: int, k: int) -> Tensor:
    """``gates`` checked to be ``(N, k)`` floating point on ``inp``'s device, cast to ``inp.dtype``."""
    if not isinstance(gates, Tensor) or tuple(gates.shape) != (n, k):
        raise ValueError(f"gates must have shape (N, k) = ({n}, {k}), got {_shape(gates)}")
    if not gates.dtype.is_floating_point or gates.device != inp.device:
        raise ValueError(f"gates must be a floating-point tensor on {inp.device}, got {gates.dtype} on {gates.device}")
    return gates.to(inp.dtype)


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _resolve(impl: str, t: Tensor, routing: ExpertRouting, needs_grad: bool) -> str:
    if impl == "auto":
        impl = choose_impl(t.device, routing.num_slots, routing.num_experts, routing.top_k, needs_grad, t.dtype)
    if impl == "triton":
        from . import grouped_triton

        if not grouped_triton.triton_available():
            raise RuntimeError("impl='triton' needs the triton package (pip install 'headmix[triton]')")
        if t.device.type == "cpu" and not torch.compiler.is_compiling() and not grouped_triton.can_run_on_cpu():
            raise RuntimeError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 (Triton interpreter)")
    return impl


def expert_map(x: Tensor, weight: Tensor, routing: ExpertRouting, impl: str = "auto") -> Tensor:
    """MoA eq. 10: ``y[n, j, :] = x[n, :] @ weight[expert_index[n, j]]``.

    Args:
        x: (N, d_in) token inputs.
        weight: (E, d_in, d_out) stacked per-expert projections (e.g. W_q^i).
        routing: :func:`~headmix.kernels.expert_routing` of the router's (N, k) choice.
        impl: one of :data:`IMPLS` (see the module docstring and :func:`choose_impl`).

    Returns:
        (N, k, d_out), differentiable with respect to ``x`` and ``weight``.
    """
    _check_common("x", x, weight, routing, impl, 2)
    impl = _resolve(impl, x, routing, _needs_grad(x, weight))
    if impl == "reference":
        return reference.reference_map(x, weight, routing.expert_index)
    if impl == "dense":
        return reference.dense_map(x, weight, routing.expert_index)
    if impl == "gather":
        return reference.gather_map(x, weight, routing.expert_index)
    if impl == "bag":
        return reference.bag_map(x, weight, routing.expert_index)
    if impl == "sorted":
        return grouped_cpu.sorted_map(x, weight, routing)
    if impl == "grouped_mm":
        return grouped_torch.grouped_mm_map(x, weight, routing)
    if impl == "grouped_cpp":
        return grouped_cpp.grouped_cpp_map(x, weight, routing)
    from . import grouped_triton

    return grouped_triton.triton_map(x, weight, routing)


def expert_map_weighted(x: Tensor, weight: Tensor, gates: Tensor, routing: ExpertRouting, groups: int,
                        impl: str = "auto") -> Tensor:
    """The gate-weighted sum of the mapped slots per group of ``k / groups`` slots (SwitchHead's values,
    arXiv 2312.07987, ``v^h_t = sum_{e in topk(s^h_t)} s^h_{t,e} x_t W_v^{h,e}``, one group per head):
    ``y[n, g] = sum_{j of group g} gates[n, j] * (x[n] @ weight[expert_index[n, j]])``, slot ``j`` in group
    ``j // (k / groups)``.

    Args:
        x: (N, d_in); weight: (E, d_in, d_out); gates: (N, k), cast to ``x.dtype``;
        routing: of the (N, k) choice; groups: divides k; impl: one of :data:`IMPLS`.

    Returns:
        (N, groups, d_out). ``triton`` scales the slots in its kernel (no (N, k, d_out) product with the
        gates); ``grouped_mm`` weights and sums in one ``bmm``; the others weight :func:`expert_map`'s output.
    """
    _check_common("x", x, weight, routing, impl, 2)
    n, k = routing.num_tokens, routing.top_k
    if not isinstance(groups, int) or groups < 1 or k % groups:
        raise ValueError(f"groups must be a positive divisor of k = {k}, got {groups!r}")
    gates = _checked_gates(gates, x, n, k)
    resolved = _resolve(impl, x, routing, _needs_grad(x, weight, gates))
    if resolved == "triton":
        from . import grouped_triton

        return grouped_triton.triton_map_weighted(x, weight, gates, routing, groups)
    if resolved == "grouped_mm":
        return grouped_torch.grouped_mm_map_weighted(x, weight, gates, routing, groups)
    if resolved == "grouped_cpp":
        return grouped_cpp.grouped_cpp_map_weighted(x, weight, gates, routing, groups)
    y = expert_map(x, weight, routing, impl)
    return (y * gates.unsqueeze(-1)).view(n, groups, k // groups, weight.shape[2]).sum(2)


def expert_reduce(h: Tensor, weight: Tensor, gates: Tensor, routing: ExpertRouting, impl: str = "auto") -> Tensor:
    """MoA eq. 12 + 6: ``y[n, :] = sum_j gates[n, j] * (h[n, j, :] @ weight[expert_index[n, j]])``.

    Args:
        h: (N, k, d_in) per-slot inputs (e.g. the k heads' attention outputs), or (N, G, k / G, d_in), slot
            ``j = g k / G + i`` (e.g. an expanded view, one row per group repeated over its k / G slots): the
            ``triton`` kernels read it in place whatever its strides, the others reshape it to (N, k, d_in).
        weight: (E, d_in, d_out) stacked per-expert projections (e.g. W_o^i).
        gates: (N, k) gate weights of the selected experts; cast to ``h.dtype``.
        routing: :func:`~headmix.kernels.expert_routing` of the router's (N, k) choice.
        impl: one of :data:`IMPLS`.

    Returns:
        (N, d_out), differentiable with respect to ``h``, ``weight`` and ``gates``.
    """
    _check_common("h", h, weight, routing, impl, 3)
    n, k = routing.num_tokens, routing.top_k
    gates = _checked_gates(gates, h, n, k)
    impl = _resolve(impl, h, routing, _needs_grad(h, weight, gates))
    if impl == "grouped_cpp":  # reads a stride-0 expanded (N, G, k / G, d_in) view in place
        return grouped_cpp.grouped_cpp_reduce(h, weight, gates, routing)
    if h.dim() == 4 and impl != "triton":
        h = h.reshape(n, k, h.shape[-1])
    if impl == "reference":
        return reference.reference_reduce(h, weight, gates, routing.expert_index)
    if impl == "dense":
        return reference.dense_reduce(h, weight, gates, routing.expert_index)
    if impl == "gather":
        return reference.gather_reduce(h, weight, gates, routing.expert_index)
    if impl == "bag":
        return reference.bag_reduce(h, weight, gates, routing.expert_index)
    if impl == "sorted":
        return grouped_cpu.sorted_reduce(h, weight, gates, routing)
    if impl == "grouped_mm":
        return grouped_torch.grouped_mm_reduce(h, weight, gates, routing)
    from . import grouped_triton

    return grouped_triton.triton_reduce(h, weight, gates, routing)
