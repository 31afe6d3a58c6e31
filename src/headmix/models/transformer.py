"""Transformer models built from headmix attention layers.

- :class:`EncoderDecoderModel`: translation (Vaswani et al. 2017 / fairseq ``transformer``): a joint
  vocabulary whose embedding is shared by the encoder, the decoder and the output projection.
- :class:`MaskedLanguageModel`: an encoder with RoBERTa's LM head (dense, activation, LayerNorm, tied
  output projection plus a bias).
- :class:`CausalLanguageModel`: a decoder without cross-attention; with ``norm_type="rmsnorm"``,
  ``ffn="swiglu"`` (or ``"moe_swiglu"``), ``positions="rotary"`` and no biases it is a Llama-style (or
  JetMoE-style) decoder.

Every attention layer (encoder self-attention, decoder self-attention, cross-attention) is built from
its :class:`~headmix.models.config.AttentionConfig`, so any of MHA, MoA, MoH and Talking-Heads can sit
in any role. Forward passes return a :class:`ModelOutput` with the task loss, the summed auxiliary
router losses (MoA eq. 17: ``L = L_model + sum_layers (alpha L_a + beta L_z)``) and the per-layer routing.

This module holds the outputs, the encoder and decoder stacks, the three models and :func:`build_model` /
:func:`load_pretrained`; their layers are in :mod:`~headmix.models.blocks`, the loss in :mod:`~headmix.models.loss`,
the saved folders in :mod:`~headmix.models.folders`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import AttentionOutput, KVCache
from ..routing import Routing
from .blocks import DecoderLayer, EncoderLayer, Embeddings, LMHead, make_norm, token_embedding, untied_output_projection
from .config import ModelConfig
from .folders import CONFIG_NAME, WEIGHTS_NAME, read_folder_config, read_folder_weights, save_folder
from .loss import check_labels, padding_of, token_loss

# Importable from here as before the split (user code, the tests); each lives in the module its comment names.
from .blocks import (FeedForward, MixtureOfSwiGLUExperts, ResidualNorm, SwiGLU,  # noqa: F401  lives in blocks
                     feed_forward, make_ffn, sinusoidal_table)
from .folders import HF_PREFIX, is_headmix_folder, is_headmix_run  # noqa: F401  lives in folders


# --------------------------------------------------------------------------------------------------
# Outputs and decoding state
# --------------------------------------------------------------------------------------------------
@dataclass
class EncoderOutput:
    """``hidden`` ``(B, S, d_model)``, ``padding_mask`` ``(B, S)`` True at padding, the summed
    ``aux_loss`` of the encoder's attention layers and their ``routing`` as ``(name, Routing)`` pairs."""

    hidden: Tensor
    padding_mask: Tensor
    aux_loss: Tensor
    routing: list[tuple[str, Routing]] = field(default_factory=list)

    def reorder(self, index: Tensor) -> EncoderOutput:
        """Select batch rows (beam search)."""
        return EncoderOutput(self.hidden.index_select(0, index), self.padding_mask.index_select(0, index),
                             self.aux_loss, self.routing)


@dataclass
class DecoderState:
    """Incremental-decoding state: one self-attention :class:`KVCache` per decoder layer (grown one step
    at a time), one static cross-attention cache per layer (the projected encoder output, computed on
    the first step), and ``length``, the number of target positions already seen (for positions).

    :meth:`preallocate` gives the state for CUDA-graph decoding: self-attention caches in buffers of a fixed
    capacity written in place (:meth:`KVCache.preallocate`) and ``length`` a 0-d tensor on the device, so
    that one decoding step has static shapes."""

    self_attn: list[KVCache | None]
    cross_attn: list[KVCache | None]
    length: int | Tensor = 0

    def preallocate(self, max_length: int) -> DecoderState:
        """This state with every self-attention cache preallocated to ``max_length`` positions."""
        if isinstance(self.length, Tensor):
            raise ValueError("the state is already preallocated")
        caches = [None if c is None else c.preallocate(max_length) for c in self.self_attn]
        position = next((c.position for c in caches if c is not None), None)
        if position is None:
            raise ValueError("the state holds no self-attention cache to preallocate")
        return DecoderState(caches, list(self.cross_attn), position.clone())

    def reorder(self, index: Tensor) -> DecoderState:
        """Select batch rows of every cache (beam search)."""
        def pick(cache: KVCache | None) -> KVCache | None:
            return None if cache is None else cache.reorder(index)

        return DecoderState([pick(c) for c in self.self_attn], [pick(c) for c in self.cross_attn], self.length)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.self_attn + self.cross_attn if c is not None)


