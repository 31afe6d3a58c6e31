"""Head utilities: how MoH layers use their heads, and what Talking-Heads layers learned to mix.

MoH (Jin et al. 2024) weighs head ``i`` of a token by ``g_i``: shared heads always (``g_i = a_s S
softmax(x W_s)_i``), routed heads when the token's router selects them (``g_i = a_r R softmax(x W_r)_i``),
with the group weights ``[a_s, a_r] = 2 softmax(x W_h)`` balancing the two groups per token. Per MoH
layer, over the real tokens of a dataset, :func:`head_utilities` reports

- ``mean_weight[h]``: the mean ``g_h`` (0 on the tokens where a routed head is not selected);
- ``weight_share[h]``: head ``h``'s share of the summed head weights;
- ``active_fraction[h]``: the fraction of tokens on which head ``h`` is active (1 for shared heads);
- ``routed_share[i]``: routed head ``i``'s share of the routing slots (the expert load of the routed
  heads, see :mod:`headmix.analysis.load`);
- ``group_weights = [mean a_s / 2, mean a_r / 2]``: the mean group weights of MoH's first routing stage
  (they sum to 1; ``[0, 1]`` without shared heads), and ``shared_weight_fraction``: the shared heads'
  share of the summed head weights ``g``.

MoH routed per K/V group (``route_per_group=True``, Grouped Query Experts) is one MoH per K/V group (its own
shared heads, router and ``[a_s, a_r]``): ``groups`` then lists, per group, its heads, its mean group
weights, its shared heads' share of the group's ``g`` and its routed heads' shares of the group's slots;
the layer-wide ``group_weights`` are the mean over the groups. The figure marks the groups. Grouped Query
Experts (``kind="gqe"``) has no shared/routed head weights ``g`` to report: a model whose only routed layers are
GQE is refused with a pointer to the expert load (each expert's share and the weighted slot's ``w`` per K/V group,
:mod:`headmix.analysis.load`) and the token-expert PMI; in a model with both, only the MoH layers are reported.

Talking-Heads attention (Shazeer et al. 2020) mixes the heads' attention logits with a learned
``h x h`` matrix before the softmax, and the attention weights with another after it;
:func:`talking_heads_matrices` reads them (entry ``[i, j]``: how much head ``j`` feeds head ``i``;
both start as the identity) and measures how far training moved them from it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from ..attention import TalkingHeadsAttention
from . import plotting
from .counts import collect_routing
from .data import write_json
from .layers import attention_layers, describe_attention, layer_role, routed_layers


# ------------------------------------------------------------------------------------------- MoH
@dataclass
class MoHLayerHeads:
    """Head usage of one MoH layer (definitions in the module docstring)."""

    name: str
    role: str
    num_heads: int
    num_shared_heads: int
    top_k: int
    num_tokens: int
    head_labels: list[str]
    mean_weight: list[float]
    weight_share: list[float]
    active_fraction: list[float]
    routed_share: list[float]
    group_weights: list[float]
    shared_weight_fraction: float
    num_groups: int = 1
    groups: list[dict[str, Any]] = field(default_factory=list)

    @property
    def shared_heads(self) -> list[int]:
        """The layer's indices of the shared heads (marked ``*`` in ``head_labels``)."""
        return [h for h, label in enumerate(self.head_labels) if label.endswith("*")]


