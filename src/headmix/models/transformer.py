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
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import AttentionOutput, KVCache
from ..attention.moa import autocast_dtype
from ..kernels import expert_map, expert_reduce, expert_routing
from ..routing import Routing, TopKRouter, load_balancing_loss
from ..storage.files import atomic_output
from .config import VERSION_FIELD, ModelConfig, check_written_by

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


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


# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------
def sinusoidal_table(num_positions: int, dim: int) -> Tensor:
    """fairseq's sinusoidal position table ``(num_positions, dim)``: ``[sin(p w_i) | cos(p w_i)]`` with
    ``w_i = 10000^(-i / (dim/2 - 1))``, positions counted from 0."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000.0) / max(half - 1, 1)))
    angles = torch.arange(num_positions, dtype=torch.float32)[:, None] * freq[None, :]
    table = torch.cat([angles.sin(), angles.cos()], dim=1)
    if dim % 2:
        table = F.pad(table, (0, 1))
    return table


def make_norm(config: ModelConfig) -> nn.Module:
    """The model's normalisation layer: ``nn.LayerNorm`` (with a bias when ``config.bias``) or
    ``nn.RMSNorm`` (``x / sqrt(mean(x^2) + eps) * g``, no bias), both with ``eps = config.norm_eps``."""
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(config.d_model, eps=config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)


class Embeddings(nn.Module):
    """Token embedding (scaled by ``sqrt(d_model)`` as in fairseq when ``scale_embeddings``) plus
    absolute positions (none with ``positions="rotary"``: the attention layers rotate queries and keys),
    an optional norm (RoBERTa) and dropout. ``tokens`` is the shared ``nn.Embedding``."""

    def __init__(self, config: ModelConfig, tokens: nn.Embedding):
        super().__init__()
        self.tokens = tokens
        self.scale = math.sqrt(config.d_model) if config.scale_embeddings else 1.0
        self.max_positions = config.max_positions
        self.positions = None
        if config.positions == "learned":
            self.positions = nn.Embedding(config.max_positions, config.d_model)
            nn.init.normal_(self.positions.weight, std=config.d_model ** -0.5)
        sinusoids = sinusoidal_table(config.max_positions, config.d_model) if config.positions == "sinusoidal" else None
        self.register_buffer("sinusoids", sinusoids, persistent=False)
        self.norm = make_norm(config) if config.embedding_norm else None
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, ids: Tensor, offset: int | Tensor = 0) -> Tensor:
        """``offset``: the position of ``ids[:, 0]``, an int or a 0-d tensor (a preallocated decoding state's
        length, whose bound the caller checks: :func:`headmix.models.generation` sizes the buffers); or a
        ``(batch, time)`` long tensor, every token's own position (left-padded batches, as Hugging Face's
        ``position_ids``)."""
        length = ids.shape[1]
        if isinstance(offset, Tensor) and offset.dim() == 2:
            if offset.shape != ids.shape:
                raise ValueError(f"positions must have the shape of the tokens {tuple(ids.shape)}, got {tuple(offset.shape)}")
            if self.positions is not None or self.sinusoids is not None:
                if bool((offset < 0).any()) or bool((offset >= self.max_positions).any()):
                    raise ValueError(f"positions must lie in [0, max_positions={self.max_positions})")
            positions = offset
        elif isinstance(offset, Tensor):
            positions = offset + torch.arange(length, device=ids.device)
        else:
            if offset + length > self.max_positions:
                raise ValueError(f"sequence of {offset + length} positions exceeds max_positions={self.max_positions}")
            positions = slice(offset, offset + length)
        x = self.tokens(ids) * self.scale
        if self.positions is not None:
            x = x + self.positions.weight[positions]
        elif self.sinusoids is not None:
            x = x + self.sinusoids[positions].to(x.dtype)
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


class FeedForward(nn.Module):
    """``fc2(dropout(act(fc1(x))))``: ``2 T d_model ffn_dim`` MACs."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, config.ffn_dim, bias=config.bias)
        self.fc2 = nn.Linear(config.ffn_dim, config.d_model, bias=config.bias)
        self.activation = F.relu if config.activation == "relu" else F.gelu
        self.dropout = nn.Dropout(config.activation_dropout)
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(fc.weight)
            if fc.bias is not None:
                nn.init.zeros_(fc.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.dropout(self.activation(self.fc1(x))))


