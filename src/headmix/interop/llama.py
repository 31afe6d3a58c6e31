"""Hugging Face Llama (``LlamaForCausalLM``) -> a headmix Llama-style :class:`CausalLanguageModel`, with
multi-head attention (the same function, exactly) or Mixture-of-Head attention (for continue-tuning, as
the MoH paper does with LLaMA3-8B).

Mapping (Llama -> headmix): ``model.embed_tokens`` -> ``decoder.embed.tokens``; per layer
``input_layernorm`` -> ``self_attn_norm.norm``, ``self_attn.{q,k,v,o}_proj`` -> ``self_attn.{q,k,v,out}_proj``,
``post_attention_layernorm`` -> ``ffn_norm.norm``, ``mlp.{gate,up,down}_proj`` -> ``ffn.{gate,up,down}_proj``;
``model.norm`` -> ``decoder.final_norm``; ``lm_head`` -> ``output_proj`` (or tied to the embedding when
``tie_word_embeddings``). RoPE with ``rope_type="default"`` maps to ``rotary=True`` with the same base;
scaled RoPE (Llama 3.1's ``"llama3"``, linear, dynamic, YaRN) is refused.

Grouped-query attention (``num_key_value_heads = G < num_attention_heads = H``): headmix MHA and MoH have one
K/V head per query head, so each K/V head's projection rows are repeated for the ``H / G`` query heads that
share it (what ``repeat_kv`` does to the activations). The function is unchanged; the parameters of
``k_proj``/``v_proj`` and the KV cache grow ``H / G`` times.

Padding: a headmix model treats the token ``pad_id`` as padding (its keys are masked); Llama has no such
rule. ``pad_id`` defaults to the checkpoint's ``pad_token_id``; without one pass a token id that never
occurs in real inputs (else 0 is used and token 0 is masked wherever it appears).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from ..attention import MixtureOfHeadsAttention, MultiHeadAttention
from ..models import AttentionConfig, CausalLanguageModel, ModelConfig, build_model
from ._hf import copy_into, first_id, require_transformers, rope_settings
from .moh import zero_moh_routers

ATTENTION_TARGETS = ("mha", "moh")


def config_from_llama(hf_config: Any, *, attention: str = "mha", num_shared_heads: int | None = None,
                      top_k: int | None = None, pad_id: int | None = None, **attention_options) -> ModelConfig:
    """The headmix :class:`ModelConfig` of a Hugging Face ``LlamaConfig``; ``attention="moh"`` with
    ``num_shared_heads`` and ``top_k`` gives MoH layers of the same heads. ``attention_options`` are extra
    :class:`AttentionConfig` fields (e.g. ``load_balance_weight``)."""
    if attention not in ATTENTION_TARGETS:
        raise ValueError(f"attention must be one of {ATTENTION_TARGETS}, got {attention!r}")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {hf_config.hidden_act!r}")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    base, fraction = rope_settings(hf_config, honours_partial=False)
    common = dict(num_heads=heads, head_dim=head_dim, bias=bool(getattr(hf_config, "attention_bias", False)),
                  dropout=float(getattr(hf_config, "attention_dropout", 0.0)), rotary=True, rotary_base=base,
                  rotary_fraction=fraction, **attention_options)
    if attention == "moh":
        if num_shared_heads is None or top_k is None:
            raise ValueError("attention='moh' needs num_shared_heads and top_k")
        att = AttentionConfig(kind="moh", num_shared_heads=num_shared_heads, top_k=top_k, **common)
    else:
        if num_shared_heads is not None or top_k is not None:
            raise ValueError("num_shared_heads and top_k apply to attention='moh' only")
        att = AttentionConfig(kind="mha", **common)
    vocab = hf_config.vocab_size
    pad = first_id(getattr(hf_config, "pad_token_id", None), 0) if pad_id is None else pad_id
    return ModelConfig(
        task="lm", vocab_size=vocab, d_model=hf_config.hidden_size, ffn_dim=hf_config.intermediate_size,
        encoder_layers=0, decoder_layers=hf_config.num_hidden_layers, decoder_self_attention=att, norm="pre",
        norm_type="rmsnorm", norm_eps=float(hf_config.rms_norm_eps), positions="rotary",
        max_positions=hf_config.max_position_embeddings, dropout=0.0, activation_dropout=0.0, ffn="swiglu",
        bias=bool(getattr(hf_config, "mlp_bias", False)), scale_embeddings=False, embedding_norm=False,
        share_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)), pad_id=pad,
        bos_id=first_id(getattr(hf_config, "bos_token_id", None), 1),
        eos_id=first_id(getattr(hf_config, "eos_token_id", None), 2), label_smoothing=0.0)


def repeat_kv_rows(weight: Tensor, kv_heads: int, heads: int) -> Tensor:
    """K/V projection rows of ``kv_heads`` heads ``(kv_heads * d_h, ...)`` repeated for ``heads`` query heads:
    query head ``h`` uses K/V head ``h // (heads / kv_heads)`` (Hugging Face's ``repeat_kv``)."""
    rows = weight.shape[0] // kv_heads
    return weight.reshape(kv_heads, rows, *weight.shape[1:]).repeat_interleave(heads // kv_heads, dim=0) \
        .reshape(heads * rows, *weight.shape[1:])


def copy_llama_attention(target: MultiHeadAttention, attn: Any, heads: int, kv_heads: int, name: str = "self_attn") -> None:
    """Copy a Hugging Face ``LlamaAttention``'s ``{q,k,v,o}_proj`` into a headmix MHA or MoH layer's
    ``{q,k,v,out}_proj``, repeating the ``kv_heads`` K/V heads for the ``heads`` query heads
    (:func:`repeat_kv_rows`); a MoH layer's routers are then zeroed (:func:`zero_moh_routers`)."""
    for ours, hf, expand in ((target.q_proj, attn.q_proj, False), (target.k_proj, attn.k_proj, True),
                             (target.v_proj, attn.v_proj, True), (target.out_proj, attn.o_proj, False)):
        for kind in ("weight", "bias"):
            t = getattr(hf, kind)
            if t is not None:
                copy_into(getattr(ours, kind), repeat_kv_rows(t, kv_heads, heads) if expand else t, f"{name}.{kind}")
    if isinstance(target, MixtureOfHeadsAttention):
        zero_moh_routers(target)


def attention_from_llama(attn: Any, *, attention: str = "mha", num_shared_heads: int | None = None,
                         top_k: int | None = None, **attention_options) -> MultiHeadAttention:
    """One Hugging Face ``LlamaAttention`` as a headmix layer: ``attention="mha"`` computes the same function
    (rotary included; the caller passes the same masks, positions start at 0 or at the cache length);
    ``attention="moh"`` gives :class:`MixtureOfHeadsAttention` with the same heads and zero routers (what it
    preserves: :mod:`headmix.interop.moh`)."""
    transformers = require_transformers()
    if not isinstance(attn, transformers.models.llama.modeling_llama.LlamaAttention):
        raise ValueError(f"attn must be a transformers LlamaAttention, got {type(attn).__name__}")
    cfg = config_from_llama(attn.config, attention=attention, num_shared_heads=num_shared_heads, top_k=top_k,
                            **attention_options)
    ref = attn.q_proj.weight
    with torch.device(ref.device):
        layer = cfg.decoder_self_attention.build(cfg.d_model).to(ref.dtype)
    heads = attn.config.num_attention_heads
    copy_llama_attention(layer, attn, heads, attn.config.num_key_value_heads or heads)
    return layer


def causal_lm_from_llama(hf_model: Any, *, attention: str = "mha", num_shared_heads: int | None = None,
                         top_k: int | None = None, pad_id: int | None = None,
                         **attention_options) -> CausalLanguageModel:
    """A headmix causal LM with the weights of a Hugging Face ``LlamaForCausalLM`` (see the module docstring).

    ``attention="mha"``: the same function (equal logits, equal greedy decoding). ``attention="moh"``: MoH
    layers with the same heads and zero routers (:func:`headmix.interop.moh.moh_from_dense` says what that
    preserves: with ``top_k`` = all routed heads, the same function)."""
    cfg = config_from_llama(hf_model.config, attention=attention, num_shared_heads=num_shared_heads, top_k=top_k,
                            pad_id=pad_id, **attention_options)
    ref = hf_model.model.embed_tokens.weight
    with torch.device(ref.device):
        model = build_model(cfg).to(ref.dtype)
    heads, kv_heads = hf_model.config.num_attention_heads, hf_model.config.num_key_value_heads or hf_model.config.num_attention_heads
    source = hf_model.model
    copy_into(model.decoder.embed.tokens.weight, source.embed_tokens.weight, "embed_tokens")
    for i, (mine, theirs) in enumerate(zip(model.decoder.layers, source.layers)):
        p = f"model.layers.{i}"
        copy_into(mine.self_attn_norm.norm.weight, theirs.input_layernorm.weight, f"{p}.input_layernorm")
        copy_into(mine.ffn_norm.norm.weight, theirs.post_attention_layernorm.weight, f"{p}.post_attention_layernorm")
        copy_llama_attention(mine.self_attn, theirs.self_attn, heads, kv_heads, f"{p}.self_attn")
        for name in ("gate_proj", "up_proj", "down_proj"):
            for kind in ("weight", "bias"):
                t = getattr(getattr(theirs.mlp, name), kind)
                if t is not None:
                    copy_into(getattr(getattr(mine.ffn, name), kind), t, f"{p}.mlp.{name}.{kind}")
    copy_into(model.decoder.final_norm.weight, source.norm.weight, "model.norm")
    if model.output_proj is not None:
        copy_into(model.output_proj.weight, hf_model.lm_head.weight, "lm_head")
    return model


def load_llama(name_or_path: str | os.PathLike, *, attention: str = "mha", num_shared_heads: int | None = None,
               top_k: int | None = None, pad_id: int | None = None, torch_dtype: torch.dtype = torch.float32,
               **attention_options) -> CausalLanguageModel:
    """Load a Llama checkpoint with ``transformers`` (a Hub name, which needs the network, or a local
    ``save_pretrained`` folder) and convert it with :func:`causal_lm_from_llama`."""
    transformers = require_transformers()
    hf_model = transformers.LlamaForCausalLM.from_pretrained(str(name_or_path)).to(torch_dtype)
    return causal_lm_from_llama(hf_model, attention=attention, num_shared_heads=num_shared_heads, top_k=top_k,
                                pad_id=pad_id, **attention_options)
