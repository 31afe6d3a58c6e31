"""A saved model's folder: ``config.json`` and ``model.safetensors``, read and written, and what kind of folder it is.

A headmix run, a ``save_pretrained`` folder or a Hugging Face folder of a headmix model; read as JSON and
safetensors, no code of a folder runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from ..storage.files import atomic_output
from .config import ModelConfig
from .config_migrations import VERSION_FIELD, check_written_by

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
#: The prefix of the headmix model's tensors in a Hugging Face folder (``HeadmixForCausalLM.model``).
HF_PREFIX = "model."


def read_folder_config(directory: Path) -> tuple[ModelConfig, bool]:
    """The headmix :class:`ModelConfig` of a folder headmix wrote, and whether it is a Hugging Face folder (an
    ``export-hf`` folder, ``HeadmixForCausalLM.save_pretrained``, a ``Trainer`` checkpoint: ``model_type``
    ``"headmix"``, the headmix config in its ``headmix`` field), read as JSON: no code from the folder runs.
    One-line errors name the file and what was expected."""
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (expected a folder headmix wrote: a run, save_pretrained, "
                                f"export-hf or a Trainer checkpoint)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or "model_type" not in data:
        return ModelConfig.load_json(path), False
    if data["model_type"] != "headmix":
        raise ValueError(f"{directory} holds a Hugging Face {data['model_type']!r} model, not a headmix one: convert "
                         f"it with headmix.interop.from_pretrained (headmix train --init-from converts it too)")
    check_written_by(data.get(VERSION_FIELD), str(path))
    if not isinstance(data.get("headmix"), dict):
        raise ValueError(f"{path} has no 'headmix' field (the headmix model config, which every folder headmix "
                         f"writes holds): not a headmix folder, or a damaged one")
    return ModelConfig.from_dict(data["headmix"], str(path)), True


def is_headmix_run(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a headmix run folder (it holds ``train_config.json``), not a Hugging Face folder."""
    return (Path(path) / "train_config.json").is_file()


def is_headmix_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a model headmix wrote: a run folder, a ``save_pretrained`` folder (headmix's own
    ``config.json``), or a Hugging Face folder of a headmix model (``export-hf``, ``HeadmixForCausalLM``'s
    ``save_pretrained``, a ``Trainer`` checkpoint: ``model_type`` ``"headmix"``); read as JSON, no code run."""
    if is_headmix_run(path):
        return True
    try:
        data = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("model_type", "headmix") == "headmix"


def save_folder(model: nn.Module, directory: str | os.PathLike) -> None:
    """Write ``model.config`` as ``config.json`` and the model's weights as ``model.safetensors`` to ``directory``,
    each atomically (:mod:`headmix.storage.files`: a temporary file in the same folder, fsync'ed, renamed; mode
    0644). Tied weights (one embedding shared by encoder, decoder and output projection) are stored once; the
    other names are recorded in the safetensors metadata (``headmix_tied``) and re-tied by
    :func:`read_folder_weights`."""
    from safetensors.torch import save_file

    from ..storage.safetensors_header import sort_metadata

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    # A parameter reachable under several names is stored once, under its first name.
    first_name: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first_name:
            tied[name] = first_name[id(p)]
        else:
            first_name[id(p)] = name
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items() if k not in tied}
    with atomic_output(directory / WEIGHTS_NAME) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt", "headmix_tied": json.dumps(tied)})
        sort_metadata(tmp)  # the same weights, the same bytes (and sha256): safetensors orders its metadata anyhow
    model.config.save_json(directory / CONFIG_NAME)


def read_folder_weights(directory: Path, device: str | torch.device, hugging_face: bool) -> dict[str, Tensor]:
    """The tensors of ``directory/model.safetensors`` on ``device``, by the headmix model's names (a Hugging Face
    folder's ``model.`` prefix dropped, ``hugging_face``), tied names restored (:func:`save_folder`): read as
    safetensors, no code of the folder runs."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not (directory / WEIGHTS_NAME).is_file():
        sharded = (directory / (WEIGHTS_NAME + ".index.json")).is_file()
        raise FileNotFoundError(f"{directory / WEIGHTS_NAME} not found" + (
            " (the weights are sharded: save the model with a larger max_shard_size)" if sharded
            else " (expected a save_pretrained folder)"))
    tensors = load_file(directory / WEIGHTS_NAME, device=str(device))
    if hugging_face:
        tensors = {k[len(HF_PREFIX):] if k.startswith(HF_PREFIX) else k: v for k, v in tensors.items()}
    with safe_open(directory / WEIGHTS_NAME, framework="pt") as f:
        tied = json.loads((f.metadata() or {}).get("headmix_tied", "{}"))
    for alias, source in tied.items():
        tensors[alias] = tensors[source]
    return tensors