class SwiGLU(nn.Module):
    """The gated feed-forward of Llama (Shazeer 2020, "GLU Variants Improve Transformer", FFN_SwiGLU):
    ``W2 (dropout(silu(x W1) * x W3))`` with ``W1 = gate_proj``, ``W3 = up_proj``, ``W2 = down_proj``
    (Llama's names): three matrix products, ``3 T d_model ffn_dim`` MACs."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn_dim, bias=config.bias)
        self.up_proj = nn.Linear(config.d_model, config.ffn_dim, bias=config.bias)
        self.down_proj = nn.Linear(config.ffn_dim, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.activation_dropout)
        for fc in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.xavier_uniform_(fc.weight)
            if fc.bias is not None:
                nn.init.zeros_(fc.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.dropout(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class MixtureOfSwiGLUExperts(nn.Module):
    """A sparsely gated mixture of SwiGLU experts (JetMoE's MoE layer; Shen et al. 2024, and Shazeer et al.
    2017): a router picks ``ffn_top_k`` of ``ffn_experts`` experts per token,
    ``y_t = sum_{i in G(x_t)} w_{i,t} W2^i (silu(x_t W1^i) * x_t W3^i) (+ b)``, with
    ``w = softmax`` over the selected logits (:class:`~headmix.routing.TopKRouter` with ``renormalize="live"``,
    which equals ``p_i / sum_{j in G} p_j``; with ``ffn_top_k=1`` that is the constant 1 and the router gets no
    task-loss gradient: :class:`~headmix.models.ModelConfig` refuses it unless asked for as an ablation).
    ``input_experts[i]`` is ``[W1^i | W3^i]`` (``d_model x 2 ffn_dim``), ``output_experts[i]`` is ``W2^i``
    (``ffn_dim x d_model``); the grouped matmuls are
    :func:`headmix.kernels.expert_map` / :func:`~headmix.kernels.expert_reduce`, as MoA's, so each token
    costs ``3 k d_model ffn_dim`` MACs. The auxiliary loss is the load-balancing loss (MoA eq. 13-15) weighted
    by ``ffn_load_balance_weight`` (``ffn_load_balance_fractions="per_token"``: JetMoe's fractions, ``k`` times
    the default's). ``forward(x, token_mask)`` returns an :class:`AttentionOutput` (the
    shared output type: ``output``, ``aux_loss``, ``routing``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, f, e, k = config.d_model, config.ffn_dim, config.ffn_experts, config.ffn_top_k
        self.num_experts, self.top_k, self.ffn_dim = e, k, f
        self.load_balance_weight = config.ffn_load_balance_weight
        self.load_balance_fractions = config.ffn_load_balance_fractions
        self.expert_impl = config.ffn_expert_impl
        self.router = TopKRouter(d, e, k, renormalize="live")
        self.input_experts = nn.Parameter(torch.empty(e, d, 2 * f))
        self.output_experts = nn.Parameter(torch.empty(e, f, d))
        self.out_bias = nn.Parameter(torch.zeros(d)) if config.bias else None
        self.dropout = nn.Dropout(config.activation_dropout)
        # an nn.Linear's scale per expert (uniform +-1/sqrt(fan_in))
        nn.init.uniform_(self.input_experts, -d ** -0.5, d ** -0.5)
        nn.init.uniform_(self.output_experts, -f ** -0.5, f ** -0.5)

    def forward(self, x: Tensor, token_mask: Tensor | None = None) -> AttentionOutput:
        batch, time, dim = x.shape
        routing = self.router(x, token_mask)
        info = expert_routing(routing.expert_index, self.num_experts)
        compute = autocast_dtype(x) or x.dtype
        h = expert_map(x.reshape(batch * time, dim).to(compute), self.input_experts.to(compute), info,
                       impl=self.expert_impl)
        gate, up = h.split(self.ffn_dim, dim=-1)
        h = self.dropout(F.silu(gate) * up)
        y = expert_reduce(h, self.output_experts.to(compute), routing.gates.to(compute), info,
                          impl=self.expert_impl).view(batch, time, dim)
        if self.out_bias is not None:
            y = y + self.out_bias.to(y.dtype)
        lb = load_balancing_loss(routing.probs, routing.expert_index, routing.token_mask, self.load_balance_fractions)
        return AttentionOutput(y, self.load_balance_weight * lb, routing=routing, losses={"load_balance": lb})


def make_ffn(config: ModelConfig) -> nn.Module:
    """The feed-forward sublayer ``config.ffn`` names."""
    if config.ffn == "moe_swiglu":
        return MixtureOfSwiGLUExperts(config)
    return SwiGLU(config) if config.ffn == "swiglu" else FeedForward(config)


def feed_forward(ffn: nn.Module, block: ResidualNorm, x: Tensor, padding_mask: Tensor | None) -> tuple[Tensor, AttentionOutput | None]:
    """The FFN sublayer with its norm and residual; the mixture of experts also returns its routing and
    auxiliary loss (as an :class:`AttentionOutput`), padded tokens excluded from its loss."""
    h = block.input(x)
    if isinstance(ffn, MixtureOfSwiGLUExperts):
        out = ffn(h, None if padding_mask is None else ~padding_mask)
        return block.add(x, out.output), out
    return block.add(x, ffn(h)), None


class ResidualNorm(nn.Module):
    """The norm (LayerNorm or RMSNorm), dropout and residual connection around a sublayer ``f``:
    pre-norm ``x + drop(f(norm(x)))`` or post-norm ``norm(x + drop(f(x)))``. Use as
    ``x = block.add(x, f(block.input(x)))``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = make_norm(config)
        self.pre_norm = config.norm == "pre"
        self.dropout = nn.Dropout(config.dropout)

    def input(self, x: Tensor) -> Tensor:
        return self.norm(x) if self.pre_norm else x

    def add(self, x: Tensor, y: Tensor) -> Tensor:
        x = x + self.dropout(y)
        return x if self.pre_norm else self.norm(x)


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


class EncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = config.encoder_self_attention.build(config.d_model)
        self.self_attn_norm = ResidualNorm(config)
        self.ffn = make_ffn(config)
        self.ffn_norm = ResidualNorm(config)

    def forward(self, x: Tensor, padding_mask: Tensor) -> tuple[Tensor, AttentionOutput, AttentionOutput | None]:
        attn = self.self_attn(self.self_attn_norm.input(x), key_padding_mask=padding_mask,
                              query_padding_mask=padding_mask)
        x = self.self_attn_norm.add(x, attn.output)
        x, ffn_out = feed_forward(self.ffn, self.ffn_norm, x, padding_mask)
        return x, attn, ffn_out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, cross_attention: bool):
        super().__init__()
        self.self_attn = config.decoder_self_attention.build(config.d_model)
        self.self_attn_norm = ResidualNorm(config)
        self.cross_attn = config.cross_attention.build(config.d_model) if cross_attention else None
        self.cross_attn_norm = ResidualNorm(config) if cross_attention else None
        self.ffn = make_ffn(config)
        self.ffn_norm = ResidualNorm(config)

    def forward(self, x: Tensor, padding_mask: Tensor | None, memory: Tensor | None, memory_padding_mask: Tensor | None,
                self_cache: KVCache | None, cross_cache: KVCache | None, use_cache: bool, *,
                key_padding_mask: Tensor | None = None,
                ) -> tuple[Tensor, AttentionOutput, AttentionOutput | None, AttentionOutput | None]:
        """``padding_mask`` ``(B, T)`` marks padded queries; ``key_padding_mask`` ``(B, past + T)`` the padded keys
        of self-attention, cached ones included (default: ``padding_mask``)."""
        self_keys = padding_mask if key_padding_mask is None else key_padding_mask
        self_out = self.self_attn(self.self_attn_norm.input(x), key_padding_mask=self_keys,
                                  query_padding_mask=padding_mask, is_causal=True,
                                  use_cache=use_cache, cache=self_cache)
        x = self.self_attn_norm.add(x, self_out.output)
        cross_out = None
        if self.cross_attn is not None:
            cross_out = self.cross_attn(self.cross_attn_norm.input(x), memory, key_padding_mask=memory_padding_mask,
                                        query_padding_mask=padding_mask, use_cache=use_cache, cache=cross_cache)
            x = self.cross_attn_norm.add(x, cross_out.output)
        x, ffn_out = feed_forward(self.ffn, self.ffn_norm, x, padding_mask)
        return x, self_out, cross_out, ffn_out


def untied_output_projection(config: ModelConfig) -> nn.Linear | None:
    """The vocabulary projection when it is not tied to the embeddings (``share_embeddings=False``)."""
    if config.share_embeddings:
        return None
    proj = nn.Linear(config.d_model, config.vocab_size, bias=False)
    nn.init.normal_(proj.weight, std=config.d_model ** -0.5)
    return proj


def token_embedding(config: ModelConfig) -> nn.Embedding:
    """fairseq's initialisation: ``N(0, d_model^-0.5)``, padding row zero (no padding row with ``pad_id=None``)."""
    emb = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_id)
    nn.init.normal_(emb.weight, std=config.d_model ** -0.5)
    if config.pad_id is not None:
        with torch.no_grad():
            emb.weight[config.pad_id].zero_()
    return emb


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
# Loss
# --------------------------------------------------------------------------------------------------
def padding_of(tokens: Tensor, pad_id: int | None) -> Tensor | None:
    """True where ``tokens`` is the padding token ``pad_id``; ``None`` (nothing is padding) without one."""
    return None if pad_id is None else tokens.eq(pad_id)


