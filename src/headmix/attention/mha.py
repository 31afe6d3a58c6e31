"""Standard multi-head attention, the baseline every other variant is measured against."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import (AttentionLayer, AttentionOutput, KVCache, attention_bias, check_mask_dtype, check_positive,
                   scaled_dot_product, zero_loss)
from .padding import check_flag, real_token_mask, zero_padded_queries
from .rotary import RotaryEmbedding, make_rotary


def split_heads(x: Tensor, heads: int) -> Tensor:
    """``(batch, time, heads * size)`` -> ``(batch, heads, time, size)``."""
    b, t, size = x.shape
    return x.view(b, t, heads, size // heads).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """``(batch, heads, time, size)`` -> ``(batch, time, heads * size)``."""
    b, h, t, s = x.shape
    return x.transpose(1, 2).reshape(b, t, h * s)


def resolve_bias(name: str, value: bool | None, default: bool) -> bool:
    """A fine bias option (``q_bias``, ``kv_bias``, ``out_bias``): ``None`` follows ``bias``."""
    if value is None:
        value = default
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True, False or None (follow bias), got {value!r}")
    return value


def resolve_head_dims(embed_dim: int, num_heads: int, head_dim: int | None, key_dim: int | None) -> tuple[int, int]:
    check_positive("num_heads", num_heads)
    if head_dim is None:
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}) when head_dim is not given")
        head_dim = embed_dim // num_heads
    check_positive("head_dim", head_dim)
    key_dim = head_dim if key_dim is None else key_dim
    check_positive("key_dim", key_dim)
    return head_dim, key_dim


class MultiHeadAttention(AttentionLayer):
    """Multi-head attention (Vaswani et al. 2017) with an optional decoupled key size.

    ``head_dim`` is the value size per head (default ``embed_dim // num_heads``); ``key_dim`` the query/key
    size per head (default ``head_dim``). A ``key_dim`` larger than ``head_dim`` lifts the low-rank
    bottleneck of small heads (Bhojanapalli et al. 2020) at the cost of larger Q/K projections only.

    Parameters: ``W_q, W_k`` of ``embed_dim x (num_heads * key_dim)``, ``W_v`` of
    ``embed_dim x (num_heads * head_dim)``, ``W_o`` of ``(num_heads * head_dim) x embed_dim``; with
    default sizes that is MoA's ``M_MHA = 4 d_m^2`` (eq. 20).

    ``bias`` switches every projection's bias on or off; ``q_bias``, ``kv_bias`` (K and V) and ``out_bias``
    (the output projection), when given, override it for their projections (Llama: all off; Qwen2: only
    ``q_bias`` and ``kv_bias``).

    ``zero_padded_queries=True`` returns 0 at padded query positions, as x-transformers does (see
    :class:`~headmix.attention.moa.MixtureOfAttentionHeads`).

    ``rotary=True`` rotates queries and keys by their positions (RoPE, :class:`RotaryEmbedding` over the
    ``key_dim`` of each head, built from ``rotary_base`` and ``rotary_fraction``; a module instance is used
    as given). In self-attention the queries and keys of a call start at position ``cache.length`` (0
    without a cache) and keys are cached after rotation. Self-attention is ``key=None`` or the query tensor
    itself passed as key (and value): ``layer(x, x, x)`` is ``layer(x)`` in every respect (rotary, growing
    cache, the token mask from ``key_padding_mask``); any other key tensor, even an equal copy, is
    cross-attention, which is not rotated (see :func:`~headmix.attention.base.is_self_attention`).
    """

    repr_sizes = ("embed_dim", "num_heads", "head_dim", "key_dim")

    def __init__(self, embed_dim: int, num_heads: int, head_dim: int | None = None, key_dim: int | None = None,
                 bias: bool = True, dropout: float = 0.0, *, q_bias: bool | None = None, kv_bias: bool | None = None,
                 out_bias: bool | None = None, rotary: bool | RotaryEmbedding = False,
                 rotary_base: float = 10000.0, rotary_fraction: float = 1.0, zero_padded_queries: bool = False):
        super().__init__(embed_dim)
        self.num_heads = num_heads
        self.head_dim, self.key_dim = resolve_head_dims(embed_dim, num_heads, head_dim, key_dim)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.dropout = dropout
        q_bias, kv_bias, out_bias = (resolve_bias(n, b, bias) for n, b in
                                     (("q_bias", q_bias), ("kv_bias", kv_bias), ("out_bias", out_bias)))
        self.q_proj = nn.Linear(embed_dim, num_heads * self.key_dim, bias=q_bias)
        self.k_proj = nn.Linear(embed_dim, num_heads * self.key_dim, bias=kv_bias)
        self.v_proj = nn.Linear(embed_dim, num_heads * self.head_dim, bias=kv_bias)
        self.out_proj = nn.Linear(num_heads * self.head_dim, embed_dim, bias=out_bias)
        self.rotary = make_rotary(rotary, rotary_base, rotary_fraction, self.key_dim)
        self.zero_padded_queries = check_flag("zero_padded_queries", zero_padded_queries)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention, *, allow_seq_first: bool = False) -> MultiHeadAttention:
        """A layer with the weights of a ``torch.nn.MultiheadAttention``; it gives the same outputs for the same
        masks, in batch-first layout: headmix layers take ``(batch, time, embed_dim)``. A module made with
        ``batch_first=False`` (torch's default) takes ``(time, batch, embed_dim)``: converting it is refused
        unless ``allow_seq_first=True`` says that its inputs will be transposed (``x.transpose(0, 1)``); a
        ``(time, batch, ...)`` tensor fed to the converted layer would attend across the batch."""
        if not isinstance(module, nn.MultiheadAttention):
            raise ValueError(f"module must be a torch.nn.MultiheadAttention, got {type(module).__name__}")
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("module uses add_bias_kv or add_zero_attn, which headmix does not support")
        if module.kdim != module.embed_dim or module.vdim != module.embed_dim:
            raise ValueError(f"module must have kdim == vdim == embed_dim ({module.embed_dim}), got {module.kdim}, {module.vdim}")
        if not module.batch_first and not allow_seq_first:
            raise ValueError("module has batch_first=False (inputs (time, batch, embed_dim)) but headmix layers take "
                             "(batch, time, embed_dim): pass allow_seq_first=True to convert it and feed the layer "
                             "x.transpose(0, 1)")
        d = module.embed_dim
        has_bias = module.in_proj_bias is not None
        layer = cls(d, module.num_heads, bias=has_bias, dropout=module.dropout)
        layer.to(device=module.out_proj.weight.device, dtype=module.out_proj.weight.dtype)
        with torch.no_grad():
            wq, wk, wv = module.in_proj_weight.split(d, dim=0)
            layer.q_proj.weight.copy_(wq)
            layer.k_proj.weight.copy_(wk)
            layer.v_proj.weight.copy_(wv)
            layer.out_proj.weight.copy_(module.out_proj.weight)
            if has_bias:
                bq, bk, bv = module.in_proj_bias.split(d)
                layer.q_proj.bias.copy_(bq)
                layer.k_proj.bias.copy_(bk)
                layer.v_proj.bias.copy_(bv)
                layer.out_proj.bias.copy_(module.out_proj.bias)
        return layer

    def _project_kv(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        return split_heads(self.k_proj(key), self.num_heads), split_heads(self.v_proj(value), self.num_heads)

    def _heads_and_masks(self, query: Tensor, key: Tensor | None, value: Tensor | None, *,
                         key_padding_mask: Tensor | None, attn_mask: Tensor | None, is_causal: bool, use_cache: bool,
                         cache: KVCache | None) -> tuple[Tensor, Tensor, Tensor, KVCache | None, tuple]:
        """Queries, keys and values split into heads (keys and values from the cache where it has them),
        the new cache, and the masks combined by :func:`attention_bias` as ``(bias, empty_rows, causal)``."""
        query, key, value = self._check_inputs(query, key, value)
        k, v, new_cache, past_len = self._keys_values(query, key, value, use_cache, cache)
        q = self._rotate_queries(split_heads(self.q_proj(query), self.num_heads), key, cache, past_len)
        batch, _, tgt, _ = q.shape
        masks = attention_bias(batch, self.num_heads, tgt, k.shape[2], key_padding_mask=key_padding_mask,
                               attn_mask=attn_mask, is_causal=is_causal, past_len=past_len,
                               dtype=q.dtype, device=q.device)
        return q, k, v, new_cache, masks

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None, is_causal: bool = False,
                use_cache: bool = False, cache: KVCache | None = None, query_padding_mask: Tensor | None = None) -> AttentionOutput:
        """Attend from ``query`` ``(B, T, embed_dim)`` to ``key`` / ``value`` ``(B, S, embed_dim)`` (``None``:
        self-attention): per head ``softmax(q k^T / sqrt(key_dim)) v`` (Vaswani et al. 2017, eq. 1), the heads
        concatenated and projected by ``out_proj`` (eq. 4-5 there). Returns an :class:`AttentionOutput`:
        ``output`` ``(B, T, embed_dim)``, no routing, ``aux_loss`` 0.
        Masks: ``key_padding_mask`` ``(B, S)``, ``attn_mask`` ``(T, S)`` (or per batch / head), ``is_causal``,
        ``query_padding_mask`` ``(B, T)``, with ``torch.nn.MultiheadAttention``'s conventions (``True`` =
        padding / forbidden; see :mod:`headmix.attention.base`); ``use_cache`` returns the new ``cache``."""
        check_mask_dtype("query_padding_mask", query_padding_mask, additive=False)  # also when zero_padded_queries is off
        query, key, value = self._check_inputs(query, key, value)  # layer(x, x, x) is layer(x)
        q, k, v, new_cache, (bias, empty, causal) = self._heads_and_masks(
            query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal,
            use_cache=use_cache, cache=cache)
        o = scaled_dot_product(q, k, v, bias, empty, self.dropout if self.training else 0.0, causal=causal)
        y = self._zero_padded(self.out_proj(merge_heads(o)), query, key, key_padding_mask, query_padding_mask, cache)
        return AttentionOutput(y, zero_loss(query), new_cache)

    def _zero_padded(self, y: Tensor, query: Tensor, key: Tensor | None, key_padding_mask: Tensor | None,
                     query_padding_mask: Tensor | None, cache: KVCache | None) -> Tensor:
        """``y`` with padded query rows zeroed when ``zero_padded_queries`` is set."""
        if not self.zero_padded_queries:
            return y
        return zero_padded_queries(y, real_token_mask(query, key, key_padding_mask, query_padding_mask, cache))
