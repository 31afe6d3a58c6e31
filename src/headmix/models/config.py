"""Model configuration: plain dataclasses, composed (a model config holds one attention config per
attention role), validated on construction and round-tripped through JSON.

``AttentionConfig`` describes one attention layer kind and builds it; ``ModelConfig`` describes a whole
Transformer (translation encoder-decoder, masked LM encoder, or causal LM decoder). This module holds their
fields, each documented; what each field may hold is in :mod:`~headmix.models.config_values`, the checks in
:mod:`~headmix.models.config_checks`, the reading of configs stored by older versions in
:mod:`~headmix.models.config_migrations`.
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
from ..routing.task_gradient import (gqe_router_without_task_gradient, moa_router_without_task_gradient,
                                     moh_router_without_task_gradient)
from ..storage.files import atomic_write
from .config_checks import AttentionConfigChecks, ModelConfigChecks, _check_keys, _choice
from .config_migrations import (VERSION_FIELD, StoredAttentionConfig, check_written_by, ffn_router_marked_as_trained,
                                head_weighting_as_trained, sequence_start_as_trained, shared_head_kv_as_trained,
                                without_foreign_defaults)
from .config_values import _KIND_DEFAULTS, ROTARY_ROLES, TASKS, _takes_default

# Importable from here as before the split (user code, the tests); each lives in the module its comment names.
from .config_values import (  # noqa: F401  lives in config_values
    ACTIVATIONS, ATTENTION_KINDS, EXPERT_IMPLS, FFN_ALLOW_FLAG, FFN_KINDS, NORM_TYPES, NORMS, POSITIONS, ROUTER_CHOICES,
    SEQUENCE_STARTS, _DEFAULT_KINDS, _KIND_FIELDS, field_applies)
from .config_checks import _fraction, _positive_int  # noqa: F401  lives in config_checks
from .config_migrations import (  # noqa: F401  lives in config_migrations
    _STORED_KEYS, _STORED_LM_KEYS, _STORED_MODEL_KEYS, NewerVersionError, _same_value, version_tuple,
    with_kind_defaults)


@dataclass
class AttentionConfig(AttentionConfigChecks, StoredAttentionConfig):
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
        gets no task gradient reads as that ablation (:meth:`marked_as_trained`). A GQE config stored before
        ``shared_head_kv`` existed reads as ``"head0"``, the shared head it was trained with
        (:func:`shared_head_kv_as_trained`)."""
        _check_keys(cls, data, name)
        data = head_weighting_as_trained(without_foreign_defaults(data))
        data = shared_head_kv_as_trained(cls.marked_as_trained(data))
        try:
            return cls(**data)
        except ValueError as err:
            message = str(err)
            if message.startswith("attention"):
                message = name + message[len("attention"):]
            raise ValueError(message) from None


#: A stored attention config dict marked as the ablation it was trained as: lives in config_migrations
#: (:meth:`headmix.models.config_migrations.StoredAttentionConfig.marked_as_trained`, which builds the config).
marked_as_trained = AttentionConfig.marked_as_trained


@dataclass
class ModelConfig(ModelConfigChecks):
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


    def attention_roles(self) -> tuple[str, ...]:
        """The attention configs this task uses."""
        return {"translation": ("encoder_self_attention", "decoder_self_attention", "cross_attention"),
                "mlm": ("encoder_self_attention",),
                "lm": ("decoder_self_attention",)}[self.task]

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
        data = sequence_start_as_trained(ffn_router_marked_as_trained(data))
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


def sequence_prefix(config: ModelConfig) -> list[int]:
    """The token ids a causal LM's text starts with under its ``sequence_start``: ``[bos_id]``, ``[eos_id]``
    (runs before the option) or ``[]`` (a tokenizer without a bos: the first token of a text is given, not
    predicted)."""
    return {"bos": [config.bos_id], "eos": [config.eos_id], "none": []}[config.sequence_start]
