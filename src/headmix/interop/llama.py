"""Hugging Face Llama (``LlamaForCausalLM``) -> a headmix Llama-style :class:`CausalLanguageModel`, with
multi-head attention (the same function, exactly) or Mixture-of-Head attention (for continue-tuning, as
the MoH paper does with LLaMA3-8B). The same mapping serves Qwen3 (:mod:`headmix.interop.qwen3`: Llama plus
QK-norm and, in the Gated Attention authors' variant, output gates).

Mapping (Llama -> headmix): ``model.embed_tokens`` -> ``decoder.embed.tokens``; per layer
``input_layernorm`` -> ``self_attn_norm.norm``, ``self_attn.{q,k,v,o}_proj`` -> ``self_attn.{q,k,v,out}_proj``,
``post_attention_layernorm`` -> ``ffn_norm.norm``, ``mlp.{gate,up,down}_proj`` -> ``ffn.{gate,up,down}_proj``;
``model.norm`` -> ``decoder.final_norm``; ``lm_head`` -> ``output_proj`` (or tied to the embedding when
``tie_word_embeddings``). RoPE with ``rope_type="default"`` maps to ``rotary=True`` with the same base;
scaled RoPE (Llama 3.1's ``"llama3"``, linear, dynamic, YaRN) is refused. Every tensor of the source is
copied exactly once (a tensor left over, or one missing, is a one-line error).

Grouped-query attention (``num_key_value_heads = G < num_attention_heads = H``): the headmix layer gets
``kv_heads=G`` and the same ``k_proj``/``v_proj`` rows; query head ``h`` uses K/V head ``h // (H / G)`` as in
Llama's ``repeat_kv``, and the KV cache holds ``G`` heads, the source's bytes per token. ``expand_kv=True``
instead repeats each K/V head's projection rows for the ``H / G`` query heads that share it
(:func:`repeat_kv_rows`, what ``repeat_kv`` does to the activations): the same function in a layer with one
K/V head per query head, with ``H / G`` times the K/V parameters and KV cache (for code that needs
``kv_heads == num_heads``).

Padding: a headmix model with a ``pad_id`` treats that token as padding (its keys are masked); Llama has no
such rule. ``pad_id`` is the one given, else the checkpoint's ``pad_token_id``, else its tokenizer's (a local
folder); where none has one the converted model has ``pad_id=None``: no token is padding, every token
(id 0 included) is attended to, and padding comes only from an attention mask (:func:`headmix.interop._hf.pad_id_of`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..attention import MixtureOfHeadsAttention, MultiHeadAttention
from ..models import AttentionConfig, CausalLanguageModel, ModelConfig, build_model
from ._hf import (check_option_names, checkpoint_folder, copy_into, pad_id_of, require_transformers, rope_settings,
                  special_fields, stop_ids_of)
from .moh import zero_moh_routers

ATTENTION_TARGETS = ("mha", "moh")
#: The named options of the Llama-family conversions (``load_llama``, ``load_qwen3``, ``from_pretrained``); the other
#: keywords are fields of the target's attention config.
CONVERSION_OPTIONS = ("attention", "num_shared_heads", "top_k", "pad_id", "stop_ids", "expand_kv", "torch_dtype")
#: Attention fields the checkpoint fixes (not options); Qwen3's mapping sets ``qk_norm`` and ``output_gate`` itself.
FROM_CHECKPOINT = ("num_heads", "head_dim", "key_dim", "kv_heads", "num_experts", "qk_norm", "output_gate")


def check_conversion_options(attention: str, attention_options: dict[str, Any]) -> None:
    """A one-line error naming a keyword of a Llama-family conversion that is neither one of its options nor a
    field of the target attention (``num_shared_head=4``, ``routr=...``, ``keep_heads=...``), listing only those
    valid for ``attention`` (:func:`headmix.interop._hf.check_option_names`)."""
    from .upcycle import MHA_ONLY

    upcycling = [name for name in attention_options if name in MHA_ONLY]
    if upcycling:
        raise ValueError(f"{upcycling[0]!r} is an upcycling option, not a conversion option: convert and upcycle with "
                         f"headmix.interop.upcycle(folder, ...)")
    if attention in ATTENTION_TARGETS:
        given = [name for name in attention_options if name != "kv_heads"]  # decoder_config says where it comes from
        check_option_names(given, CONVERSION_OPTIONS, attention, exclude=FROM_CHECKPOINT)


def config_from_llama(hf_config: Any, *, attention: str = "mha", num_shared_heads: int | None = None,
                      top_k: int | None = None, pad_id: int | None = None, expand_kv: bool = False,
                      stop_ids: Sequence[int] | None = None, **attention_options) -> ModelConfig:
    """The headmix :class:`ModelConfig` of a Hugging Face ``LlamaConfig``; ``attention="moh"`` with
    ``num_shared_heads`` and ``top_k`` gives MoH layers of the same heads. ``kv_heads`` is the checkpoint's
    ``num_key_value_heads`` (``expand_kv=True``: one K/V head per query head, see the module docstring).
    ``attention_options`` are extra :class:`AttentionConfig` fields (e.g. ``load_balance_weight``, or
    ``route_per_group=True`` for MoH routed within each K/V group). ``stop_ids``: every id that ends the
    source's generation (default: the config's ``eos_token_id``, an int or a list; :func:`load_llama` adds the
    folder's generation config and tokenizer): the model's ``stop_ids``, its ``eos_id`` the config's first."""
    check_conversion_options(attention, attention_options)
    return decoder_config(hf_config, attention=attention, num_shared_heads=num_shared_heads, top_k=top_k,
                          pad_id=pad_id, expand_kv=expand_kv, stop_ids=stop_ids, **attention_options)


