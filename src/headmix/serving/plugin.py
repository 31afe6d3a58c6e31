"""headmix's vLLM plugin: :func:`register`, the ``vllm.general_plugins`` entry point of headmix's package metadata
(``pyproject.toml``), which vLLM calls in each of its processes before it reads a model.

It makes four registrations, each once per process (vLLM may call it several times), three through vLLM's
public extension points for out-of-tree models and one through the single function that reaches into vLLM
(:func:`patch_vllm_internals`):

- the vLLM model :class:`headmix.serving.model.VllmHeadmixForCausalLM` under the architecture
  ``HeadmixForCausalLM`` (``vllm.ModelRegistry.register_model``, by name: the model module is imported when a
  headmix model is loaded, not before);
- headmix's Hugging Face config with ``transformers``' ``AutoConfig`` (``import headmix.hf``), so the
  ``config.json`` of an ``export-hf`` folder (``model_type`` ``"headmix"``, with an ``auto_map``) is read by the
  installed headmix, without ``trust_remote_code`` and without running code from the folder;
- the config format ``"headmix"`` (``vllm serve FOLDER --config-format headmix``, ``LLM(FOLDER,
  config_format="headmix")``; vLLM's ``register_config_parser``, asked first with ``get_config_parser``) for the
  folders headmix writes in its own form (a run's final model, ``CausalLanguageModel.save_pretrained``), whose
  ``config.json`` has no ``model_type``; it reads Hugging Face folders of headmix models too;
- a check of the model's and the engine's config, in vLLM's per-architecture table ``MODELS_CONFIG_MAP`` (which
  it consults when it reads a model's config and where it makes the engine's config, in the process that starts
  the engine, before any worker starts): a model vLLM cannot serve is refused there in one line
  (:func:`~headmix.serving.support.check_servable`), not 40 s later under the engine's worker tracebacks, and so is
  a ``tensor_parallel_size`` the model cannot be split over (:func:`~headmix.serving.support.check_tensor_parallel`).
  vLLM has no public hook for this: :func:`patch_vllm_internals` adds it on the vLLM versions it was tested with
  (:data:`TESTED_VLLM`) and, on any other, adds nothing and says so in one warning line (the model then refuses
  the same configs where vLLM builds it, later). (A head size the attention backend refuses is known only where
  the model is built.)

The same function makes vLLM serve a headmix model in the dtype its weights were saved in when no ``dtype`` is
given (:func:`saved_dtype_resolver`: vLLM's ``"auto"`` would serve a float32 model in bfloat16).

vLLM is imported here only inside :func:`register`: importing headmix never imports vLLM.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from .support import ARCHITECTURE, check_servable

#: The vLLM model class, as ``module:class`` (imported by vLLM when a headmix model is loaded).
MODEL_CLASS = "headmix.serving.model:VllmHeadmixForCausalLM"
#: The Hugging Face ``model_type`` of headmix's config (:class:`~headmix.hf.HeadmixConfig`).
MODEL_TYPE = "headmix"
#: The config format of headmix's own folders (``--config-format headmix``).
CONFIG_FORMAT = "headmix"
#: The vLLM releases (``vllm.__version__`` without a local part such as ``+cpu``) whose internals
#: :func:`patch_vllm_internals` was tested with (``make test-vllm``).
TESTED_VLLM = ("0.32.0",)


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
    patch_vllm_internals()


def hf_config_of_folder(folder: str | Path) -> Any:
    """The :class:`~headmix.hf.HeadmixConfig` (``architectures`` ``["HeadmixForCausalLM"]``, ``dtype`` the one its
    weights are saved in, :func:`saved_dtype`) of a folder headmix wrote, in its own form or as a Hugging Face
    folder, read as JSON (no code from the folder runs)."""
    from headmix.hf import HeadmixConfig
    from headmix.models.folders import read_folder_config

    config, _ = read_folder_config(Path(folder))
    return HeadmixConfig(headmix=config, architectures=[ARCHITECTURE], name_or_path=str(folder),
                         dtype=saved_dtype(folder))


def saved_dtype(folder: str | Path) -> str | None:
    """The dtype the folder's weights are saved in (its ``*.safetensors`` files' headers), as ``config.json``'s
    ``dtype`` names it: what vLLM serves the model in (:func:`saved_dtype_resolver`); ``None`` without weights."""
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


def _register_config_format() -> None:
    from vllm.transformers_utils.config import get_config_parser, register_config_parser
    from vllm.transformers_utils.config_parser_base import ConfigParserBase

    try:
        get_config_parser(CONFIG_FORMAT)
        return  # registered already in this process
    except ValueError:
        pass

    class HeadmixConfigParser(ConfigParserBase):
        """``config_format="headmix"``: the config of a folder headmix wrote (:func:`hf_config_of_folder`)."""

        def parse(self, model: str | Path, trust_remote_code: bool, revision: str | None = None,
                  code_revision: str | None = None, **kwargs: Any) -> tuple[dict, Any]:
            if not Path(model).is_dir():
                raise ValueError(f"config_format 'headmix' reads a local folder headmix wrote, got {model!r}")
            config = hf_config_of_folder(model)
            check_servable(config)  # refused here, before vLLM resolves the architecture
            return config.to_dict(), config

    register_config_parser(CONFIG_FORMAT)(HeadmixConfigParser)


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


def patch_vllm_internals() -> bool:
    """The one place headmix uses vLLM names that vLLM does not document for out-of-tree models, on a vLLM release
    in :data:`TESTED_VLLM`: its per-architecture config table ``MODELS_CONFIG_MAP`` gets :class:`ServableCheck` for
    ``HeadmixForCausalLM``, and its per-``model_type`` table ``MODEL_ARCH_CONFIG_CONVERTORS`` a convertor for
    ``"headmix"`` that counts the query heads the model splits over ranks (GQE's shared head, held by every rank,
    not among them); and its rule for ``dtype="auto"`` (``_resolve_auto_dtype``) keeps a headmix model's saved dtype
    (:func:`saved_dtype_resolver`). On any other release it changes nothing and logs one line naming the version (the model
    refuses the same configs where it is built, after the engine started; GQE is refused by vLLM's own head count
    above one rank). Returns whether the patch is in place."""
    import vllm

    release = str(vllm.__version__).split("+")[0]
    if release not in TESTED_VLLM:
        logging.getLogger(__name__).warning(
            "headmix's vLLM plugin does not add its early config check, GQE's head count nor the saved dtype to vLLM %s "
            "(tested with %s): a model vLLM cannot serve is refused when the engine builds it, GQE above one rank by "
            "vLLM, and a float32 model without --dtype is served in vLLM's auto dtype",
            vllm.__version__, ", ".join(TESTED_VLLM))
        return False
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.transformers_utils.model_arch_config_convertor import (MODEL_ARCH_CONFIG_CONVERTORS,
                                                                     ModelArchConfigConvertorBase)

    class SplitHeads(ModelArchConfigConvertorBase):
        """The query heads vLLM checks ``tensor_parallel_size`` against: those the model splits over the ranks.
        GQE: its ``top_k * kv_heads`` slots, split by K/V group; its shared head, which every rank holds, apart (the
        Hugging Face config's ``num_attention_heads`` counts it: 5 on 2 K/V groups, which 2 ranks do not divide)."""

        def get_total_num_attention_heads(self) -> int:
            heads = super().get_total_num_attention_heads()
            gqe = self.hf_config.model_config().decoder_self_attention
            return heads - int(gqe.shared_head is not False) if gqe.kind == "gqe" else heads

    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, ServableCheck)
    MODEL_ARCH_CONFIG_CONVERTORS.setdefault(MODEL_TYPE, SplitHeads)
    # a headmix model served in the dtype it was saved in without ``dtype`` (vLLM's private "auto" rule)
    from vllm.config import model as model_config
    from vllm.platforms import current_platform

    if not getattr(model_config._resolve_auto_dtype, "headmix_saved_dtype", False):
        model_config._resolve_auto_dtype = saved_dtype_resolver(model_config._resolve_auto_dtype,
                                                                lambda: current_platform.supported_dtypes)
    return True
