"""Streaming count accumulators: one pass over a dataset, nothing per token kept.

Every analysis reduces the routing decisions of a batch to counts and sums at once and drops the
batch: per routed layer, the slots each expert received (``(E,)``), the summed gate weights and router
probabilities, the number of real tokens and, for the PMI analysis, the token x expert co-occurrence
matrix ``(vocab, E)`` (int64; 8k x 32 is 2 MiB). Memory does not grow with the dataset, and counting
batch by batch gives exactly the counts of one big batch.

A *slot* is one (token occurrence, selected expert) pair: a token routed to ``k`` experts fills ``k``
slots. Padding never counts: a token is real when the routing's ``token_mask`` says so and (when the
token ids are known) its id is not the pad id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.moa import real_token_mask
from ..models import CausalLanguageModel, EncoderDecoderModel, MaskedLanguageModel
from ..routing import Routing
from ..routing.router import router_dtype
from .layers import RoutedLayer, _unwrap, layer_routings, layer_token_ids, require_routed

TRANSLATION_INPUTS = ("src", "tgt_in")
LM_INPUTS = ("input_ids",)


@dataclass
class LayerCounts:
    """Counts of one routed layer, accumulated with :meth:`add` over any number of routings.

    ``counts[e]``: slots routed to expert ``e``; ``gate_sum[e]``: the summed gate weights ``w`` (eq. 9)
    of those slots; ``prob_sum[e]``: the summed router probabilities ``p_e`` (eq. 7) over real tokens;
    ``num_tokens``: real tokens. With ``vocab_size`` set, ``cooc[v, e]`` counts the slots of token id
    ``v`` routed to expert ``e`` and ``token_counts[v]`` the occurrences of ``v``.
    """

    name: str
    num_experts: int
    vocab_size: int | None = None
    top_k: int | None = None
    num_tokens: int = 0
    counts: Tensor = field(init=False)
    gate_sum: Tensor = field(init=False)
    prob_sum: Tensor = field(init=False)
    cooc: Tensor | None = field(init=False, default=None)
    token_counts: Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be positive, got {self.num_experts}")
        self.counts = torch.zeros(self.num_experts, dtype=torch.long)
        self.gate_sum = torch.zeros(self.num_experts, dtype=torch.float64)
        self.prob_sum = torch.zeros(self.num_experts, dtype=torch.float64)
        if self.vocab_size is not None:
            self.cooc = torch.zeros(self.vocab_size, self.num_experts, dtype=torch.long)
            self.token_counts = torch.zeros(self.vocab_size, dtype=torch.long)

    @property
    def num_slots(self) -> int:
        return int(self.counts.sum())

    def add(self, routing: Routing, token_ids: Tensor | None = None, pad_id: int | None = None) -> None:
        """Add one layer call's routing. ``token_ids`` ``(B, T)`` (or ``(N,)``) are the ids of the
        layer's query tokens, needed for the co-occurrence counts; positions holding ``pad_id`` are
        skipped like those the routing's ``token_mask`` marks as padding."""
        if routing.num_experts != self.num_experts:
            raise ValueError(f"{self.name}: routing over {routing.num_experts} experts, expected {self.num_experts}")
        index = routing.expert_index.detach().cpu()
        n, k = index.shape
        if self.top_k is None:
            self.top_k = k
        elif k != self.top_k:
            raise ValueError(f"{self.name}: routing selects {k} experts per token, earlier calls {self.top_k}")
        keep = torch.ones(n, dtype=torch.bool) if routing.token_mask is None else routing.token_mask.detach().cpu().reshape(n).bool()
        ids = None
        if token_ids is not None:
            ids = token_ids.detach().cpu().reshape(-1).long()
            if ids.numel() != n:
                raise ValueError(f"{self.name}: {ids.numel()} token ids for a routing of {n} tokens "
                                 f"(batch shape {tuple(routing.batch_shape)})")
            if pad_id is not None:
                keep = keep & ids.ne(pad_id)
        elif self.cooc is not None:
            raise ValueError(f"{self.name}: token_ids are needed to count token x expert co-occurrences")
        index = index[keep]
        flat = index.reshape(-1)
        self.counts += torch.bincount(flat, minlength=self.num_experts)
        self.gate_sum.index_add_(0, flat, routing.gates.detach().cpu()[keep].reshape(-1).double())
        self.prob_sum += routing.probs.detach().cpu()[keep].double().sum(0)
        self.num_tokens += int(keep.sum())
        if self.cooc is not None:
            ids = ids[keep]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
                raise ValueError(f"{self.name}: token id {int(ids.max())} outside the vocabulary of {self.vocab_size}")
            pairs = (ids[:, None] * self.num_experts + index).reshape(-1)
            self.cooc += torch.bincount(pairs, minlength=self.vocab_size * self.num_experts).view(
                self.vocab_size, self.num_experts)
            self.token_counts += torch.bincount(ids, minlength=self.vocab_size)

    def merge(self, other: LayerCounts) -> None:
        """Add another accumulator of the same layer (e.g. from another process)."""
        if other.num_experts != self.num_experts or (other.cooc is None) != (self.cooc is None):
            raise ValueError(f"cannot merge counts of {other.name} into {self.name}: different shapes")
        self.counts += other.counts
        self.gate_sum += other.gate_sum
        self.prob_sum += other.prob_sum
        self.num_tokens += other.num_tokens
        if self.cooc is not None:
            self.cooc += other.cooc
            self.token_counts += other.token_counts
        self.top_k = self.top_k or other.top_k


