"""What each config field may hold, which attention kinds use which field, and the defaults of their unset fields.

Read by the dataclasses of :mod:`headmix.models.config`, their checks and the migrations of stored configs.
"""

from __future__ import annotations

from ..kernels import IMPLS
from ..routing.task_gradient import ALLOW_FLAG

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

#: The model config's option that allows a feed-forward router without a task-loss gradient (an ablation).
FFN_ALLOW_FLAG = "ffn_" + ALLOW_FLAG


def _takes_default(field: str, kind: str) -> bool:
    return kind in _DEFAULT_KINDS.get(field, _KIND_FIELDS[field])


def field_applies(field: str, kind: str) -> bool:
    """Whether the :class:`AttentionConfig` field ``field`` means something for attention ``kind`` (fields that
    apply to some kinds only must be unset for the others)."""
    return kind in _KIND_FIELDS.get(field, ATTENTION_KINDS)
