"""Hugging Face JetMoe <-> headmix: the attention layer (``JetMoeAttention`` <-> MoA with ``kv_heads``) and
the whole causal LM (``JetMoeForCausalLM`` <-> a headmix Llama-style decoder with MoA attention and the
mixture-of-SwiGLU-experts feed-forward, ``ffn="moe_swiglu"``).

JetMoE's attention is MoA (Zhang et al. 2022) with ``G = num_key_value_heads`` K/V heads: the headmix layer
is ``MixtureOfAttentionHeads(kv_heads=G, renormalize="live", kv_bias=False, out_bias=True, rotary=True)``.
Parameter mapping (JetMoe -> headmix; JetMoe stores expert weights as ``(E, out, in)``, headmix as
``(E, in, out)``):

- ``experts.input_linear.weight[e]`` (``G d_h x d_m``) -> ``query_experts[e]`` transposed;
- ``experts.output_linear.weight[e]`` (``d_m x G d_h``) -> ``output_experts[e]`` transposed;
- ``experts.router.layer.weight`` -> ``router.gate.weight``; ``experts.bias`` -> ``out_bias``;
- ``kv_proj.weight`` (``2 G d_h x d_m``, keys then values) -> ``k_proj.weight``, ``v_proj.weight``.

JetMoe's query head ``j G + g`` (expert slot ``j``, K/V group ``g``) attends with K/V head ``g``, as headmix's;
its gates are a softmax over the top-k logits, which is ``renormalize="live"`` (``p_i / sum_{top-k} p``,
gradient through the denominator). Outputs and gradients are equal; the KV cache holds the same ``2 G d_h``
numbers per token.

What differs (not part of the function): JetMoe's auxiliary loss is one load-balancing loss over the
router logits of all layers pooled (MoA and MoE routers together), expert fractions summing to ``k``,
weighted by ``aux_loss_coef``; headmix sums one loss per routed layer (equal to theirs for one layer). The
conversion sets ``load_balance_weight = ffn_load_balance_weight = aux_loss_coef``, ``z_loss_weight = 0`` and
their fractions (``load_balance_fractions = ffn_load_balance_fractions = "per_token"``). JetMoe's per-layer RMSNorms use eps ``1e-6`` whatever ``rms_norm_eps`` says (only the
final norm uses it); headmix has one ``norm_eps``: the conversion takes ``1e-6``, so the final norm differs
slightly when ``rms_norm_eps != 1e-6`` (and converting back needs ``norm_eps == 1e-6``). Padding as in
:mod:`headmix.interop.llama`: the source's pad id or none (no token masked by its value).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..attention import MixtureOfAttentionHeads
from ..models import AttentionConfig, CausalLanguageModel, ModelConfig, build_model
from ._hf import checkpoint_folder, copy_into, pad_id_of, require_transformers, rope_settings, special_fields

#: JetMoe's per-layer RMSNorm epsilon (``JetMoeRMSNorm``'s default; the decoder layers do not pass
#: ``rms_norm_eps``).
JETMOE_LAYER_NORM_EPS = 1e-6


def _check_activation(hf_config: Any) -> None:
    if getattr(hf_config, "activation_function", "silu") != "silu":
        raise ValueError(f"activation_function must be 'silu' (SwiGLU experts), got {hf_config.activation_function!r}")


def attention_config_from_jetmoe(hf_config: Any) -> AttentionConfig:
    """The headmix :class:`AttentionConfig` of a ``JetMoeConfig``'s attention (see the module docstring)."""
    base, fraction = rope_settings(hf_config, honours_partial=False)
    return AttentionConfig(kind="moa", num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
                           head_dim=hf_config.kv_channels, kv_heads=hf_config.num_key_value_heads, renormalize="live",
                           bias=False, out_bias=True, rotary=True, rotary_base=base, rotary_fraction=fraction,
                           dropout=float(hf_config.attention_dropout), load_balance_weight=float(hf_config.aux_loss_coef),
                           load_balance_fractions="per_token", z_loss_weight=0.0)


