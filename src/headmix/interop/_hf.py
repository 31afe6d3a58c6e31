"""Small helpers shared by the Hugging Face conversions (``transformers`` is imported lazily)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor


def require_transformers():
    """The ``transformers`` module, or a one-line error saying how to install it."""
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - the test environment has it
        raise ImportError("headmix.interop needs Hugging Face transformers: pip install 'headmix[hf]'") from err
    return transformers


def rope_settings(config: Any, *, honours_partial: bool) -> tuple[float, float]:
    """``(rotary_base, rotary_fraction)`` of a Hugging Face config with plain RoPE, for transformers 4.45+
    (``rope_theta`` / ``rope_scaling``) and 5.x (``rope_parameters``); ``ValueError`` for scaled RoPE
    (``llama3``, ``linear``, ``dynamic``, ``yarn``, ...), which headmix's rotary embedding does not model.
    ``honours_partial``: whether the model applies ``partial_rotary_factor`` (Llama's default RoPE does not)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} (scaled RoPE) cannot be converted: headmix's rotary embedding "
                         f"is plain RoPE (rope_type 'default')")
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    fraction = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) if honours_partial else 1.0
    return float(base), float(fraction or 1.0)


def first_id(value: Any, default: int) -> int:
    """A token id from a config field that may be None, an int or a list of ints."""
    if value is None:
        return default
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else default
    return int(value)


def pad_id_of(hf_config: Any, pad_id: int | None, name_or_path: Any = None) -> int | None:
    """The padding token of a converted model: ``pad_id`` where given, else the source config's
    ``pad_token_id``, else (for a local folder ``name_or_path`` with a tokenizer) the tokenizer's; ``None``
    where none has one: no token is then padding (masks come from an attention mask), so an ordinary token
    such as id 0 is never masked by its value. A padding token that is also the config's bos or eos token (Qwen3's
    ``<|endoftext|>``) is a real token of the text, which the source attends to: ``None`` too."""
    if pad_id is not None:
        return pad_id
    found = getattr(hf_config, "pad_token_id", None)
    if found is None and name_or_path is not None and Path(name_or_path, "tokenizer_config.json").is_file():
        found = require_transformers().AutoTokenizer.from_pretrained(str(name_or_path)).pad_token_id
    if found is None:
        return None
    found = first_id(found, 0)
    real = [getattr(hf_config, f"{role}_token_id", None) for role in ("bos", "eos")]
    real = {int(i) for value in real for i in (value if isinstance(value, (list, tuple)) else [value]) if i is not None}
    return None if found in real else found


def copy_into(target: Tensor, source: Tensor, name: str) -> None:
    """``target.copy_(source)`` with a one-line error naming the tensor when the shapes differ."""
    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(f"{name}: source shape {tuple(source.shape)} does not fit {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(source)
