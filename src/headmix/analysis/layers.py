"""Finding the routed layers of a model, choosing one, and knowing which tokens its queries are.

A *routed layer* is an attention layer that returns a :class:`~headmix.routing.Routing`: a
:class:`~headmix.attention.MixtureOfAttentionHeads` (MoA, Zhang et al. 2022; its "experts" are the
attention experts of eq. 10-12) or a :class:`~headmix.attention.MixtureOfHeadsAttention` with routed
heads (MoH; its "experts" are the routed heads, counted from 0 after the ``num_shared_heads`` shared
heads). The layer names are the module names, which are also the names under which the models report
their routing (``ModelOutput.routing``), e.g. ``encoder.layers.0.self_attn``,
``decoder.layers.3.cross_attn``.

A :class:`~headmix.attention.SwitchHeadAttention` routes on two sides, so it is two routed layers,
``<module>:value`` (the value-side selection over the key/value tokens; absent with one expert per head)
and ``<module>:output`` (the output-side selection over the query tokens), each over the
``num_heads * num_experts`` experts ``h * E + e`` with ``top_k`` slots per head.

*Routing groups*: a layer whose experts fall into ``G`` equal groups, each token choosing ``top_k`` in
every group, is described by ``num_groups = G`` and ``group_kind``: SwitchHead (a group per head, ``"head"``),
MoH routed per K/V group (``route_per_group=True``: a group per K/V head, ``"K/V group"``; its routed heads are
numbered group by group, as ``routing.expert_index`` numbers them) and Grouped Query Experts
(:class:`~headmix.attention.GroupedQueryExpertsAttention`, ``kind="gqe"``, arXiv 2606.20945: a softmax router per
K/V group over that group's ``M`` query-head experts, the top ``k`` kept; a ``"K/V group"`` per K/V head, its
experts ``g M + e`` labelled ``g{g}.E{e}``, its gate weights the weighted slot's ``w``).
The load, head-utility (MoH only) and PMI reports then give each group's own shares beside the layer's
(:attr:`RoutedLayer.group_of`); another kind with groups of experts needs only its ``RoutedLayer`` here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from torch import Tensor, nn

from ..attention import (AttentionLayer, GroupedQueryExpertsAttention, MixtureOfAttentionHeads, MixtureOfHeadsAttention,
                         SwitchHeadAttention)
from ..attention.moh import head_ids
from ..attention.switchhead import SwitchHeadRouting
from ..routing import Routing

KIND_NAMES = {"moa": "MoA", "moh": "MoH", "switchhead": "SwitchHead", "gqe": "GQE"}
#: The two routed sides of a SwitchHead layer, as name suffixes.
SWITCHHEAD_SIDES = (":value", ":output")


@dataclass(frozen=True)
class RoutedLayer:
    """One routed layer: ``index`` in the model's routed-layer order, module ``name``, ``kind``
    (``"moa"``, ``"moh"``, ``"switchhead"`` or ``"gqe"``), ``num_experts`` (MoA experts ``E``, MoH routed heads
    ``R``, GQE's query-head experts ``G M``), ``top_k``
    (per group) and, for MoH, ``num_shared_heads`` (per group: each group's shared heads come first, so
    without groups routed head ``i`` is head ``num_shared_heads + i`` of the layer).

    ``num_groups`` ``G`` and ``group_kind``: the experts fall into ``G`` equal consecutive groups and a token
    fills ``top_k`` slots in each (module docstring): SwitchHead (``kind="switchhead"``, one routed layer
    per side; ``num_experts`` is ``num_heads * E``, a group per head), MoH routed per K/V group and GQE
    (``kind="gqe"``, ``num_experts`` all ``G M`` query-head experts; both a group per K/V head). ``G = 1`` for
    every other layer."""

    index: int
    name: str
    kind: str
    num_experts: int
    top_k: int
    num_shared_heads: int = 0
    module: nn.Module | None = field(default=None, repr=False, compare=False)
    num_groups: int = 1
    group_kind: str = ""

    def __post_init__(self) -> None:
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(f"{self.name}: num_groups ({self.num_groups}) must divide num_experts ({self.num_experts})")

    @property
    def slots_per_token(self) -> int:
        """Routing slots one token fills: ``top_k`` in each of the ``num_groups`` groups."""
        return self.num_groups * self.top_k

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.num_groups

    def group_of(self, expert: int) -> int:
        """The routing group of expert ``expert`` (0 without groups)."""
        return expert // self.experts_per_group

    @property
    def group_labels(self) -> list[str]:
        """``h0 ..`` for SwitchHead's heads, ``g0 ..`` for K/V groups; ``[]`` without groups."""
        if self.num_groups == 1:
            return []
        return [("h" if self.group_kind == "head" else "g") + str(g) for g in range(self.num_groups)]

    @property
    def shared_head_ids(self) -> list[int]:
        """MoH: the layer's indices of the shared heads (each group's first ``num_shared_heads`` heads)."""
        return head_ids(self.num_groups, self.num_shared_heads + self.experts_per_group, self.num_shared_heads)[0]

    @property
    def routed_head_ids(self) -> list[int]:
        """MoH: the layer's index of each routed head, in routing order (group by group)."""
        return head_ids(self.num_groups, self.num_shared_heads + self.experts_per_group, self.num_shared_heads)[1]

    @property
    def role(self) -> str:
        """``"encoder self-attention"``, ``"decoder self-attention"`` or ``"cross-attention"``."""
        return layer_role(self.name)

    @property
    def expert_labels(self) -> list[str]:
        """Axis labels: ``E0 .. E{E-1}`` for MoA experts; for MoH the routed heads' indices in the
        layer (``h1 .. h3`` with one shared head), with their K/V group in front when routed per group
        (``g1.h5``); for SwitchHead the head and its expert (``h0.E2``); for GQE the K/V group and its expert
        (``g1.E0``: expert ``M + 0``)."""
        groups = self.group_labels
        if self.kind == "moh":
            heads = [f"h{h}" for h in self.routed_head_ids]
            return [f"{groups[self.group_of(i)]}.{h}" for i, h in enumerate(heads)] if groups else heads
        if groups:
            e = self.experts_per_group
            return [f"{groups[i // e]}.E{i % e}" for i in range(self.num_experts)]
        return [f"E{i}" for i in range(self.num_experts)]

    def describe(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "kind": self.kind, "role": self.role,
                "num_experts": self.num_experts, "top_k": self.top_k, "num_shared_heads": self.num_shared_heads,
                "num_groups": self.num_groups, "group_kind": self.group_kind}


def layer_role(name: str) -> str:
    """The role of an attention layer from its module name: ``"encoder self-attention"``,
    ``"decoder self-attention"`` or ``"cross-attention"`` (a SwitchHead side's suffix ``:value`` /
    ``:output`` is ignored)."""
    name = name.split(":")[0]
    if name.endswith("cross_attn"):
        return "cross-attention"
    return ("encoder" if name.startswith("encoder.") else "decoder") + " self-attention"


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DDP / FSDP wrappers


def attention_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every headmix attention layer of ``model`` as ``(name, module)``, in module order."""
    return [(n, m) for n, m in _unwrap(model).named_modules() if isinstance(m, AttentionLayer)]


def describe_attention(model: nn.Module) -> str:
    """``"encoder.layers.0.self_attn (MultiHeadAttention), ..."``: what a model has, for error messages."""
    layers = attention_layers(model)
    if not layers:
        return "no headmix attention layer"
    return ", ".join(f"{n} ({type(m).__name__})" for n, m in layers)


def routed_layers(model: nn.Module) -> list[RoutedLayer]:
    """The model's routed layers (MoA, MoH with routed heads, SwitchHead's sides, GQE), in the order the model reports
    their routing (encoder layers, then each decoder layer's self- then cross-attention)."""
    out: list[RoutedLayer] = []
    for name, m in _unwrap(model).named_modules():
        if isinstance(m, MixtureOfAttentionHeads):
            out.append(RoutedLayer(len(out), name, "moa", m.num_experts, m.top_k, 0, m))
        elif isinstance(m, MixtureOfHeadsAttention) and m.num_routed_heads > 0:
            out.append(RoutedLayer(len(out), name, "moh", m.num_routed_heads, m.top_k, m.num_shared_heads, m,
                                   m.route_groups, "K/V group" if m.route_per_group else ""))
        elif isinstance(m, GroupedQueryExpertsAttention):  # a softmax router per K/V group over its M experts
            out.append(RoutedLayer(len(out), name, "gqe", m.num_experts, m.top_k, 0, m, m.kv_heads, "K/V group"))
        elif isinstance(m, SwitchHeadAttention):
            for side in SWITCHHEAD_SIDES if m.num_experts > 1 else SWITCHHEAD_SIDES[1:]:
                out.append(RoutedLayer(len(out), name + side, "switchhead", m.num_heads * m.num_experts, m.top_k,
                                       0, m, m.num_heads, "head"))
    return out


def layer_routings(name: str, routing: Routing | SwitchHeadRouting) -> list[tuple[str, Routing]]:
    """``(routed layer name, Routing)`` pairs of one layer's reported routing: itself, or a SwitchHead
    layer's two sides as ``name:value`` (when it selected values in this call) and ``name:output``."""
    if isinstance(routing, SwitchHeadRouting):
        sides = [(name + ":value", routing.value), (name + ":output", routing.output)]
        return [(n, r) for n, r in sides if r is not None]
    return [(name, routing)]


def describe_routed(layers: list[RoutedLayer]) -> str:
    """``"6 routed MoA layers: [0] encoder.layers.0.self_attn, ..."``."""
    kinds = sorted({KIND_NAMES[l.kind] for l in layers})
    noun = "layer" if len(layers) == 1 else "layers"
    return f"{len(layers)} routed {'/'.join(kinds)} {noun}: " + ", ".join(f"[{l.index}] {l.name}" for l in layers)


def require_routed(model: nn.Module, what: str = "this analysis") -> list[RoutedLayer]:
    """The routed layers, or a ``ValueError`` naming the attention layers the model has instead."""
    layers = routed_layers(model)
    if not layers:
        raise ValueError(f"{what} needs a routed attention layer (MoA, SwitchHead, GQE, or MoH with routed heads), "
                         f"but this model has none; its attention layers are: {describe_attention(model)}")
    return layers


def default_layer(layers: list[RoutedLayer]) -> RoutedLayer:
    """The first routed encoder self-attention layer (the MoA paper's choice for Table 4), or the first
    routed layer when the encoder has none (causal LMs)."""
    for layer in layers:
        if layer.role == "encoder self-attention":
            return layer
    return layers[0]


def select_layer(model: nn.Module, layer: int | str | None) -> RoutedLayer:
    """The routed layer ``layer``: an index into :func:`routed_layers` (``0`` = the first), a module
    name (``"decoder.layers.1.cross_attn"``), or ``None`` for :func:`default_layer`. An index out of
    range or an unknown name is a ``ValueError`` that lists the routed layers."""
    layers = require_routed(model)
    if layer is None:
        return default_layer(layers)
    if isinstance(layer, str) and not layer.lstrip("-").isdigit():
        for l in layers:
            if l.name == layer:
                return l
        raise ValueError(f"no routed layer named {layer!r}: this model has {describe_routed(layers)}")
    if isinstance(layer, bool) or not isinstance(layer, (int, str)):
        raise ValueError(f"layer must be an index or a layer name, got {layer!r}")
    index = int(layer)
    if not 0 <= index < len(layers):
        raise ValueError(f"layer {index} is out of range: this model has {describe_routed(layers)}")
    return layers[index]


def layer_token_ids(name: str, inputs: Mapping[str, Tensor]) -> Tensor:
    """The token ids of a layer's queries, ``(B, T)``: the encoder's input (``src``) for encoder layers,
    the decoder's input (``tgt_in``) for decoder self- and cross-attention, ``input_ids`` for the
    language models. A SwitchHead cross-attention's value side selects over the memory: ``src``."""
    if "src" in inputs:
        if name.endswith(":value") and name.split(":")[0].endswith("cross_attn"):
            return inputs["src"]
        return inputs["src"] if name.startswith("encoder.") else inputs["tgt_in"]
    return inputs["input_ids"]