@dataclass
class DecoderOutput:
    hidden: Tensor
    aux_loss: Tensor
    routing: list[tuple[str, Routing]] = field(default_factory=list)
    state: DecoderState | None = None


@dataclass
class ModelOutput:
    """What a model's ``forward`` returns.

    ``logits`` ``(B, T, vocab)``; ``lm_loss`` the label-smoothed cross-entropy averaged over the target
    tokens (padding and ``-100`` labels ignored), ``None`` without targets; ``nll_loss`` the same
    without smoothing (detached; ``exp`` of it is the perplexity); ``aux_loss`` the sum of all attention
    layers' weighted auxiliary losses; ``total_loss = lm_loss + aux_loss`` (what to backpropagate);
    ``loss``: for a :class:`CausalLanguageModel` ``total_loss`` (as in ``transformers``: the loss is what
    is optimised, its parts beside it), for the translation and masked LMs ``lm_loss``;
    ``num_tokens`` the number of target tokens; ``routing`` ``(layer name, Routing)`` for every routed
    layer call; ``state`` the decoding state when ``use_cache=True``.
    """

    logits: Tensor
    loss: Tensor | None
    nll_loss: Tensor | None
    aux_loss: Tensor
    total_loss: Tensor | None
    num_tokens: Tensor | None
    routing: list[tuple[str, Routing]] = field(default_factory=list)
    state: DecoderState | None = None
    lm_loss: Tensor | None = None


def _collect(outputs: list[tuple[str, AttentionOutput | None]], aux: Tensor) -> tuple[Tensor, list]:
    """Add the layers' auxiliary losses (MoA eq. 17 sums them over layers) and list their routing as
    ``(name, Routing)`` pairs. Called once per model call on all its layers' outputs, with names built
    from the layer index outside any layer's code: a compiled model traces it once (no per-layer guard on a
    name string or on whether ``aux`` requires grad)."""
    routing = []
    for name, out in outputs:
        if out is None:
            continue
        aux = aux + out.aux_loss
        if out.routing is not None:
            routing.append((name, out.routing))
    return aux, routing


class TransformerEncoder(nn.Module):
    """Embeddings, ``encoder_layers`` layers of self-attention + FFN, and a final norm with pre-norm."""

    def __init__(self, config: ModelConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.config = config
        self.embed = Embeddings(config, embed_tokens)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.encoder_layers))
        self.final_norm = make_norm(config) if config.norm == "pre" else None

    def forward(self, tokens: Tensor) -> EncoderOutput:
        padding_mask = tokens.eq(self.config.pad_id)
        x = self.embed(tokens)
        outputs = []
        for i, layer in enumerate(self.layers):
            x, attn, ffn_out = layer(x, padding_mask)
            outputs += [(f"encoder.layers.{i}.self_attn", attn), (f"encoder.layers.{i}.ffn", ffn_out)]
        if self.final_norm is not None:
            x = self.final_norm(x)
        aux, routing = _collect(outputs, x.new_zeros((), dtype=torch.float32))
        return EncoderOutput(x, padding_mask, aux, routing)