@dataclass
class HeadUtilityReport:
    """Head usage of every MoH layer with routed heads: ``to_json()``, ``to_markdown()``, ``plot(path)``."""

    layers: list[MoHLayerHeads]
    num_batches: int = 0
    source: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"analysis": "moh_head_utilities", "source": self.source, "num_batches": self.num_batches, **self.meta,
                "layers": [asdict(l) for l in self.layers]}

    def to_json(self, path: str | os.PathLike | None = None, indent: int = 2) -> str:
        return write_json(self.to_dict(), path, indent)

    def to_markdown(self) -> str:
        lines = ["| layer | heads (shared + routed) | top-k | tokens | group weights shared / routed | "
                 "shared share of g | routed-head shares |",
                 "|---|---|---|---|---|---|---|"]
        for l in self.layers:
            shared = len(l.shared_heads)
            routed_labels = [lab for lab in l.head_labels if not lab.endswith("*")]
            shares = ", ".join(f"{lab} {100 * s:.1f}%" for lab, s in zip(routed_labels, l.routed_share))
            heads = f"{shared} + {l.num_heads - shared}"
            if l.num_groups > 1:
                heads += f" in {l.num_groups} K/V groups"
            lines.append(f"| {l.name} | {heads} | {l.top_k} | "
                         f"{l.num_tokens} | {l.group_weights[0]:.3f} / {l.group_weights[1]:.3f} | "
                         f"{100 * l.shared_weight_fraction:.1f}% | {shares} |")
        grouped = [l for l in self.layers if l.groups]
        if grouped:
            lines += ["", "Per K/V group (each routes on its own; shares of the group's own g and slots):", "",
                      "| layer | group | heads | group weights shared / routed | shared share of g | "
                      "routed-head shares |", "|---|---|---|---|---|---|"]
            for l in grouped:
                for g in l.groups:
                    routed = [h for h in g["heads"] if h not in l.shared_heads]
                    shares = ", ".join(f"h{h} {100 * s:.1f}%" for h, s in zip(routed, g["routed_share"]))
                    lines.append(f"| {l.name} | {g['label']} | {', '.join(l.head_labels[h] for h in g['heads'])} | "
                                 f"{g['group_weights'][0]:.3f} / {g['group_weights'][1]:.3f} | "
                                 f"{100 * g['shared_weight_fraction']:.1f}% | {shares} |")
        lines += ["", "| layer | head | shared | active on | mean g | share of g |", "|---|---|---|---|---|---|"]
        for l in self.layers:
            shared = set(l.shared_heads)
            for h in range(l.num_heads):
                lines.append(f"| {l.name} | {h} | {'yes' if h in shared else 'no'} | "
                             f"{100 * l.active_fraction[h]:.1f}% | {l.mean_weight[h]:.3f} | {100 * l.weight_share[h]:.1f}% |")
        return "\n".join(lines) + "\n"

    def figure(self) -> Any:
        """A ``matplotlib.figure.Figure`` with one panel per MoH layer: the mean weight ``g`` of each
        head (bars; green: shared, blue: routed) with the % of tokens on which it is active (black dots,
        right axis)."""
        rows, cols = plotting.grid(len(self.layers))
        fig, axes = plotting.new_figure(rows, cols, figsize=(4.4 * cols, 3.2 * rows))
        for ax, l in zip(axes.flat, self.layers):
            x = list(range(l.num_heads))
            shared = set(l.shared_heads)
            colors = ["tab:green" if h in shared else "tab:blue" for h in x]
            ax.bar(x, l.mean_weight, color=colors)
            for g in l.groups:  # K/V groups marked: a dotted line between groups, the label above each
                first, last = g["heads"][0], g["heads"][-1]
                if first:
                    ax.axvline(first - 0.5, color="grey", lw=0.8, ls=":")
                ax.text((first + last) / 2, 0.98, g["label"], transform=ax.get_xaxis_transform(), ha="center",
                        va="top", fontsize=7)
            ax.set_xticks(x)
            ax.set_xticklabels(l.head_labels, fontsize=7, rotation=0 if l.num_heads <= 12 else 90)
            ax.set_ylabel("mean head weight g", fontsize=8)
            ax.set_title(f"{l.name}\ngroup weights shared {l.group_weights[0]:.2f} / routed {l.group_weights[1]:.2f}",
                         fontsize=8)
            twin = ax.twinx()
            twin.plot(x, [100 * a for a in l.active_fraction], "ko", ms=4)
            twin.set_ylim(0, 105)
            twin.set_ylabel("% of tokens active", fontsize=8)
            twin.tick_params(labelsize=7)
            ax.tick_params(labelsize=7)
        for ax in list(axes.flat)[len(self.layers):]:
            ax.axis("off")
        fig.suptitle("MoH head usage (green: shared heads, blue: routed heads; dots: % of tokens active)", fontsize=10)
        fig.tight_layout()
        return fig

    def plot(self, path: str | os.PathLike) -> Path:
        """:meth:`figure` written as a PNG to ``path``."""
        return plotting.save(self.figure(), path)


def moh_layers(model: nn.Module) -> list:
    """The routed layers of ``model`` that are MoH layers with routed heads."""
    return [l for l in routed_layers(model) if l.kind == "moh"]


