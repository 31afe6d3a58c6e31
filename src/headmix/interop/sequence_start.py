"""How a Hugging Face checkpoint's documents start (:attr:`headmix.models.ModelConfig.sequence_start`), read from the
tokenizer beside it: Llama 3's puts ``<|begin_of_text|>`` first (``"bos"``, as it was pretrained), Qwen3's adds
nothing (``"none"``). A converted model keeps it, so ``generate``, ``evaluate`` and continued training
(``headmix train --init-from``) start every text as the checkpoint's own tokenizer does."""

from __future__ import annotations

import os
from pathlib import Path

#: The convention of each family, for a checkpoint without a tokenizer beside it.
FAMILY_SEQUENCE_STARTS = {"llama": "bos", "jetmoe": "bos", "qwen3": "none"}


def folder_sequence_start(name_or_path: str | os.PathLike, model_type: str) -> str:
    """The convention of the checkpoint ``name_or_path``: its tokenizer's (:attr:`headmix.data.Tokenizer.sequence_start`)
    where the folder holds a ``tokenizer.json``, else its family's (:data:`FAMILY_SEQUENCE_STARTS`)."""
    folder = Path(name_or_path)
    if (folder / "tokenizer.json").is_file():
        from ..data import Tokenizer

        try:
            return Tokenizer.load(folder).sequence_start
        except ValueError as err:
            raise ValueError(f"{folder}: its tokenizer: {err}") from None
    return FAMILY_SEQUENCE_STARTS[model_type]