def _copy_attention(moa: MixtureOfAttentionHeads, attn: Any, prefix: str) -> None:
    kv = moa.kv_heads * moa.head_dim
    copy_into(moa.query_experts, attn.experts.input_linear.weight.transpose(1, 2), f"{prefix}.experts.input_linear")
    copy_into(moa.output_experts, attn.experts.output_linear.weight.transpose(1, 2), f"{prefix}.experts.output_linear")
    copy_into(moa.router.gate.weight, attn.experts.router.layer.weight, f"{prefix}.experts.router.layer")
    copy_into(moa.k_proj.weight, attn.kv_proj.weight[:kv], f"{prefix}.kv_proj (keys)")
    copy_into(moa.v_proj.weight, attn.kv_proj.weight[kv:], f"{prefix}.kv_proj (values)")
    copy_into(moa.out_bias, attn.experts.bias, f"{prefix}.experts.bias")


def moa_from_jetmoe_attention(attn: Any) -> MixtureOfAttentionHeads:
    """A headmix MoA layer with the weights of a Hugging Face ``JetMoeAttention`` (equal outputs and
    gradients for the same positions and masks)."""
    transformers = require_transformers()
    if not isinstance(attn, transformers.models.jetmoe.modeling_jetmoe.JetMoeAttention):
        raise ValueError(f"attn must be a transformers JetMoeAttention, got {type(attn).__name__}")
    cfg = attn.config
    ref = attn.kv_proj.weight
    with torch.device(ref.device):
        moa = attention_config_from_jetmoe(cfg).build(cfg.hidden_size).to(ref.dtype)
    _copy_attention(moa, attn, "attn")
    return moa


def _check_moa_for_jetmoe(moa: MixtureOfAttentionHeads) -> None:
    if not isinstance(moa, MixtureOfAttentionHeads):
        raise ValueError(f"the attention must be a headmix MixtureOfAttentionHeads, got {type(moa).__name__}")
    if moa.router.router_type != "softmax" or moa.router.renormalize != "live":
        raise ValueError(f"JetMoe's gates are a softmax over the top-k logits: the MoA layer needs router='softmax' "
                         f"and renormalize='live', got router={moa.router.router_type!r}, renormalize={moa.router.renormalize!r}")
    if moa.k_proj.bias is not None:
        raise ValueError("JetMoe's kv_proj has no bias: the MoA layer needs kv_bias=False")
    rotary = moa.rotary
    if rotary is None or rotary.rotary_dim != moa.head_dim or rotary.interleaved:
        raise ValueError("JetMoe rotates the whole head, half-split: the MoA layer needs rotary=True with "
                         "rotary_fraction=1 and the half-split layout")


def jetmoe_config_for(moa: MixtureOfAttentionHeads, **fields) -> Any:
    """A ``JetMoeConfig`` whose attention has the MoA layer's shapes; ``fields`` set the rest."""
    transformers = require_transformers()
    return transformers.JetMoeConfig(hidden_size=moa.embed_dim, num_local_experts=moa.num_experts,
                                     num_experts_per_tok=moa.top_k, num_key_value_heads=moa.kv_heads,
                                     kv_channels=moa.head_dim, attention_dropout=moa.dropout,
                                     rope_parameters={"rope_type": "default", "rope_theta": moa.rotary.base}, **fields)


def _copy_attention_back(attn: Any, moa: MixtureOfAttentionHeads, prefix: str) -> None:
    with torch.no_grad():
        copy_into(attn.experts.input_linear.weight, moa.query_experts.transpose(1, 2), f"{prefix}.query_experts")
        copy_into(attn.experts.output_linear.weight, moa.output_experts.transpose(1, 2), f"{prefix}.output_experts")
        copy_into(attn.experts.router.layer.weight, moa.router.gate.weight, f"{prefix}.router.gate")
        copy_into(attn.kv_proj.weight, torch.cat([moa.k_proj.weight, moa.v_proj.weight]), f"{prefix}.k_proj/v_proj")
        if moa.out_bias is None:
            attn.experts.bias.zero_()
        else:
            copy_into(attn.experts.bias, moa.out_bias, f"{prefix}.out_bias")


def jetmoe_attention_from_moa(moa: MixtureOfAttentionHeads, layer_idx: int = 0) -> Any:
    """A Hugging Face ``JetMoeAttention`` (with its own ``JetMoeConfig``) computing what the headmix MoA layer
    computes; the layer must be in JetMoe's form (softmax router with ``renormalize="live"``, no K/V bias,
    whole-head half-split rotary). A missing output bias becomes JetMoe's bias of zeros."""
    transformers = require_transformers()
    _check_moa_for_jetmoe(moa)
    config = jetmoe_config_for(moa)
    ref = moa.query_experts
    with torch.device(ref.device):
        attn = transformers.models.jetmoe.modeling_jetmoe.JetMoeAttention(config, layer_idx).to(ref.dtype)
    _copy_attention_back(attn, moa, "attn")
    return attn


