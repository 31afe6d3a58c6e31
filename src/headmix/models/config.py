"""Model configuration: plain dataclasses, composed (a model config holds one attention config per
attention role), validated on construction and round-tripped through JSON.

``AttentionConfig`` describes one attention layer kind and builds it; ``ModelConfig`` describes a whole
Transformer (translation encoder-decoder, masked LM encoder, or causal LM decoder).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from .. import attention
from ..kernels import IMPLS
from ..routing.losses import LOAD_BALANCE_FRACTIONS
from ..routing.task_gradient import (ALLOW_FLAG, check_router_learns, ffn_router_without_task_gradient,
                                     gqe_router_without_task_gradient, moa_router_without_task_gradient,
                                     moh_router_without_task_gradient)
from ..storage.files import atomic_write

ATTENTION_KINDS = ("mha", "moa", "moh", "talking_heads", "switchhead", "mosa", "gqe")
TASKS = ("translation", "mlm", "lm")
NORMS = ("pre", "post")
NORM_TYPES = ("layernorm", "rmsnorm")
POSITIONS = ("sinusoidal", "learned", "rotary")
ACTIVATIONS = ("relu", "gelu")
FFN_KINDS = ("mlp", "swiglu", "moe_swiglu")
#: How a causal LM's document starts (``ModelConfig.sequence_start``): ``"bos"``, each document is
#: ``bos text eos`` (Llama 3's pretraining, headmix's own tokenizer); ``"none"``, ``text eos`` (a tokenizer without
#: a bos, Qwen3's); ``"eos"``, the stream starts with eos and each document is followed by one (``eos text eos
#: text2 eos``: every causal-LM run trained before the option, which loads as it was trained).
SEQUENCE_STARTS = ("bos", "none", "eos")
#: The self-attention roles that get rotary position embeddings with ``positions="rotary"`` (cross-attention
#: compares positions of two different sequences: it stays without rotary).
ROTARY_ROLES = ("encoder_self_attention", "decoder_self_attention")
#: ``expert_impl`` choices: the kernels' (see :mod:`headmix.kernels`).
EXPERT_IMPLS = IMPLS

# Fields that only mean something for some kinds; they must be None (unset) for the others.
_KIND_FIELDS = {
    "num_experts": ("moa", "switchhead", "gqe"),
    "kv_heads": ("moa", "mha", "moh", "talking_heads", "gqe"),
    "top_k": ("moa", "moh", "switchhead", "gqe"),
    "num_shared_heads": ("moh",),
    "num_heads": ("mha", "moh", "talking_heads", "switchhead"),
    "key_dim": ("mha", "talking_heads"),
    "expert_dropout": ("switchhead",),
    "init_scale": ("switchhead",),
    "dropout_on": ("switchhead",),
    "q_bias": ("mha", "moh", "talking_heads", "gqe"),
    "kv_bias": ("mha", "moa", "moh", "talking_heads", "gqe"),
    "out_bias": ("mha", "moa", "moh", "talking_heads", "gqe"),
    "head_weighting": ("moh",),
    "moh_impl": ("moh",),
    "qk_norm": ("mha", "moh", "talking_heads"),
    "output_gate": ("mha", "moh", "talking_heads"),
    "route_per_group": ("moh",),
    "num_sparse_heads": ("mosa",),
    "num_dense_heads": ("mosa",),
    "sparsity": ("mosa",),
    "tokens_per_head": ("mosa",),
    "include_first": ("mosa",),
    "router": ("moa", "moh", "switchhead", "gqe"),
    "renormalize": ("moa",),
    "load_balance_weight": ("moa", "moh", "gqe"),
    "z_loss_weight": ("moa",),
    "pre_softmax": ("talking_heads",),
    "post_softmax": ("talking_heads",),
    "expert_impl": ("moa", "moh", "switchhead"),
    "load_balance_fractions": ("moa", "moh", "gqe"),
    "weighted_slot": ("gqe",),
    "weighted_slot_renormalize": ("gqe",),
    "shared_head": ("gqe",),
    "hard_slot_scale": ("gqe",),
    "shared_head_kv": ("gqe",),
    "router_init": ("gqe",),
    "weight_init": ("gqe",),
    ALLOW_FLAG: ("moa", "moh", "gqe"),
}

#: The value an unset (None) field of :data:`_KIND_FIELDS` takes for the kinds that use it: ``__post_init__``
#: fills it in, so ``AttentionConfig(kind="moa").router == "softmax"`` while ``kind="mha"`` keeps ``None``.
#: Configs saved before these fields defaulted to None stored these values for every kind:
#: :meth:`AttentionConfig.from_dict` drops such a stored default of a field the kind does not use.
_KIND_DEFAULTS = {
    "router": "softmax",
    "renormalize": "detached",
    "load_balance_weight": 0.01,
    "z_loss_weight": 0.001,
    "pre_softmax": True,
    "post_softmax": True,
    "expert_impl": "auto",
    "load_balance_fractions": "normalized",
    # stored resolved, so that a config reads as it was trained whatever a later default becomes
    # (shared_head_kv_as_trained repairs the configs stored before, when an unset field meant K/V head 0)
    "head_weighting": "renormalized",
    "hard_slot_scale": "none",
    "shared_head_kv": "mean",
    "dropout_on": "attention",
}


#: Fields whose :data:`_KIND_DEFAULTS` value is filled in for these kinds only (the others keep ``None``, their
#: layer's own router): ``router="softmax"`` is MoA's default; MoH and SwitchHead take ``router`` only to set
#: the random-routing control.
_DEFAULT_KINDS = {"router": ("moa",)}

#: The ``router`` values of each kind: its learned router (``None`` = the layer's own) or ``"random"``; MoH also
#: ``"query_norm"``, the MoH authors' parameter-free rule of MoH-LLaMA3.
ROUTER_CHOICES = {"moa": ("softmax", "noisy_topk", "random"), "moh": ("softmax", "random", "query_norm"),
                  "switchhead": ("sigmoid", "random"), "gqe": ("softmax", "random")}


def _takes_default(field: str, kind: str) -> bool:
    return kind in _DEFAULT_KINDS.get(field, _KIND_FIELDS[field])


def with_kind_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """An attention config dict with its kind's unset (``None``) fields of :data:`_KIND_DEFAULTS` filled in, as
    :class:`AttentionConfig` fills them on construction (a dict stored with ``null`` there, compared with one
    this version writes)."""
    kind = data.get("kind", "mha")
    return {**data, **{k: v for k, v in _KIND_DEFAULTS.items() if k in data and data[k] is None
                       and _takes_default(k, kind)}}


def without_foreign_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """A stored attention config dict without the defaults that files of older versions stored for every kind
    (e.g. ``router="softmax"`` for kind ``"mha"``, now unset there): what :meth:`AttentionConfig.from_dict`
    reads."""
    kind = data.get("kind", "mha")
    return {k: v for k, v in data.items()
            if not (k in _KIND_DEFAULTS and not _takes_default(k, kind) and _same_value(v, _KIND_DEFAULTS[k]))}


#: Keys that every attention config dict headmix has written holds (``dataclasses.asdict`` writes every field;
#: these exist since the first stored configs): a dict with them is a stored config, not one written by hand.
_STORED_KEYS = ("dropout", "bias", "rotary_base", "zero_padded_queries")


def marked_as_trained(data: dict[str, Any]) -> dict[str, Any]:
    """A stored attention config dict (one that holds :data:`_STORED_KEYS`) without the key
    ``allow_router_without_task_gradient`` (written before the rule that refuses a learned router without a
    task-loss gradient), with the key set true where the rule would refuse it: such a config was trained as
    that ablation, and loads and evaluates as it. Any other dict is returned as it is (a dict written by hand
    is refused as a new one would be)."""
    stored = all(k in data for k in _STORED_KEYS)
    if ALLOW_FLAG in data or data.get("kind") not in _KIND_FIELDS[ALLOW_FLAG] or not stored:
        return data
    marked = {**data, ALLOW_FLAG: True}
    try:
        refused = AttentionConfig(**marked).router_without_task_gradient() is not None
    except (TypeError, ValueError):  # not a complete config: its own errors are reported where it is built
        refused = False
    return marked if refused else data


def shared_head_kv_as_trained(data: dict[str, Any]) -> dict[str, Any]:
    """A stored GQE attention config dict (one that holds :data:`_STORED_KEYS`) without the key ``shared_head_kv``
    (written before the option, when the shared head read K/V head 0), with ``"head0"``: it loads, trains on and
    evaluates as it was trained. Any other dict is returned as it is (unset: the authors' mean)."""
    if data.get("kind") != "gqe" or "shared_head_kv" in data or not all(k in data for k in _STORED_KEYS):
        return data
    return {**data, "shared_head_kv": "head0"}


def field_applies(field: str, kind: str) -> bool:
    """Whether the :class:`AttentionConfig` field ``field`` means something for attention ``kind`` (fields that
    apply to some kinds only must be unset for the others)."""
    return kind in _KIND_FIELDS.get(field, ATTENTION_KINDS)


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _fraction(name: str, value: Any, *, closed: bool = False) -> None:
    in_range = isinstance(value, (int, float)) and (0.0 <= value <= 1.0 if closed else 0.0 <= value < 1.0)
    ok = in_range and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"{name} must be a number in [0, 1{']' if closed else ')'}, got {value!r}")


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


