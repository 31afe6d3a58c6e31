"""Validation of model and attention configs: one-line errors naming the field and what was expected.

The dataclasses of :mod:`headmix.models.config` take their ``validate`` methods from the two classes here (errors
name the field as ``cross_attention.top_k``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import attention
from ..routing.losses import LOAD_BALANCE_FRACTIONS
from ..routing.task_gradient import ALLOW_FLAG, check_router_learns, ffn_router_without_task_gradient
from .config_values import (ACTIVATIONS, ATTENTION_KINDS, EXPERT_IMPLS, FFN_ALLOW_FLAG, FFN_KINDS, NORM_TYPES, NORMS,
                            POSITIONS, ROTARY_ROLES, ROUTER_CHOICES, SEQUENCE_STARTS, TASKS, _KIND_FIELDS)


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


def _check_keys(cls: type, data: dict[str, Any], name: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} in {name}; known fields: {sorted(known)}")


class AttentionConfigChecks:
    """The checks of :class:`~headmix.models.config.AttentionConfig` (its base class): the fields a kind does not
    use stay unset, and every field holds what its kind allows."""

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


class ModelConfigChecks:
    """The checks of :class:`~headmix.models.config.ModelConfig` (its base class), each attention config's among
    them."""

    def _validate_mosa_role(self, role: str, att: AttentionConfigChecks) -> None:
        """MoSA is self-attention, and its ``sparsity`` must leave each head two tokens of a
        ``max_positions``-long sequence."""
        if role == "cross_attention":
            raise ValueError("cross_attention.kind 'mosa' is not allowed: MoSA is self-attention only")
        if att.sparsity is not None and self.max_positions // att.sparsity < 2:
            raise ValueError(f"{role}.sparsity ({att.sparsity}) leaves fewer than two tokens per head of a "
                             f"max_positions ({self.max_positions}) sequence")

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
            if not isinstance(value, AttentionConfigChecks):  # an AttentionConfig (the one class built on it)
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