# --------------------------------------------------------------------------------------------------
# Whole models
# --------------------------------------------------------------------------------------------------
def config_from_jetmoe(hf_config: Any, *, pad_id: int | None = None) -> ModelConfig:
    """The headmix :class:`ModelConfig` of a ``JetMoeConfig`` (see the module docstring)."""
    _check_activation(hf_config)
    return ModelConfig(
        task="lm", vocab_size=hf_config.vocab_size, d_model=hf_config.hidden_size, ffn_dim=hf_config.intermediate_size,
        encoder_layers=0, decoder_layers=hf_config.num_hidden_layers,
        decoder_self_attention=attention_config_from_jetmoe(hf_config), norm="pre", norm_type="rmsnorm",
        norm_eps=JETMOE_LAYER_NORM_EPS, positions="rotary", max_positions=hf_config.max_position_embeddings,
        dropout=0.0, activation_dropout=0.0, ffn="moe_swiglu", ffn_experts=hf_config.num_local_experts,
        ffn_top_k=hf_config.num_experts_per_tok, ffn_load_balance_weight=float(hf_config.aux_loss_coef),
        ffn_load_balance_fractions="per_token", bias=True,
        scale_embeddings=False, embedding_norm=False, share_embeddings=bool(hf_config.tie_word_embeddings),
        **special_fields(hf_config, pad_id_of(hf_config, pad_id)), label_smoothing=0.0)


def _layer_pairs(model: CausalLanguageModel, hf_model: Any):
    for i, (mine, theirs) in enumerate(zip(model.decoder.layers, hf_model.model.layers)):
        yield f"model.layers.{i}", mine, theirs


def causal_lm_from_jetmoe(hf_model: Any, *, pad_id: int | None = None) -> CausalLanguageModel:
    """A headmix causal LM with the weights of a Hugging Face ``JetMoeForCausalLM``: equal logits and greedy
    decoding (the final norm's eps aside, see the module docstring)."""
    cfg = config_from_jetmoe(hf_model.config, pad_id=pad_id)
    ref = hf_model.model.embed_tokens.weight
    with torch.device(ref.device):
        model = build_model(cfg).to(ref.dtype)
    copy_into(model.decoder.embed.tokens.weight, ref, "model.embed_tokens")
    for p, mine, theirs in _layer_pairs(model, hf_model):
        copy_into(mine.self_attn_norm.norm.weight, theirs.input_layernorm.weight, f"{p}.input_layernorm")
        copy_into(mine.ffn_norm.norm.weight, theirs.post_attention_layernorm.weight, f"{p}.post_attention_layernorm")
        _copy_attention(mine.self_attn, theirs.self_attention, f"{p}.self_attention")
        moe, ffn = theirs.mlp, mine.ffn
        copy_into(ffn.input_experts, moe.input_linear.weight.transpose(1, 2), f"{p}.mlp.input_linear")
        copy_into(ffn.output_experts, moe.output_linear.weight.transpose(1, 2), f"{p}.mlp.output_linear")
        copy_into(ffn.router.gate.weight, moe.router.layer.weight, f"{p}.mlp.router.layer")
        copy_into(ffn.out_bias, moe.bias, f"{p}.mlp.bias")
    copy_into(model.decoder.final_norm.weight, hf_model.model.norm.weight, "model.norm")
    if model.output_proj is not None:
        copy_into(model.output_proj.weight, hf_model.lm_head.weight, "lm_head")
    return model


