"""headmix folders <-> Hugging Face folders, without loss.

- :func:`run_to_hf`: a finished ``headmix train lm`` run (or any folder headmix's ``save_pretrained`` wrote) ->
  a new folder that ``AutoModelForCausalLM.from_pretrained`` loads: ``config.json`` (a :class:`HeadmixConfig`
  with ``auto_map``), ``model.safetensors`` (the same tensors under ``model.``), the two headmix source files
  ``auto_map`` names and, when the run has one, its tokenizer as a ``PreTrainedTokenizerFast``
  (``tokenizer.json``, with headmix's pad / bos / eos tokens) for ``AutoTokenizer``, which starts every text as
  the model's documents started in training (its ``sequence_start``).
- :func:`hf_to_headmix`: such a folder -> the headmix :class:`~headmix.models.CausalLanguageModel` (its
  ``save_pretrained`` writes headmix's own form again).

The output folder is written whole or not at all (:func:`headmix.storage.files.atomic_directory`), and an
existing one is refused, never overwritten.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from headmix.models.transformer import CausalLanguageModel, load_pretrained
from headmix.storage.files import atomic_directory

from .modeling_headmix import HeadmixForCausalLM


def run_to_hf(source: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the causal LM of the headmix folder ``source`` (``config.json`` + ``model.safetensors``, and
    ``tokenizer/tokenizer.json`` when present; of a Hugging Face folder, an export, its tokenizer files as they are)
    as a Hugging Face folder ``out``; returns ``out``. A ``ValueError``
    for a folder that is not a causal LM, or an ``out`` that exists."""
    source, out = Path(source), Path(out)
    if out.exists():
        raise ValueError(f"out {out} exists: choose a new folder (nothing is overwritten)")
    model = load_pretrained(source)
    if not isinstance(model, CausalLanguageModel):
        raise ValueError(f"{source} holds a {type(model).__name__}; only causal LMs (task 'lm') become Hugging Face models")
    tokenizer = _hf_tokenizer(source / "tokenizer" / "tokenizer.json", model.config)
    exported = [source / name for name in HF_TOKENIZER_FILES if (source / name).is_file()]
    with atomic_directory(out) as tmp:
        HeadmixForCausalLM.from_headmix(model).save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
            _name_tokenizer_class(Path(tmp) / "tokenizer_config.json", model.config)
        elif exported:  # a Hugging Face folder (an export): its tokenizer as it is
            for file in exported:
                shutil.copyfile(file, Path(tmp) / file.name)
    return out


#: The files of a Hugging Face folder's tokenizer, copied as they are when the source is such a folder.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


#: The tokenizer class ``tokenizer_config.json`` names: the fast tokenizer every transformers release knows
#: (transformers 5 writes ``TokenizersBackend``, which releases before 5 do not).
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def _name_tokenizer_class(path: Path, config) -> None:
    """Name :data:`TOKENIZER_CLASS` in ``tokenizer_config.json``, with ``add_bos_token`` true exactly where the
    model's documents start with bos (what readers that go by it rather than ``tokenizer.json``'s post-processor
    see; transformers 5 saves neither)."""
    import json

    data = json.loads(path.read_text())
    data["tokenizer_class"] = TOKENIZER_CLASS
    data["add_bos_token"] = config.sequence_start == "bos"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def hf_to_headmix(folder: str | os.PathLike) -> CausalLanguageModel:
    """The headmix causal LM of a Hugging Face folder written by :func:`run_to_hf` or
    ``HeadmixForCausalLM.save_pretrained`` (a ``ValueError`` names a missing tensor; a headmix run folder, whose
    ``config.json`` is headmix's own, is refused in one line naming its loader)."""
    from headmix.models.folders import CONFIG_NAME, read_folder_config

    if not read_folder_config(Path(folder))[1]:
        raise ValueError(f"{folder} is a headmix run (or save_pretrained) folder, not a Hugging Face one: load it with "
                         f"headmix.models.load_pretrained, or write a Hugging Face folder with run_to_hf "
                         f"(headmix export-hf); its {CONFIG_NAME} has no model_type")
    return HeadmixForCausalLM.from_pretrained(str(folder)).to_headmix()


def _hf_tokenizer(file: Path, config):
    """The run's tokenizer as a ``PreTrainedTokenizerFast`` with headmix's special tokens, or ``None``. It starts
    every text it encodes (with ``add_special_tokens``, the default) as the model's ``sequence_start`` says and
    ``headmix generate`` does: ``bos`` first, ``eos`` first (a run trained before the option) or nothing, so
    ``tokenizer(text)``, ``generate``, ``pipeline("text-generation")``, lm-eval and vLLM feed the model what it was
    trained on; it decodes without cleaning up spaces (headmix does not); its
    ``model_max_length`` is the model's context, ``max_positions``."""
    if not file.is_file():
        return None
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer.from_file(str(file))
    special = {name: tokenizer.id_to_token(getattr(config, field))
               for name, field in (("pad_token", "pad_id"), ("bos_token", "bos_id"), ("eos_token", "eos_id"))
               if getattr(config, field) is not None}
    start = {"bos": config.bos_id, "eos": config.eos_id, "none": None}[config.sequence_start]
    if start is None:  # the post-processor the file may have (Qwen3's, Llama 3's) would add its own first token
        tokenizer.post_processor = TemplateProcessing(single="$A", pair="$A $B", special_tokens=[])
    else:
        first = tokenizer.id_to_token(start)
        tokenizer.post_processor = TemplateProcessing(single=f"{first} $A", pair=f"{first} $A {first} $B",
                                                      special_tokens=[(first, start)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False,
                                   model_max_length=config.max_positions, **special)