@dataclass
class HeadCounts:
    """Per-head weight sums of one MoH layer (MoH's ``g_i``, shared and routed heads together, in the
    layer's head order), accumulated over real tokens.

    ``shared_heads`` / ``routed_heads``: the layer's indices of the shared heads and of the routed heads in
    routing order (:attr:`~headmix.analysis.layers.RoutedLayer.routed_head_ids`; with ``num_groups`` K/V
    groups, each group's shared heads then its routed heads). ``weight_sum[h]``: summed ``g_h``;
    ``active[h]``: tokens on which head ``h`` is active (shared heads: every token; routed heads: the tokens
    that selected them); ``group_sum[g]``: summed group weights ``[a_s, a_r] / 2`` of routing group ``g``
    (MoH's first routing stage, a softmax over the two groups; ``[0, 1]`` without shared heads)."""

    name: str
    num_heads: int
    shared_heads: list[int]
    routed_heads: list[int]
    num_groups: int = 1
    num_tokens: int = 0
    weight_sum: Tensor = field(init=False)
    active: Tensor = field(init=False)
    group_sum: Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.weight_sum = torch.zeros(self.num_heads, dtype=torch.float64)
        self.active = torch.zeros(self.num_heads, dtype=torch.long)
        self.group_sum = torch.zeros(self.num_groups, 2, dtype=torch.float64)

    def add(self, g: Tensor, routing: Routing, groups: Tensor | None) -> None:
        """``g`` ``(B, T, H)`` head weights, ``routing`` of the routed heads, ``groups`` ``(N, G, 2)`` the
        group softmax of each routing group (or None without shared heads)."""
        n = routing.expert_index.shape[0]
        keep = torch.ones(n, dtype=torch.bool) if routing.token_mask is None else routing.token_mask.detach().cpu().reshape(n).bool()
        g = g.detach().cpu().reshape(n, self.num_heads)[keep].double()
        self.weight_sum += g.sum(0)
        real = int(keep.sum())
        self.active[self.shared_heads] += real
        self.active[self.routed_heads] += torch.bincount(routing.expert_index.detach().cpu()[keep].reshape(-1),
                                                         minlength=len(self.routed_heads))
        if groups is None:
            self.group_sum[:, 1] += real
        else:
            self.group_sum += groups.detach().cpu()[keep].double().sum(0)
        self.num_tokens += real


@dataclass
class RoutingStats:
    """What :func:`collect_routing` gathered: ``layers`` (the routed layers), ``counts`` per layer name,
    ``heads`` per MoH layer name (when asked for), and the number of batches and real tokens seen."""

    layers: list[RoutedLayer]
    counts: dict[str, LayerCounts]
    heads: dict[str, HeadCounts] = field(default_factory=dict)
    num_batches: int = 0


def as_model_inputs(model: nn.Module, batch: Any) -> dict[str, Tensor]:
    """The forward keyword arguments of one batch, without targets.

    ``batch`` may be a dict (a headmix loader's batch, or model keyword arguments: ``src``/``tgt_in`` for
    translation, ``input_ids`` for the language models; other keys are ignored), a ``(src, tgt_in)``
    pair for translation, or an ``input_ids`` tensor ``(B, T)`` for the language models."""
    inner = _unwrap(model)
    task = getattr(getattr(inner, "config", None), "task", None)
    names = TRANSLATION_INPUTS if isinstance(inner, EncoderDecoderModel) else LM_INPUTS
    if isinstance(batch, Tensor):
        batch = {names[0]: batch} if len(names) == 1 else None
    elif isinstance(batch, (tuple, list)) and len(batch) == len(names) and all(isinstance(t, Tensor) for t in batch):
        batch = dict(zip(names, batch))
    if not isinstance(batch, Mapping) or any(n not in batch for n in names):
        got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(f"a {task or 'headmix'} model's batch needs {list(names)}, got {got}")
    return {n: batch[n] for n in names}