def causal_lm_to_jetmoe(model: CausalLanguageModel) -> Any:
    """A Hugging Face ``JetMoeForCausalLM`` computing what a headmix causal LM in JetMoe's form computes:
    pre-norm RMSNorm with ``norm_eps=1e-6``, rotary positions, MoA attention in JetMoe's form (see
    :func:`jetmoe_attention_from_moa`) and ``ffn="moe_swiglu"`` with the attention's ``num_experts`` and
    ``top_k``, no embedding scaling or norm. Missing output biases become zeros."""
    transformers = require_transformers()
    cfg = model.config
    if not isinstance(model, CausalLanguageModel):
        raise ValueError(f"model must be a headmix CausalLanguageModel, got {type(model).__name__}")
    att = cfg.decoder_self_attention
    checks = [
        (cfg.norm == "pre" and cfg.norm_type == "rmsnorm", "pre-norm RMSNorm (norm='pre', norm_type='rmsnorm')"),
        (cfg.norm_eps == JETMOE_LAYER_NORM_EPS, f"norm_eps={JETMOE_LAYER_NORM_EPS} (JetMoe's layer norms)"),
        (cfg.positions == "rotary", "positions='rotary'"),
        (not cfg.scale_embeddings and not cfg.embedding_norm, "scale_embeddings=False and embedding_norm=False"),
        (cfg.ffn == "moe_swiglu", "ffn='moe_swiglu'"),
        (att.kind == "moa" and cfg.ffn_experts == att.num_experts and cfg.ffn_top_k == att.top_k,
         "MoA attention with num_experts == ffn_experts and top_k == ffn_top_k (JetMoe shares them)"),
    ]
    for ok, what in checks:
        if not ok:
            raise ValueError(f"the model is not in JetMoe's form: it needs {what}")
    first = model.decoder.layers[0].self_attn
    _check_moa_for_jetmoe(first)
    hf_config = jetmoe_config_for(
        first, vocab_size=cfg.vocab_size, num_hidden_layers=cfg.decoder_layers, intermediate_size=cfg.ffn_dim,
        max_position_embeddings=cfg.max_positions, activation_function="silu", tie_word_embeddings=cfg.share_embeddings,
        rms_norm_eps=cfg.norm_eps, aux_loss_coef=att.load_balance_weight, pad_token_id=cfg.pad_id,
        bos_token_id=cfg.bos_id, eos_token_id=cfg.eos_token_id_field())
    ref = model.decoder.embed.tokens.weight
    with torch.device(ref.device):
        hf_model = transformers.JetMoeForCausalLM(hf_config).to(ref.dtype).eval()
    with torch.no_grad():
        copy_into(hf_model.model.embed_tokens.weight, ref, "decoder.embed.tokens")
        for p, mine, theirs in _layer_pairs(model, hf_model):
            _check_moa_for_jetmoe(mine.self_attn)
            copy_into(theirs.input_layernorm.weight, mine.self_attn_norm.norm.weight, f"{p}.self_attn_norm")
            copy_into(theirs.post_attention_layernorm.weight, mine.ffn_norm.norm.weight, f"{p}.ffn_norm")
            _copy_attention_back(theirs.self_attention, mine.self_attn, f"{p}.self_attn")
            moe, ffn = theirs.mlp, mine.ffn
            copy_into(moe.input_linear.weight, ffn.input_experts.transpose(1, 2), f"{p}.ffn.input_experts")
            copy_into(moe.output_linear.weight, ffn.output_experts.transpose(1, 2), f"{p}.ffn.output_experts")
            copy_into(moe.router.layer.weight, ffn.router.gate.weight, f"{p}.ffn.router.gate")
            if ffn.out_bias is None:
                moe.bias.zero_()
            else:
                copy_into(moe.bias, ffn.out_bias, f"{p}.ffn.out_bias")
        copy_into(hf_model.model.norm.weight, model.decoder.final_norm.weight, "decoder.final_norm")
        if model.output_proj is not None:
            copy_into(hf_model.lm_head.weight, model.output_proj.weight, "output_proj")
    return hf_model


def load_jetmoe(name_or_path: str | os.PathLike, *, pad_id: int | None = None,
                torch_dtype: torch.dtype = torch.float32) -> CausalLanguageModel:
    """Load a JetMoe checkpoint with ``transformers`` (a Hub name such as ``jetmoe/jetmoe-8b``, which needs the
    network, or a local ``save_pretrained`` folder) and convert it with :func:`causal_lm_from_jetmoe`."""
    transformers = require_transformers()
    checkpoint_folder(name_or_path, "load_jetmoe")
    hf_model = transformers.JetMoeForCausalLM.from_pretrained(str(name_or_path)).to(torch_dtype)
    return causal_lm_from_jetmoe(hf_model, pad_id=pad_id_of(hf_model.config, pad_id, name_or_path))