def gqe_hint(model: nn.Module) -> str:
    """What to use instead of the head utilities for GQE layers (no shared heads, no head weights ``g``:
    ``" (GQE layers: ...)"``), or ``""`` when the model has none."""
    gqe = [l.name for l in routed_layers(model) if l.kind == "gqe"]
    if not gqe:
        return ""
    return (f" (Grouped Query Experts layers {', '.join(gqe)} have no MoH head weights: use `headmix analyze load` "
            "for each expert's share and the weighted slot's w per K/V group, `headmix analyze pmi` for its tokens)")


def head_utilities(model: nn.Module, batches: Iterable[Any], *, source: str | None = None) -> HeadUtilityReport:
    """How every MoH layer (with routed heads) uses its heads over ``batches`` (streamed; per-head sums
    only): mean weights, activation rates, routed-head shares and the shared/routed balance (the mean
    group weights). ``ValueError`` when the model has no such layer."""
    layers = moh_layers(model)
    if not layers:
        raise ValueError("head utilities need a MoH layer with routed heads, but this model has none; its attention "
                         f"layers are: {describe_attention(model)}{gqe_hint(model)}")
    stats = collect_routing(model, batches, layers=[l.name for l in layers], heads=True)
    out = []
    for l in layers:
        hc, lc = stats.heads[l.name], stats.counts[l.name]
        tokens = max(hc.num_tokens, 1)
        shared = set(hc.shared_heads)
        group_size = hc.num_heads // l.num_groups
        groups = []
        for g, label in enumerate(l.group_labels):  # each K/V group: one MoH of its own
            heads = list(range(g * group_size, (g + 1) * group_size))
            counts = lc.counts.view(l.num_groups, -1)[g]
            groups.append({"group": g, "label": label, "heads": heads,
                           "group_weights": (hc.group_sum[g] / tokens).tolist(),
                           "shared_weight_fraction": _fraction(hc.weight_sum[[h for h in heads if h in shared]],
                                                               hc.weight_sum[heads]),
                           "routed_share": _shares(counts)})
        out.append(MoHLayerHeads(
            name=l.name, role=l.role, num_heads=hc.num_heads, num_shared_heads=l.num_shared_heads, top_k=l.top_k,
            num_tokens=hc.num_tokens,
            head_labels=[f"h{h}" + ("*" if h in shared else "") for h in range(hc.num_heads)],
            mean_weight=(hc.weight_sum / tokens).tolist(),
            weight_share=_shares(hc.weight_sum),
            active_fraction=(hc.active.double() / tokens).tolist(),
            routed_share=_shares(lc.counts),
            group_weights=(hc.group_sum.mean(0) / tokens).tolist(),
            shared_weight_fraction=_fraction(hc.weight_sum[hc.shared_heads], hc.weight_sum),
            num_groups=l.num_groups, groups=groups))
    return HeadUtilityReport(out, stats.num_batches, source)


def _shares(values: torch.Tensor) -> list[float]:
    """``values / values.sum()`` as a list (zeros when the sum is 0)."""
    total = float(values.sum())
    return (values.double() / total).tolist() if total else [0.0] * len(values)


def _fraction(part: torch.Tensor, whole: torch.Tensor) -> float:
    """``part.sum() / whole.sum()`` (0 when the whole is 0)."""
    total = float(whole.sum())
    return float(part.sum()) / total if total else 0.0


# ------------------------------------------------------------------------------------ Talking heads
@dataclass
class MixingMatrix:
    """One learned ``h x h`` mixing matrix (``which``: ``"pre"`` softmax or ``"post"`` softmax).
    ``identity_distance`` = ``||M - I||_F``; ``off_diagonal_fraction`` = ``sum |off-diagonal| / sum |M|``
    (0 for the identity it starts from); ``diagonal_mean`` = mean of ``M[i, i]``."""

    which: str
    matrix: list[list[float]]
    identity_distance: float
    off_diagonal_fraction: float
    diagonal_mean: float

    @classmethod
    def from_tensor(cls, which: str, m: torch.Tensor) -> MixingMatrix:
        m = m.detach().double().cpu()
        eye = torch.eye(m.shape[0], dtype=m.dtype)
        absm = m.abs()
        total = float(absm.sum())
        off = float((absm * (1 - eye)).sum())
        return cls(which, m.tolist(), float((m - eye).norm()), off / total if total else 0.0, float(m.diagonal().mean()))


@dataclass
class TalkingHeadsLayer:
    name: str
    role: str
    num_heads: int
    pre: MixingMatrix | None
    post: MixingMatrix | None


