"""The Transformer's layers: embeddings, norms, feed-forward layers, residual wrapper, encoder and decoder layers.

Positions and token embeddings, LayerNorm / RMSNorm, the MLP, SwiGLU and the mixture of SwiGLU experts, the encoder
and decoder layers built from each role's attention config, the output projection and RoBERTa's LM head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import AttentionOutput, KVCache
from ..attention.moa import autocast_dtype
from ..kernels import expert_map, expert_reduce, expert_routing
from ..routing import TopKRouter, load_balancing_loss
from .config import ModelConfig


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
