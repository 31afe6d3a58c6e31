"""Reading configs stored by older headmix versions as they were trained, and refusing those of newer ones.

Each repair of a stored dict, in the order :meth:`AttentionConfig.from_dict
<headmix.models.config.AttentionConfig.from_dict>` and :meth:`ModelConfig.from_dict
<headmix.models.config.ModelConfig.from_dict>` apply them.
"""

from __future__ import annotations

from typing import Any

from ..routing.task_gradient import ALLOW_FLAG, ffn_router_without_task_gradient
from .config_values import _KIND_DEFAULTS, _KIND_FIELDS, FFN_ALLOW_FLAG, _takes_default


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


class StoredAttentionConfig:
    """The migration of :class:`~headmix.models.config.AttentionConfig` (its base class) that builds the config it
    reads: whether the rule that refuses a router without a task-loss gradient would refuse a stored dict."""

    @classmethod
    def marked_as_trained(cls, data: dict[str, Any]) -> dict[str, Any]:
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
            refused = cls(**marked).router_without_task_gradient() is not None
        except (TypeError, ValueError):  # not a complete config: its own errors are reported where it is built
            refused = False
        return marked if refused else data


def head_weighting_as_trained(data: dict[str, Any]) -> dict[str, Any]:
    """A MoH attention config dict saved before ``head_weighting`` existed (the key absent) with ``"scaled"``, the
    weighting its weights were trained with (a saved ``null`` means the current default). Any other dict is
    returned as it is."""
    if data.get("kind") == "moh" and "head_weighting" not in data:
        data = {**data, "head_weighting": "scaled"}
    return data


def shared_head_kv_as_trained(data: dict[str, Any]) -> dict[str, Any]:
    """A stored GQE attention config dict (one that holds :data:`_STORED_KEYS`) without the key ``shared_head_kv``
    (written before the option, when the shared head read K/V head 0), with ``"head0"``: it loads, trains on and
    evaluates as it was trained. Any other dict is returned as it is (unset: the authors' mean)."""
    if data.get("kind") != "gqe" or "shared_head_kv" in data or not all(k in data for k in _STORED_KEYS):
        return data
    return {**data, "shared_head_kv": "head0"}


#: Keys every model config dict headmix has written with ``ffn="moe_swiglu"`` holds: a stored config.
_STORED_MODEL_KEYS = ("ffn_experts", "ffn_top_k", "ffn_load_balance_weight", "ffn_expert_impl", "label_smoothing")

#: Keys every causal-LM config dict headmix has written holds (``dataclasses.asdict`` writes every field): a stored
#: config, not one written by hand.
_STORED_LM_KEYS = ("pad_id", "bos_id", "eos_id", "label_smoothing", "share_embeddings")


def ffn_router_marked_as_trained(data: dict[str, Any]) -> dict[str, Any]:
    """A stored model config dict (one that holds :data:`_STORED_MODEL_KEYS`) without
    ``ffn_allow_router_without_task_gradient`` (written before the rule that refuses a feed-forward router without a
    task-loss gradient) whose ``moe_swiglu`` router gets none, with the key set true: the ablation it was trained
    as (as :meth:`~StoredAttentionConfig.marked_as_trained` for attention). Any other dict is returned as it is."""
    stored = FFN_ALLOW_FLAG not in data and all(k in data for k in _STORED_MODEL_KEYS)
    if stored and data.get("ffn") == "moe_swiglu" and ffn_router_without_task_gradient(data["ffn_experts"],
                                                                                       data["ffn_top_k"]):
        return {**data, FFN_ALLOW_FLAG: True}  # stored before the rule: the ablation it was trained as
    return data


def sequence_start_as_trained(data: dict[str, Any]) -> dict[str, Any]:
    """A stored causal-LM config dict (one that holds :data:`_STORED_LM_KEYS`) without ``sequence_start`` (written
    before the option, when every run trained on the eos-first stream ``eos text eos text2 eos``), with ``"eos"``:
    it loads, evaluates, generates and continues training as it was trained. Any other dict is returned as it is
    (unset: ``"bos"``)."""
    if data.get("task") != "lm" or "sequence_start" in data or not all(k in data for k in _STORED_LM_KEYS):
        return data
    return {**data, "sequence_start": "eos"}


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

