"""Hugging Face Qwen3 (``Qwen3ForCausalLM``) -> a headmix Llama-style :class:`CausalLanguageModel` with MHA or
MoH, keeping grouped-query K/V heads and QK-norm; and the Gated Attention authors' gated Qwen3 (Qiu et al.
2025, arXiv 2505.06708, ``qiuzh20/gated_attention``, ``modeling_qwen3.py``) with its output gates.

Qwen3 is Llama (:mod:`headmix.interop.llama`, same names and mapping) plus QK-norm: ``self_attn.q_norm`` and
``self_attn.k_norm``, an RMSNorm over each head's ``head_dim`` (epsilon ``rms_norm_eps``) applied to the
queries and keys before rotary, map to the headmix layer's ``q_norm`` / ``k_norm`` (``qk_norm=True``, whose
epsilon is 1e-6: a checkpoint with another ``rms_norm_eps`` is refused). ``head_dim`` may differ from
``hidden_size / num_attention_heads`` (Qwen3-0.6B: 16 heads of 128 on ``hidden_size`` 1024); the attention
scale is ``head_dim ** -0.5`` on both sides. Tied embeddings (the small Qwen3s) map to
``share_embeddings=True``; ``attention_bias`` to the biases of the four projections.

Refused with a one-line error: ``rms_norm_eps`` other than 1e-6 (with QK-norm), sliding-window layers
(``layer_types`` with ``"sliding_attention"``, which transformers derives from ``use_sliding_window`` and
``max_window_layers``: headmix's layers attend to the whole causal prefix), scaled RoPE (YaRN etc.), an
activation other than SiLU.

The gated Qwen3 of the Gated Attention authors (position G1: ``o_h <- o_h * sigmoid(x W_g)`` after the
attention of head ``h``, before ``o_proj``, from the layer's input ``x``): its config sets
``headwise_attn_output_gate`` (one gate per head) or ``elementwise_attn_output_gate`` (one per head and
channel), and its ``q_proj`` holds the gate rows next to the query rows, grouped by K/V head: viewed as
``(kv_heads, rows_per_group)``, each group's rows are the ``H/G`` query heads' ``H/G * head_dim`` rows,
then the group's ``H/G`` gate rows (headwise) or ``H/G * head_dim`` gate rows (elementwise). Query head
``g H/G + j`` takes gate row(s) ``j`` of group ``g``. The conversion splits them into headmix's ``q_proj`` and
``gate_proj`` (``output_gate="headwise"`` / ``"elementwise"``, bias as ``q_proj``'s). Their config's
``use_qk_norm`` (default True) and ``qkv_bias`` (the bias of the four projections in their modeling code)
are honoured. Their checkpoints cannot be loaded by ``Qwen3ForCausalLM`` (the wider ``q_proj``):
:func:`load_qwen3` reads such a folder's ``safetensors`` files itself (no pickled weights: opening them runs
no code) and never runs the folder's modeling code.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..attention import MultiHeadAttention
from ..attention.mha import QK_NORM_EPS  # Qwen3 uses rms_norm_eps (1e-6 in every released Qwen3) for both norms
from ..models import CausalLanguageModel, ModelConfig
from ._hf import checkpoint_folder, copy_into, pad_id_of, require_transformers, stop_ids_of
from .llama import (SourceTensors, causal_lm_from_state, check_conversion_options, decoder_config,
                    hf_decoder_from_causal_lm)


#: The gate flags of the Gated Attention authors' Qwen3 config and the headmix ``output_gate`` they map to.
GATE_FLAGS = {"headwise_attn_output_gate": "headwise", "elementwise_attn_output_gate": "elementwise"}


def output_gate_of(hf_config: Any) -> str | None:
    """The headmix ``output_gate`` of a (gated) Qwen3 config: ``None``, ``"headwise"`` or ``"elementwise"``."""
    gates = [kind for flag, kind in GATE_FLAGS.items() if getattr(hf_config, flag, False)]
    if len(gates) > 1:  # their code would take the headwise gate
        raise ValueError("headwise_attn_output_gate and elementwise_attn_output_gate are both set; set one")
    return gates[0] if gates else None


def config_from_qwen3(hf_config: Any, *, attention: str = "mha", num_shared_heads: int | None = None,
                      top_k: int | None = None, pad_id: int | None = None, expand_kv: bool = False,
                      stop_ids: Sequence[int] | None = None, **attention_options) -> ModelConfig:
    """The headmix :class:`ModelConfig` of a Hugging Face ``Qwen3Config`` (or the Gated Attention authors'
    gated one): :func:`headmix.interop.llama.config_from_llama`'s mapping plus ``qk_norm`` and
    ``output_gate`` (see the module docstring); refuses what headmix cannot express. ``stop_ids``: as
    :func:`~headmix.interop.llama.config_from_llama` (Qwen3's generation config adds ``<|endoftext|>`` to the
    config's ``<|im_end|>``: :func:`load_qwen3` reads it)."""
    # transformers 5 derives layer_types from use_sliding_window, sliding_window and max_window_layers
    windowed = [i for i, kind in enumerate(getattr(hf_config, "layer_types", None) or []) if kind != "full_attention"]
    if windowed:
        raise ValueError(f"layer_types: layers {windowed} use sliding-window attention, which cannot be converted: "
                         f"headmix's layers attend to the whole causal prefix")
    for name in ("qk_norm", "output_gate"):
        if name in attention_options:
            raise ValueError(f"{name} comes from the checkpoint's config")
    check_conversion_options(attention, attention_options)
    qk_norm = bool(getattr(hf_config, "use_qk_norm", True))
    if qk_norm and float(hf_config.rms_norm_eps) != QK_NORM_EPS:
        raise ValueError(f"rms_norm_eps must be {QK_NORM_EPS} (the epsilon of headmix's QK-norm, which Qwen3's "
                         f"q_norm/k_norm share with its layer norms), got {hf_config.rms_norm_eps}")
    extra = dict(qk_norm=True) if qk_norm else {}
    gate = output_gate_of(hf_config)
    if gate is not None:
        extra["output_gate"] = gate
    bias = getattr(hf_config, "qkv_bias", None)
    config = decoder_config(hf_config, attention=attention, num_shared_heads=num_shared_heads, top_k=top_k,
                            pad_id=pad_id, expand_kv=expand_kv, honours_partial_rotary=False, stop_ids=stop_ids,
                            attention_bias=None if bias is None else bool(bias), **extra, **attention_options)
    return config.replace(sequence_start="none")  # Qwen3's tokenizer adds no bos (interop.sequence_start)


def split_gated_q_rows(t: Tensor, heads: int, kv_heads: int, head_dim: int, gate: str) -> tuple[Tensor, Tensor]:
    """The authors' ``q_proj`` rows (weight or bias) -> ``(query rows, gate rows)`` in headmix's head order:
    per K/V group ``g``, ``[H/G * head_dim query rows | H/G * gate_width gate rows]`` (module docstring)."""
    per_group = heads // kv_heads
    width = 1 if gate == "headwise" else head_dim
    grouped = t.reshape(kv_heads, per_group * (head_dim + width), *t.shape[1:])
    query, gates = grouped.split([per_group * head_dim, per_group * width], dim=1)
    return query.reshape(heads * head_dim, *t.shape[1:]), gates.reshape(heads * width, *t.shape[1:])


def copy_gated_q_proj(target: MultiHeadAttention, source: SourceTensors, heads: int, kv_heads: int,
                      head_dim: int, gate: str) -> None:
    """Copy the authors' gated ``q_proj`` into ``target.q_proj`` and ``target.gate_proj``."""
    for kind in ("weight", "bias"):
        t = source.take(f"q_proj.{kind}", required=kind == "weight")
        if (t is None) != (getattr(target.q_proj, kind) is None):
            raise ValueError(f"{source.prefix}q_proj.bias: {'absent' if t is None else 'present'} in the source, "
                             f"{'present' if t is None else 'absent'} in the headmix layer")
        if t is None:
            continue
        query, gates = split_gated_q_rows(t, heads, kv_heads, head_dim, gate)
        copy_into(getattr(target.q_proj, kind), query, f"{source.prefix}q_proj.{kind} (query rows)")
        copy_into(getattr(target.gate_proj, kind), gates, f"{source.prefix}q_proj.{kind} (gate rows)")


def causal_lm_from_qwen3_state(hf_config: Any, state: Mapping[str, Tensor], *, attention: str = "mha",
                               num_shared_heads: int | None = None, top_k: int | None = None,
                               pad_id: int | None = None, expand_kv: bool = False,
                               **attention_options) -> CausalLanguageModel:
    """A headmix causal LM from a (gated) Qwen3 config and its state dict (the names of
    ``Qwen3ForCausalLM``); see :func:`causal_lm_from_qwen3`."""
    cfg = config_from_qwen3(hf_config, attention=attention, num_shared_heads=num_shared_heads, top_k=top_k,
                            pad_id=pad_id, expand_kv=expand_kv, **attention_options)
    gate = output_gate_of(hf_config)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = cfg.decoder_self_attention.head_dim
    q_rows = None if gate is None else (
        lambda target, source: copy_gated_q_proj(target, source, heads, kv_heads, head_dim, gate))
    return causal_lm_from_state(cfg, hf_config, state, q_rows)


def causal_lm_from_qwen3(hf_model: Any, *, attention: str = "mha", num_shared_heads: int | None = None,
                         top_k: int | None = None, pad_id: int | None = None, expand_kv: bool = False,
                         **attention_options) -> CausalLanguageModel:
    """A headmix causal LM with the weights of a Hugging Face ``Qwen3ForCausalLM`` (or a module with its
    names and the Gated Attention authors' gated config): ``attention="mha"`` computes the same function with
    the source's ``kv_heads``, QK-norm and gates; ``attention="moh"`` (``num_shared_heads``, ``top_k``;
    ``route_per_group=True`` for routing inside each K/V group) gives MoH layers of the same heads with zero
    routers (:mod:`headmix.interop.moh`: the same function when every head is active). ``stop_ids``: by default
    the config's and the generation config's eos ids."""
    if attention_options.get("stop_ids") is None:
        attention_options["stop_ids"] = stop_ids_of(hf_model.config,
                                                     generation_config=getattr(hf_model, "generation_config", None))
    return causal_lm_from_qwen3_state(hf_model.config, hf_model.state_dict(), attention=attention,
                                      num_shared_heads=num_shared_heads, top_k=top_k, pad_id=pad_id,
                                      expand_kv=expand_kv, **attention_options)


def read_safetensors_folder(folder: Path) -> dict[str, Tensor]:
    """The tensors of a ``save_pretrained`` folder's ``model.safetensors`` (or its shards listed in
    ``model.safetensors.index.json``); a one-line error for a folder without safetensors weights."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{folder}: no model.safetensors (or its index); headmix reads gated Qwen3 weights "
                         f"from safetensors only")
    state: dict[str, Tensor] = {}
    for name in files:
        state.update(load_file(str(folder / name)))
    return state


def load_qwen3(name_or_path: str | os.PathLike, *, attention: str = "mha", num_shared_heads: int | None = None,
               top_k: int | None = None, pad_id: int | None = None, torch_dtype: torch.dtype = torch.float32,
               expand_kv: bool = False, **attention_options) -> CausalLanguageModel:
    """Load a Qwen3 checkpoint (a Hub name, which needs the network, or a local ``save_pretrained`` folder)
    and convert it with :func:`causal_lm_from_qwen3`. A gated checkpoint of the Gated Attention authors must
    be a local folder; its safetensors are read directly (module docstring)."""
    transformers = require_transformers()
    checkpoint_folder(name_or_path, "load_qwen3")
    hf_config = transformers.AutoConfig.from_pretrained(str(name_or_path))
    if attention_options.get("stop_ids") is None:  # every stop id of the source (headmix.interop._hf.stop_ids_of)
        generation = None
        if not Path(name_or_path).exists():  # a Hub name: its generation_config.json, where it has one
            try:
                generation = transformers.GenerationConfig.from_pretrained(str(name_or_path))
            except OSError:
                pass
        attention_options["stop_ids"] = stop_ids_of(hf_config, name_or_path, generation)
    options = dict(attention=attention, num_shared_heads=num_shared_heads, top_k=top_k,
                   pad_id=pad_id_of(hf_config, pad_id, name_or_path),
                   expand_kv=expand_kv, **attention_options)
    if output_gate_of(hf_config) is None:
        hf_model = transformers.Qwen3ForCausalLM.from_pretrained(str(name_or_path)).to(torch_dtype)
        return causal_lm_from_qwen3(hf_model, **options)
    folder = Path(name_or_path)
    if not folder.is_dir():
        raise ValueError(f"name_or_path: a gated Qwen3 checkpoint must be a local folder, got {str(name_or_path)!r}")
    state = {k: v.to(torch_dtype) for k, v in read_safetensors_folder(folder).items()}
    return causal_lm_from_qwen3_state(hf_config, state, **options)


def causal_lm_to_qwen3(model: CausalLanguageModel) -> Any:
    """A Hugging Face ``Qwen3ForCausalLM`` with the weights of a headmix Llama-style causal LM with MHA
    attention, ``qk_norm=True`` (epsilon ``norm_eps``, as Qwen3's), any ``kv_heads``, no output gate (the
    gated form is the authors' own modeling code, not a ``transformers`` class) and no feed-forward biases:
    see :func:`headmix.interop.llama.hf_decoder_from_causal_lm`."""
    return hf_decoder_from_causal_lm(model, "qwen3")
