"""Expert load: the share of routing slots each expert (MoA) or routed head (MoH) receives, per layer.

This is the MoA paper's load analysis (Zhang et al. 2022, Figure 3 and Appendix A): on WMT14 En-De
with 32 experts the most used expert of a layer took about 5% of the tokens and the least about 1%
(most between 2% and 4%; uniform would be 1/32 = 3.1%). An even load means the load-balancing loss
(eq. 13-15) works and no expert is wasted.

Per layer, with ``c_e`` the slots routed to expert ``e`` over the real (non-padding) tokens of a
dataset (a token routed to ``k`` experts fills ``k`` slots):

- ``share_e = c_e / sum_j c_j`` (sums to 1; the paper's "% of tokens" per expert);
- ``token_fraction_e = c_e / num_tokens`` (the fraction of tokens that selected ``e``; sums to ``k``);
- ``gate_share_e``: the share of the summed gate weights ``w`` (eq. 9) that went to ``e``;
- ``mean_prob_e``: the mean router probability ``p_e`` (eq. 7), the ``P_i`` of the balancing loss;
- summaries: ``max_share``, ``min_share``, the coefficient of variation ``cv = std(share) / mean(share)``
  (0 = perfectly even) and ``norm_entropy = H(share) / log E`` (1 = perfectly even), the same
  definitions as the training log's ``load_*`` fields.

Layers with routing groups (:mod:`headmix.analysis.layers`: experts in ``G`` equal groups, ``k`` slots per
token in each) get the load inside each group, which is what each group's router balances: ``groups``
lists, per group, its ``label``, the shares of its experts among that group's slots and their summaries
(the layer-wide ``share`` is then ``1 / G`` of the group's share; its uniform is ``1 / (G R)``), each expert's
``gate_share`` of the group's summed gate weights and the group's ``gate_fraction`` of the layer's.
SwitchHead (arXiv 2312.07987) layers appear twice, ``<module>:value`` and ``<module>:output``, each over the
``H * E`` experts ``h{h}.E{e}``, a group per head; ``gate_share`` is the share of the summed sigmoid weights
and ``mean_prob`` the mean sigmoid ``s`` (not a distribution). MoH routed per K/V group has a group per K/V
head, its routed heads labelled ``g{group}.h{head}``; ``mean_prob`` sums to 1 within each group. So does Grouped
Query Experts (``kind="gqe"``, arXiv 2606.20945), a group per K/V head, its query-head experts labelled
``g{group}.E{e}``: its gate weights are the weighted slot's ``w`` (eq. 6: ``p`` normalised over all ``k G``
selected heads; ``p`` with ``weighted_slot_renormalize=False``), so a group's ``gate_fraction`` is its part of
the weighted slot and ``gate_share`` each expert's within it.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from torch import nn

from . import plotting
from ..routing.stats import load_summary
from .counts import LayerCounts, RoutingStats, collect_routing
from .data import write_json
from .layers import RoutedLayer, routed_layers


@dataclass
class LayerLoad:
    """The load of one routed layer (see the module docstring for the definitions)."""

    name: str
    kind: str
    role: str
    num_experts: int
    top_k: int
    num_shared_heads: int
    labels: list[str]
    num_tokens: int
    counts: list[int]
    share: list[float]
    token_fraction: list[float]
    gate_share: list[float]
    mean_prob: list[float]
    max_share: float
    min_share: float
    cv: float
    norm_entropy: float
    num_groups: int = 1
    group_kind: str = ""
    groups: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_counts(cls, layer: RoutedLayer, counts: LayerCounts) -> LayerLoad:
        c = counts.counts.double()
        total, tokens = float(c.sum()), counts.num_tokens
        gates = float(counts.gate_sum.sum())
        summary = load_summary(counts.counts)
        groups = []
        for g, (label, c_g, w_g) in enumerate(zip(layer.group_labels, counts.counts.view(layer.num_groups, -1),
                                                  counts.gate_sum.view(layer.num_groups, -1))):
            total_g, gates_g = float(c_g.sum()), float(w_g.sum())
            groups.append({"group": g, "label": label,
                           "share": (c_g.double() / total_g).tolist() if total_g else [0.0] * len(c_g),
                           "gate_share": (w_g / gates_g).tolist() if gates_g else [0.0] * len(w_g),
                           "gate_fraction": gates_g / gates if gates else 0.0,
                           **load_summary(c_g)})
        return cls(
            name=layer.name, kind=layer.kind, role=layer.role, num_experts=layer.num_experts,
            top_k=(counts.top_k or layer.slots_per_token) // layer.num_groups, num_shared_heads=layer.num_shared_heads,
            labels=layer.expert_labels, num_groups=layer.num_groups, group_kind=layer.group_kind, groups=groups,
            num_tokens=tokens, counts=[int(x) for x in counts.counts],
            share=(c / total).tolist() if total else [0.0] * layer.num_experts,
            token_fraction=(c / tokens).tolist() if tokens else [0.0] * layer.num_experts,
            gate_share=(counts.gate_sum / gates).tolist() if gates else [0.0] * layer.num_experts,
            mean_prob=(counts.prob_sum / tokens).tolist() if tokens else [0.0] * layer.num_experts,
            **summary)

    @property
    def max_min_ratio(self) -> float:
        """``max_share / min_share`` (``inf`` when an expert got nothing)."""
        return self.max_share / self.min_share if self.min_share > 0 else math.inf


@dataclass
class LoadReport:
    """Expert load of every routed layer of a model on a dataset (MoA paper Figure 3, Appendix A).

    ``to_json()`` / ``to_markdown()`` / ``plot(path)`` (all layers' bar charts in one figure),
    ``plot_layers(folder)`` (one PNG per layer) and ``plot_summary(path)`` (max/min share, CV and
    entropy per layer); ``figure()``, ``layer_figure(i)`` and ``summary_figure()`` return the same
    figures as ``matplotlib.figure.Figure`` objects (for a notebook), without writing files."""

    layers: list[LayerLoad]
    num_batches: int = 0
    source: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: int | str) -> LayerLoad:
        if isinstance(key, str):
            for layer in self.layers:
                if layer.name == key:
                    return layer
            raise KeyError(key)
        return self.layers[key]

    @classmethod
    def from_stats(cls, stats: RoutingStats, source: str | None = None) -> LoadReport:
        return cls([LayerLoad.from_counts(l, stats.counts[l.name]) for l in stats.layers], stats.num_batches, source)

    def to_dict(self) -> dict[str, Any]:
        return {"analysis": "expert_load", "source": self.source, "num_batches": self.num_batches, **self.meta,
                "layers": [asdict(l) for l in self.layers]}

    def to_json(self, path: str | os.PathLike | None = None, indent: int = 2) -> str:
        """The report as JSON (written to ``path`` when given)."""
        return write_json(self.to_dict(), path, indent)

    def to_markdown(self, shares: bool = True) -> str:
        """A summary table (one row per layer) and, with ``shares``, each layer's shares in percent."""
        lines = ["| # | layer | kind | E | k | tokens | max share | min share | max/min | CV | entropy/log E |",
                 "|---|---|---|---|---|---|---|---|---|---|---|"]
        for i, l in enumerate(self.layers):
            lines.append(f"| {i} | {l.name} | {l.kind} | {l.num_experts} | {l.top_k} | {l.num_tokens} | "
                         f"{100 * l.max_share:.2f}% | {100 * l.min_share:.2f}% | {l.max_min_ratio:.2f} | "
                         f"{l.cv:.3f} | {l.norm_entropy:.3f} |")
        if shares:  # a table per run of layers with the same experts: its headers are their labels
            for labels, layers in _same_labels(self.layers):
                lines += ["", "| layer | uniform | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
                lines += [f"| {l.name} | {100 / l.num_experts:.1f}% | " + " | ".join(f"{100 * s:.1f}%" for s in l.share)
                          + " |" for l in layers]
        grouped = [l for l in self.layers if l.groups]
        if grouped:
            kinds = " / ".join(dict.fromkeys(l.group_kind for l in grouped))
            lines += ["", f"Per {kinds} (shares of the group's own slots):", "",
                      "| layer | group | experts | max share | min share | CV | entropy/log E | share of gates |",
                      "|---|---|---|---|---|---|---|---|"]
            for l in grouped:
                for g in l.groups:
                    lines.append(f"| {l.name} | {g['label']} | {len(g['share'])} | {100 * g['max_share']:.2f}% | "
                                 f"{100 * g['min_share']:.2f}% | {g['cv']:.3f} | {g['norm_entropy']:.3f} | "
                                 f"{100 * g['gate_fraction']:.1f}% |")
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------------------------- plots
    def _bars(self, ax, layer: LayerLoad, compact: bool = False) -> None:
        x = range(layer.num_experts)
        shares = [100 * s for s in layer.share]
        colors = ["tab:blue"] * layer.num_experts
        if shares and max(shares) > min(shares):
            colors[shares.index(min(shares))] = "tab:orange"
            colors[shares.index(max(shares))] = "tab:red"
        ax.bar(x, shares, color=colors)
        ax.axhline(100 / layer.num_experts, color="k", lw=0.8, ls="--", label="uniform")
        size = layer.num_experts // layer.num_groups
        for g in layer.groups:  # routing groups marked: a dotted line between groups, the label above each
            if g["group"]:
                ax.axvline(g["group"] * size - 0.5, color="grey", lw=0.8, ls=":")
            ax.text((g["group"] + 0.5) * size - 0.5, 0.98, g["label"], transform=ax.get_xaxis_transform(),
                    ha="center", va="top", fontsize=7)
        ax.set_xticks(list(x))
        ax.set_xticklabels(layer.labels if layer.num_experts <= 16 else [str(i) for i in x],
                           fontsize=7, rotation=0 if layer.num_experts <= 16 else 90)
        ax.set_ylabel("% of routing slots", fontsize=8)
        ax.set_xlabel("routed head" if layer.kind == "moh" else "expert", fontsize=8)
        ax.set_title(f"{layer.name}\nmax {100 * layer.max_share:.1f}%  min {100 * layer.min_share:.1f}%  "
                     f"CV {layer.cv:.2f}  H/logE {layer.norm_entropy:.2f}", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)

    def figure(self) -> Any:
        """One ``matplotlib.figure.Figure`` with a bar chart per layer: each expert's share of the routing
        slots in % (red: most used, orange: least used, dashed: the uniform share 1/E)."""
        rows, cols = plotting.grid(len(self.layers))
        fig, axes = plotting.new_figure(rows, cols, figsize=(4.2 * cols, 3.0 * rows))
        for ax, layer in zip(axes.flat, self.layers):
            self._bars(ax, layer)
        for ax in list(axes.flat)[len(self.layers):]:
            ax.axis("off")
        source = "/".join(Path(self.source).parts[-3:]) if self.source else None
        fig.suptitle(f"Expert load per layer{' on ' + source if source else ''} (dashed: uniform)", fontsize=10)
        fig.tight_layout()
        return fig

    def plot(self, path: str | os.PathLike) -> Path:
        """:meth:`figure` written as a PNG to ``path``."""
        return plotting.save(self.figure(), path)

    def layer_figure(self, index: int) -> Any:
        """The bar chart of layer ``index`` alone (a ``matplotlib.figure.Figure``)."""
        layer = self.layers[index]
        fig, ax = plotting.new_figure(figsize=(max(4.5, 0.3 * layer.num_experts + 2), 3.2), squeeze=True)
        self._bars(ax, layer)
        fig.tight_layout()
        return fig

    def plot_layers(self, folder: str | os.PathLike) -> list[Path]:
        """One bar-chart PNG per layer (:meth:`layer_figure`), ``folder/NN_<layer name>.png``."""
        return [plotting.save(self.layer_figure(i), Path(folder) / f"{i:02d}_{plotting.safe_name(layer.name)}.png")
                for i, layer in enumerate(self.layers)]

    def summary_figure(self) -> Any:
        """Per layer: max and min share against the uniform share (in %); coefficient of variation;
        normalised entropy (the MoA paper's Appendix A reads the load through the max/min shares)."""
        names = [l.name for l in self.layers]
        x = list(range(len(names)))
        fig, axes = plotting.new_figure(1, 3, figsize=(max(10, 1.2 * len(names) + 6), 3.8), squeeze=True)
        ax = axes[0]
        ax.plot(x, [100 * l.max_share for l in self.layers], "o-", color="tab:red", label="max share")
        ax.plot(x, [100 * l.min_share for l in self.layers], "o-", color="tab:orange", label="min share")
        ax.plot(x, [100 / l.num_experts for l in self.layers], "k--", lw=0.8, label="uniform 1/E")
        ax.set_ylabel("% of routing slots")
        ax.set_ylim(bottom=0)
        ax.set_title("most and least used expert")
        ax.legend(fontsize=7)
        axes[1].bar(x, [l.cv for l in self.layers], color="tab:purple")
        axes[1].set_title("coefficient of variation (0 = even)")
        axes[2].bar(x, [l.norm_entropy for l in self.layers], color="tab:green")
        axes[2].axhline(1.0, color="k", lw=0.8, ls="--")
        axes[2].set_ylim(0, 1.05)
        axes[2].set_title("entropy / log E (1 = even)")
        for a in axes:
            a.set_xticks(x)
            a.set_xticklabels(names, rotation=45, ha="right", fontsize=7)
        fig.tight_layout()
        return fig

    def plot_summary(self, path: str | os.PathLike) -> Path:
        """:meth:`summary_figure` written as a PNG to ``path``."""
        return plotting.save(self.summary_figure(), path)


def _same_labels(layers: list[LayerLoad]) -> list[tuple[list[str], list[LayerLoad]]]:
    """Consecutive layers grouped by their expert labels (most models: one group)."""
    runs: list[tuple[list[str], list[LayerLoad]]] = []
    for layer in layers:
        if runs and runs[-1][0] == layer.labels:
            runs[-1][1].append(layer)
        else:
            runs.append((layer.labels, [layer]))
    return runs


def expert_load(model: nn.Module, batches: Iterable[Any], *, layers: Iterable[str] | None = None,
                pad_id: int | None = None, source: str | None = None) -> LoadReport:
    """The expert load (MoA paper Figure 3, Appendix A) of every routed layer of ``model`` over
    ``batches``, streamed: only per-layer ``(E,)`` counts are kept between batches.

    ``batches``: an iterable of dicts (a headmix loader's batches, or ``{"src", "tgt_in"}`` /
    ``{"input_ids"}``), ``(src, tgt_in)`` pairs or ``input_ids`` tensors. ``layers``: restrict to these
    layer names. A model without a routed (MoA/MoH) layer is a ``ValueError``."""
    stats = collect_routing(model, batches, layers=layers, pad_id=pad_id)
    return LoadReport.from_stats(stats, source)


__all__ = ["LayerLoad", "LoadReport", "expert_load", "routed_layers"]
