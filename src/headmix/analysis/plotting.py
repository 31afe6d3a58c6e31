"""matplotlib helpers for the analysis figures.

Figures are built with matplotlib's object API (:class:`matplotlib.figure.Figure`), never through
``pyplot`` or ``matplotlib.use``: plotting from a notebook or a GUI program leaves its backend and its
open figures as they were. PNG files are written by ``Figure.savefig``, which picks the Agg renderer for
that file only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any


def new_figure(rows: int = 1, cols: int = 1, *, figsize: tuple[float, float], squeeze: bool = False) -> tuple[Any, Any]:
    """A new ``matplotlib.figure.Figure`` (not registered with pyplot) and its ``rows x cols`` axes
    (as ``Figure.subplots``: an array unless ``squeeze`` reduces it)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    return fig, fig.subplots(rows, cols, squeeze=squeeze)


def save(fig: Any, path: str | os.PathLike, dpi: int = 110) -> Path:
    """Write ``fig`` to ``path`` (parent folders created) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path


def grid(n: int, max_cols: int = 3) -> tuple[int, int]:
    """Rows and columns of a grid of ``n`` panels."""
    cols = max(1, min(max_cols, n))
    return -(-n // cols), cols


def safe_name(name: str) -> str:
    """A file-name-safe version of a layer name (``encoder.layers.0.self_attn`` stays as it is)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)