def token_loss(logits: Tensor, target: Tensor, pad_id: int | None, label_smoothing: float) -> tuple[Tensor, Tensor, Tensor]:
    """Label-smoothed cross-entropy averaged over target tokens; ``target`` positions equal to ``pad_id``
    or ``-100`` are ignored. Smoothing spreads ``label_smoothing`` uniformly over the vocabulary
    (``torch.nn.functional.cross_entropy``'s definition). Returns ``(loss, nll_loss, num_tokens)``;
    ``nll_loss`` is detached. ``pad_id=None``: only ``-100`` is ignored."""
    if pad_id is not None:
        target = target.masked_fill(target.eq(pad_id), -100)
    target = target.reshape(-1)
    flat = logits.reshape(-1, logits.shape[-1]).float()
    num_tokens = target.ne(-100).sum()
    denom = num_tokens.clamp(min=1).to(flat.dtype)
    loss = F.cross_entropy(flat, target, ignore_index=-100, label_smoothing=label_smoothing, reduction="sum") / denom
    if label_smoothing > 0:
        with torch.no_grad():
            nll = F.cross_entropy(flat, target, ignore_index=-100, reduction="sum") / denom
    else:
        nll = loss.detach()
    return loss, nll, num_tokens


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
        from safetensors.torch import save_file

        from ..storage.safetensors_header import sort_metadata

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = self.state_dict()
        # A parameter reachable under several names is stored once, under its first name.
        first_name: dict[int, str] = {}
        tied: dict[str, str] = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            if id(p) in first_name:
                tied[name] = first_name[id(p)]
            else:
                first_name[id(p)] = name
        tensors = {k: v.detach().contiguous().cpu() for k, v in state.items() if k not in tied}
        with atomic_output(directory / WEIGHTS_NAME) as tmp:
            save_file(tensors, tmp, metadata={"format": "pt", "headmix_tied": json.dumps(tied)})
            sort_metadata(tmp)  # the same weights, the same bytes (and sha256): safetensors orders its metadata anyhow
        self.config.save_json(directory / CONFIG_NAME)

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


