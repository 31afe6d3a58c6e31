"""matplotlib helpers for the analysis figures (the non-interactive Agg backend, PNG files)."""

from __future__ import annotations

import os
import re
from pathlib import Path


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | os.PathLike, dpi: int = 110) -> Path:
    """Write ``fig`` to ``path`` (parent folders created), close it, return the path."""
    plt = pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


def grid(n: int, max_cols: int = 3) -> tuple[int, int]:
    """Rows and columns of a grid of ``n`` panels."""
    cols = max(1, min(max_cols, n))
    return -(-n // cols), cols


def safe_name(name: str) -> str:
    """A file-name-safe version of a layer name (``encoder.layers.0.self_attn`` stays as it is)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)