@dataclass
class TalkingHeadsReport:
    """The mixing matrices of every Talking-Heads layer: ``to_json()``, ``to_markdown()``, ``plot(path)``."""

    layers: list[TalkingHeadsLayer]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"analysis": "talking_heads_matrices", **self.meta, "layers": [asdict(l) for l in self.layers]}

    def to_json(self, path: str | os.PathLike | None = None, indent: int = 2) -> str:
        return write_json(self.to_dict(), path, indent)

    def to_markdown(self) -> str:
        lines = ["| layer | heads | matrix | ‖M − I‖_F | off-diagonal mass | mean diagonal |", "|---|---|---|---|---|---|"]
        for l in self.layers:
            for m in (l.pre, l.post):
                if m is not None:
                    lines.append(f"| {l.name} | {l.num_heads} | {m.which}-softmax | {m.identity_distance:.4f} | "
                                 f"{100 * m.off_diagonal_fraction:.2f}% | {m.diagonal_mean:.4f} |")
        return "\n".join(lines) + "\n"

    def figure(self, deviation: bool = False) -> Any:
        """A ``matplotlib.figure.Figure`` with a heatmap per layer and matrix (rows: layers; columns:
        pre-softmax, post-softmax): entry ``[i, j]`` is how much head ``j`` feeds head ``i`` (red positive,
        blue negative, the colour scale symmetric around 0; values printed for up to 8 heads). With
        ``deviation`` the heatmaps show ``M - I``, what training changed (the identity is the
        initialisation)."""
        cols = [w for w in ("pre", "post") if any(getattr(l, w) is not None for l in self.layers)] or ["pre"]
        rows = len(self.layers)
        height = 3.2 * rows + 0.5
        fig, axes = plotting.new_figure(rows, len(cols), figsize=(3.6 * len(cols) + 0.8, height))
        for r, l in enumerate(self.layers):
            for c, which in enumerate(cols):
                ax = axes[r][c]
                m = getattr(l, which)
                if m is None:
                    ax.axis("off")
                    ax.set_title(f"{l.name}\n(no {which}-softmax mixing)", fontsize=8)
                    continue
                mat = torch.tensor(m.matrix)
                if deviation:
                    mat = mat - torch.eye(l.num_heads, dtype=mat.dtype)
                lim = float(mat.abs().max()) or 1.0
                im = ax.imshow(mat.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim)
                label = "M - I" if deviation else "M"
                ax.set_title(f"{l.name}\n{which}-softmax {label}, ||M-I|| = {m.identity_distance:.3g}", fontsize=8)
                ax.set_xlabel("from head j", fontsize=8)
                ax.set_ylabel("to head i", fontsize=8)
                ax.set_xticks(range(l.num_heads))
                ax.set_yticks(range(l.num_heads))
                ax.tick_params(labelsize=7)
                if l.num_heads <= 8:
                    fmt = "{:.1e}" if deviation and lim < 0.01 else "{:.2f}" if not deviation else "{:.3f}"
                    for i in range(l.num_heads):
                        for j in range(l.num_heads):
                            v = float(mat[i, j])
                            ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=6,
                                    color="white" if abs(v) > 0.6 * lim else "black")
                cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
                cb.ax.tick_params(labelsize=7)
        what = "learned change M - I" if deviation else "M (the identity at initialisation)"
        fig.suptitle(f"Talking-Heads mixing matrices: {what}", fontsize=10)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / height))
        return fig

    def plot(self, path: str | os.PathLike, deviation: bool = False) -> Path:
        """:meth:`figure` written as a PNG to ``path``."""
        return plotting.save(self.figure(deviation), path)


def talking_heads_matrices(model: nn.Module) -> TalkingHeadsReport:
    """The learned pre- and post-softmax mixing matrices of every Talking-Heads layer of ``model`` (no
    data needed). ``ValueError`` when the model has none, naming the attention layers it has."""
    layers = []
    for name, m in attention_layers(model):
        if isinstance(m, TalkingHeadsAttention):
            layers.append(TalkingHeadsLayer(
                name, layer_role(name), m.num_heads,
                None if m.pre_mix is None else MixingMatrix.from_tensor("pre", m.pre_mix),
                None if m.post_mix is None else MixingMatrix.from_tensor("post", m.post_mix)))
    if not layers:
        raise ValueError(f"this model has no Talking-Heads layer; its attention layers are: {describe_attention(model)}")
    return TalkingHeadsReport(layers)
