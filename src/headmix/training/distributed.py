"""Data-parallel training with PyTorch's own tools: DDP (every rank holds the model) or FSDP2
(``fully_shard``: parameters, gradients and optimizer state sharded across ranks; works on CPU with gloo).

:class:`Parallel` hides the difference from the training loop: gradient-sync control for gradient
accumulation, gradient clipping, and full (unsharded) weights and optimizer state for checkpoints,
gathered with ``torch.distributed.checkpoint.state_dict``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def init_distributed(device: torch.device) -> Dist:
    """Join the process group that ``torchrun`` describes (gloo on CPU, nccl on CUDA); a no-op alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def _fully_shard() -> Callable:
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:  # torch 2.4-2.5
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def shard_by_layer(model: nn.Module) -> nn.Module:
    """``model`` sharded with FSDP2 across the ranks: one shard group per Transformer layer, the rest at the root
    (the student's layout, and a distilling run's parent's)."""
    fully_shard = _fully_shard()
    for name, child in model.named_modules():
        if name.endswith("layers") and isinstance(child, nn.ModuleList):
            for block in child:
                fully_shard(block)
    return fully_shard(model)


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """``value`` averaged over the ranks of the process group (a collective call: every rank makes it); ``value``
    itself without one."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    total = value.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


class Parallel:
    """The model as the training loop sees it. ``kind`` is ``"none"``, ``"ddp"`` or ``"fsdp"``.

    ``module`` is the model to call; ``plain`` an unwrapped model of the same architecture that holds the
    full weights whenever :meth:`full_model` returns it (the model itself except under FSDP).
    """

    def __init__(self, model: nn.Module, kind: str, device: torch.device, make_plain: Callable[[], nn.Module]):
        if kind not in ("none", "ddp", "fsdp"):
            raise ValueError(f"kind must be 'none', 'ddp' or 'fsdp', got {kind!r}")
        self.kind = kind
        self.plain = model
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP
            self.module = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        elif kind == "fsdp":
            self.module = shard_by_layer(model)
            self.plain = make_plain() if dist.get_rank() == 0 else None
        else:
            self.module = model

    def no_sync(self):
        """Inside, backward accumulates gradients without synchronising them across ranks."""
        if self.kind == "ddp":
            return self.module.no_sync()
        if self.kind == "fsdp":
            return _fsdp_no_sync(self.module)
        return contextlib.nullcontext()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` (0 = do not clip) and return the total gradient norm over all ranks."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _resharded(self) -> None:
        # A forward without autograd (validation) can leave FSDP2 parameters unsharded; the state-dict
        # functions map optimizer state through the sharded parameters, so reshard first.
        for m in self.module.modules():
            if hasattr(m, "reshard") and hasattr(m, "unshard"):
                m.reshard()

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        return StateDictOptions(full_state_dict=True, cpu_offload=True)

    def full_model(self) -> nn.Module | None:
        """The model with its full weights on rank 0 (a collective call under FSDP); None elsewhere."""
        if self.kind != "fsdp":
            return self.plain
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        self._resharded()
        state = get_model_state_dict(self.module, options=self._options())
        if self.plain is not None:
            self.plain.load_state_dict(state)
        return self.plain

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self.kind != "fsdp":
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        self._resharded()
        return get_optimizer_state_dict(self.module, optimizer, options=self._options())

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        if self.kind != "fsdp":
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(self.module, optimizer, optim_state_dict=state,
                                 options=StateDictOptions(full_state_dict=True))


@contextlib.contextmanager
def _fsdp_no_sync(module):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
