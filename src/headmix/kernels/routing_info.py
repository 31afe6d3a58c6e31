"""Routing bookkeeping shared by the expert map and reduce kernels.

A Mixture of Attention Heads layer (MoA, Zhang et al. 2022, arXiv 2210.05144)
routes every token ``n`` to ``k`` of ``E`` experts (eq. 4-5: top-k of the
router).  The router's ``expert_index`` (N, k) is flattened into ``N*k``
*slots*, slot ``s = n*k + j`` being "token n, its j-th selected expert".  The
grouped kernels want the slots grouped by expert, so :func:`expert_routing`
computes once per layer call

* ``sort_order``: the slot ids sorted (stably) by expert,
* ``sorted_expert``: the expert of each sorted slot,
* ``counts`` / ``offsets``: the number of slots per expert and their cumulative
  sum, so expert ``e`` owns ``sort_order[offsets[e]:offsets[e+1]]``,
* optionally (Triton path) a table of ``block_m``-row blocks in the sorted
  order, each inside one expert (scattermoe's "padded block indices").

Everything is computed with tensor ops on the device of ``expert_index``; no
value is read back to the host (no ``.item()``, ``.tolist()``, ``bincount``),
so building the routing never synchronises a GPU stream.  Shapes only depend
on ``N``, ``k``, ``E`` and ``block_m``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from .cpp_build import cpp_kernel_available, cpp_ops

__all__ = ["DEFAULT_BLOCK_M", "ExpertRouting", "block_table", "expert_routing"]

#: Rows of the sorted slot buffer handled by one Triton program.
DEFAULT_BLOCK_M = 64


@dataclass(frozen=True)
class ExpertRouting:
    """Slots (token, choice) grouped by expert; see :func:`expert_routing`.

    Attributes:
        expert_index: (N, k) long, the router's choice per token (eq. 4-5).
        num_experts: E.
        top_k: k.
        sort_order: (N*k,) long, flat slot ids ``n*k + j`` stably sorted by expert.
        sorted_expert: (N*k,) long, ``expert_index.flatten()[sort_order]``.
        offsets: (E+1,) long, ``[0, cumsum(counts)]``.
        block_m: rows per Triton program (``None``: :data:`DEFAULT_BLOCK_M`).

    Computed when read (not every kernel needs them, and each costs a kernel launch on a GPU):
    ``sorted_token`` (N*k,) the token ``n = sort_order // k`` of each sorted slot; ``counts`` (E,) slots
    per expert; ``block_expert`` / ``block_start``, the ``block_m``-row block table of
    :func:`block_table` (the Triton kernels find their block from ``offsets`` themselves).
    """

    expert_index: Tensor
    num_experts: int
    top_k: int
    sort_order: Tensor
    sorted_expert: Tensor
    offsets: Tensor
    block_m: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.expert_index.shape[0]

    @property
    def num_slots(self) -> int:
        return self.sort_order.shape[0]

    @property
    def device(self) -> torch.device:
        return self.expert_index.device

    @property
    def sorted_token(self) -> Tensor:
        return self.sort_order // self.top_k

    @property
    def counts(self) -> Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def block_expert(self) -> Tensor | None:
        return None if self.block_m is None else self._blocks()[0]

    @property
    def block_start(self) -> Tensor | None:
        return None if self.block_m is None else self._blocks()[1]

    def _blocks(self) -> tuple[Tensor, Tensor]:
        return block_table(self.counts, self.offsets, self.num_slots, self.block_m)

    def counts_list(self) -> list[int]:
        """Slots per expert as Python ints (a host sync on GPU: CPU paths only)."""
        return self.counts.tolist()

    def with_blocks(self, block_m: int = DEFAULT_BLOCK_M) -> ExpertRouting:
        """This routing with Triton programs of ``block_m`` rows (no host sync, no work)."""
        _check_block_m(block_m)
        return self if self.block_m == block_m else dataclasses.replace(self, block_m=block_m)


def _check_block_m(block_m) -> None:
    if not (isinstance(block_m, int) and block_m >= 16 and block_m & (block_m - 1) == 0):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m!r}")


def block_table(counts: Tensor, offsets: Tensor, num_slots: int, block_m: int) -> tuple[Tensor, Tensor]:
    """Split each expert's run of sorted slots into ``block_m``-row blocks.

    Returns ``(block_expert, block_start)`` of static length
    ``cdiv(num_slots, block_m) + min(E, num_slots)``: the real number of blocks,
    ``sum_e cdiv(counts[e], block_m)``, is data dependent but never larger (each
    non-empty expert wastes less than one block).  Unused tail entries have
    ``block_expert == E`` and are skipped by the kernels, so the grid size is
    known on the host without reading ``counts`` back.
    """
    num_experts = counts.shape[0]
    max_blocks = -(-num_slots // block_m) + min(num_experts, num_slots)
    blocks_per_expert = (counts + (block_m - 1)) // block_m
    block_end = torch.cumsum(blocks_per_expert, 0)
    block_begin = block_end - blocks_per_expert
    b = torch.arange(max_blocks, device=counts.device, dtype=block_end.dtype)
    # expert e owns blocks [block_begin[e], block_end[e]); right=True skips empty experts
    block_expert = torch.searchsorted(block_end, b, right=True)
    e = block_expert.clamp(max=num_experts - 1)
    block_start = offsets[e] + (b - block_begin[e]) * block_m
    return block_expert.to(torch.int32), block_start.to(torch.int32)


@torch.library.custom_op("headmix::sort_by_expert", mutates_args=(), device_types="cpu")
def sort_by_expert(expert_index: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(sorted_expert, sort_order, offsets)`` of the (N, k) int64 ``expert_index``: its flat slots stably sorted by
    expert, as ``torch.sort(stable=True)`` and ``torch.searchsorted`` give them, by one C++ counting sort (CPU;
    built with headmix's C++ kernels, :mod:`.cpp_build`)."""
    return tuple(cpp_ops().sort_by_expert(expert_index, num_experts))