@dataclass
class AttentionConfig:
    """One attention layer.

    ``kind``:

    - ``"mha"``: multi-head attention, ``num_heads`` heads of ``head_dim`` (default ``d_model // num_heads``),
      query/key size ``key_dim`` (default ``head_dim``).
    - ``"moa"``: Mixture of Attention Heads (eq. 6-12): ``num_experts`` experts of size ``head_dim``, the
      router selects ``top_k`` per token; the paper's ``{K}K{E}E{D}D`` is ``top_k=K, num_experts=E,
      head_dim=D``. ``router``, ``renormalize`` (eq. 9), ``load_balance_weight`` (alpha, eq. 17),
      ``z_loss_weight`` (beta) and ``expert_impl`` (the grouped-projection kernel) apply to it;
      ``kv_heads`` (default 1, the paper's single shared K/V head) gives JetMoE's grouped K/V heads.
    - ``router="random"`` (MoA, MoH, SwitchHead; MoH and SwitchHead leave ``router`` unset for their learned
      router): the random-routing control, the same number of experts or heads per token chosen uniformly at
      random, with the weights the layer gives at equal router scores, no router parameters and no auxiliary
      loss (:mod:`headmix.routing.random`).
    - ``router="query_norm"`` (MoH): MoH-LLaMA3's parameter-free rule, each token's ``top_k`` routed heads with
      the largest query norms, every active head weighted 1, no auxiliary loss; ``head_weighting`` must stay
      unset or ``"renormalized"`` (see :class:`~headmix.attention.MixtureOfHeadsAttention`).
    - ``"moh"``: Mixture-of-Head attention: ``num_heads`` heads, ``num_shared_heads`` always on, ``top_k``
      of the others routed per token.
    - ``"talking_heads"``: ``num_heads`` heads mixed by learned ``h x h`` maps before (``pre_softmax``)
      and/or after (``post_softmax``) the softmax.
    - ``"switchhead"``: SwitchHead (arXiv 2312.07987): ``num_heads`` heads of ``head_dim`` (default
      ``d_model // num_heads``), each with ``num_experts`` value and output projections of which ``top_k``
      are selected per token by sigmoid selectors; ``expert_dropout`` (default 0), ``init_scale`` (default
      1) and ``expert_impl`` apply to it. Its ``bias`` adds query/key and output biases (the authors' layer
      has none: the presets set ``bias=False``). ``dropout_on`` (unset = ``"attention"``) places its dropout:
      ``"attention"`` drops the attention probabilities, ``"queries"`` the projected queries as the authors'
      code does (the presets leave it unset: ``"attention"``, the placement of every other kind).

    ``dropout`` is the dropout on the attention probabilities (SwitchHead: where ``dropout_on`` says).

    ``bias`` switches all the layer's biases; ``q_bias`` (not for MoA, whose experts have none), ``kv_bias``
    and ``out_bias``, when set, override it for the query, key/value and output projections.

    ``head_weighting`` (MoH; default ``"renormalized"``, the MoH authors' code; ``"paper"``, ``"scaled"``),
    ``load_balance_fractions`` (MoA / MoH; ``"per_token"`` is Hugging Face JetMoe's loss, ``top_k`` times
    the default ``"normalized"``) and ``zero_padded_queries`` (zero output at padded queries) are the
    peers' conventions, see ``docs/implementations.md``. ``moh_impl`` (MoH; ``"auto"`` when unset,
    ``"dense"``, ``"sparse"``) says how MoH computes its heads (the same results: only the selected heads, or
    every head then weights; see :class:`~headmix.attention.MixtureOfHeadsAttention`); ``expert_impl`` is
    then the kernel of sparse MoH's routed projections.

    - ``"mosa"``: Mixture of Sparse Attention (arXiv 2505.00315), self-attention only: ``num_sparse_heads``
      heads of ``head_dim`` (default ``d_model // (num_sparse_heads + num_dense_heads)``) each choosing its
      top ``k = T // sparsity`` tokens (or ``tokens_per_head``; give one), beside ``num_dense_heads`` (default
      0) dense causal heads; ``include_first`` (default False) always chooses token 0. No biases (``bias``
      must be false, as the authors' layer). The MoSA authors rotate half of each head
      (``rotary_fraction=0.5``).

    ``rotary`` rotates queries and keys of self-attention by position (RoPE, any kind; ``rotary_base`` is the
    ``10000`` of ``theta_i = base^(-2i/d)``, ``rotary_fraction`` the fraction of each query/key head rotated:
    default 1.0, the whole head, as Llama; the SwitchHead authors' ``SwitchHeadRope`` rotates 0.5).

    ``kv_heads`` (MHA, MoH, Talking-Heads; unset = ``num_heads``): grouped-query attention, ``num_heads /
    kv_heads`` query heads per K/V head (``1``: multi-query attention); the cache holds ``kv_heads`` heads.
    ``qk_norm`` (MHA, MoH, Talking-Heads; unset = off): an RMSNorm over each head's queries and keys before
    rotary (Qwen3, OLMo 2). ``output_gate`` (same kinds; unset = none): ``"headwise"`` or ``"elementwise"``,
    Gated Attention's sigmoid gate on each head's output before the output projection (arXiv 2505.06708, G1).
    ``route_per_group`` (MoH; needs ``kv_heads``; unset = off): MoH per K/V group, routing inside each
    K/V group, with ``num_shared_heads`` and ``top_k`` counted per group (not the paper's GQE: kind ``"gqe"``).
    - ``"gqe"``: Grouped Query Experts as its paper defines it (arXiv 2606.20945,
      :class:`~headmix.attention.GroupedQueryExpertsAttention`): ``num_experts`` query-head experts (unset: 16) on
      ``kv_heads`` K/V heads (unset: 8), ``top_k`` selected per token in each group (unset: 1), heads of
      ``head_dim`` (unset: ``d_model // num_experts``); output ``Concat(hard slots, weighted slot, shared head)
      W_O``. The paper's ablations: ``weighted_slot``, ``weighted_slot_renormalize``, ``shared_head`` (unset:
      true) and ``hard_slot_scale`` (unset: ``"none"``; ``"p"``). ``router`` (``"random"``: the control),
      ``load_balance_weight`` and ``load_balance_fractions`` as MoH. ``num_heads`` stays unset.
      ``shared_head_kv`` (unset: ``"mean"``, the authors' code: the shared head over the mean of the K/V heads;
      ``"head0"``: over K/V head 0, what a GQE config stored without the key was trained with, and reads as),
      ``router_init`` (unset: ``"normal"``; ``"zero"``, the authors') and ``weight_init`` (unset: ``"default"``;
      ``"xavier_uniform"``, the authors'): see :class:`~headmix.attention.GroupedQueryExpertsAttention`;
      ``attention.gqe.AUTHORS_OPTIONS`` is the authors' layer.
    ``allow_router_without_task_gradient`` (MoA, MoH, GQE; unset = off): a learned router that would get no gradient
    from the task loss with the options given (MoH/GQE ``head_weighting="renormalized"`` with ``top_k=1``, one
    routed head; MoA ``top_k=1`` with ``renormalize="live"`` or ``router="noisy_topk"``, one expert; GQE ``weighted_slot=False`` with unscaled hard slots: see
    :mod:`headmix.routing.task_gradient`) is refused unless this is true, which asks for it as an ablation;
    study reports label such rows. A config stored before this rule (every field but this one) that the rule
    refuses reads as that ablation (:meth:`from_dict`), the way it was trained.
    A field that the chosen ``kind`` does not use must stay unset (``None``): setting it is a ``ValueError``
    naming it (the table ``_KIND_FIELDS`` says which kinds use which field). Unset fields the kind uses take
    their defaults on construction (``_KIND_DEFAULTS``: ``router="softmax"`` (MoA), ``renormalize="detached"``,
    ``load_balance_weight=0.01``, ``z_loss_weight=0.001``, ``pre_softmax=post_softmax=True``,
    ``expert_impl="auto"``, ``load_balance_fractions="normalized"``, ``head_weighting="renormalized"`` (MoH),
    ``hard_slot_scale="none"``, ``shared_head_kv="mean"`` (GQE), ``dropout_on="attention"`` (SwitchHead)): a
    stored config holds the value it was trained with, never a ``null`` that a later default would change.
    """

    kind: str = "mha"
    num_heads: int | None = None
    head_dim: int | None = None
    key_dim: int | None = None
    num_experts: int | None = None
    kv_heads: int | None = None
    top_k: int | None = None
    num_shared_heads: int | None = None
    router: str | None = None
    renormalize: str | None = None
    load_balance_weight: float | None = None
    z_loss_weight: float | None = None
    pre_softmax: bool | None = None
    post_softmax: bool | None = None
    dropout: float = 0.0
    expert_impl: str | None = None
    bias: bool = True
    expert_dropout: float | None = None
    init_scale: float | None = None
    dropout_on: str | None = None
    moh_impl: str | None = None
    q_bias: bool | None = None
    kv_bias: bool | None = None
    out_bias: bool | None = None
    rotary: bool = False
    rotary_base: float = 10000.0
    rotary_fraction: float = 1.0
    head_weighting: str | None = None
    load_balance_fractions: str | None = None
    zero_padded_queries: bool = False
    #: RMSNorm over each head's queries and keys before rotary (QK-norm); None: off.
    qk_norm: bool | None = None
    #: ``"headwise"`` / ``"elementwise"`` sigmoid gate on each head's output (Gated Attention G1); None: no gate.
    output_gate: str | None = None
    #: MoH: route inside each K/V group (MoH per K/V group); None: off.
    route_per_group: bool | None = None
    num_sparse_heads: int | None = None
    """MoSA: the heads that choose their tokens."""
    num_dense_heads: int | None = None
    """MoSA: ordinary causal heads beside the sparse ones (unset: 0)."""
    sparsity: float | None = None
    """MoSA: each sparse head keeps ``T // sparsity`` tokens (at least 2)."""
    tokens_per_head: int | None = None
    """MoSA: each sparse head keeps this many tokens (instead of ``sparsity``)."""
    include_first: bool | None = None
    """MoSA: the first token is always chosen (unset: False)."""
    weighted_slot: bool | None = None
    """GQE: the renormalised weighted-sum slot (unset: on)."""
    weighted_slot_renormalize: bool | None = None
    """GQE: the weighted slot's weights renormalised over the selected heads (unset: on; off: ``w = p``)."""
    shared_head: bool | None = None
    """GQE: the always-on shared head (unset: on)."""
    hard_slot_scale: str | None = None
    """GQE: ``"none"`` (unset) or ``"p"``: the hard slots scaled by their router probability."""
    shared_head_kv: str | None = None
    """GQE: the shared head's K/V, ``"mean"`` of the K/V heads (unset, the authors') or ``"head0"`` (stored configs
    without the key)."""
    router_init: str | None = None
    """GQE: the router's initial weights, ``"normal"`` (unset) or ``"zero"`` (the authors')."""
    weight_init: str | None = None
    """GQE: the projections' initial weights, ``"default"`` (unset, ``torch.nn.Linear``'s) or ``"xavier_uniform"``."""
    allow_router_without_task_gradient: bool | None = None
    """MoA, MoH, GQE: allow a learned router that gets no task-loss gradient with these options, as an ablation."""

    def __post_init__(self) -> None:
        self._check_kind_fields("attention")
        for fname, default in _KIND_DEFAULTS.items():
            if getattr(self, fname) is None and _takes_default(fname, self.kind):
                setattr(self, fname, default)
        self.validate()

    def _check_kind_fields(self, name: str) -> None:
        """``ValueError`` naming the first field set (not None) that ``kind`` does not use (:data:`_KIND_FIELDS`)."""
        _choice(f"{name}.kind", self.kind, ATTENTION_KINDS)
        for fname, kinds in _KIND_FIELDS.items():
            if self.kind not in kinds and getattr(self, fname) is not None:
                raise ValueError(f"{name}.{fname} applies to kind {' / '.join(repr(k) for k in kinds)} only; "
                                 f"it must be unset (None) for kind {self.kind!r}, got {getattr(self, fname)!r}")

    def validate(self, embed_dim: int | None = None, name: str = "attention") -> None:
        """Raise ``ValueError`` naming the offending field (``name.field``). With ``embed_dim``, also check
        that the default head size ``embed_dim // num_heads`` exists."""
        self._check_kind_fields(name)
        if self.kind in ("moa", "switchhead"):
            required = ("num_experts", "top_k", "head_dim") if self.kind == "moa" else ("num_experts", "top_k")
            for fname in required:
                if getattr(self, fname) is None:
                    raise ValueError(f"{name}.{fname} is required for kind {self.kind!r}")
                _positive_int(f"{name}.{fname}", getattr(self, fname))
            if self.kv_heads is not None:
                _positive_int(f"{name}.kv_heads", self.kv_heads)
            if self.top_k > self.num_experts:
                raise ValueError(f"{name}.top_k K={self.top_k} exceeds num_experts E={self.num_experts}")
            _choice(f"{name}.expert_impl", self.expert_impl, EXPERT_IMPLS)
        if self.router is not None and self.kind in ROUTER_CHOICES:
            _choice(f"{name}.router", self.router, ROUTER_CHOICES[self.kind])
        if self.kind == "mosa":
            self._validate_mosa(embed_dim, name)
        elif self.kind == "gqe":
            self._validate_gqe(embed_dim, name)
        elif self.kind != "moa":
            if self.num_heads is None:
                raise ValueError(f"{name}.num_heads is required for kind {self.kind!r}")
            _positive_int(f"{name}.num_heads", self.num_heads)
            for fname in ("head_dim", "key_dim"):
                if getattr(self, fname) is not None:
                    _positive_int(f"{name}.{fname}", getattr(self, fname))
            if self.head_dim is None and embed_dim is not None and embed_dim % self.num_heads:
                raise ValueError(f"{name}.num_heads ({self.num_heads}) must divide d_model ({embed_dim}) when {name}.head_dim is not set")
        if self.kind in ("mha", "moh", "talking_heads") and self.kv_heads is not None:
            _positive_int(f"{name}.kv_heads", self.kv_heads)
            if self.num_heads % self.kv_heads:
                raise ValueError(f"{name}.kv_heads ({self.kv_heads}) must divide {name}.num_heads ({self.num_heads})")
        if self.qk_norm is not None and not isinstance(self.qk_norm, bool):
            raise ValueError(f"{name}.qk_norm must be true, false or null (off), got {self.qk_norm!r}")
        if self.output_gate is not None:
            _choice(f"{name}.output_gate", self.output_gate, attention.mha.OUTPUT_GATES)
        if self.route_per_group is not None and not isinstance(self.route_per_group, bool):
            raise ValueError(f"{name}.route_per_group must be true, false or null (off), got {self.route_per_group!r}")
        if self.route_per_group and self.kv_heads is None:
            raise ValueError(f"{name}.route_per_group needs {name}.kv_heads (the groups to route in)")
        if self.kind == "moh":
            if self.num_shared_heads is None or self.top_k is None:
                raise ValueError(f"{name}.num_shared_heads and {name}.top_k are required for kind 'moh'")
            group = self.num_heads // self.kv_heads if self.route_per_group else self.num_heads
            where = "num_heads / kv_heads" if self.route_per_group else "num_heads"
            if not isinstance(self.num_shared_heads, int) or not 0 <= self.num_shared_heads < group:
                raise ValueError(f"{name}.num_shared_heads must be in [0, {where}={group}), got {self.num_shared_heads!r}")
            routed = group - self.num_shared_heads
            _positive_int(f"{name}.top_k", self.top_k)
            if self.top_k > routed:
                raise ValueError(f"{name}.top_k K={self.top_k} exceeds the {routed} routed heads ({where} - num_shared_heads)")
        if self.kind == "switchhead":
            if self.expert_dropout is not None:
                _fraction(f"{name}.expert_dropout", self.expert_dropout)
            if self.init_scale is not None and (not isinstance(self.init_scale, (int, float))
                                                or isinstance(self.init_scale, bool) or not self.init_scale > 0):
                raise ValueError(f"{name}.init_scale must be a positive number, got {self.init_scale!r}")
            if self.dropout_on is not None:
                _choice(f"{name}.dropout_on", self.dropout_on, attention.switchhead.DROPOUT_PLACEMENTS)
        if self.kind == "talking_heads" and not (self.pre_softmax or self.post_softmax):
            raise ValueError(f"{name}: talking_heads needs pre_softmax or post_softmax (otherwise use kind 'mha')")
        _fraction(f"{name}.dropout", self.dropout)
        if not isinstance(self.bias, bool):
            raise ValueError(f"{name}.bias must be true or false, got {self.bias!r}")
        for fname in ("q_bias", "kv_bias", "out_bias"):
            if getattr(self, fname) is not None and not isinstance(getattr(self, fname), bool):
                raise ValueError(f"{name}.{fname} must be true, false or null (follow bias), got {getattr(self, fname)!r}")
        if self.head_weighting is not None:
            _choice(f"{name}.head_weighting", self.head_weighting, attention.moh.HEAD_WEIGHTINGS)
            if self.router == "query_norm" and self.head_weighting != "renormalized":
                raise ValueError(f"{name}.head_weighting must be 'renormalized' (or unset) with router 'query_norm', "
                                 f"which weighs every active head 1; got {self.head_weighting!r}")
        if self.moh_impl is not None:
            _choice(f"{name}.moh_impl", self.moh_impl, attention.moh.MOH_IMPLS)
        if self.load_balance_fractions is not None:
            _choice(f"{name}.load_balance_fractions", self.load_balance_fractions, LOAD_BALANCE_FRACTIONS)
        if not isinstance(self.zero_padded_queries, bool):
            raise ValueError(f"{name}.zero_padded_queries must be true or false, got {self.zero_padded_queries!r}")
        if not isinstance(self.rotary, bool):
            raise ValueError(f"{name}.rotary must be true or false, got {self.rotary!r}")
        if not isinstance(self.rotary_base, (int, float)) or isinstance(self.rotary_base, bool) or not self.rotary_base > 1:
            raise ValueError(f"{name}.rotary_base must be a number > 1, got {self.rotary_base!r}")
        if not isinstance(self.rotary_fraction, (int, float)) or isinstance(self.rotary_fraction, bool) \
                or not 0 < self.rotary_fraction <= 1:
            raise ValueError(f"{name}.rotary_fraction must be a number in (0, 1], got {self.rotary_fraction!r}")
        if self.rotary and embed_dim is not None and int(self.resolved_key_dim(embed_dim) * self.rotary_fraction) < 2:
            raise ValueError(f"{name}.rotary_fraction ({self.rotary_fraction}) rotates fewer than 2 of the "
                             f"{self.resolved_key_dim(embed_dim)} query/key dimensions per head")
        for fname in ("load_balance_weight", "z_loss_weight"):
            v = getattr(self, fname)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{name}.{fname} must be a non-negative number, got {v!r}")
        allowed = self.allow_router_without_task_gradient
        if allowed is not None and not isinstance(allowed, bool):
            raise ValueError(f"{name}.{ALLOW_FLAG} must be true, false or null (off), got {allowed!r}")
        check_router_learns(self.router_without_task_gradient(), bool(allowed), name, f"{name}.{ALLOW_FLAG}")

    def router_without_task_gradient(self) -> tuple[str, str] | None:
        """``(why, alternatives)`` when this config's learned router gets no gradient from the task loss
        (:mod:`headmix.routing.task_gradient`), else None (it learns, or there is no learned router)."""
        if self.kind == "moa":
            return moa_router_without_task_gradient(self.num_experts, self.top_k, self.router, self.renormalize)
        if self.kind == "moh":
            group = self.num_heads // self.kv_heads if self.route_per_group else self.num_heads
            return moh_router_without_task_gradient(group - self.num_shared_heads, self.top_k,
                                                    self.head_weighting or "renormalized", self.router or "softmax",
                                                    bool(self.route_per_group))
        if self.kind == "gqe":
            experts, kv, top_k = self.gqe_sizes()
            return gqe_router_without_task_gradient(experts // kv,  # validate checked that kv divides experts
                                                    self.weighted_slot is not False, self.hard_slot_scale or "none",
                                                    self.router or "softmax", top_k * kv,
                                                    self.weighted_slot_renormalize is not False)
        return None

    def _validate_mosa(self, embed_dim: int | None, name: str) -> None:
        if self.num_sparse_heads is None:
            raise ValueError(f"{name}.num_sparse_heads is required for kind 'mosa'")
        _positive_int(f"{name}.num_sparse_heads", self.num_sparse_heads)
        dense = self.num_dense_heads or 0
        if not isinstance(dense, int) or isinstance(dense, bool) or dense < 0:
            raise ValueError(f"{name}.num_dense_heads must be a non-negative integer, got {self.num_dense_heads!r}")
        if (self.sparsity is None) == (self.tokens_per_head is None):
            raise ValueError(f"{name}: give exactly one of sparsity and tokens_per_head for kind 'mosa'")
        if self.sparsity is not None and (not isinstance(self.sparsity, (int, float)) or isinstance(self.sparsity, bool)
                                          or not self.sparsity >= 1):
            raise ValueError(f"{name}.sparsity must be a number >= 1, got {self.sparsity!r}")
        if self.tokens_per_head is not None and (not isinstance(self.tokens_per_head, int)
                                                 or isinstance(self.tokens_per_head, bool) or self.tokens_per_head < 2):
            raise ValueError(f"{name}.tokens_per_head must be an integer >= 2, got {self.tokens_per_head!r}")
        if self.include_first is not None and not isinstance(self.include_first, bool):
            raise ValueError(f"{name}.include_first must be true or false, got {self.include_first!r}")
        if self.head_dim is not None:
            _positive_int(f"{name}.head_dim", self.head_dim)
        elif embed_dim is not None and embed_dim % (self.num_sparse_heads + dense):
            raise ValueError(f"{name}.num_sparse_heads + num_dense_heads ({self.num_sparse_heads + dense}) must divide "
                             f"d_model ({embed_dim}) when {name}.head_dim is not set")
        if self.bias:
            raise ValueError(f"{name}.bias must be false for kind 'mosa' (the MoSA layer has no biases)")

    def _validate_gqe(self, embed_dim: int | None, name: str) -> None:
        experts, kv, top_k = self.gqe_sizes()
        for fname, value in (("num_experts", experts), ("kv_heads", kv), ("top_k", top_k)):
            _positive_int(f"{name}.{fname}", value)
        if experts % kv:
            raise ValueError(f"{name}.kv_heads ({kv}) must divide {name}.num_experts ({experts})")
        if top_k > experts // kv:
            raise ValueError(f"{name}.top_k K={top_k} exceeds the {experts // kv} experts per group (num_experts / kv_heads)")
        for fname in ("weighted_slot", "weighted_slot_renormalize", "shared_head"):
            if getattr(self, fname) is not None and not isinstance(getattr(self, fname), bool):
                raise ValueError(f"{name}.{fname} must be true, false or null (on), got {getattr(self, fname)!r}")
        for fname, choices in (("hard_slot_scale", attention.gqe.HARD_SLOT_SCALES),
                               ("shared_head_kv", attention.gqe.SHARED_HEAD_KVS),
                               ("router_init", attention.gqe.ROUTER_INITS),
                               ("weight_init", attention.gqe.WEIGHT_INITS)):
            if getattr(self, fname) is not None:
                _choice(f"{name}.{fname}", getattr(self, fname), choices)
        if self.head_dim is not None:
            _positive_int(f"{name}.head_dim", self.head_dim)
        elif embed_dim is not None and embed_dim % experts:
            raise ValueError(f"{name}.num_experts ({experts}) must divide d_model ({embed_dim}) when {name}.head_dim is not set")

    def gqe_sizes(self) -> tuple[int, int, int]:
        """GQE's ``(num_experts, kv_heads, top_k)`` with the paper's main setting for unset ones (16, 8, 1)."""
        return (16 if self.num_experts is None else self.num_experts, 8 if self.kv_heads is None else self.kv_heads,
                1 if self.top_k is None else self.top_k)

    def resolved_biases(self) -> tuple[bool, bool, bool]:
        """``(q_bias, kv_bias, out_bias)`` with unset ones following ``bias`` (``q_bias`` False for MoA)."""
        def pick(value: bool | None) -> bool:
            return self.bias if value is None else value
        return (pick(self.q_bias) if self.kind != "moa" else False), pick(self.kv_bias), pick(self.out_bias)

    def resolved_head_dim(self, embed_dim: int) -> int:
        """Value size per head (per expert for MoA)."""
        if self.head_dim is None and self.kind == "mosa":
            return embed_dim // (self.num_sparse_heads + (self.num_dense_heads or 0))
        if self.head_dim is None and self.kind == "gqe":
            return embed_dim // self.gqe_sizes()[0]
        return self.head_dim if self.head_dim is not None else embed_dim // self.num_heads

    def resolved_key_dim(self, embed_dim: int) -> int:
        """Query/key size per head (equal to the head size except for MHA/Talking-Heads with ``key_dim``)."""
        return self.key_dim if self.key_dim is not None else self.resolved_head_dim(embed_dim)

    @property
    def routed(self) -> bool:
        return self.kind in ("moa", "moh", "switchhead", "mosa", "gqe")

    def build(self, embed_dim: int) -> nn.Module:
        """The attention layer this config describes, for model width ``embed_dim``."""
        self.validate(embed_dim)
        if self.kind == "mosa":
            return attention.MixtureOfSparseAttention(
                embed_dim, self.num_sparse_heads, self.resolved_head_dim(embed_dim), sparsity=self.sparsity,
                tokens_per_head=self.tokens_per_head, num_dense_heads=self.num_dense_heads or 0,
                include_first=bool(self.include_first), rotary=self.rotary, rotary_base=self.rotary_base,
                rotary_fraction=self.rotary_fraction, dropout=self.dropout, zero_padded_queries=self.zero_padded_queries)
        common = dict(bias=self.bias, dropout=self.dropout, rotary=self.rotary, rotary_base=self.rotary_base,
                      rotary_fraction=self.rotary_fraction, kv_bias=self.kv_bias, out_bias=self.out_bias,
                      zero_padded_queries=self.zero_padded_queries)
        if self.routed:
            common["load_balance_fractions"] = self.load_balance_fractions
        if self.kind != "moa":
            common["q_bias"] = self.q_bias
        if self.kind in ("mha", "moh", "talking_heads"):
            common.update(kv_heads=self.kv_heads, qk_norm=bool(self.qk_norm), output_gate=self.output_gate)
        if self.kind == "mha":
            return attention.MultiHeadAttention(embed_dim, self.num_heads, self.head_dim, self.key_dim, **common)
        if self.kind == "moa":
            return attention.MixtureOfAttentionHeads(
                embed_dim, self.num_experts, self.top_k, self.head_dim, router=self.router,
                renormalize=self.renormalize, load_balance_weight=self.load_balance_weight,
                z_loss_weight=self.z_loss_weight, expert_impl=self.expert_impl, kv_heads=self.kv_heads or 1,
                allow_router_without_task_gradient=bool(self.allow_router_without_task_gradient), **common)
        if self.kind == "moh":
            return attention.MixtureOfHeadsAttention(
                embed_dim, self.num_heads, self.num_shared_heads, self.top_k, self.head_dim,
                load_balance_weight=self.load_balance_weight, head_weighting=self.head_weighting or "renormalized",
                impl=self.moh_impl or "auto", expert_impl=self.expert_impl,
                route_per_group=bool(self.route_per_group), router=self.router or "softmax",
                allow_router_without_task_gradient=bool(self.allow_router_without_task_gradient), **common)
        if self.kind == "gqe":
            experts, kv, top_k = self.gqe_sizes()
            return attention.GroupedQueryExpertsAttention(
                embed_dim, experts, kv, top_k, self.head_dim,
                weighted_slot=self.weighted_slot is not False,
                weighted_slot_renormalize=self.weighted_slot_renormalize is not False,
                shared_head=self.shared_head is not False, hard_slot_scale=self.hard_slot_scale or "none",
                router=self.router or "softmax", load_balance_weight=self.load_balance_weight,
                allow_router_without_task_gradient=bool(self.allow_router_without_task_gradient),
                shared_head_kv=self.shared_head_kv or "mean", router_init=self.router_init or "normal",
                weight_init=self.weight_init or "default", **common)
        if self.kind == "switchhead":
            return attention.SwitchHeadAttention(
                embed_dim, self.num_heads, self.num_experts, self.top_k, self.head_dim, bias=self.bias,
                dropout=self.dropout, expert_dropout=self.expert_dropout or 0.0,
                init_scale=1.0 if self.init_scale is None else self.init_scale, expert_impl=self.expert_impl,
                rotary=self.rotary, rotary_base=self.rotary_base, rotary_fraction=self.rotary_fraction,
                zero_padded_queries=self.zero_padded_queries, dropout_on=self.dropout_on or "attention",
                router=self.router or "sigmoid")
        return attention.TalkingHeadsAttention(
            embed_dim, self.num_heads, self.pre_softmax, self.post_softmax, head_dim=self.head_dim,
            key_dim=self.key_dim, **common)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], name: str = "attention") -> AttentionConfig:
        """Build from a dict; errors name the field as ``name.field`` (e.g. ``cross_attention.top_k``).

        A MoH config saved before ``head_weighting`` existed (the key absent) reads as ``"scaled"``, the
        weighting its weights were trained with; a saved ``null`` means the current default. A config saved
        before ``allow_router_without_task_gradient`` existed (every field written but that one) whose router
        gets no task gradient reads as that ablation (:func:`marked_as_trained`). A GQE config stored before
        ``shared_head_kv`` existed reads as ``"head0"``, the shared head it was trained with
        (:func:`shared_head_kv_as_trained`)."""
        _check_keys(cls, data, name)
        data = without_foreign_defaults(data)
        if data.get("kind") == "moh" and "head_weighting" not in data:
            data = {**data, "head_weighting": "scaled"}
        data = shared_head_kv_as_trained(marked_as_trained(data))
        try:
            return cls(**data)
        except ValueError as err:
            message = str(err)
            if message.startswith("attention"):
                message = name + message[len("attention"):]
            raise ValueError(message) from None