class TransformerDecoder(nn.Module):
    """Embeddings, ``decoder_layers`` layers of causal self-attention, cross-attention (when
    ``cross_attention``) and FFN, and a final norm with pre-norm. Returns hidden states; the
    output projection belongs to the model."""

    def __init__(self, config: ModelConfig, embed_tokens: nn.Embedding, cross_attention: bool):
        super().__init__()
        self.config = config
        self.embed = Embeddings(config, embed_tokens)
        self.layers = nn.ModuleList(DecoderLayer(config, cross_attention) for _ in range(config.decoder_layers))
        self.final_norm = make_norm(config) if config.norm == "pre" else None

    def forward(self, tokens: Tensor, memory: Tensor | None = None, memory_padding_mask: Tensor | None = None, *,
                state: DecoderState | None = None, use_cache: bool = False, key_padding_mask: Tensor | None = None,
                positions: Tensor | None = None) -> DecoderOutput:
        """``tokens`` ``(B, T)``: the whole target prefix, or with ``state`` only the new tokens (taken as
        non-padding). ``memory`` ``(B, S, d_model)`` the encoder output for cross-attention (not needed
        once ``state`` holds the static cross-attention caches).

        ``key_padding_mask`` ``(B, past + T)``, True at padding, replaces the rule "the token ``pad_id`` is
        padding" for the self-attention keys (cached positions included) and, its last ``T`` columns, for the
        queries (Hugging Face's ``attention_mask``, inverted). ``positions`` ``(B, T)``: each token's position in
        the absolute position embeddings (default ``past + t``; rotary positions always come from the cache)."""
        past = 0 if state is None else state.length
        padding_mask = padding_of(tokens, self.config.pad_id) if state is None else None
        if key_padding_mask is not None:
            if key_padding_mask.dtype != torch.bool or key_padding_mask.shape != (tokens.shape[0], past + tokens.shape[1]):
                raise ValueError(f"key_padding_mask must be a bool tensor of shape (batch, past + time) = "
                                 f"({tokens.shape[0]}, {past + tokens.shape[1]}), got {key_padding_mask.dtype} "
                                 f"{tuple(key_padding_mask.shape)}")
            padding_mask = key_padding_mask[:, past:]
        x = self.embed(tokens, offset=past if positions is None else positions)
        outputs = []
        n = len(self.layers)
        self_caches = state.self_attn if state is not None else [None] * n
        cross_caches = state.cross_attn if state is not None else [None] * n
        new_self, new_cross = [], []
        for i, layer in enumerate(self.layers):
            x, self_out, cross_out, ffn_out = layer(x, padding_mask, memory, memory_padding_mask,
                                                    self_caches[i], cross_caches[i], use_cache,
                                                    key_padding_mask=key_padding_mask)
            outputs += [(f"decoder.layers.{i}.self_attn", self_out), (f"decoder.layers.{i}.cross_attn", cross_out),
                        (f"decoder.layers.{i}.ffn", ffn_out)]
            new_self.append(self_out.cache)
            new_cross.append(None if cross_out is None else cross_out.cache)
        if self.final_norm is not None:
            x = self.final_norm(x)
        aux, routing = _collect(outputs, x.new_zeros((), dtype=torch.float32))
        new_state = DecoderState(new_self, new_cross, past + tokens.shape[1]) if use_cache else None
        return DecoderOutput(x, aux, routing, new_state)


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------
class PreTrainedModel(nn.Module):
    """Save/load for the three models: ``config.json`` + ``model.safetensors``.

    Tied weights (one embedding shared by encoder, decoder and output projection) are stored once;
    the other names are recorded in the safetensors metadata and re-tied on load by building the model
    from its config.
    """

    task: str = ""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.task != self.task:
            raise ValueError(f"{type(self).__name__} needs a config with task={self.task!r}, got task={config.task!r}")
        self.config = config

    def _output_weight(self) -> Tensor:  # pragma: no cover - overridden
        raise NotImplementedError

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write ``config.json`` and ``model.safetensors`` to ``directory``, each atomically
        (:mod:`headmix.storage.files`: a temporary file in the same folder, fsync'ed, renamed; mode 0644)."""
        save_folder(self, directory)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, device: str | torch.device = "cpu") -> PreTrainedModel:
        """Build the model from ``directory/config.json`` and load ``directory/model.safetensors``."""
        model = load_pretrained(directory, device)
        if cls is not PreTrainedModel and not isinstance(model, cls):
            raise ValueError(f"{directory} holds a {type(model).__name__} (task {model.config.task!r}), not a {cls.__name__}")
        return model

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """The output projection ``hidden W^T``: ``T d_model V`` MACs. An untied projection is called as the
        module ``output_proj`` (so a wrapper of it, such as a PEFT LoRA adapter, takes part); a tied one is
        the embedding's weight."""
        if self.output_proj is not None:
            return self.output_proj(hidden)
        return F.linear(hidden, self._output_weight())

    def _finish(self, logits: Tensor, target: Tensor | None, aux: Tensor, routing: list,
                state: DecoderState | None = None, scored: Tensor | None = None) -> ModelOutput:
        """The output; ``target`` scored against ``scored`` (default: ``logits``)."""
        if target is None:
            return ModelOutput(logits, None, None, aux, None, None, routing, state)
        lm_loss, nll, n = token_loss(logits if scored is None else scored, target, self.config.pad_id,
                                     self.config.label_smoothing)
        total = lm_loss + aux
        return ModelOutput(logits, total if self.task == "lm" else lm_loss, nll, aux, total, n, routing, state,
                           lm_loss)