@sort_by_expert.register_fake
def _(expert_index, num_experts):
    slots = expert_index.numel()
    return expert_index.new_empty(slots), expert_index.new_empty(slots), expert_index.new_empty(num_experts + 1)


def expert_routing(
    expert_index: Tensor, num_experts: int, *, block_m: int | None = None, check_range: bool = True
) -> ExpertRouting:
    """Group the (token, choice) slots of ``expert_index`` by expert.

    Args:
        expert_index: (N, k) integer tensor, the experts chosen for each token
            (MoA eq. 4-5).  Rows normally hold distinct experts; repeated experts
            are still handled correctly by every implementation.
        num_experts: E, the number of experts (>= 1); values must lie in [0, E).
        block_m: rows per Triton program (a power of two >= 16; default
            :data:`DEFAULT_BLOCK_M`).
        check_range: check on CPU that the values lie in [0, E) (two reductions
            read back to the host; never done on accelerators or under
            ``torch.compile``). Layers pass False: a router's top-k is in range.

    Call once per layer call; :func:`~headmix.kernels.expert_map` and
    :func:`~headmix.kernels.expert_reduce` reuse the result.  No host sync:
    one sort and one ``searchsorted``, or on the CPU, eager, one C++ counting
    sort (:func:`sort_by_expert`) where headmix's C++ kernels are built
    (``sorted_token``, ``counts`` and the block table are computed only when
    read).
    """
    if not isinstance(expert_index, Tensor) or expert_index.dim() != 2:
        shape = tuple(expert_index.shape) if isinstance(expert_index, Tensor) else type(expert_index).__name__
        raise ValueError(f"expert_index must be a 2-d (N, k) tensor, got {shape}")
    if expert_index.dtype.is_floating_point or expert_index.dtype.is_complex or expert_index.dtype == torch.bool:
        raise ValueError(f"expert_index must be an integer tensor, got dtype {expert_index.dtype}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if block_m is not None:
        _check_block_m(block_m)
    n, k = expert_index.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"expert_index must have 1 <= k <= num_experts = {num_experts} columns, got k = {k}")
    if check_range and expert_index.device.type == "cpu" and n > 0 and not torch.compiler.is_compiling():
        # cheap on CPU; skipped on accelerators (a host sync) and under torch.compile
        lo, hi = int(expert_index.min()), int(expert_index.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert_index values must lie in [0, {num_experts}), got range [{lo}, {hi}]")

    expert_index = expert_index.long()
    if expert_index.device.type == "cpu" and not torch.compiler.is_compiling() and n > 0 and cpp_kernel_available():
        # one C++ counting sort (the same result as the sort and searchsorted below, one operation)
        sorted_expert, sort_order, offsets = sort_by_expert(expert_index, num_experts)
    else:
        sorted_expert, sort_order = torch.sort(expert_index.reshape(-1), stable=True)
        # offsets[e] = number of slots with expert < e (sorted_expert is sorted)
        offsets = torch.searchsorted(
            sorted_expert, torch.arange(num_experts + 1, device=expert_index.device, dtype=torch.long))
    return ExpertRouting(
        expert_index=expert_index,
        num_experts=num_experts,
        top_k=k,
        sort_order=sort_order,
        sorted_expert=sorted_expert,
        offsets=offsets,
        block_m=block_m,
    )