@dataclass
class ModelConfig:
    """A whole Transformer.

    ``task``: ``"translation"`` (encoder-decoder with cross-attention), ``"mlm"`` (encoder with a RoBERTa LM
    head) or ``"lm"`` (decoder-only, causal). Translation needs ``encoder_layers`` and ``decoder_layers``
    > 0, MLM only ``encoder_layers``, LM only ``decoder_layers``. Attention roles the task does not have
    stay ``None``; the ones it has default to 8-head MHA.

    ``norm``: ``"post"`` (Vaswani et al., fairseq's default) or ``"pre"`` (adds a final norm to the
    encoder and decoder stacks). ``norm_type``: ``"layernorm"`` or ``"rmsnorm"`` (Zhang & Sennrich 2019,
    ``x / sqrt(mean(x^2) + eps) * g``, as Llama; ``torch.nn.RMSNorm``), both with epsilon ``norm_eps``.
    ``positions``: ``"sinusoidal"`` or ``"learned"`` (added to the embeddings, up to ``max_positions``), or
    ``"rotary"``: no absolute positions; the self-attention configs get ``rotary=True`` (RoFormer, Su et al.
    2021; their ``rotary_base`` / ``rotary_fraction`` apply), cross-attention stays without. With absolute
    positions the attention configs are left as given (rotary on top of them is allowed).
    ``ffn``: ``"mlp"`` (``fc2(act(fc1 x))``, ``activation``), ``"swiglu"`` (Shazeer 2020, as Llama:
    ``down(silu(gate x) * up x)``) or ``"moe_swiglu"``: a mixture of ``ffn_experts`` SwiGLU experts of width
    ``ffn_dim``, ``ffn_top_k`` per token (JetMoE's MoE layer; router weights ``softmax`` over the top-k logits,
    load-balancing loss weighted by ``ffn_load_balance_weight`` with ``ffn_load_balance_fractions`` as the
    attention's ``load_balance_fractions``, grouped kernel ``ffn_expert_impl``); its router gets no task-loss
    gradient with ``ffn_top_k=1`` or one expert (a softmax over one logit), which is refused unless
    ``ffn_allow_router_without_task_gradient`` asks for it as an ablation (:mod:`headmix.routing.task_gradient`;
    a config stored before this rule reads as that ablation).
    ``sequence_start`` (task ``"lm"`` only, ``None`` for the others): how every document the model is trained on,
    scored or prompted with starts (:data:`SEQUENCE_STARTS`; unset: ``"bos"``). Training packs documents so,
    ``evaluate`` scores them so, ``generate`` puts :func:`sequence_prefix` before a prompt, and an export's tokenizer
    adds the same token. A causal-LM config stored without it (every run before the option) reads as ``"eos"``,
    the stream it was trained on (:func:`sequence_start_as_trained`).
    ``bias``: biases of the feed-forward linears (for ``moe_swiglu`` one output bias, as JetMoE) and of
    LayerNorm (Llama has none); the attention layers' biases are set in each ``AttentionConfig``.
    ``pad_id``, ``bos_id``, ``eos_id``: the special tokens (``eos_id`` ends a training document and a generated
    sequence). ``stop_ids``: every token id that ends a generated sequence, ``eos_id`` among them (Llama 3.1
    Instruct's ``<|end_of_text|>``, ``<|eom_id|>`` and ``<|eot_id|>``); ``None``, as configs stored before the
    field: ``eos_id`` alone (:meth:`stop_token_ids`).
    ``scale_embeddings`` multiplies token embeddings by ``sqrt(d_model)`` (fairseq); ``embedding_norm``
    adds a LayerNorm after the embeddings (RoBERTa). ``share_embeddings`` ties the token embeddings of
    encoder, decoder and the output projection (one joint vocabulary). ``dropout`` is the residual and
    embedding dropout, ``activation_dropout`` the dropout after the FFN activation; the attention-probability
    dropout lives in each ``AttentionConfig``.
    """

    task: str = "translation"
    vocab_size: int = 32000
    d_model: int = 512
    ffn_dim: int = 2048
    encoder_layers: int = 6
    decoder_layers: int = 6
    encoder_self_attention: AttentionConfig | None = None
    decoder_self_attention: AttentionConfig | None = None
    cross_attention: AttentionConfig | None = None
    norm: str = "post"
    norm_type: str = "layernorm"
    norm_eps: float = 1e-5
    positions: str = "sinusoidal"
    max_positions: int = 1024
    dropout: float = 0.1
    activation_dropout: float = 0.0
    activation: str = "relu"
    ffn: str = "mlp"
    ffn_experts: int | None = None
    ffn_top_k: int | None = None
    ffn_load_balance_weight: float = 0.01
    ffn_load_balance_fractions: str = "normalized"
    ffn_expert_impl: str = "auto"
    #: ``moe_swiglu``: allow a router without a task-loss gradient (``ffn_top_k=1``, one expert), as an ablation
    ffn_allow_router_without_task_gradient: bool = False
    bias: bool = True
    scale_embeddings: bool = True
    embedding_norm: bool = False
    share_embeddings: bool = True
    pad_id: int | None = 0
    bos_id: int = 1
    eos_id: int = 2
    stop_ids: list[int] | None = None
    label_smoothing: float = 0.1
    sequence_start: str | None = None

    def __post_init__(self) -> None:
        _choice("task", self.task, TASKS)
        if self.task == "lm" and self.sequence_start is None:
            self.sequence_start = "bos"  # stored resolved: a later default never changes what a run was trained on
        if isinstance(self.stop_ids, tuple):
            self.stop_ids = list(self.stop_ids)  # as JSON reads it back
        roles = self.attention_roles()
        for role in ("encoder_self_attention", "decoder_self_attention", "cross_attention"):
            value = getattr(self, role)
            if isinstance(value, dict):
                value = AttentionConfig.from_dict(value, role)
                setattr(self, role, value)
            if role in roles and value is None:
                value = AttentionConfig(kind="mha", num_heads=8)
                setattr(self, role, value)
            if self.positions == "rotary" and role in ROTARY_ROLES and value is not None and not value.rotary:
                setattr(self, role, dataclasses.replace(value, rotary=True))  # a copy: the caller's stays as given
        self.validate()

    def _validate_mosa_role(self, role: str, att: AttentionConfig) -> None:
        """MoSA is self-attention, and its ``sparsity`` must leave each head two tokens of a
        ``max_positions``-long sequence."""
        if role == "cross_attention":
            raise ValueError("cross_attention.kind 'mosa' is not allowed: MoSA is self-attention only")
        if att.sparsity is not None and self.max_positions // att.sparsity < 2:
            raise ValueError(f"{role}.sparsity ({att.sparsity}) leaves fewer than two tokens per head of a "
                             f"max_positions ({self.max_positions}) sequence")

    def attention_roles(self) -> tuple[str, ...]:
        """The attention configs this task uses."""
        return {"translation": ("encoder_self_attention", "decoder_self_attention", "cross_attention"),
                "mlm": ("encoder_self_attention",),
                "lm": ("decoder_self_attention",)}[self.task]

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field."""
        _choice("task", self.task, TASKS)
        for name in ("vocab_size", "d_model", "ffn_dim", "max_positions"):
            _positive_int(name, getattr(self, name))
        for name in ("encoder_layers", "decoder_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        needs = {"translation": ("encoder_layers", "decoder_layers"), "mlm": ("encoder_layers",),
                 "lm": ("decoder_layers",)}[self.task]
        for name in ("encoder_layers", "decoder_layers"):
            if name in needs and getattr(self, name) == 0:
                raise ValueError(f"{name} must be > 0 for task {self.task!r}")
            if name not in needs and getattr(self, name) != 0:
                raise ValueError(f"{name} must be 0 for task {self.task!r}, got {getattr(self, name)}")
        roles = self.attention_roles()
        for role in ("encoder_self_attention", "decoder_self_attention", "cross_attention"):
            value = getattr(self, role)
            if role not in roles:
                if value is not None:
                    raise ValueError(f"{role} must be None for task {self.task!r} (it has no such attention)")
                continue
            if not isinstance(value, AttentionConfig):
                raise ValueError(f"{role} must be an AttentionConfig, got {type(value).__name__}")
            value.validate(self.d_model, role)
            if value.kind == "mosa":
                self._validate_mosa_role(role, value)
        _choice("norm", self.norm, NORMS)
        _choice("norm_type", self.norm_type, NORM_TYPES)
        if not isinstance(self.norm_eps, (int, float)) or isinstance(self.norm_eps, bool) or not 0 < self.norm_eps < 1:
            raise ValueError(f"norm_eps must be a number in (0, 1), got {self.norm_eps!r}")
        _choice("positions", self.positions, POSITIONS)
        if self.positions == "rotary":
            for role in ROTARY_ROLES:
                att = getattr(self, role)
                if att is not None and not att.rotary:
                    raise ValueError(f"{role}.rotary must be True with positions='rotary' (the only position "
                                     f"information is the attention's rotary embedding)")
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("ffn", self.ffn, FFN_KINDS)
        if self.ffn == "moe_swiglu":
            for name in ("ffn_experts", "ffn_top_k"):
                if getattr(self, name) is None:
                    raise ValueError(f"{name} is required with ffn='moe_swiglu'")
                _positive_int(name, getattr(self, name))
            if self.ffn_top_k > self.ffn_experts:
                raise ValueError(f"ffn_top_k ({self.ffn_top_k}) exceeds ffn_experts ({self.ffn_experts})")
        else:
            for name in ("ffn_experts", "ffn_top_k"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} applies to ffn='moe_swiglu' only; it must be unset (None) with ffn={self.ffn!r}")
        v = self.ffn_load_balance_weight
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            raise ValueError(f"ffn_load_balance_weight must be a non-negative number, got {v!r}")
        _choice("ffn_load_balance_fractions", self.ffn_load_balance_fractions, LOAD_BALANCE_FRACTIONS)
        _choice("ffn_expert_impl", self.ffn_expert_impl, EXPERT_IMPLS)
        if self.ffn == "moe_swiglu":
            check_router_learns(ffn_router_without_task_gradient(self.ffn_experts, self.ffn_top_k),
                                self.ffn_allow_router_without_task_gradient, "ffn", FFN_ALLOW_FLAG)
        elif not isinstance(self.ffn_allow_router_without_task_gradient, bool):
            raise ValueError(f"{FFN_ALLOW_FLAG} must be true or false, "
                             f"got {self.ffn_allow_router_without_task_gradient!r}")
        _fraction("dropout", self.dropout)
        _fraction("activation_dropout", self.activation_dropout)
        _fraction("label_smoothing", self.label_smoothing)
        for name in ("scale_embeddings", "embedding_norm", "share_embeddings", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.pad_id is None and self.task != "lm":
            raise ValueError(f"pad_id must be a token id for task {self.task!r} (None, no padding token, is for "
                             f"task 'lm' only), got None")
        for name in ("pad_id", "bos_id", "eos_id"):
            v = getattr(self, name)
            if v is None and name == "pad_id":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < self.vocab_size:
                raise ValueError(f"{name} must be a token id in [0, vocab_size={self.vocab_size}), got {v!r}")
        if self.task == "lm":
            _choice("sequence_start", self.sequence_start, SEQUENCE_STARTS)
        elif self.sequence_start is not None:
            raise ValueError(f"sequence_start applies to task 'lm' only; it must be unset (None) for task "
                             f"{self.task!r}, got {self.sequence_start!r}")
        self._validate_stop_ids()

    def _validate_stop_ids(self) -> None:
        """``stop_ids``: ``None`` or a list of distinct token ids holding ``eos_id``."""
        ids = self.stop_ids
        if ids is None:
            return
        if not isinstance(ids, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"stop_ids must be None or a list of token ids in [0, vocab_size={self.vocab_size}), "
                             f"got {ids!r}")
        if len(set(ids)) != len(ids) or self.eos_id not in ids:
            raise ValueError(f"stop_ids must be distinct token ids among them eos_id ({self.eos_id}), got {list(ids)}")

    def stop_token_ids(self) -> list[int]:
        """The ids that end a generated sequence: ``stop_ids``, or ``[eos_id]`` where it is ``None``."""
        return [self.eos_id] if self.stop_ids is None else [int(i) for i in self.stop_ids]

    def eos_token_id_field(self) -> int | list[int]:
        """The stop ids as a Hugging Face config's ``eos_token_id``: ``eos_id`` where it is the only one, else the
        list of every stop id (in the source's order, as Llama 3.1 Instruct's ``config.json`` and
        ``generation_config.json`` hold them): what an export, ``generate`` and vLLM read."""
        stops = self.stop_token_ids()
        return stops[0] if len(stops) == 1 else stops

    def replace(self, **changes: Any) -> ModelConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    # --- JSON round trip -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "the model config") -> ModelConfig:
        """Build from a dict (a saved ``config.json``: its ``headmix_version``, when there, must not be newer
        than this headmix; ``source`` names the file in that error)."""
        if not isinstance(data, dict):
            raise ValueError(f"a model config must be a JSON object, got {type(data).__name__}")
        data = dict(data)
        check_written_by(data.pop(VERSION_FIELD, None), source)
        _check_keys(cls, data, "model config")
        stored = FFN_ALLOW_FLAG not in data and all(k in data for k in _STORED_MODEL_KEYS)
        if stored and data.get("ffn") == "moe_swiglu" and ffn_router_without_task_gradient(data["ffn_experts"],
                                                                                           data["ffn_top_k"]):
            data[FFN_ALLOW_FLAG] = True  # stored before the rule: the ablation it was trained as (marked_as_trained)
        data = sequence_start_as_trained(data)
        for role in ("encoder_self_attention", "decoder_self_attention", "cross_attention"):
            if isinstance(data.get(role), dict):
                data[role] = AttentionConfig.from_dict(data[role], role)
        return cls(**data)

    def to_json(self) -> str:
        """The config as JSON, with the version of the headmix that writes it (``headmix_version``)."""
        from .. import __version__

        return json.dumps({VERSION_FIELD: __version__, **self.to_dict()}, indent=2, sort_keys=False) + "\n"

    def save_json(self, path: str | os.PathLike) -> None:
        """Write the config as JSON, atomically (:func:`headmix.storage.files.atomic_write`)."""

        atomic_write(path, self.to_json())

    @classmethod
    def load_json(cls, path: str | os.PathLike) -> ModelConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        if isinstance(data, dict) and "model_type" in data:
            raise ValueError(f"{path} is a Hugging Face config (model_type {data['model_type']!r}), not a headmix "
                             f"model config: load the folder with headmix.models.load_pretrained (a headmix export) "
                             f"or convert it with headmix.interop.from_pretrained")
        return cls.from_dict(data, str(path))


#: The model config's option that allows a feed-forward router without a task-loss gradient (an ablation).
FFN_ALLOW_FLAG = "ffn_" + ALLOW_FLAG
#: Keys every model config dict headmix has written with ``ffn="moe_swiglu"`` holds: a stored config.
_STORED_MODEL_KEYS = ("ffn_experts", "ffn_top_k", "ffn_load_balance_weight", "ffn_expert_impl", "label_smoothing")

#: Keys every causal-LM config dict headmix has written holds (``dataclasses.asdict`` writes every field): a stored
#: config, not one written by hand.
_STORED_LM_KEYS = ("pad_id", "bos_id", "eos_id", "label_smoothing", "share_embeddings")


def sequence_start_as_trained(data: dict[str, Any]) -> dict[str, Any]:
    """A stored causal-LM config dict (one that holds :data:`_STORED_LM_KEYS`) without ``sequence_start`` (written
    before the option, when every run trained on the eos-first stream ``eos text eos text2 eos``), with ``"eos"``:
    it loads, evaluates, generates and continues training as it was trained. Any other dict is returned as it is
    (unset: ``"bos"``)."""
    if data.get("task") != "lm" or "sequence_start" in data or not all(k in data for k in _STORED_LM_KEYS):
        return data
    return {**data, "sequence_start": "eos"}


def sequence_prefix(config: ModelConfig) -> list[int]:
    """The token ids a causal LM's text starts with under its ``sequence_start``: ``[bos_id]``, ``[eos_id]``
    (runs before the option) or ``[]`` (a tokenizer without a bos: the first token of a text is given, not
    predicted)."""
    return {"bos": [config.bos_id], "eos": [config.eos_id], "none": []}[config.sequence_start]


#: The field of a saved ``config.json`` (headmix's own, and a Hugging Face export's) naming the headmix that wrote it.
VERSION_FIELD = "headmix_version"


def version_tuple(version: str) -> tuple[int, ...]:
    """``(major, minor, patch)`` of a version string (``"0.2.0"``, ``"0.2.1.dev3"``: the leading digits of each)."""
    parts = []
    for part in str(version).split(".")[:3]:
        digits = ""
        for c in part:
            if not c.isdigit():
                break
            digits += c
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


class NewerVersionError(ValueError):
    """A file written by a newer headmix than the one reading it (not a damaged file: upgrading reads it)."""


def check_written_by(version: Any, source: str) -> None:
    """A one-line ``ValueError`` when ``source`` was written by a headmix newer than this one (``version``; None:
    a file of a version that recorded none, older)."""
    from .. import __version__

    if version is None:
        return
    if not isinstance(version, str):
        raise ValueError(f"{source}: {VERSION_FIELD} must be a version string, got {version!r}")
    if version_tuple(version) > version_tuple(__version__):
        raise NewerVersionError(f"{source} was written by headmix {version}, newer than this headmix {__version__}: "
                         f"upgrade headmix (pip install -U headmix) to read it")


def _same_value(a: Any, b: Any) -> bool:
    """``a == b`` with the types too (``True`` is not ``1``, ``0.01`` is not ``"0.01"``)."""
    return type(a) is type(b) and a == b


def _check_keys(cls: type, data: dict[str, Any], name: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} in {name}; known fields: {sorted(known)}")