def decoder_config(hf_config: Any, *, attention: str, num_shared_heads: int | None, top_k: int | None,
                   pad_id: int | None, expand_kv: bool, honours_partial_rotary: bool = False,
                   attention_bias: bool | None = None, stop_ids: Sequence[int] | None = None,
                   **attention_options) -> ModelConfig:
    """The headmix :class:`ModelConfig` of a Llama-family config (Llama, Qwen3): see
    :func:`config_from_llama`. ``attention_bias`` overrides the config's ``attention_bias`` (the Gated
    Attention authors' Qwen3 calls it ``qkv_bias``)."""
    if attention not in ATTENTION_TARGETS:
        raise ValueError(f"attention must be one of {ATTENTION_TARGETS}, got {attention!r}")
    if not isinstance(expand_kv, bool):
        raise ValueError(f"expand_kv must be a bool, got {expand_kv!r}")
    if "kv_heads" in attention_options:
        raise ValueError("kv_heads comes from the checkpoint's num_key_value_heads (expand_kv=True repeats them)")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {hf_config.hidden_act!r}")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    base, fraction = rope_settings(hf_config, honours_partial=honours_partial_rotary)
    if attention_bias is None:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
    common = dict(num_heads=heads, head_dim=head_dim, bias=attention_bias,
                  dropout=float(getattr(hf_config, "attention_dropout", 0.0)), rotary=True, rotary_base=base,
                  rotary_fraction=fraction, **attention_options)
    if kv_heads != heads and not expand_kv:
        common["kv_heads"] = kv_heads
    if attention == "moh":
        for name, value, least in (("num_shared_heads", num_shared_heads, 0), ("top_k", top_k, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"attention='moh' needs {name}, a {'positive' if least else 'non-negative'} "
                                 f"integer, got {value!r}")
        att = AttentionConfig(kind="moh", num_shared_heads=num_shared_heads, top_k=top_k, **common)
    else:
        if num_shared_heads is not None or top_k is not None:
            raise ValueError("num_shared_heads and top_k apply to attention='moh' only")
        att = AttentionConfig(kind="mha", **common)
    vocab = hf_config.vocab_size
    return ModelConfig(
        task="lm", vocab_size=vocab, d_model=hf_config.hidden_size, ffn_dim=hf_config.intermediate_size,
        encoder_layers=0, decoder_layers=hf_config.num_hidden_layers, decoder_self_attention=att, norm="pre",
        norm_type="rmsnorm", norm_eps=float(hf_config.rms_norm_eps), positions="rotary",
        max_positions=hf_config.max_position_embeddings, dropout=0.0, activation_dropout=0.0, ffn="swiglu",
        bias=bool(getattr(hf_config, "mlp_bias", False)), scale_embeddings=False, embedding_norm=False,
        share_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        **special_fields(hf_config, pad_id_of(hf_config, pad_id), stop_ids), label_smoothing=0.0)


def repeat_kv_rows(weight: Tensor, kv_heads: int, heads: int) -> Tensor:
    """K/V projection rows of ``kv_heads`` heads ``(kv_heads * d_h, ...)`` repeated for ``heads`` query heads:
    query head ``h`` uses K/V head ``h // (heads / kv_heads)`` (Hugging Face's ``repeat_kv``)."""
    rows = weight.shape[0] // kv_heads
    return weight.reshape(kv_heads, rows, *weight.shape[1:]).repeat_interleave(heads // kv_heads, dim=0) \
        .reshape(heads * rows, *weight.shape[1:])


class SourceTensors:
    """The tensors of a source state dict, each to be taken exactly once: :meth:`take` returns a tensor
    (``None`` for an absent optional one), :meth:`scope` a view of the names under a prefix (sharing what
    is left), and :meth:`finish` raises a one-line error naming the tensors under the prefix that no mapping
    took (a conversion that forgot one, e.g. a QK-norm weight)."""

    def __init__(self, state: Mapping[str, Tensor], prefix: str = ""):
        self.prefix = prefix
        self.left = dict(state)

    def scope(self, prefix: str) -> SourceTensors:
        view = SourceTensors({}, self.prefix + prefix)
        view.left = self.left
        return view

    def take(self, name: str, required: bool = True) -> Tensor | None:
        key = self.prefix + name
        if key not in self.left:
            if required:
                raise ValueError(f"{key}: missing from the source checkpoint")
            return None
        return self.left.pop(key)

    def finish(self, ignore: tuple[str, ...] = ()) -> None:
        left = sorted(k for k in self.left if k.startswith(self.prefix) and k[len(self.prefix):] not in ignore)
        if left:
            raise ValueError(f"source tensors with no place in the headmix model: {left}")


def copy_linear(target: torch.nn.Linear, source: SourceTensors, name: str,
                rows: Callable[[Tensor], Tensor] = lambda t: t) -> None:
    """Copy ``name.weight`` (and ``name.bias`` where the source has one) into ``target``, through ``rows``
    (a map of the output rows, e.g. :func:`repeat_kv_rows`)."""
    copy_into(target.weight, rows(source.take(f"{name}.weight")), source.prefix + f"{name}.weight")
    bias = source.take(f"{name}.bias", required=False)
    if (bias is None) != (target.bias is None):
        raise ValueError(f"{source.prefix}{name}.bias: {'absent' if bias is None else 'present'} in the source, "
                         f"{'present' if bias is None else 'absent'} in the headmix layer")
    if bias is not None:
        copy_into(target.bias, rows(bias), source.prefix + f"{name}.bias")


def copy_llama_attention(target: MultiHeadAttention, source: SourceTensors, heads: int, kv_heads: int,
                         q_rows: Callable[[SourceTensors], None] | None = None) -> None:
    """Copy a Llama-family attention's ``{q,k,v,o}_proj`` (and Qwen3's ``{q,k}_norm``) from ``source`` into a
    headmix MHA or MoH layer's ``{q,k,v,out}_proj`` (``{q,k}_norm``). The K/V rows are copied as they are
    when the layer has the source's ``kv_heads``, and repeated for the ``heads`` query heads
    (:func:`repeat_kv_rows`) when it has one K/V head per query head (``expand_kv``). ``q_rows`` copies
    ``q_proj`` instead of the plain copy (the gated Qwen3's query and gate rows). A MoH layer's routers are
    then zeroed (:func:`zero_moh_routers`)."""
    layer_kv = target.k_proj.weight.shape[0] // target.key_dim
    expand = (lambda t: repeat_kv_rows(t, kv_heads, heads)) if layer_kv != kv_heads else (lambda t: t)
    if q_rows is None:
        copy_linear(target.q_proj, source, "q_proj")
    else:
        q_rows(source)
    copy_linear(target.k_proj, source, "k_proj", expand)
    copy_linear(target.v_proj, source, "v_proj", expand)
    copy_linear(target.out_proj, source, "o_proj")
    for norm in ("q_norm", "k_norm"):
        mine = getattr(target, norm, None)
        weight = source.take(f"{norm}.weight", required=mine is not None)
        if weight is not None:
            if mine is None:
                raise ValueError(f"{source.prefix}{norm}.weight: the source has QK-norm, the headmix layer has not")
            copy_into(mine.weight, weight, source.prefix + f"{norm}.weight")
    if isinstance(target, MixtureOfHeadsAttention):
        zero_moh_routers(target)


def attention_from_llama(attn: Any, *, attention: str = "mha", num_shared_heads: int | None = None,
                         top_k: int | None = None, expand_kv: bool = False, **attention_options) -> MultiHeadAttention:
    """One Hugging Face ``LlamaAttention`` as a headmix layer: ``attention="mha"`` computes the same function
    (rotary included; the caller passes the same masks, positions start at 0 or at the cache length);
    ``attention="moh"`` gives :class:`MixtureOfHeadsAttention` with the same heads and zero routers (what it
    preserves: :mod:`headmix.interop.moh`). ``kv_heads`` is the source's (``expand_kv=True``: repeated)."""
    transformers = require_transformers()
    if not isinstance(attn, transformers.models.llama.modeling_llama.LlamaAttention):
        raise ValueError(f"attn must be a transformers LlamaAttention, got {type(attn).__name__}")
    cfg = config_from_llama(attn.config, attention=attention, num_shared_heads=num_shared_heads, top_k=top_k,
                            expand_kv=expand_kv, **attention_options)
    ref = attn.q_proj.weight
    with torch.device(ref.device):
        layer = cfg.decoder_self_attention.build(cfg.d_model).to(ref.dtype)
    heads = attn.config.num_attention_heads
    source = SourceTensors(attn.state_dict())
    copy_llama_attention(layer, source, heads, attn.config.num_key_value_heads or heads)
    source.finish()
    return layer


def causal_lm_from_state(cfg: ModelConfig, hf_config: Any, state: Mapping[str, Tensor],
                         q_rows: Callable[[MultiHeadAttention, SourceTensors], None] | None = None) -> CausalLanguageModel:
    """A headmix causal LM of ``cfg`` with the tensors of a Llama-family state dict (``LlamaForCausalLM``,
    ``Qwen3ForCausalLM`` names), each copied once (see the module docstring); ``q_rows(layer, source)``
    replaces the plain ``q_proj`` copy. ``lm_head.weight`` is ignored when the embeddings are tied."""
    ref = state["model.embed_tokens.weight"]
    with torch.device(ref.device):
        model = build_model(cfg).to(ref.dtype)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    source = SourceTensors(state)
    copy_into(model.decoder.embed.tokens.weight, source.take("model.embed_tokens.weight"), "model.embed_tokens.weight")
    for i, mine in enumerate(model.decoder.layers):
        layer = source.scope(f"model.layers.{i}.")
        copy_into(mine.self_attn_norm.norm.weight, layer.take("input_layernorm.weight"), f"{layer.prefix}input_layernorm")
        copy_into(mine.ffn_norm.norm.weight, layer.take("post_attention_layernorm.weight"),
                  f"{layer.prefix}post_attention_layernorm")
        copy_llama_attention(mine.self_attn, layer.scope("self_attn."), heads, kv_heads,
                             None if q_rows is None else (lambda s, target=mine.self_attn: q_rows(target, s)))
        mlp = layer.scope("mlp.")
        for name in ("gate_proj", "up_proj", "down_proj"):
            copy_linear(getattr(mine.ffn, name), mlp, name)
    copy_into(model.decoder.final_norm.weight, source.take("model.norm.weight"), "model.norm.weight")
    if model.output_proj is not None:
        copy_into(model.output_proj.weight, source.take("lm_head.weight"), "lm_head.weight")
    source.finish(ignore=("lm_head.weight",) if model.output_proj is None else ())
    return model


def causal_lm_from_llama(hf_model: Any, *, attention: str = "mha", num_shared_heads: int | None = None,
                         top_k: int | None = None, pad_id: int | None = None, expand_kv: bool = False,
                         stop_ids: Sequence[int] | None = None, **attention_options) -> CausalLanguageModel:
    """A headmix causal LM with the weights of a Hugging Face ``LlamaForCausalLM`` (see the module docstring).

    ``attention="mha"``: the same function (equal logits, equal greedy decoding), with the source's
    ``kv_heads``. ``attention="moh"``: MoH layers with the same heads and zero routers
    (:func:`headmix.interop.moh.moh_from_dense` says what that preserves: with ``top_k`` = all routed heads,
    the same function). ``stop_ids``: by default the config's and the generation config's eos ids."""
    if stop_ids is None:
        stop_ids = stop_ids_of(hf_model.config, generation_config=getattr(hf_model, "generation_config", None))
    cfg = config_from_llama(hf_model.config, attention=attention, num_shared_heads=num_shared_heads, top_k=top_k,
                            pad_id=pad_id, expand_kv=expand_kv, stop_ids=stop_ids, **attention_options)
    return causal_lm_from_state(cfg, hf_model.config, hf_model.state_dict())


def load_llama(name_or_path: str | os.PathLike, *, attention: str = "mha", num_shared_heads: int | None = None,
               top_k: int | None = None, pad_id: int | None = None, torch_dtype: torch.dtype = torch.float32,
               expand_kv: bool = False, stop_ids: Sequence[int] | None = None,
               **attention_options) -> CausalLanguageModel:
    """Load a Llama checkpoint with ``transformers`` (a Hub name, which needs the network, or a local
    ``save_pretrained`` folder) and convert it with :func:`causal_lm_from_llama`. ``stop_ids``: by default every
    stop id of the source (its config's, its generation config's and its tokenizer's eos:
    :func:`headmix.interop._hf.stop_ids_of`)."""
    transformers = require_transformers()
    checkpoint_folder(name_or_path, "load_llama")
    hf_model = transformers.LlamaForCausalLM.from_pretrained(str(name_or_path)).to(torch_dtype)
    if stop_ids is None:
        stop_ids = stop_ids_of(hf_model.config, name_or_path, hf_model.generation_config)
    return causal_lm_from_llama(hf_model, attention=attention, num_shared_heads=num_shared_heads, top_k=top_k,
                                pad_id=pad_id_of(hf_model.config, pad_id, name_or_path), expand_kv=expand_kv,
                                stop_ids=stop_ids, **attention_options)


#: headmix parameter names -> Llama-family (``LlamaForCausalLM``, ``Qwen3ForCausalLM``) names, in order.
HF_NAMES = (("decoder.embed.tokens.", "model.embed_tokens."), ("decoder.final_norm.", "model.norm."),
            ("output_proj.", "lm_head."), ("decoder.layers.", "model.layers."),
            (".self_attn_norm.norm.", ".input_layernorm."), (".ffn_norm.norm.", ".post_attention_layernorm."),
            (".self_attn.out_proj.", ".self_attn.o_proj."), (".ffn.", ".mlp."))


def hf_decoder_from_causal_lm(model: CausalLanguageModel, family: str) -> Any:
    """A Hugging Face ``LlamaForCausalLM`` (``family="llama"``) or ``Qwen3ForCausalLM`` (``"qwen3"``) computing
    what a headmix causal LM in that form computes, with its ``kv_heads`` (the inverse of
    :func:`causal_lm_from_llama` / :func:`headmix.interop.qwen3.causal_lm_from_qwen3` with ``attention="mha"``);
    a one-line error names what the model lacks (MoH routers, output gates, ... have no place there)."""
    transformers = require_transformers()
    if not isinstance(model, CausalLanguageModel):
        raise ValueError(f"model must be a headmix CausalLanguageModel, got {type(model).__name__}")
    cfg, att = model.config, model.config.decoder_self_attention
    if att.kind != "mha":
        raise ValueError(f"the model is not in {family}'s form: it needs MHA attention, not {att.kind!r}")
    first = model.decoder.layers[0].self_attn
    projections = (first.q_proj, first.k_proj, first.v_proj, first.out_proj)
    qk_norm = family == "qwen3"
    checks = [
        (cfg.norm == "pre" and cfg.norm_type == "rmsnorm", "pre-norm RMSNorm (norm='pre', norm_type='rmsnorm')"),
        (cfg.positions == "rotary" and att.rotary_fraction == 1.0, "positions='rotary' with rotary_fraction=1.0"),
        (not cfg.scale_embeddings and not cfg.embedding_norm, "scale_embeddings=False and embedding_norm=False"),
        (cfg.ffn == "swiglu" and (family == "llama" or not cfg.bias), "ffn='swiglu' (Qwen3: bias=False)"),
        (first.key_dim == first.head_dim, "key_dim == head_dim"),
        (first.output_gate is None, "no output_gate (Llama and Qwen3 have none)"),
        (len({p.bias is None for p in projections}) == 1, "biases on all four attention projections or on none"),
        (first.qk_norm == qk_norm and (not qk_norm or first.q_norm.eps == cfg.norm_eps),
         "qk_norm=True with qk_norm_eps == norm_eps" if qk_norm else "qk_norm=False"),
    ]
    for ok, what in checks:
        if not ok:
            raise ValueError(f"the model is not in {family}'s form: it needs {what}")
    config_class, model_class = ((transformers.LlamaConfig, transformers.LlamaForCausalLM) if family == "llama" else
                                 (transformers.Qwen3Config, transformers.Qwen3ForCausalLM))
    extra = dict(mlp_bias=cfg.bias) if family == "llama" else {}
    hf_config = config_class(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.decoder_layers, num_attention_heads=first.num_heads, num_key_value_heads=first.kv_heads,
        head_dim=first.head_dim, max_position_embeddings=cfg.max_positions, rms_norm_eps=cfg.norm_eps,
        hidden_act="silu", tie_word_embeddings=cfg.share_embeddings, attention_bias=first.q_proj.bias is not None,
        attention_dropout=att.dropout, rope_parameters={"rope_type": "default", "rope_theta": att.rotary_base},
        pad_token_id=cfg.pad_id, bos_token_id=cfg.bos_id, eos_token_id=cfg.eos_token_id_field(), **extra)
    state = {}
    for name, p in model.named_parameters():
        for ours, theirs in HF_NAMES:
            name = name.replace(ours, theirs)
        state[name] = p.detach()
    if cfg.share_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    ref = model.decoder.embed.tokens.weight
    with torch.device(ref.device):
        hf_model = model_class(hf_config).to(ref.dtype).eval()
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"the model is not in {family}'s form: parameters {sorted(unexpected)} have no place in "
                         f"{model_class.__name__}, which needs {sorted(missing)}")
    return hf_model


def causal_lm_to_llama(model: CausalLanguageModel) -> Any:
    """A Hugging Face ``LlamaForCausalLM`` with the weights of a headmix Llama-style causal LM with MHA
    attention (any ``kv_heads``, no QK-norm or output gate): see :func:`hf_decoder_from_causal_lm`."""
    return hf_decoder_from_causal_lm(model, "llama")
