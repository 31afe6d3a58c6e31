"""Conversions between headmix and Hugging Face ``transformers`` models (an optional dependency:
``pip install 'headmix[hf]'``; it is imported only when a function needs it).

- :mod:`.moh`: dense attention -> Mixture-of-Head attention for continue-tuning (``moh_from_dense``).
- :mod:`.llama`: ``LlamaForCausalLM`` -> a headmix Llama-style causal LM with MHA or MoH, keeping grouped-query
  K/V heads (``causal_lm_from_llama``, ``load_llama``; back: ``causal_lm_to_llama``); one ``LlamaAttention`` -> MHA or MoH (``attention_from_llama``).
- :mod:`.qwen3`: ``Qwen3ForCausalLM`` (grouped K/V heads, QK-norm) and the Gated Attention authors' gated Qwen3
  (headwise or elementwise output gates) -> a headmix causal LM with MHA or MoH (``causal_lm_from_qwen3``,
  ``load_qwen3``; back, ungated: ``causal_lm_to_qwen3``).
- :mod:`.jetmoe`: ``JetMoeAttention`` <-> headmix MoA with ``kv_heads`` (``moa_from_jetmoe_attention``,
  ``jetmoe_attention_from_moa``) and ``JetMoeForCausalLM`` <-> a headmix causal LM with MoA attention and
  the mixture-of-SwiGLU-experts feed-forward (``causal_lm_from_jetmoe``, ``causal_lm_to_jetmoe``,
  ``load_jetmoe``).
- :func:`from_pretrained`: a Llama, Qwen3 or JetMoe checkpoint (Hub name or local folder), converted by its
  ``model_type``.
- :mod:`.upcycle`: any dense model headmix reads (a Hugging Face folder, a headmix run, ``save_pretrained`` or
  ``export-hf`` folder) -> MoH with a learned, query-norm or random router, or the statically pruned dense
  control (``upcycle``, ``upcycle_model``, ``head_importance``).

docs/implementations.md ("Models and conversions") says what each conversion preserves.
"""

from __future__ import annotations

import difflib
import inspect
import os

from .jetmoe import (
    causal_lm_from_jetmoe,
    causal_lm_to_jetmoe,
    config_from_jetmoe,
    jetmoe_attention_from_moa,
    load_jetmoe,
    moa_from_jetmoe_attention,
)
from .llama import attention_from_llama, causal_lm_from_llama, causal_lm_to_llama, config_from_llama, load_llama
from ._hf import checkpoint_folder, require_transformers
from .moh import moh_from_dense, zero_moh_routers
from .qwen3 import causal_lm_from_qwen3, causal_lm_to_qwen3, config_from_qwen3, load_qwen3
from .sequence_start import folder_sequence_start
from .upcycle import head_importance, upcycle, upcycle_model, upcycled_config

#: The Hugging Face ``model_type`` values :func:`from_pretrained` converts, and their loaders.
LOADERS = {"llama": load_llama, "jetmoe": load_jetmoe, "qwen3": load_qwen3}
#: Their config mappings (a Hugging Face config -> the headmix :class:`~headmix.models.ModelConfig`).
CONFIGS = {"llama": config_from_llama, "jetmoe": config_from_jetmoe, "qwen3": config_from_qwen3}


def from_pretrained(name_or_path: str | os.PathLike, **options):
    """Load a Hugging Face causal LM checkpoint (a Hub name, which needs the network, or a local folder) and
    convert it to a headmix :class:`~headmix.models.CausalLanguageModel` with the loader of its
    ``model_type`` (:func:`load_llama`, :func:`load_qwen3` or :func:`load_jetmoe`; ``options`` go to it). The model
    starts its documents as the tokenizer beside the checkpoint does (:func:`folder_sequence_start`)."""
    transformers = require_transformers()
    checkpoint_folder(name_or_path, "from_pretrained")
    model_type = transformers.AutoConfig.from_pretrained(str(name_or_path)).model_type
    if model_type not in LOADERS:
        raise ValueError(f"{name_or_path} is a {model_type!r} checkpoint; headmix converts {sorted(LOADERS)}")
    loader = LOADERS[model_type]
    named = [n for n, p in inspect.signature(loader).parameters.items() if p.kind is p.KEYWORD_ONLY]
    if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(loader).parameters.values()):
        for name in options:  # JetMoe's loader takes no attention options
            if name not in named:
                close = difflib.get_close_matches(name, named, n=1)
                raise ValueError(f"{name!r} is not an option of {loader.__name__}"
                                 + (f" (did you mean {close[0]!r}?)" if close else "") + f": expected {', '.join(named)}")
    model = loader(name_or_path, **options)
    model.config = model.decoder.config = model.config.replace(
        sequence_start=folder_sequence_start(name_or_path, model_type))
    return model


__all__ = ["attention_from_llama", "causal_lm_from_llama", "config_from_llama", "load_llama", "moh_from_dense", "zero_moh_routers",
           "moa_from_jetmoe_attention", "jetmoe_attention_from_moa", "config_from_jetmoe", "causal_lm_from_jetmoe",
           "causal_lm_to_jetmoe", "load_jetmoe", "from_pretrained", "causal_lm_from_qwen3", "config_from_qwen3",
           "load_qwen3", "causal_lm_to_llama", "causal_lm_to_qwen3", "upcycle", "upcycle_model", "upcycled_config",
           "head_importance"]
