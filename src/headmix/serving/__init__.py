"""Serving headmix causal language models with vLLM (docs/serving.md).

- :mod:`headmix.serving.support`: what vLLM can serve, and the one-line refusals of the rest (no vLLM needed).
- :mod:`headmix.serving.plugin`: the ``vllm.general_plugins`` entry point (headmix's package metadata) that
  registers the architecture ``HeadmixForCausalLM`` with ``vllm.ModelRegistry`` and headmix's config with
  ``transformers``' ``AutoConfig``, so ``vllm serve FOLDER`` loads a folder headmix wrote without remote code.
- :mod:`headmix.serving.model`: the decoder built from vLLM's layers (paged attention, rotary, norms, linear
  and embedding layers), with headmix's own routers.

``import headmix`` (and ``import headmix.serving``) does not import vLLM: only the plugin's ``register`` and
the model module do, when vLLM calls them.
"""