class LMHead(nn.Module):
    """RoBERTa's LM head transform: ``LayerNorm(act(dense(x)))`` (the tied projection and its bias are
    applied by the model)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.activation = F.relu if config.activation == "relu" else F.gelu
        self.norm = nn.LayerNorm(config.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.activation(self.dense(x)))


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


def check_labels(input_ids: Tensor, labels: Tensor) -> None:
    """A one-line ``ValueError`` unless ``labels`` are a causal LM's labels in ``transformers``' convention: the
    shape of ``input_ids``, and not the inputs shifted by one (the old convention, which would now train the
    model to predict the token two ahead). Both :class:`CausalLanguageModel` and the Hugging Face wrapper
    (:class:`~headmix.hf.HeadmixForCausalLM`) call it, so both refuse the same labels with the same message."""
    if not isinstance(labels, Tensor) or tuple(labels.shape) != tuple(input_ids.shape):
        raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)} (labels are the inputs; "
                         f"the model shifts them), got {tuple(labels.shape) if isinstance(labels, Tensor) else labels!r}")
    if labels.shape[1] < 2:
        return
    labels = labels.to(input_ids.device)
    ignored = labels.eq(-100)
    unshifted = (labels.eq(input_ids) | ignored).all()
    shifted = (labels[:, :-1].eq(input_ids[:, 1:]) | ignored[:, :-1]).all() & ~ignored[:, :-1].all()
    message = ("labels are input_ids shifted by one: labels are now the inputs themselves, as in transformers (the "
               "model shifts them): pass labels=input_ids (or, to CausalLanguageModel, targets= aligned with the logits)")
    if torch.compiler.is_compiling():  # no host read in a compiled graph: an assertion the graph keeps
        torch._assert_async(~(shifted & ~unshifted), message)
    elif bool(shifted & ~unshifted):
        raise ValueError(message)


MODEL_CLASSES = {"translation": EncoderDecoderModel, "mlm": MaskedLanguageModel, "lm": CausalLanguageModel}


def build_model(config: ModelConfig, device: str | torch.device | None = None) -> PreTrainedModel:
    """The model for ``config.task``, with fresh weights (on ``device``; ``"meta"`` builds shapes only)."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
    if device is None:
        return MODEL_CLASSES[config.task](config)
    with torch.device(device):
        return MODEL_CLASSES[config.task](config)


