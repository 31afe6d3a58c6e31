"""headmix's vLLM plugin: :func:`register`, the ``vllm.general_plugins`` entry point of headmix's package metadata
(``pyproject.toml``), which vLLM calls in each of its processes before it reads a model.

It makes four registrations and one change, each once per process (vLLM may call it several times):

- the vLLM model :class:`headmix.serving.model.VllmHeadmixForCausalLM` under the architecture
  ``HeadmixForCausalLM`` (``vllm.ModelRegistry.register_model``, by name: the model module is imported when a
  headmix model is loaded, not before);
- headmix's Hugging Face config with ``transformers``' ``AutoConfig`` (``import headmix.hf``), so the
  ``config.json`` of an ``export-hf`` folder (``model_type`` ``"headmix"``, with an ``auto_map``) is read by the
  installed headmix, without ``trust_remote_code`` and without running code from the folder;
- the config format ``"headmix"`` (``vllm serve FOLDER --config-format headmix``, ``LLM(FOLDER,
  config_format="headmix")``) for the folders headmix writes in its own form (a run's final model,
  ``CausalLanguageModel.save_pretrained``), whose ``config.json`` has no ``model_type``; it reads Hugging Face
  folders of headmix models too;
- a check of the model's and the engine's config (``MODELS_CONFIG_MAP``, vLLM's per-architecture hook, which it
  consults when it reads a model's config and where it makes the engine's config, in the process that starts the
  engine, before any worker starts): a model vLLM cannot serve is refused there in one line
  (:func:`~headmix.serving.support.check_servable`), not 40 s later under the engine's worker tracebacks, and so is
  a ``tensor_parallel_size`` the model cannot be split over (:func:`~headmix.serving.support.check_tensor_parallel`).
  (A head size the attention backend refuses is known only where the model is built.)

And it serves a headmix model in the dtype its weights were saved in when no ``dtype`` is given
(:func:`serve_in_saved_dtype`: vLLM's ``"auto"`` would serve a float32 model in bfloat16).

vLLM is imported here only inside :func:`register`: importing headmix never imports vLLM.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from .support import ARCHITECTURE, check_servable

#: The vLLM model class, as ``module:class`` (imported by vLLM when a headmix model is loaded).
MODEL_CLASS = "headmix.serving.model:VllmHeadmixForCausalLM"
#: The config format of headmix's own folders (``--config-format headmix``).
CONFIG_FORMAT = "headmix"


def register() -> None:
    """The plugin entry point: register the model, the ``AutoConfig`` and the config format (module docstring).

    vLLM calls every installed plugin whatever model it serves: where ``headmix.hf`` cannot be imported (a
    ``transformers`` older than 5.17), this logs one warning and registers nothing, rather than stop vLLM."""
    from vllm import ModelRegistry

    try:
        import headmix.hf  # noqa: F401  (registers model_type "headmix" with AutoConfig)
    except ImportError as err:
        logging.getLogger(__name__).warning("headmix's vLLM plugin registers nothing (headmix models will not "
                                            "load): %s", err)
        return
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    _register_config_format()
    _register_config_check()
    serve_in_saved_dtype()


def hf_config_of_folder(folder: str | Path) -> Any:
    """The :class:`~headmix.hf.HeadmixConfig` (``architectures`` ``["HeadmixForCausalLM"]``, ``dtype`` the one its
    weights are saved in, :func:`saved_dtype`) of a folder headmix wrote, in its own form or as a Hugging Face
    folder, read as JSON (no code from the folder runs)."""
    from headmix.hf import HeadmixConfig
    from headmix.models.transformer import read_folder_config

    config, _ = read_folder_config(Path(folder))
    return HeadmixConfig(headmix=config, architectures=[ARCHITECTURE], name_or_path=str(folder),
                         dtype=saved_dtype(folder))


def saved_dtype(folder: str | Path) -> str | None:
    """The dtype the folder's weights are saved in (its ``*.safetensors`` files' headers), as ``config.json``'s
    ``dtype`` names it: what vLLM serves the model in (:func:`serve_in_saved_dtype`); ``None`` without weights."""
    from headmix.storage.safetensors_header import FLOAT_DTYPES, floating_dtype

    stored = {floating_dtype(path) for path in sorted(Path(folder).glob("*.safetensors"))} - {None}
    return next((name for name in FLOAT_DTYPES.values() if name in stored), None)


def saved_dtype_resolver(resolve: Any, supported_dtypes: Any) -> Any:
    """vLLM's resolution of ``dtype="auto"`` (``resolve``: ``vllm.config.model._resolve_auto_dtype(model_type,
    config_dtype, *, is_pooling_model)``), except that a headmix model (``model_type`` ``"headmix"``) is served in
    the dtype its config names, the one its weights were saved in, where the platform supports it
    (``supported_dtypes()``): vLLM's own rule serves a float32 model in bfloat16 ("Downcast for float32 models"),
    whose greedy tokens then differ from headmix's. An explicit ``--dtype`` is not resolved here and wins."""
    from headmix.hf import HeadmixConfig

    def resolve_auto_dtype(model_type: str, config_dtype: Any, **kwargs: Any) -> Any:
        if model_type == HeadmixConfig.model_type and config_dtype in supported_dtypes():
            return config_dtype
        return resolve(model_type, config_dtype, **kwargs)

    resolve_auto_dtype.headmix_saved_dtype = True  # type: ignore[attr-defined]
    return resolve_auto_dtype


