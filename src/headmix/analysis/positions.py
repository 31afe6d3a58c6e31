"""Token-choice load of Mixture of Sparse Attention layers: how often each sparse head chooses each token
position (MoSA, arXiv 2505.00315).

MoSA heads choose their tokens (expert choice), so every head takes exactly ``k`` tokens of a sequence and
the per-head load of :mod:`headmix.analysis.load` is even by construction. What varies is *which*
positions a head takes. Per MoSA layer and sparse head ``h``, over the real (non-padding) tokens of a
dataset:

- ``chosen[h][t]``: the number of sequences in which head ``h`` chose position ``t``;
- ``real[t]``: the number of sequences with a real token at position ``t``;
- ``chosen_rate[h][t] = chosen[h][t] / real[t]`` (0 where no sequence reaches ``t``);
- per head: ``first_token_rate`` (``chosen_rate[h][0]``; 1 with ``include_first``) and
  ``mean_position``, the mean position of the tokens the head chose.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from ..attention.mosa import MixtureOfSparseAttention, MoSARouting
from .counts import _model_routing, as_model_inputs
from .data import write_json
from .layers import _unwrap, describe_attention


@dataclass
class PositionLoad:
    """The token choice of one MoSA layer (see the module docstring)."""

    name: str
    num_heads: int
    chosen: list[list[int]]
    real: list[int]
    chosen_rate: list[list[float]]
    first_token_rate: list[float]
    mean_position: list[float]


@dataclass
class PositionLoadReport:
    """Token-choice load of every MoSA layer of a model on a dataset; ``to_json()``, ``to_markdown()``."""

    layers: list[PositionLoad]
    num_batches: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"analysis": "position_load", "num_batches": self.num_batches, **self.meta,
                "layers": [asdict(l) for l in self.layers]}

    def to_json(self, path: str | os.PathLike | None = None, indent: int = 2) -> str:
        """The report as JSON (written to ``path`` when given)."""
        return write_json(self.to_dict(), path, indent)

    def to_markdown(self) -> str:
        lines = []
        for layer in self.layers:
            lines += [f"### {layer.name}", "", "| head | first-token rate | mean chosen position |", "|---|---:|---:|"]
            lines += [f"| {h} | {layer.first_token_rate[h]:.3f} | {layer.mean_position[h]:.1f} |"
                      for h in range(layer.num_heads)]
            lines.append("")
        return "\n".join(lines)


def mosa_layers(model: nn.Module) -> list[tuple[str, MixtureOfSparseAttention]]:
    """The model's MoSA layers as ``(name, module)``, or a one-line ``ValueError`` naming what it has."""
    found = [(n, m) for n, m in _unwrap(model).named_modules() if isinstance(m, MixtureOfSparseAttention)]
    if not found:
        raise ValueError(f"position load needs a MixtureOfSparseAttention layer, but this model has none; its "
                         f"attention layers are: {describe_attention(model)}")
    return found


@torch.no_grad()
def position_load(model: nn.Module, batches: Iterable[Any]) -> PositionLoadReport:
    """Run ``model`` (eval mode, no gradients) over ``batches`` (as :func:`headmix.analysis.expert_load`
    takes them) and count which positions each sparse head of each MoSA layer chose."""
    layers = dict(mosa_layers(model))
    chosen: dict[str, torch.Tensor] = {}
    real: dict[str, torch.Tensor] = {}
    try:
        device = next(model.parameters()).device
    except StopIteration:  # pragma: no cover - a model without parameters
        device = torch.device("cpu")
    was_training, num_batches = model.training, 0
    model.eval()
    try:
        for batch in batches:
            inputs = {k: v.to(device) for k, v in as_model_inputs(model, batch).items()}
            for name, routing in _model_routing(model, inputs):
                if name not in layers or not isinstance(routing, MoSARouting):
                    continue
                batch_size, length = routing.router_scores.shape[:2]
                mask = routing.token_mask if routing.token_mask is not None else torch.ones(
                    batch_size, length, dtype=torch.bool, device=routing.router_scores.device)
                _add(chosen, name, routing.selection_counts(length).cpu())
                _add(real, name, mask.sum(0).cpu()[None])
            num_batches += 1
    finally:
        model.train(was_training)
    return PositionLoadReport([_layer_load(n, chosen[n], real[n][0]) for n in layers if n in chosen], num_batches)


def _add(store: dict[str, torch.Tensor], name: str, counts: torch.Tensor) -> None:
    """Sum counts of different lengths (batches padded to different lengths) along the positions."""
    old = store.get(name)
    if old is None:
        store[name] = counts.clone()
        return
    length = max(old.shape[-1], counts.shape[-1])
    out = torch.zeros(old.shape[0], length, dtype=torch.long)
    out[:, :old.shape[-1]] += old
    out[:, :counts.shape[-1]] += counts
    store[name] = out


def _layer_load(name: str, chosen: torch.Tensor, real: torch.Tensor) -> PositionLoad:
    rate = torch.where(real > 0, chosen.double() / real.clamp(min=1).double(), torch.zeros((), dtype=torch.double))
    positions = torch.arange(chosen.shape[1], dtype=torch.double)
    totals = chosen.sum(1).double()
    mean = torch.where(totals > 0, (chosen.double() * positions).sum(1) / totals.clamp(min=1), torch.zeros(()))
    return PositionLoad(name, chosen.shape[0], chosen.tolist(), real.tolist(), rate.tolist(), rate[:, 0].tolist(),
                        mean.tolist())