#: The prefix of the headmix model's tensors in a Hugging Face folder (``HeadmixForCausalLM.model``).
HF_PREFIX = "model."


def read_folder_config(directory: Path) -> tuple[ModelConfig, bool]:
    """The headmix :class:`ModelConfig` of a folder headmix wrote, and whether it is a Hugging Face folder (an
    ``export-hf`` folder, ``HeadmixForCausalLM.save_pretrained``, a ``Trainer`` checkpoint: ``model_type``
    ``"headmix"``, the headmix config in its ``headmix`` field), read as JSON: no code from the folder runs.
    One-line errors name the file and what was expected."""
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (expected a folder headmix wrote: a run, save_pretrained, "
                                f"export-hf or a Trainer checkpoint)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or "model_type" not in data:
        return ModelConfig.load_json(path), False
    if data["model_type"] != "headmix":
        raise ValueError(f"{directory} holds a Hugging Face {data['model_type']!r} model, not a headmix one: convert "
                         f"it with headmix.interop.from_pretrained (headmix train --init-from converts it too)")
    check_written_by(data.get(VERSION_FIELD), str(path))
    if not isinstance(data.get("headmix"), dict):
        raise ValueError(f"{path} has no 'headmix' field (the headmix model config, which every folder headmix "
                         f"writes holds): not a headmix folder, or a damaged one")
    return ModelConfig.from_dict(data["headmix"], str(path)), True


def is_headmix_run(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a headmix run folder (it holds ``train_config.json``), not a Hugging Face folder."""
    return (Path(path) / "train_config.json").is_file()


def is_headmix_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a model headmix wrote: a run folder, a ``save_pretrained`` folder (headmix's own
    ``config.json``), or a Hugging Face folder of a headmix model (``export-hf``, ``HeadmixForCausalLM``'s
    ``save_pretrained``, a ``Trainer`` checkpoint: ``model_type`` ``"headmix"``); read as JSON, no code run."""
    if is_headmix_run(path):
        return True
    try:
        data = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("model_type", "headmix") == "headmix"


def load_pretrained(directory: str | os.PathLike, device: str | torch.device = "cpu") -> PreTrainedModel:
    """Load a model headmix wrote: ``save_pretrained`` (a run's final model), or a Hugging Face folder of a
    headmix model (``export-hf``, ``HeadmixForCausalLM.save_pretrained``, a ``Trainer`` checkpoint), read as
    JSON and safetensors without ``transformers`` or any code of the folder: the right class for its task, ties
    restored."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    directory = Path(directory)
    config, hugging_face = read_folder_config(directory)
    if not (directory / WEIGHTS_NAME).is_file():
        sharded = (directory / (WEIGHTS_NAME + ".index.json")).is_file()
        raise FileNotFoundError(f"{directory / WEIGHTS_NAME} not found" + (
            " (the weights are sharded: save the model with a larger max_shard_size)" if sharded
            else " (expected a save_pretrained folder)"))
    tensors = load_file(directory / WEIGHTS_NAME, device=str(device))
    if hugging_face:
        tensors = {k[len(HF_PREFIX):] if k.startswith(HF_PREFIX) else k: v for k, v in tensors.items()}
    with safe_open(directory / WEIGHTS_NAME, framework="pt") as f:
        tied = json.loads((f.metadata() or {}).get("headmix_tied", "{}"))
    for alias, source in tied.items():
        tensors[alias] = tensors[source]
    model = build_model(config, device)
    expected = set(model.state_dict())
    for names, what in ((sorted(expected - set(tensors)), "misses"), (sorted(set(tensors) - expected), "holds unknown")):
        if names:
            raise ValueError(f"{directory / WEIGHTS_NAME} {what} {len(names)} tensor(s) of the model its "
                             f"{CONFIG_NAME} describes, first {names[0]!r}")
    model.load_state_dict(tensors, strict=True)
    return model
