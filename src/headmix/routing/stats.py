"""Summaries of how evenly a router spreads its tokens (used by the training log and the analyses)."""

from __future__ import annotations

import math

from torch import Tensor


def load_summary(counts: Tensor) -> dict[str, float]:
    """Summary of an ``(E,)`` vector of routing slots per expert, in float64: ``max_share`` and
    ``min_share`` (shares of the slots), ``cv`` (std / mean of the shares, population std; 0 = even) and
    ``norm_entropy`` (entropy of the shares / log E; 1 = even, and 1 for a single expert)."""
    counts = counts.double()
    total = float(counts.sum())
    if total <= 0:
        return {"max_share": 0.0, "min_share": 0.0, "cv": 0.0, "norm_entropy": 0.0}
    share = counts / total
    nz = share[share > 0]
    n = counts.numel()
    return {"max_share": float(share.max()), "min_share": float(share.min()),
            "cv": float(share.std(unbiased=False) / share.mean()),
            "norm_entropy": float(-(nz * nz.log()).sum()) / math.log(n) if n > 1 else 1.0}
