"""The validation loss of a model over a loader, and the expert load of its routed layers."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
from torch import nn

from ..routing import load_summary


def add_expert_counts(routing: list, counts: dict[str, torch.Tensor]) -> None:
    """Add the routing slots each expert received in one forward pass (``(layer name, Routing)`` list)
    to ``counts``, per layer name."""
    for name, r in routing:
        c = r.expert_counts().detach().cpu()
        counts[name] = counts[name] + c if name in counts else c


def load_record(counts: dict[str, torch.Tensor]) -> dict[str, float]:
    """The expert load of ``counts`` averaged over the routed layers: ``load_max_share``,
    ``load_min_share``, ``load_cv`` ({} without routed layers)."""
    if not counts:
        return {}
    summaries = [load_summary(c) for c in counts.values()]
    return {f"load_{k}": sum(s[k] for s in summaries) / len(summaries) for k in ("max_share", "min_share", "cv")}


def progress_bar(total: int | None, desc: str, unit: str, enabled: bool):
    """A tqdm bar on stderr when ``enabled`` and stderr is a terminal (``update(n)``, ``close()``), else ``None``."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, disable=None)


@torch.no_grad()
def validation_loss(model: nn.Module, loader, task, device: torch.device | str,
                    autocast: Callable[[], Any] = contextlib.nullcontext, *, progress: bool = False) -> dict[str, Any]:
    """Token-averaged loss (label-smoothed as in training), NLL and perplexity of ``model`` over
    ``loader`` (batches of ``task``), and the share of routing slots per expert of each routed layer.
    ``progress``: a bar of the batches on stderr."""
    was_training = model.training
    model.eval()
    loss, nll, tokens = 0.0, 0.0, 0
    counts: dict[str, torch.Tensor] = {}
    bar = progress_bar(len(loader) if hasattr(loader, "__len__") else None, "evaluate", "batch", progress)
    for batch in loader:
        if bar is not None:
            bar.update(1)
        with autocast():
            out = model(**task.model_inputs(batch, device))
        n = int(out.num_tokens)
        loss += float(out.lm_loss) * n
        nll += float(out.nll_loss) * n
        tokens += n
        add_expert_counts(out.routing, counts)
    if bar is not None:
        bar.close()
    model.train(was_training)
    n = max(tokens, 1)
    return {"loss": loss / n, "nll": nll / n, "ppl": math.exp(min(nll / n, 50.0)), "tokens": tokens,
            "expert_load": {k: (v / v.sum().clamp(min=1)).tolist() for k, v in counts.items()}}
