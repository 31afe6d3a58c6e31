"""headmix causal language models as Hugging Face ``transformers`` models (docs/hf.md).

Importing this package registers ``model_type="headmix"`` with ``AutoConfig`` and :class:`HeadmixForCausalLM`
with ``AutoModelForCausalLM`` (so ``AutoModelForCausalLM.from_pretrained(folder)`` loads a saved headmix model
with the installed headmix, running no code from the folder), and marks both classes for ``auto_map`` (a saved
folder also loads with ``trust_remote_code=True`` where headmix is installed but not imported). ``import
headmix`` does not import this package: ``transformers`` would add about 2 s to every headmix import (measured
in docs/hf.md), so the registration happens here, once, on request.

- :class:`HeadmixConfig`, :class:`HeadmixForCausalLM`, :class:`HeadmixCache`: the config, the model, the cache.
- :func:`run_to_hf`, :func:`hf_to_headmix`: a headmix run folder (or model folder) to a Hugging Face folder
  (weights, config, tokenizer) and back, without loss.
- :class:`DistillationTrainer`, :func:`distillation_loss` (:mod:`headmix.distillation.hf_trainer`): ``Trainer``
  with the loss distilled from a frozen parent; imported on first use (``transformers.Trainer`` is a slow import).
"""

from __future__ import annotations

from ..interop._hf import require_transformers
from ..models.config_migrations import version_tuple

#: The oldest transformers headmix.hf is tested with (``cache`` is ``past_key_values`` up to 5.23: both work).
OLDEST_TRANSFORMERS = (5, 17)

_transformers = require_transformers()
if not OLDEST_TRANSFORMERS <= version_tuple(_transformers.__version__)[:2] < (6, 0):
    raise ImportError(f"headmix.hf needs transformers >=5.17,<6 (installed: {_transformers.__version__}): "
                      f"pip install 'headmix[hf]'")

from .configuration_headmix import HeadmixConfig  # noqa: E402  (after the one-line install hint)
from .convert import hf_to_headmix, run_to_hf  # noqa: E402
from .modeling_headmix import HeadmixCache, HeadmixCausalLMOutput, HeadmixForCausalLM  # noqa: E402

_transformers.AutoConfig.register(HeadmixConfig.model_type, HeadmixConfig, exist_ok=True)
_transformers.AutoModelForCausalLM.register(HeadmixConfig, HeadmixForCausalLM, exist_ok=True)
HeadmixConfig.register_for_auto_class()
HeadmixForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["HeadmixConfig", "HeadmixForCausalLM", "HeadmixCache", "HeadmixCausalLMOutput", "run_to_hf",
           "hf_to_headmix", "DistillationTrainer", "distillation_loss"]


def __getattr__(name: str):
    if name in ("DistillationTrainer", "distillation_loss"):  # transformers.Trainer only when it is asked for
        from ..distillation import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
