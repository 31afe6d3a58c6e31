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


#: ``output_gate`` kinds (Gated Attention, Qiu et al. 2025, arXiv 2505.06708, position G1): one sigmoid gate per
#: head (``"headwise"``) or one per output element of each head (``"elementwise"``).
OUTPUT_GATES = ("headwise", "elementwise")


def resolve_kv_heads(num_heads: int, kv_heads: int | None) -> int:
    """``kv_heads`` (None: ``num_heads``), a positive divisor of ``num_heads``."""
    if kv_heads is None:
        return num_heads
    check_positive("kv_heads", kv_heads)
    if num_heads % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads}) must divide num_heads ({num_heads}): each K/V head serves num_heads / kv_heads query heads")
    return kv_heads


def check_output_gate(output_gate: str | None) -> str | None:
    if output_gate is not None and output_gate not in OUTPUT_GATES:
        raise ValueError(f"output_gate must be None or one of {OUTPUT_GATES}, got {output_gate!r}")
    return output_gate


#: The epsilon of QK-norm (``qk_norm_eps``'s default): the one of every layer built from an
#: :class:`~headmix.models.config.AttentionConfig`, which has no field for it (Qwen3's ``rms_norm_eps``).
QK_NORM_EPS = 1e-6


class HeadRMSNorm(nn.Module):
    """RMSNorm over the last dimension of each head (QK-norm, as Qwen3 and OLMo 2):
    ``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 and cast back before the weight, as Hugging
    Face's ``Qwen3RMSNorm`` does. ``weight`` has shape ``(size,)`` and starts at 1."""

    def __init__(self, size: int, eps: float = QK_NORM_EPS):
        super().__init__()
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
            raise ValueError(f"qk_norm_eps must be a positive number, got {eps!r}")
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(size))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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

    ``kv_heads=G`` (grouped-query attention, Ainslie et al. 2023; default ``num_heads``, the layer above with
    the same parameters): ``W_k`` is ``embed_dim x (G * key_dim)`` and ``W_v`` ``embed_dim x (G * head_dim)``,
    query head ``h`` attends with K/V head ``h // (num_heads / G)`` (Hugging Face's ``repeat_kv``, SDPA's
    ``enable_gqa``), and the cache holds ``G`` heads. ``kv_heads=1`` is multi-query attention (Shazeer 2019).
    The attention runs through :func:`~headmix.attention.base.scaled_dot_product`'s grouped form: headmix
    never repeats the keys and values.

    ``qk_norm=True`` (Qwen3, OLMo 2): ``q_norm`` and ``k_norm`` (:class:`HeadRMSNorm`, weight ``(key_dim,)``,
    epsilon ``qk_norm_eps``) normalise each head's query and key before the rotary positions.

    ``output_gate`` (Gated Attention, Qiu et al. 2025, arXiv 2505.06708, position G1, eq. 5-6:
    ``Y' = Y * sigmoid(X W_theta)``): ``"headwise"`` adds ``gate_proj`` ``embed_dim -> num_heads`` (one
    scalar per head), ``"elementwise"`` ``embed_dim -> num_heads * head_dim``; each head's attention output
    ``o_h`` is multiplied by ``sigmoid(gate_proj(x))`` (``x`` the layer's query input) before ``out_proj``.
    ``gate_proj`` has a bias when the query projection has one (``q_bias``).

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
                 rotary_base: float = 10000.0, rotary_fraction: float = 1.0, zero_padded_queries: bool = False,
                 kv_heads: int | None = None, qk_norm: bool = False, qk_norm_eps: float = QK_NORM_EPS,
                 output_gate: str | None = None):
        super().__init__(embed_dim)
        self.num_heads = num_heads
        self.head_dim, self.key_dim = resolve_head_dims(embed_dim, num_heads, head_dim, key_dim)
        self.kv_heads = resolve_kv_heads(num_heads, kv_heads)
        self.qk_norm = check_flag("qk_norm", qk_norm)
        self.output_gate = check_output_gate(output_gate)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.dropout = dropout
        q_bias, kv_bias, out_bias = (resolve_bias(n, b, bias) for n, b in
                                     (("q_bias", q_bias), ("kv_bias", kv_bias), ("out_bias", out_bias)))
        self.q_proj = nn.Linear(embed_dim, num_heads * self.key_dim, bias=q_bias)
        self.k_proj = nn.Linear(embed_dim, self.kv_heads * self.key_dim, bias=kv_bias)
        self.v_proj = nn.Linear(embed_dim, self.kv_heads * self.head_dim, bias=kv_bias)
        self.out_proj = nn.Linear(num_heads * self.head_dim, embed_dim, bias=out_bias)
        self.q_norm = self.k_norm = self.gate_proj = None
        if self.qk_norm:
            self.q_norm, self.k_norm = HeadRMSNorm(self.key_dim, qk_norm_eps), HeadRMSNorm(self.key_dim, qk_norm_eps)
        if self.output_gate is not None:
            gates = num_heads if self.output_gate == "headwise" else num_heads * self.head_dim
            self.gate_proj = nn.Linear(embed_dim, gates, bias=q_bias)
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
        k = split_heads(self.k_proj(key), self.kv_heads)
        return (k if self.k_norm is None else self.k_norm(k)), split_heads(self.v_proj(value), self.kv_heads)

    def _project_queries(self, query: Tensor, projected: Tensor | None = None) -> Tensor:
        """``(batch, num_heads, time, key_dim)`` queries, each head RMS-normalised with ``qk_norm`` (before the
        rotary positions, which the caller applies); ``projected``: ``q_proj(query)`` when the caller has it
        already (MoH's query-norm router reads it)."""
        q = split_heads(self.q_proj(query) if projected is None else projected, self.num_heads)
        return q if self.q_norm is None else self.q_norm(q)

    def output_gates(self, query: Tensor) -> Tensor | None:
        """The Gated Attention G1 gates ``sigmoid(x W_theta)`` of the query input ``x``, as ``(batch, time,
        num_heads, 1)`` (headwise) or ``(batch, time, num_heads, head_dim)`` (elementwise); None without
        ``output_gate``."""
        if self.gate_proj is None:
            return None
        return torch.sigmoid(self.gate_proj(query)).unflatten(-1, (self.num_heads, -1))

    def _gate_heads(self, o: Tensor, query: Tensor) -> Tensor:
        """The attention output ``o`` ``(batch, num_heads, time, head_dim)`` times its output gates (G1)."""
        gates = self.output_gates(query)
        return o if gates is None else o * gates.transpose(1, 2).to(o.dtype)

    def _heads_and_masks(self, query: Tensor, key: Tensor | None, value: Tensor | None, *,
                         key_padding_mask: Tensor | None, attn_mask: Tensor | None, is_causal: bool, use_cache: bool,
                         cache: KVCache | None, projected_queries: Tensor | None = None,
                         ) -> tuple[Tensor, Tensor, Tensor, KVCache | None, tuple]:
        """Queries, keys and values split into heads (keys and values from the cache where it has them),
        the new cache, and the masks combined by :func:`attention_bias` as ``(bias, empty_rows, causal)``.
        ``projected_queries``: ``q_proj(query)``, when the caller computed it already."""
        query, key, value = self._check_inputs(query, key, value)
        k, v, new_cache, past_len = self._keys_values(query, key, value, use_cache, cache)
        q = self._rotate_queries(self._project_queries(query, projected_queries), key, cache, past_len)
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
        o = self._gate_heads(o, query)
        y = self._zero_padded(self.out_proj(merge_heads(o)), query, key, key_padding_mask, query_padding_mask, cache)
        return AttentionOutput(y, zero_loss(query), new_cache)

    def _zero_padded(self, y: Tensor, query: Tensor, key: Tensor | None, key_padding_mask: Tensor | None,
                     query_padding_mask: Tensor | None, cache: KVCache | None) -> Tensor:
        """``y`` with padded query rows zeroed when ``zero_padded_queries`` is set."""
        if not self.zero_padded_queries:
            return y
        return zero_padded_queries(y, real_token_mask(query, key, key_padding_mask, query_padding_mask, cache))