class EncoderDecoderModel(PreTrainedModel):
    """Translation model: ``model(src (B, S), tgt_in (B, T), tgt_out=None)``.

    ``tgt_in`` is the decoder input (``bos`` + target), ``tgt_out`` the target shifted by one (target +
    ``eos``); padding (``pad_id``) anywhere is masked. With ``share_embeddings`` one embedding matrix
    serves the encoder, the decoder and the output projection (joint vocabulary).
    """

    task = "translation"

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        enc_tokens = token_embedding(config)
        dec_tokens = enc_tokens if config.share_embeddings else token_embedding(config)
        self.encoder = TransformerEncoder(config, enc_tokens)
        self.decoder = TransformerDecoder(config, dec_tokens, cross_attention=True)
        self.output_proj = untied_output_projection(config)

    def _output_weight(self) -> Tensor:
        return self.decoder.embed.tokens.weight if self.output_proj is None else self.output_proj.weight

    def encode(self, src: Tensor) -> EncoderOutput:
        return self.encoder(src)

    def decode(self, tgt_in: Tensor, encoder_out: EncoderOutput, *, state: DecoderState | None = None,
               use_cache: bool = False) -> DecoderOutput:
        """Decoder hidden states; with ``state``, ``tgt_in`` holds only the new tokens."""
        return self.decoder(tgt_in, encoder_out.hidden, encoder_out.padding_mask, state=state, use_cache=use_cache)

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor | None = None) -> ModelOutput:
        enc = self.encode(src)
        dec = self.decode(tgt_in, enc)
        logits = self.compute_logits(dec.hidden)
        return self._finish(logits, tgt_out, enc.aux_loss + dec.aux_loss, enc.routing + dec.routing)


class MaskedLanguageModel(PreTrainedModel):
    """Encoder + RoBERTa LM head: ``model(input_ids, labels=None)``; ``labels`` hold the original token
    at masked positions and ``-100`` (or ``pad_id``) elsewhere."""

    task = "mlm"

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.encoder = TransformerEncoder(config, token_embedding(config))
        self.lm_head = LMHead(config)
        self.output_proj = untied_output_projection(config)
        self.output_bias = nn.Parameter(torch.zeros(config.vocab_size))

    def _output_weight(self) -> Tensor:
        return self.encoder.embed.tokens.weight if self.output_proj is None else self.output_proj.weight

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return F.linear(self.lm_head(hidden), self._output_weight(), self.output_bias)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> ModelOutput:
        enc = self.encoder(input_ids)
        return self._finish(self.compute_logits(enc.hidden), labels, enc.aux_loss, enc.routing)