def serve_in_saved_dtype() -> None:
    """Install :func:`saved_dtype_resolver` in vLLM (once per process): ``vllm serve FOLDER`` and ``LLM(FOLDER)``
    serve a headmix model in the precision it was saved in, without ``--dtype``."""
    from vllm.config import model as model_config
    from vllm.platforms import current_platform

    if not getattr(model_config._resolve_auto_dtype, "headmix_saved_dtype", False):
        model_config._resolve_auto_dtype = saved_dtype_resolver(model_config._resolve_auto_dtype,
                                                                lambda: current_platform.supported_dtypes)


def _register_config_format() -> None:
    from vllm.transformers_utils import config as vllm_config
    from vllm.transformers_utils.config_parser_base import ConfigParserBase

    if CONFIG_FORMAT in vllm_config._CONFIG_FORMAT_TO_CONFIG_PARSER:
        return

    class HeadmixConfigParser(ConfigParserBase):
        """``config_format="headmix"``: the config of a folder headmix wrote (:func:`hf_config_of_folder`)."""

        def parse(self, model: str | Path, trust_remote_code: bool, revision: str | None = None,
                  code_revision: str | None = None, **kwargs: Any) -> tuple[dict, Any]:
            if not Path(model).is_dir():
                raise ValueError(f"config_format 'headmix' reads a local folder headmix wrote, got {model!r}")
            config = hf_config_of_folder(model)
            check_servable(config)  # refused here, before vLLM resolves the architecture
            return config.to_dict(), config

    vllm_config.register_config_parser(CONFIG_FORMAT)(HeadmixConfigParser)


class ServableCheck:
    """vLLM's per-architecture config hook (``vllm.model_executor.models.config.VerifyAndUpdateConfig``'s two
    methods): :func:`~headmix.serving.support.check_servable` on the config vLLM read, when it reads it, and
    :func:`~headmix.serving.support.check_tensor_parallel` where vLLM makes the engine's config, before the workers
    start."""

    @staticmethod
    def verify_and_update_model_config(model_config: Any) -> None:
        check_servable(model_config.hf_config)

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        from .support import check_tensor_parallel, servable_config

        check_tensor_parallel(servable_config(vllm_config.model_config.hf_config)[0],
                              vllm_config.parallel_config.tensor_parallel_size)


def _register_config_check() -> None:
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, ServableCheck)
