"""Upcycling: a trained dense decoder (multi-head or grouped-query attention) -> a routed one, and its static
control, the same model with its least important heads pruned.

The MoH paper's language-model result is a dense model continue-tuned into Mixture-of-Head attention
(MoH-LLaMA3-8B from LLaMA3-8B, Jin et al. 2024, section 4.4). Any dense source headmix reads can start it: a
Hugging Face Llama / Qwen3 / gated Qwen3 folder (:func:`headmix.interop.from_pretrained`), a headmix run, a
``save_pretrained`` or ``export-hf`` folder (:func:`headmix.models.load_pretrained`). Targets
(:func:`upcycled_config` checks a request against the source before anything is built or written):

- ``attention="moh"``: every layer's heads become MoH's (the first ``num_shared_heads`` of the layer, or of each
  K/V group with ``route_per_group=True``, shared; ``top_k`` of the others per token), with ``router``:
  ``"softmax"`` (MoH's learned router, zero-initialised: :func:`headmix.interop.zero_moh_routers`),
  ``"query_norm"`` (the MoH authors' parameter-free rule of MoH-LLaMA3: the routed heads with the largest query
  norms) or ``"random"`` (the random-routing control). Every projection is copied, so with every head active
  (``top_k`` = the routed heads) the model computes the source's function (equal logits), whatever the router.
  A zero-initialised learned router scores every routed head the same, and ``torch.topk`` breaks that tie by
  position: at conversion it keeps the first ``top_k`` routed heads of each token, i.e. it prunes by position,
  until training moves its weights away from zero.
- ``attention="mha"`` with ``keep_heads=m``: the static control, a dense model keeping ``m`` query heads per
  layer, per K/V group under grouped-query attention (``kv_heads < num_heads``; the K/V heads all stay), or of
  the layer's heads under multi-head attention (one K/V head per query head: the dropped heads' K/V go too).
  The heads kept are those of largest importance on a few calibration batches of the user's data
  (:func:`head_importance`): the mean over real tokens of the L2 norm of the head's contribution to the layer's
  output, ``||gate_i(x) H^i W_O^i||`` (MoH's summation form: the layer's output is the sum of these plus the
  output bias). Removing a head takes exactly that vector out of the layer's output at its input, so ranking by
  its mean size removes the heads whose loss perturbs each layer least, to first order; it needs no labels or
  backward pass (unlike gradient-based importance, Michel et al. 2019) and no router.

Refused, each in one line naming the option: a source whose attention is not dense (MoA, MoH, SwitchHead, ...;
``key_dim`` other than ``head_dim``), a model that is not a decoder-only language model, ``top_k`` above the
routed heads, ``num_shared_heads`` leaving no head to route, ``keep_heads`` of 0 or above the heads, a router or
option the target does not take. The paper's Grouped Query Experts (GQE) layer has an output projection of
another shape than a dense layer's (not one block per query head), so it is not an upcycling target.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..attention import MixtureOfHeadsAttention, MultiHeadAttention
from ..attention.base import scaled_dot_product
from ..models import AttentionConfig, CausalLanguageModel, ModelConfig, build_model
from ..models.folders import is_headmix_folder
from ._hf import check_option_names, stop_ids_of
from .moh import zero_moh_routers

#: The targets of an upcycling: MoH, or dense attention (with ``keep_heads``: statically pruned).
TARGETS = ("moh", "mha")
#: MoH's routers as an upcycling names them: the learned one, MoH-LLaMA3's rule, the random-routing control.
ROUTERS = ("softmax", "query_norm", "random")
#: The options :func:`upcycle` and ``headmix train --init-options`` take beyond the target's attention fields.
OPTIONS = ("attention", "num_shared_heads", "top_k", "router", "route_per_group", "keep_heads",
           "calibration_batches")
#: The options of one target only: MoH's, and the pruning control's (``attention="mha"``).
MOH_ONLY = ("num_shared_heads", "top_k", "router", "route_per_group")
MHA_ONLY = ("keep_heads", "calibration_batches")
#: Attention fields the upcycled model takes from its source (not options).
SOURCE_FIELDS = ("kind", "num_heads", "head_dim", "key_dim", "kv_heads", "num_experts", "qk_norm", "output_gate")
#: Calibration batches of the pruning control when ``calibration_batches`` is not given.
CALIBRATION_BATCHES = 8


def dense_source(config: ModelConfig) -> AttentionConfig:
    """The dense self-attention of a model to upcycle; one-line ``ValueError`` for any other model."""
    if config.task != "lm" or config.decoder_self_attention is None or config.encoder_layers:
        raise ValueError(f"init_from: upcycling converts decoder-only language models, this one is a {config.task!r} "
                         f"model")
    att = config.decoder_self_attention
    if att.kind != "mha":
        raise ValueError(f"init_from: the source's attention is {att.kind!r}; upcycling starts from dense attention "
                         f"('mha', any kv_heads)")
    if att.key_dim is not None and att.key_dim != att.resolved_head_dim(config.d_model):
        raise ValueError(f"init_from: the source's key_dim ({att.key_dim}) differs from its head_dim; MoH heads and "
                         f"pruned heads have one size")
    return att


def upcycled_config(config: ModelConfig, *, attention: str = "moh", num_shared_heads: int | None = None,
                    top_k: int | None = None, router: str = "softmax", route_per_group: bool = False,
                    keep_heads: int | None = None, calibration_batches: int | None = None,
                    **attention_options: Any) -> ModelConfig:
    """The config of the upcycled model of a dense ``config`` (module docstring), or a one-line ``ValueError``
    naming the option. ``attention_options``: further fields of the target's :class:`AttentionConfig` (e.g.
    ``load_balance_weight`` or ``moh_impl`` for MoH)."""
    att = dense_source(config)
    if attention in TARGETS:  # only the options of that target, and of its attention kind
        named = [o for o in OPTIONS if o not in (MHA_ONLY if attention == "moh" else MOH_ONLY)]
        check_option_names(attention_options, named, attention, exclude=SOURCE_FIELDS, what="an upcycling option")
    heads, groups = att.num_heads, att.kv_heads or att.num_heads
    head_dim = att.resolved_head_dim(config.d_model)
    if attention not in TARGETS:
        raise ValueError(f"attention must be one of {TARGETS} (MoH, or dense with keep_heads), got {attention!r}")
    if calibration_batches is not None and (isinstance(calibration_batches, bool) or not isinstance(
            calibration_batches, int) or calibration_batches < 1):
        raise ValueError(f"calibration_batches must be a positive integer, got {calibration_batches!r}")
    base = dataclasses.replace(att, key_dim=None, head_dim=head_dim)
    if attention == "mha":
        for name, value in (("num_shared_heads", num_shared_heads), ("top_k", top_k), ("route_per_group",
                                                                                       route_per_group or None)):
            if value is not None:
                raise ValueError(f"{name} applies to attention 'moh'; attention 'mha' keeps keep_heads heads")
        if router != "softmax":
            raise ValueError(f"router applies to attention 'moh', got router {router!r} with attention 'mha'")
        if keep_heads is None:
            target = dataclasses.replace(base, **attention_options)
        else:
            grouped = groups < heads
            per = heads // groups if grouped else heads
            where = f"the {per} query heads per K/V group" if grouped else f"the layer's {heads} heads"
            if isinstance(keep_heads, bool) or not isinstance(keep_heads, int) or not 1 <= keep_heads <= per:
                raise ValueError(f"keep_heads must be between 1 and {where}, got {keep_heads!r}")
            target = dataclasses.replace(base, num_heads=keep_heads * groups if grouped else keep_heads,
                                         kv_heads=groups if grouped else None, **attention_options)
        return config.replace(decoder_self_attention=target)
    if keep_heads is not None or calibration_batches is not None:
        raise ValueError("keep_heads and calibration_batches apply to attention 'mha' (the pruning control)")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    if not isinstance(route_per_group, bool):
        raise ValueError(f"route_per_group must be true or false, got {route_per_group!r}")
    if route_per_group and groups == heads:
        raise ValueError(f"route_per_group needs grouped K/V heads; the source has one K/V head per query head "
                         f"({heads})")
    per = heads // groups if route_per_group else heads
    where = " per K/V group" if route_per_group else ""
    for name, value, least in (("num_shared_heads", num_shared_heads, 0), ("top_k", top_k, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be a {'positive' if least else 'non-negative'} integer for attention "
                             f"'moh', got {value!r}")
    if num_shared_heads >= per:
        raise ValueError(f"num_shared_heads ({num_shared_heads}) must leave a head to route: it must be below the "
                         f"{per} heads{where}")
    if not 1 <= top_k <= per - num_shared_heads:
        raise ValueError(f"top_k ({top_k}) must be between 1 and the {per - num_shared_heads} routed heads{where} "
                         f"({per} - num_shared_heads {num_shared_heads})")
    target = AttentionConfig(**{**_moh_fields(base), "kind": "moh", "num_shared_heads": num_shared_heads,
                                "top_k": top_k, "router": None if router == "softmax" else router,
                                "route_per_group": route_per_group or None, **attention_options})
    return config.replace(decoder_self_attention=target)


def _moh_fields(att: AttentionConfig) -> dict[str, Any]:
    """The fields of a dense attention config that MoH shares (the heads, their sizes and biases, rotary,
    QK-norm, output gate, dropout)."""
    names = ("num_heads", "head_dim", "kv_heads", "dropout", "bias", "q_bias", "kv_bias", "out_bias", "rotary",
             "rotary_base", "rotary_fraction", "qk_norm", "output_gate", "zero_padded_queries")
    return {name: getattr(att, name) for name in names}


def upcycle_model(model: CausalLanguageModel, *, batches: Iterable[Tensor] | None = None,
                  **options: Any) -> CausalLanguageModel:
    """A dense headmix causal LM upcycled as ``options`` say (:data:`OPTIONS`, module docstring): MoH with the
    model's projections and a zero-initialised (``"softmax"``), parameter-free (``"query_norm"``) or random
    router; or with ``attention="mha", keep_heads=m`` the pruning control, whose heads are ranked on
    ``batches`` (token ids ``(batch, time)``; :func:`head_importance`). The source model is not changed."""
    config = upcycled_config(model.config, **options)
    ref = model.decoder.embed.tokens.weight
    if config.decoder_self_attention.kind == "mha" and options.get("keep_heads") is not None:
        if batches is None:
            raise ValueError("keep_heads needs calibration batches (batches=...) to rank the heads on")
        kept = [scores.argsort(descending=True, stable=True) for scores in head_importance(model, batches)]
        return pruned_model(model, config, kept)
    with torch.device(ref.device):
        target = build_model(config).to(ref.dtype)
    missing, unexpected = target.load_state_dict(model.state_dict(), strict=False)
    routers = ("routed_gate.", "shared_gate.", "group_gate.", "random_router.")
    left = [name for name in missing if not any(part in name for part in routers)]
    if unexpected or left:
        raise ValueError(f"init_from: the source's tensors do not fit the upcycled model (unexpected {unexpected[:3]}, "
                         f"missing {left[:3]})")
    for layer in target.decoder.layers:
        if isinstance(layer.self_attn, MixtureOfHeadsAttention):
            zero_moh_routers(layer.self_attn)
    return target.train(model.training)


@torch.no_grad()
def head_importance(model: CausalLanguageModel, batches: Iterable[Tensor]) -> list[Tensor]:
    """Per decoder layer, each query head's importance ``(num_heads,)``: the mean over the real tokens of
    ``batches`` (token ids; padding is the model's ``pad_id``) of ``||gate_i(x) H^i W_O^i||_2``, the norm of the
    head's contribution to the attention layer's output (module docstring). Computed in evaluation mode, the
    model's own forward feeding each layer its input."""
    layers = [layer.self_attn for layer in model.decoder.layers]
    if not all(type(layer) is MultiHeadAttention for layer in layers):
        raise ValueError("head_importance needs a model with dense attention (MultiHeadAttention) in every layer")
    totals = [torch.zeros(layer.num_heads, dtype=torch.float64) for layer in layers]
    counts = [0]
    was_training = model.training
    model.eval()

    def hook(index: int):
        def record(module: MultiHeadAttention, args: tuple, kwargs: dict, output: Any) -> None:
            query = args[0]
            q, k, v, _, (bias, empty, causal) = module._heads_and_masks(
                query, None, None, key_padding_mask=kwargs.get("key_padding_mask"), attn_mask=kwargs.get("attn_mask"),
                is_causal=kwargs.get("is_causal", False), use_cache=False, cache=None)
            o = module._gate_heads(scaled_dot_product(q, k, v, bias, empty, 0.0, causal=causal), query)
            w_o = module.out_proj.weight.view(module.embed_dim, module.num_heads, module.head_dim)
            padded = kwargs.get("query_padding_mask")
            real = torch.ones(query.shape[:2], dtype=torch.bool, device=query.device) if padded is None else ~padded
            for h in range(module.num_heads):
                norms = (o[:, h] @ w_o[:, h].T).double().norm(dim=-1)  # (batch, time)
                totals[index][h] += norms[real].sum().cpu()
            if index == 0:
                counts[0] += int(real.sum())

        return record

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        device = model.decoder.embed.tokens.weight.device
        for ids in batches:
            model(ids.to(device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    if counts[0] == 0:
        raise ValueError("batches: no real token to measure the heads' importance on")
    return [total / counts[0] for total in totals]


@torch.no_grad()
def pruned_model(model: CausalLanguageModel, config: ModelConfig, ranked: list[Tensor]) -> CausalLanguageModel:
    """The dense ``model`` with, in each layer, the query heads of ``config`` (``keep_heads`` per K/V group, or
    of the layer) chosen in the order of ``ranked`` (each layer's heads, most important first); everything else
    copied. The kept heads keep their order in the layer."""
    att = config.decoder_self_attention
    ref = model.decoder.embed.tokens.weight
    with torch.device(ref.device):
        target = build_model(config).to(ref.dtype)
    source_att = model.config.decoder_self_attention
    heads = source_att.num_heads
    groups = source_att.kv_heads or heads
    grouped = groups < heads
    per_group = heads // groups
    keep = att.num_heads // groups if grouped else att.num_heads
    kept_layers = []
    for order in ranked:
        if grouped:  # the first `keep` of each group, in the ranking's order
            ranking = order.tolist()
            kept_layers.append(sorted(h for g in range(groups) for h in [h for h in ranking if h // per_group == g][:keep]))
        else:
            kept_layers.append(sorted(order.tolist()[:keep]))
    state = model.state_dict()
    new_state = {name: state[name] for name in target.state_dict()}
    for i, (layer, kept) in enumerate(zip(model.decoder.layers, kept_layers)):
        new_state.update(_head_slices(f"decoder.layers.{i}.self_attn.", layer.self_attn, kept, grouped))
    target.load_state_dict(new_state)
    return target.train(model.training)


def _rows(weight: Tensor, heads: list[int], size: int) -> Tensor:
    """The rows of ``heads`` (``size`` each) of a per-head weight or bias."""
    return torch.cat([weight[h * size:(h + 1) * size] for h in heads])


def _head_slices(prefix: str, source: MultiHeadAttention, kept: list[int], grouped: bool) -> dict[str, Tensor]:
    """The pruned layer's tensors that differ from the source's: the kept heads' query rows, output-projection
    columns and output-gate rows, and (one K/V head per query head) their K/V rows."""
    dk, dv = source.key_dim, source.head_dim
    out: dict[str, Tensor] = {prefix + "q_proj.weight": _rows(source.q_proj.weight, kept, dk),
                              prefix + "out_proj.weight": _rows(source.out_proj.weight.T, kept, dv).T.contiguous()}
    if source.q_proj.bias is not None:
        out[prefix + "q_proj.bias"] = _rows(source.q_proj.bias, kept, dk)
    if source.gate_proj is not None:
        width = source.gate_proj.weight.shape[0] // source.num_heads
        out[prefix + "gate_proj.weight"] = _rows(source.gate_proj.weight, kept, width)
        if source.gate_proj.bias is not None:
            out[prefix + "gate_proj.bias"] = _rows(source.gate_proj.bias, kept, width)
    if not grouped:
        for name, size in (("k_proj", dk), ("v_proj", dv)):
            lin = getattr(source, name)
            out[prefix + f"{name}.weight"] = _rows(lin.weight, kept, size)
            if lin.bias is not None:
                out[prefix + f"{name}.bias"] = _rows(lin.bias, kept, size)
    return out


def source_config(path: str | os.PathLike, loader_options: dict[str, Any] | None = None) -> ModelConfig:
    """The dense headmix config of a source folder, read without loading its weights: a headmix folder's own, or
    a Hugging Face folder's as :func:`headmix.interop.from_pretrained` converts it, every stop id of the folder
    included (``loader_options``: its ``pad_id``, ``expand_kv``)."""
    folder = Path(path)
    if is_headmix_folder(folder):
        from ..models.folders import read_folder_config

        return read_folder_config(folder)[0]
    from . import CONFIGS
    from ._hf import require_transformers
    from .sequence_start import folder_sequence_start

    if not (folder / "config.json").is_file():
        raise (FileNotFoundError if not folder.exists() else ValueError)(
            f"init_from {folder} " + ("not found" if not folder.exists() else "holds no model (no config.json): "
                                      "expected a folder headmix wrote or a Hugging Face Llama, Qwen3 or JetMoe folder"))
    hf_config = require_transformers().AutoConfig.from_pretrained(str(folder))
    if hf_config.model_type not in CONFIGS:
        raise ValueError(f"init_from {folder} is a {hf_config.model_type!r} checkpoint; headmix converts "
                         f"{sorted(CONFIGS)}")
    mapping = CONFIGS[hf_config.model_type]
    taken = inspect.signature(mapping).parameters  # JetMoe's mapping has no expand_kv (its source is refused anyway)
    options = {k: v for k, v in (loader_options or {}).items() if k in taken}
    if "stop_ids" in taken and options.get("stop_ids") is None:  # the folder's generation config and tokenizer too
        options["stop_ids"] = stop_ids_of(hf_config, folder)
    config = mapping(hf_config, **options)
    return config.replace(sequence_start=folder_sequence_start(folder, hf_config.model_type))


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(upcycling options, Hugging Face loader options)``: ``pad_id``, ``expand_kv`` and ``torch_dtype`` go to the
    loader of a Hugging Face source, everything else to :func:`upcycled_config`."""
    loader = {k: v for k, v in options.items() if k in ("pad_id", "expand_kv", "torch_dtype")}
    return {k: v for k, v in options.items() if k not in loader}, loader


def check_upcycle(path: str | os.PathLike, options: dict[str, Any]) -> ModelConfig:
    """The upcycled config of the source folder ``path`` under ``options`` (:func:`upcycled_config`), from the
    source's config alone: what ``headmix train --init-from PATH --init-options JSON`` checks before it writes
    anything."""
    upcycling, loader = split_options(options)
    if loader and is_headmix_folder(path):
        raise ValueError(f"init_options {sorted(loader)} apply to a Hugging Face init_from only")
    return upcycled_config(source_config(path, {k: v for k, v in loader.items() if k != "torch_dtype"}), **upcycling)


def upcycle(path: str | os.PathLike, *, batches: Iterable[Tensor] | None = None, **options: Any) -> CausalLanguageModel:
    """Load the dense model of the folder ``path`` (a headmix run, ``save_pretrained`` or ``export-hf`` folder, or a
    Hugging Face Llama / Qwen3 / gated Qwen3 folder) and upcycle it (:func:`upcycle_model`; module docstring).
    ``batches``: token ids ``(batch, time)`` of the user's data, which the pruning control
    (``attention="mha", keep_heads=m``) ranks the heads on. ``options``: :data:`OPTIONS`, further fields of the
    target's attention config, and for a Hugging Face folder its loader's ``pad_id``, ``expand_kv``,
    ``torch_dtype``."""
    check_upcycle(path, options)  # every refusal before the weights are read
    upcycling, loader = split_options(options)
    if is_headmix_folder(path):
        from ..models import load_pretrained

        model = load_pretrained(path)
    else:
        from . import from_pretrained

        model = from_pretrained(path, **loader)
    return upcycle_model(model, batches=batches, **upcycling)
