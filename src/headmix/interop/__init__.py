"""Conversions between headmix and Hugging Face ``transformers`` models (an optional dependency:
``pip install 'headmix[hf]'``; it is imported only when a function needs it).

- :mod:`.moh`: dense attention -> Mixture-of-Head attention for continue-tuning (``moh_from_dense``).
- :mod:`.llama`: ``LlamaForCausalLM`` -> a headmix Llama-style causal LM with MHA or MoH
  (``causal_lm_from_llama``, ``load_llama``).
- :mod:`.jetmoe`: ``JetMoeAttention`` <-> headmix MoA with ``kv_heads`` (``moa_from_jetmoe_attention``,
  ``jetmoe_attention_from_moa``) and ``JetMoeForCausalLM`` <-> a headmix causal LM with MoA attention and
  the mixture-of-SwiGLU-experts feed-forward (``causal_lm_from_jetmoe``, ``causal_lm_to_jetmoe``,
  ``load_jetmoe``).

docs/implementations.md ("Models and conversions") says what each conversion preserves.
"""

from .jetmoe import (
    causal_lm_from_jetmoe,
    causal_lm_to_jetmoe,
    config_from_jetmoe,
    jetmoe_attention_from_moa,
    load_jetmoe,
    moa_from_jetmoe_attention,
)
from .llama import causal_lm_from_llama, config_from_llama, load_llama
from .moh import moh_from_dense, zero_moh_routers

__all__ = ["causal_lm_from_llama", "config_from_llama", "load_llama", "moh_from_dense", "zero_moh_routers",
           "moa_from_jetmoe_attention", "jetmoe_attention_from_moa", "config_from_jetmoe", "causal_lm_from_jetmoe",
           "causal_lm_to_jetmoe", "load_jetmoe"]