def model_routing(model: nn.Module, inputs: dict[str, Tensor]) -> list[tuple[str, Routing]]:
    """The ``(layer name, Routing)`` list of one forward pass (a SwitchHead layer gives its two sides,
    see :func:`~headmix.analysis.layers.layer_routings`). For the headmix models only the encoder
    and decoder stacks run: the routing does not depend on the output projection, the largest matmul
    of a small model (``d_model x vocab`` per token), so it is skipped."""
    return [pair for name, routing in _model_routing(model, inputs) for pair in layer_routings(name, routing)]


def _model_routing(model: nn.Module, inputs: dict[str, Tensor]) -> list[tuple[str, Any]]:
    inner = _unwrap(model)
    if isinstance(inner, EncoderDecoderModel):
        enc = inner.encode(inputs["src"])
        return enc.routing + inner.decode(inputs["tgt_in"], enc).routing
    if isinstance(inner, MaskedLanguageModel):
        return inner.encoder(inputs["input_ids"]).routing
    if isinstance(inner, CausalLanguageModel):
        return inner.decoder(inputs["input_ids"]).routing
    return model(**inputs).routing


def _moh_hook(head_counts: HeadCounts):
    def hook(module, args, kwargs, output) -> None:
        query = args[0] if args else kwargs["query"]
        key = args[1] if len(args) > 1 else kwargs.get("key")
        mask = real_token_mask(query, key, kwargs.get("key_padding_mask"), kwargs.get("query_padding_mask"),
                               kwargs.get("cache"))
        g, routing = module.head_weights(query, mask)
        groups = None
        if module.group_gate is not None:  # [a_s, a_r] / 2 of each routing group: a softmax over each pair
            flat = query.reshape(-1, query.shape[-1]).to(router_dtype(query))  # the layer's router precision
            groups = F.linear(flat, module.group_gate.weight.to(flat.dtype)).view(flat.shape[0], -1, 2).softmax(-1)
        head_counts.add(g, routing, groups)
    return hook


@torch.no_grad()
def collect_routing(model: nn.Module, batches: Iterable[Any], *, layers: Iterable[str] | None = None,
                    cooccurrence: Iterable[str] = (), heads: bool = False, pad_id: int | None = None) -> RoutingStats:
    """Run ``model`` (in eval mode, without gradients) over ``batches`` and count its routing.

    ``layers``: names of the routed layers to count (default all); ``cooccurrence``: names of the layers
    whose token x expert matrix to keep; ``heads``: also gather MoH per-head weights through forward
    hooks. ``pad_id`` defaults to the model config's. Raises ``ValueError`` when the model has no routed
    layer. The model's train/eval mode is restored afterwards.
    """
    all_layers = require_routed(model)
    by_name = {l.name: l for l in all_layers}
    wanted = list(by_name) if layers is None else list(layers)
    cooc = set(cooccurrence)
    for name in wanted + sorted(cooc):
        if name not in by_name:
            raise ValueError(f"no routed layer named {name!r}; routed layers: {', '.join(by_name)}")
    config = getattr(_unwrap(model), "config", None)
    if pad_id is None:
        pad_id = getattr(config, "pad_id", None)
    vocab = getattr(config, "vocab_size", None)
    if cooc and vocab is None:
        raise ValueError("the model has no config.vocab_size: cannot size the token x expert counts")
    stats = RoutingStats([by_name[n] for n in wanted],
                         {n: LayerCounts(n, by_name[n].num_experts, vocab if n in cooc else None,
                                         by_name[n].slots_per_token)
                          for n in dict.fromkeys(wanted + sorted(cooc))})
    handles = []
    if heads:
        for l in all_layers:
            if l.kind == "moh" and l.name in stats.counts:
                stats.heads[l.name] = HeadCounts(l.name, l.module.num_heads, l.shared_head_ids, l.routed_head_ids,
                                                 l.num_groups)
                handles.append(l.module.register_forward_hook(_moh_hook(stats.heads[l.name]), with_kwargs=True))
    try:
        device = next(model.parameters()).device
    except StopIteration:  # pragma: no cover - a model without parameters
        device = torch.device("cpu")
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            inputs = {k: v.to(device) for k, v in as_model_inputs(model, batch).items()}
            for name, routing in model_routing(model, inputs):
                if name in stats.counts:
                    stats.counts[name].add(routing, layer_token_ids(name, inputs), pad_id)
            stats.num_batches += 1
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return stats