class CausalLanguageModel(PreTrainedModel):
    """Decoder-only language model: ``model(input_ids, labels=None)``, with ``transformers``' convention.

    ``labels`` are the inputs themselves (``labels=input_ids``; ``-100`` and ``pad_id`` ignored): the model
    shifts them, scoring ``logits[:, t]`` against ``labels[:, t + 1]``. ``out.loss`` is what is optimised:
    ``lm_loss + aux_loss`` (the cross-entropy plus the routing losses), both returned beside it. Labels
    shifted already (headmix's earlier convention: ``labels = x[:, 1:]`` for ``input_ids = x[:, :-1]``)
    are refused in one line. ``targets`` instead are aligned with the logits (``targets[:, t]`` follows
    ``input_ids[:, t]``, as translation's ``tgt_out``): packed training blocks, whose last target lies past
    the inputs, use them. For incremental decoding pass ``use_cache=True`` and the returned ``state`` back
    with the new tokens only.
    """

    task = "lm"

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.decoder = TransformerDecoder(config, token_embedding(config), cross_attention=False)
        self.output_proj = untied_output_projection(config)

    def _output_weight(self) -> Tensor:
        return self.decoder.embed.tokens.weight if self.output_proj is None else self.output_proj.weight

    def forward(self, input_ids: Tensor, labels: Tensor | None = None, *, targets: Tensor | None = None,
                state: DecoderState | None = None, use_cache: bool = False) -> ModelOutput:
        if labels is not None:
            if targets is not None:
                raise ValueError("pass labels (the inputs; the model shifts them) or targets (aligned with the "
                                 "logits), not both")
            check_labels(input_ids, labels)
        dec = self.decoder(input_ids, state=state, use_cache=use_cache)
        logits = self.compute_logits(dec.hidden)
        if labels is not None:
            return self._finish(logits, labels[:, 1:], dec.aux_loss, dec.routing, dec.state, scored=logits[:, :-1])
        return self._finish(logits, targets, dec.aux_loss, dec.routing, dec.state)


MODEL_CLASSES = {"translation": EncoderDecoderModel, "mlm": MaskedLanguageModel, "lm": CausalLanguageModel}


def build_model(config: ModelConfig, device: str | torch.device | None = None) -> PreTrainedModel:
    """The model for ``config.task``, with fresh weights (on ``device``; ``"meta"`` builds shapes only)."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
    if device is None:
        return MODEL_CLASSES[config.task](config)
    with torch.device(device):
        return MODEL_CLASSES[config.task](config)


def load_pretrained(directory: str | os.PathLike, device: str | torch.device = "cpu") -> PreTrainedModel:
    """Load a model headmix wrote: ``save_pretrained`` (a run's final model), or a Hugging Face folder of a
    headmix model (``export-hf``, ``HeadmixForCausalLM.save_pretrained``, a ``Trainer`` checkpoint), read as
    JSON and safetensors without ``transformers`` or any code of the folder: the right class for its task, ties
    restored."""
    directory = Path(directory)
    config, hugging_face = read_folder_config(directory)
    tensors = read_folder_weights(directory, device, hugging_face)
    model = build_model(config, device)
    expected = set(model.state_dict())
    for names, what in ((sorted(expected - set(tensors)), "misses"), (sorted(set(tensors) - expected), "holds unknown")):
        if names:
            raise ValueError(f"{directory / WEIGHTS_NAME} {what} {len(names)} tensor(s) of the model its "
                             f"{CONFIG_NAME} describes, first {names[0]!r}")
    model.load_state_dict(tensors, strict=True)
    return model
