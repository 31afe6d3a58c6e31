"""Small helpers shared by the Hugging Face conversions (``transformers`` is imported lazily)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Iterable, Sequence
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


def token_ids(value: Any) -> list[int]:
    """The token ids of a config field that may be None, an int or a list of ints (Llama 3.1's ``eos_token_id``)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(i) for i in value]
    return [int(value)]


def first_id(value: Any, default: int) -> int:
    """The first token id of a config field that may be None, an int or a list of ints (``default`` where none)."""
    ids = token_ids(value)
    return ids[0] if ids else default


def stop_ids_of(hf_config: Any, name_or_path: Any = None, generation_config: Any = None) -> list[int]:
    """Every id at which a Hugging Face source stops generating, in this order, each once: its config's
    ``eos_token_id`` (an int or a list), its generation config's (``generation_config``, and a local folder's
    ``generation_config.json``, read as JSON) and, for a local folder with a tokenizer, the tokenizer's eos token.
    Llama 3.1 Instruct: ``<|end_of_text|>``, ``<|eom_id|>``, ``<|eot_id|>``; Qwen3: ``<|im_end|>``,
    ``<|endoftext|>``."""
    found = token_ids(getattr(hf_config, "eos_token_id", None))
    if generation_config is not None:
        found += token_ids(getattr(generation_config, "eos_token_id", None))
    folder = None if name_or_path is None else Path(name_or_path)
    if folder is not None and (folder / "generation_config.json").is_file():
        try:
            data = json.loads((folder / "generation_config.json").read_text())
        except ValueError as err:
            raise ValueError(f"{folder / 'generation_config.json'} is not valid JSON ({err})") from None
        found += token_ids(data.get("eos_token_id") if isinstance(data, dict) else None)
    if folder is not None and (folder / "tokenizer_config.json").is_file():
        found += token_ids(require_transformers().AutoTokenizer.from_pretrained(str(folder)).eos_token_id)
    return list(dict.fromkeys(found))


def special_fields(hf_config: Any, pad_id: int | None, stop_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """The ``pad_id``, ``bos_id``, ``eos_id`` and ``stop_ids`` of the :class:`~headmix.models.ModelConfig` of a
    Hugging Face source: ``eos_id`` is the config's first eos id; ``stop_ids`` is every id that ends its generation
    (``stop_ids`` where given, else the config's ``eos_token_id`` list: :func:`stop_ids_of` adds a folder's
    generation config and tokenizer), ``eos_id`` first, ``None`` where that is ``eos_id`` alone; ``pad_id``
    (:func:`pad_id_of`) is ``None`` where it is a stop id (a real token of the text)."""
    eos = first_id(getattr(hf_config, "eos_token_id", None), 2)
    given = token_ids(getattr(hf_config, "eos_token_id", None)) if stop_ids is None else [int(i) for i in stop_ids]
    stops = list(dict.fromkeys([eos, *given]))
    return dict(pad_id=None if pad_id in stops else pad_id, bos_id=first_id(getattr(hf_config, "bos_token_id", None), 1),
                eos_id=eos, stop_ids=stops if len(stops) > 1 else None)


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


def check_option_names(given: Iterable[str], named: Sequence[str], kind: str, *, exclude: Iterable[str] = (),
                       what: str = "a conversion option") -> None:
    """A one-line ``ValueError`` naming the first key of ``given`` that is neither one of ``named`` nor a field of
    the ``kind`` attention's config (:class:`~headmix.models.AttentionConfig`, those :func:`field_applies` to that
    kind, less ``exclude``: the fields the source fixes), with the closest valid name when one is close; it lists
    only the options valid for that kind."""
    from ..models.config import AttentionConfig
    from ..models.config_values import field_applies

    skip = set(exclude) | set(named) | {"kind"}
    fields = [f.name for f in dataclasses.fields(AttentionConfig) if f.name not in skip and field_applies(f.name, kind)]
    for name in given:
        if name in named or name in fields:
            continue
        close = difflib.get_close_matches(str(name), [*named, *fields], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{name!r} is not {what}{hint}: expected {', '.join(named)} or a field of {kind!r} "
                         f"attention ({', '.join(fields)})")


def checkpoint_folder(name_or_path: str | os.PathLike, route: str) -> None:
    """One-line errors for what the Hugging Face route (``route``: the function called) cannot read, before
    ``transformers`` would say "Unrecognized model": a local path that does not exist, a folder that holds no model
    (no ``config.json``), and a folder headmix wrote (a run, ``save_pretrained``, ``export-hf``), which names the
    headmix route. A Hub name (``org/model``, not on disk) passes."""
    from ..models.folders import is_headmix_folder

    folder = Path(name_or_path).expanduser()
    text = str(name_or_path)
    if not folder.exists():
        if folder.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1 or os.sep != "/" and os.sep in text:
            raise FileNotFoundError(f"{route}: {text} not found")
        return  # a Hub name: transformers fetches it
    if not (folder / "config.json").is_file():
        raise ValueError(f"{route}: {text} holds no model (no config.json); expected a Hugging Face Llama, Qwen3 or "
                         f"JetMoe folder")
    if is_headmix_folder(folder):
        raise ValueError(f"{route}: {text} is a folder headmix wrote (a run, save_pretrained or export-hf), not a "
                         f"Hugging Face checkpoint: load it with headmix.models.load_pretrained (upcycle it with "
                         f"headmix.interop.upcycle; on the command line: headmix train --init-from)")
