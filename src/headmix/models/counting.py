"""Parameter and MACs accounting, following the MoA paper (Zhang et al. 2022, eq. 18-20, Appendix E).

Three numbers per model:

- ``full``: every multiply-accumulate of the model's matrix products, from the config alone. Attention
  costs both ``Q K^T`` *and* ``softmax(.) V``, i.e. ``2 T S d`` per head dimension; projections,
  routers, FFN (two matmuls for the MLP, three for SwiGLU), LM head and output projection are counted;
  embeddings are lookups (0 MACs). Element-wise work (softmax, LayerNorm / RMSNorm, activations and the
  SwiGLU gate product, rotary position embeddings, residual adds, biases, MoA's gate scaling) is not
  counted, as in ptflops / fvcore-style counts of matrix products.
- ``paper``: the same, except that each attention layer is costed by the paper's formula as printed:
  eq. 18 ``C_MoA = k T^2 d_h + 2(k+1) T d_h d_m`` (one ``T^2`` term, router aside) and eq. 19
  ``C_MHA = T^2 d_m + 4 T d_m^2``. For cross-attention ``T^2`` becomes ``T S`` and the projection term
  keeps the query length ``T``, as printed (with Appendix E's ``S = T = 10`` this is the formula itself).
  MoH and Talking-Heads have no formula in the paper; the column uses eq. 19 for them. SwitchHead
  (arXiv 2312.07987) is costed exactly as its authors count it (RobertCsordas/moe_attention,
  ``paper/common.py``, ``get_attention_flops``, variant ``full_rope`` with value and output experts, no
  context blocks): per head, dense Q and K projections, ``k`` value and ``k`` output expert projections and
  both attention products, plus the weighted sums of the ``k`` expert outputs (``k d_h`` per token, head and
  side) and the two selectors counted as ``E d_m`` per token and side (their formula's ``n_experts *
  state_size``; the layer's selectors are ``H E d_m``, the ``full`` count has those):
  ``C_SH = H (T d_m d_h + S d_m d_h + k S d_m d_h + k T d_h d_m + 2 T S d_h) + H k d_h (S + T) + E d_m (S + T)``,
  ``= 2 H T d_h (d_m (1 + k) + T) + 2 H k T d_h + 2 E d_m T`` in self-attention (their formula, with
  ``unroll = T``); cross-attention puts ``S`` where the key/value side runs (their formula has no
  cross-attention).
- Sparse MoH (``moh_impl="sparse"``): the ``full`` count is what it computes, the shared and the
  ``top_k`` selected heads' query projections, attention and output projections per query token (per K/V
  group with ``route_per_group``: ``kv_heads (num_shared_heads + top_k)`` heads), and every
  head's keys and values; dense MoH (and ``auto``, whatever it picks at run time) counts every head. With
  ``route_per_group`` or one K/V head this is exactly the slot form's grouped-query attention of
  ``G (S + k)`` query heads, on every device and compiled; global-top-k MoH over several K/V heads computes it
  on the eager CPU (up to the padding of each head's rows to its largest group), while off the CPU and under
  ``torch.compile`` its padded layout computes every routed head's attention rows (the count, from the config
  alone, does not follow the device). With
  ``router="query_norm"`` (MoH-LLaMA3's rule, which reads every routed head's query) the query projection
  of every head is counted; the norms are element-wise work, and the rule has no router projection.
- ``kv_heads`` (MHA, MoH, Talking-Heads): the K/V projections make ``kv_heads`` heads, ``2 S d_m
  kv_heads d_h`` MACs; ``output_gate``: its projection ``T d_m H`` (headwise) or ``T d_m H d_h``
  (elementwise) for every head; ``qk_norm`` is element-wise (0 MACs, ``2 d_k`` parameters). The ``paper``
  column stays eq. 19-20 as printed (every head with its own K/V, no gates).
- GQE (arXiv 2606.20945, ``kind="gqe"``): the ``full`` count is what it computes (:func:`gqe_macs`): every
  expert's query (one dense projection, then each token's ``k G`` gathered), ``k G + 1`` attention heads (the
  slots and the shared head), ``W_O`` of ``(k G + 2) d_h`` inputs; the ``paper`` column is eq. 19 for its
  ``num_experts`` heads. Both ``attention`` conventions apply to its ``k G + 1`` heads.
- MoSA (arXiv 2505.00315) has no formula in the MoA paper; both columns count what it computes
  (:func:`mosa_macs`): per sparse head the router ``T d_m``, the chosen tokens' Q, K, V and output projections
  ``4 k d_m d_h`` and the attention among them ``2 k^2 d_h`` (``k = T // sparsity``, at least 2, at most
  ``T``), plus the dense heads as MHA.
- ``attention`` convention of the ``full`` count (``headmix macs --attention-macs``, a study's
  ``attention_macs``): ``"full"`` (the default, the MoA and SwitchHead papers' convention) counts every
  (query, key) pair of the score and weights x values products, ``T S`` per head; ``"causal"`` counts a
  causal layer (the decoder's self-attention) as a causal flash kernel computes it: in tiles of
  :data:`FLASH_TILE` (128 queries x 128 keys), every tile at or below the diagonal computed whole, those
  above it skipped (:func:`causal_pairs`: about half the square, exactly the square up to one tile). It
  applies to every kind's score and weights x values products (and Talking-Heads' mixing of the scores,
  which is per computed pair): MoSA's sparse heads attend causally among their ``k`` chosen tokens, so they
  count ``causal_pairs(k)``. Encoder self-attention and cross-attention are not causal and count ``T S``
  in both conventions. Projections and routers do not change.
- ``measured``: run the model once under ``torch.utils.flop_counter.FlopCounterMode`` (MACs =
  FLOPs / 2), with MoA layers on ``expert_impl="sorted"`` so that only the ``k`` selected experts per
  token are computed (and counted).

Parameters: ``full`` is the exact ``sum(p.numel())``; ``paper`` uses eq. 20 for attention,
``M_MoA = (2E + 2) d_h d_m`` and ``M_MHA = 4 d_m^2`` (no router, no biases), and for SwitchHead
``M_SH = 2 H (E + 1) d_h d_m`` (Q, K, and E value and E output experts per head; no selectors, no biases).

Appendix E setup (the defaults here): batch 1, source and target length 10 for translation, length 128
for the masked LM (and for the causal LM).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
from torch import nn

from .config import AttentionConfig, ModelConfig

#: Appendix E input sizes.
APPENDIX_E_LENGTHS = {"translation": (10, 10), "mlm": (128, None), "lm": (None, 128)}
#: How the ``full`` count costs attention's score and weights x values products (module docstring):
#: ``"full"``, every (query, key) pair, or ``"causal"``, causal layers as a causal flash kernel computes them.
ATTENTION_MACS = ("full", "causal")
#: The (queries, keys) tile of the ``causal`` convention: the forward tile of the flash kernel that PyTorch's
#: ``scaled_dot_product_attention`` runs on an H100 for heads of 64 (FlashAttention-2's ``run_mha_fwd_hdim64``,
#: ``kBlockM = kBlockN = 128``; FlashAttention-3 also uses 128 x 128 for causal heads of 128). Heads of 128 under
#: FlashAttention-2 use 128 x 64 tiles, which skip more of the square; one tile size keeps the count a property
#: of the model, not of the head size.
FLASH_TILE = (128, 128)


def causal_pairs(length: int, tile: tuple[int, int] = FLASH_TILE) -> int:
    """The (query, key) pairs a causal flash kernel computes over ``length`` tokens with ``tile`` = (query rows,
    key columns) per tile: the query rows of tile ``i`` (``[i m, min((i + 1) m, T))``) against the keys up to the
    end of the last key tile that reaches their last query (``min(ceil((i + 1) m / n) n, T)``), so a tile on
    the diagonal is computed whole and the tiles above it not at all. The rows and columns past ``T`` (the
    kernel masks them) are not counted: ``T <= m`` gives ``T^2``, a long sequence about ``T^2 / 2``."""
    rows, cols = tile
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be a non-negative integer, got {length!r}")
    pairs = 0
    for start in range(0, length, rows):
        end = min(start + rows, length)
        keys = min(-(-(start + rows) // cols) * cols, length)
        pairs += (end - start) * keys
    return pairs


def check_convention(attention: str) -> str:
    """``attention`` if it is one of :data:`ATTENTION_MACS`, else ``ValueError`` naming the option."""
    if attention not in ATTENTION_MACS:
        raise ValueError(f"attention_macs must be one of {ATTENTION_MACS}, got {attention!r}")
    return attention


@dataclass
class Count:
    """Per-component counts: ``full`` (exact) and ``paper`` (attention by eq. 18-20 as printed)."""

    full: dict[str, int]
    paper: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.full.values())

    @property
    def paper_total(self) -> int:
        return sum(self.paper.values())


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """``sum(p.numel())`` over the model's parameters, each tied parameter once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


# --------------------------------------------------------------------------------------------------
# One attention layer
# --------------------------------------------------------------------------------------------------
def attention_macs(att: AttentionConfig, d_model: int, tgt_len: int, src_len: int,
                   causal: bool = False) -> tuple[int, int]:
    """``(full, paper)`` MACs of one attention layer with ``tgt_len`` queries over ``src_len`` keys
    (``src_len == tgt_len`` for self-attention), batch 1, inference (no router noise). ``causal``: the ``full``
    count's score and weights x values products cover the pairs a causal flash kernel computes
    (:func:`causal_pairs`, self-attention only) instead of all ``T S``; the ``paper`` count is unchanged."""
    d, t, s = d_model, tgt_len, src_len
    if causal and t != s:
        raise ValueError(f"causal attention is self-attention: tgt_len {t} and src_len {s} must be equal")
    pairs = causal_pairs(t) if causal else t * s  # (query, key) pairs of the score and weights x values products
    if att.kind == "mosa":
        full = mosa_macs(att, d, t, causal=causal)
        return full, mosa_macs(att, d, t)
    if att.kind == "moa":
        # kv_heads G: every expert is G heads of d_h (one per K/V head), i.e. eq. 10-12 with d_h -> G d_h
        k, e, dh = att.top_k, att.num_experts, att.head_dim * (att.kv_heads or 1)
        full = (t * d * e * _learned(att)  # router logits x W_g (eq. 7); none for the random control
                + k * t * d * dh     # expert query projections (eq. 10), k per token
                + 2 * s * d * dh     # shared K and V projections, once
                + 2 * k * pairs * dh  # scores and weights x values of k heads
                + k * t * dh * d)    # expert output projections (eq. 12)
        paper = k * t * s * dh + 2 * (k + 1) * t * dh * d  # eq. 18
        return full, paper
    if att.kind == "gqe":
        return gqe_macs(att, d, t, s, pairs)
    if att.kind == "switchhead":
        h, e, k, dh = att.num_heads, att.num_experts, att.top_k, att.resolved_head_dim(d)
        products = h * (t * d * dh + s * d * dh + k * s * d * dh + k * t * dh * d + 2 * t * s * dh)
        computed = products - h * 2 * (t * s - pairs) * dh  # the attention products over the computed pairs
        # sigmoid(x W_sel), output and value side (none for the random control)
        selectors = (t * d * h * e + (s * d * h * e if e > 1 else 0)) * _learned(att)
        # The SwitchHead authors' count (get_attention_flops): + the weighted sums of the k expert outputs
        # (value side over S, output side over T) + the two selectors as E d_m per token and side.
        paper = products + h * k * dh * (s + t) + e * d * (s + t)
        return computed + selectors, paper
    h = att.num_heads
    dv = att.resolved_head_dim(d)
    dk = att.resolved_key_dim(d)
    kv = att.kv_heads or h  # grouped-query attention: the K/V projections make kv_heads heads
    groups = _route_groups(att)
    # Heads whose queries, attention rows and output projection are computed per query token: all of them,
    # or with sparse MoH the shared heads and the top_k selected ones (per group with route_per_group; keys
    # and values stay dense).
    active = groups * (att.num_shared_heads + att.top_k) if att.kind == "moh" and att.moh_impl == "sparse" else h
    # MoH's query-norm router reads every routed head's query: the query projection stays whole (its norms are
    # element-wise work, not counted, as RMSNorm)
    queried = h if att.kind == "moh" and att.router == "query_norm" else active
    full = t * d * queried * dk + s * d * kv * (dk + dv) + active * pairs * (dk + dv) + t * active * dv * d
    paper = t * s * h * dk + 2 * t * d * h * dk + 2 * t * d * h * dv  # eq. 19 (= T^2 d_m + 4 T d_m^2)
    full += t * d * _output_gates(att, h, dv)  # Gated Attention's gate projection, every head (QK-norm: element-wise)
    if att.kind == "talking_heads":
        full += (int(att.pre_softmax) + int(att.post_softmax)) * h * h * pairs
    if att.kind == "moh":
        full += t * d * _moh_router_width(att, h, groups) * _learned(att)
    return full, paper


def minimal_attention_macs(att: AttentionConfig, d_model: int, length: int, causal: bool = True) -> int:
    """The MACs one self-attention layer needs at the least over ``length`` tokens (batch 1): what its tokens use,
    whichever form computes it. MoH: the shared heads and each token's ``top_k`` selected heads (per group with
    ``route_per_group``): their queries, attention rows and output projections, every K/V head, the router (MoH's
    sparse form; the query-norm rule reads every routed head's query, so its query projection stays whole). GQE:
    the ``k G`` selected query heads and the shared head's queries (its layer computes every expert's query in one
    GEMM, :func:`gqe_macs`; the others are never used). MoA and SwitchHead compute only what a token selects, MHA /
    GQA / Talking-Heads everything: their :func:`attention_macs`. ``causal``: the attention products over the pairs
    a causal flash kernel computes (:func:`causal_pairs`). This is the count the time-beside-compute table
    (``headmix bench compute``) sets each measured time ratio beside."""
    t = length
    if att.kind == "moh":
        return attention_macs(dataclasses.replace(att, moh_impl="sparse"), d_model, t, t, causal=causal)[0]
    full = attention_macs(att, d_model, t, t, causal=causal)[0]
    if att.kind == "gqe":
        experts, kv, top_k = att.gqe_sizes()
        full -= t * d_model * (experts - top_k * kv) * att.resolved_head_dim(d_model)  # the unselected experts' queries
    return full


def gqe_macs(att: AttentionConfig, d_model: int, tgt_len: int, src_len: int, pairs: int) -> tuple[int, int]:
    """``(full, paper)`` MACs of one GQE layer (``pairs``: the (query, key) pairs of each attention head). ``full``,
    as the layer computes them: the router ``T d_m E`` (none for the random control), every expert's query and
    the shared head's in one projection ``T d_m (E + 1) d_h`` (all ``E`` are computed, then each token's
    ``k G`` gathered), the ``G`` K/V heads ``2 S d_m G d_h``, the attention of the ``k G`` slots and the shared head
    ``(k G + 1) 2 pairs d_h``, and ``W_O`` over its ``(k G + 2) d_h`` inputs ``T (k G + 2) d_h d_m`` (the weighted
    sum is element-wise). ``paper``: eq. 19 for ``E`` heads of ``d_h`` (GQE's paper has no MACs formula)."""
    d, t, s = d_model, tgt_len, src_len
    experts, kv, top_k = att.gqe_sizes()
    dh, shared = att.resolved_head_dim(d), int(att.shared_head is not False)
    slots = top_k * kv + int(att.weighted_slot is not False) + shared
    full = (t * d * experts * _learned(att) + t * d * (experts + shared) * dh + 2 * s * d * kv * dh
            + (top_k * kv + shared) * pairs * 2 * dh + t * slots * dh * d)
    paper = t * s * experts * dh + 4 * t * d * experts * dh
    return full, paper


def gqe_parameters(att: AttentionConfig, d_model: int) -> tuple[int, int]:
    """``(full, paper)`` parameters of one GQE layer: ``W_q`` of the ``E`` experts and the shared head, the ``G``
    K/V heads' ``W_k, W_v``, ``W_O`` of ``(k G + 2) d_h`` inputs, the router ``d_m E`` (none for the random
    control) and the biases; ``paper``: eq. 20 for ``E`` heads of ``d_h``."""
    d = d_model
    experts, kv, top_k = att.gqe_sizes()
    dh, shared = att.resolved_head_dim(d), int(att.shared_head is not False)
    slots = top_k * kv + int(att.weighted_slot is not False) + shared
    q_bias, kv_bias, out_bias = att.resolved_biases()
    full = ((experts + shared) * dh * (d + q_bias) + 2 * kv * dh * (d + kv_bias) + slots * dh * d + d * out_bias
            + d * experts * _learned(att))
    return full, 4 * d * experts * dh


def _learned(att: AttentionConfig) -> int:
    """1 for a layer with a learned router, 0 for the random-routing control (``router="random"``) and MoH's
    query-norm rule (``router="query_norm"``): no router projection to compute or store."""
    return int(att.router not in ("random", "query_norm"))


def _route_groups(att: AttentionConfig) -> int:
    """MoH's router groups: the K/V groups with ``route_per_group``, else 1."""
    return att.kv_heads if att.kind == "moh" and att.route_per_group else 1


def _output_gates(att: AttentionConfig, heads: int, head_dim: int) -> int:
    """Outputs of the ``output_gate`` projection: one per head (headwise), one per output element
    (elementwise), or 0."""
    return {None: 0, "headwise": heads, "elementwise": heads * head_dim}[att.output_gate]


def _moh_router_width(att: AttentionConfig, heads: int, groups: int) -> int:
    """Outputs of MoH's router projections: ``W_r`` over the routed heads, and with shared heads ``W_s``
    over them and ``W_h``'s two group weights, per router group."""
    shared = groups * att.num_shared_heads
    return (heads - shared) + ((shared + 2 * groups) if shared else 0)
def mosa_tokens(att: AttentionConfig, length: int) -> int:
    """``k``, the tokens each MoSA sparse head chooses from ``length``: ``length // sparsity`` (or
    ``tokens_per_head``), at least 2 and at most ``length`` (the layer's rule)."""
    k = int(length // att.sparsity) if att.tokens_per_head is None else att.tokens_per_head
    return min(max(k, 2), length)


def mosa_macs(att: AttentionConfig, d_model: int, length: int, causal: bool = False) -> int:
    """MACs of one MoSA layer over ``length`` tokens: ``H_s (T d_m + 4 k d_m d_h + 2 k^2 d_h)`` for the
    sparse heads (router; the chosen tokens' Q, K, V and output projections; scores and weights x values
    among the ``k`` chosen) plus ``H_d (4 T d_m d_h + 2 T^2 d_h)`` for the dense heads. ``causal``: ``k^2``
    and ``T^2`` become :func:`causal_pairs` of ``k`` and ``T`` (a sparse head attends causally among the
    tokens it chose)."""
    d, t = d_model, length
    dh, k = att.resolved_head_dim(d), mosa_tokens(att, length)
    k_pairs, t_pairs = (causal_pairs(k), causal_pairs(t)) if causal else (k * k, t * t)
    sparse = att.num_sparse_heads * (t * d + 4 * k * d * dh + 2 * k_pairs * dh)
    dense = (att.num_dense_heads or 0) * (4 * t * d * dh + 2 * t_pairs * dh)
    return sparse + dense


def attention_parameters(att: AttentionConfig, d_model: int) -> tuple[int, int]:
    """``(full, paper)`` parameters of one attention layer; ``paper`` is eq. 20."""
    d = d_model
    if att.kind == "mosa":  # router d_m per sparse head; W_Q, W_K, W_V, W_O of d_m x d_h per head
        heads = att.num_sparse_heads + (att.num_dense_heads or 0)
        full = att.num_sparse_heads * d + 4 * heads * d * att.resolved_head_dim(d)
        return full, full
    if att.kind == "moa":
        e, dh = att.num_experts, att.head_dim * (att.kv_heads or 1)
        paper = (2 * e + 2) * dh * d
        router = d * e * (2 if att.router == "noisy_topk" else 1) * _learned(att)
        _, kv_bias, out_bias = att.resolved_biases()
        bias = 2 * dh * kv_bias + d * out_bias
        return paper + router + bias, paper
    if att.kind == "gqe":
        return gqe_parameters(att, d)
    if att.kind == "switchhead":
        h, e, dh = att.num_heads, att.num_experts, att.resolved_head_dim(d)
        paper = 2 * h * (e + 1) * dh * d
        selectors = d * h * e * (2 if e > 1 else 1) * _learned(att)
        return paper + selectors + ((2 * h * dh + d) if att.bias else 0), paper
    h = att.num_heads
    dv = att.resolved_head_dim(d)
    dk = att.resolved_key_dim(d)
    kv = att.kv_heads or h
    paper = 2 * d * h * dk + 2 * d * h * dv  # = 4 d_m^2
    q_bias, kv_bias, out_bias = att.resolved_biases()
    gates = _output_gates(att, h, dv)
    full = (d * h * dk + d * kv * (dk + dv) + h * dv * d  # W_q, W_k and W_v of kv_heads heads, W_o
            + h * dk * q_bias + kv * (dk + dv) * kv_bias + d * out_bias
            + gates * (d + q_bias)  # the output gate's projection (its bias follows q_bias)
            + (2 * dk if att.qk_norm else 0))  # QK-norm: one weight per query/key dimension, for q and for k
    if att.kind == "talking_heads":
        full += (int(att.pre_softmax) + int(att.post_softmax)) * h * h
    if att.kind == "moh":
        full += d * _moh_router_width(att, h, _route_groups(att)) * _learned(att)
    return full, paper


# --------------------------------------------------------------------------------------------------
# Whole models
# --------------------------------------------------------------------------------------------------
def ffn_macs(config: ModelConfig, tokens: int) -> int:
    """MACs of one feed-forward sublayer over ``tokens`` tokens: MLP ``2 T d_m d_ffn``, SwiGLU
    ``3 T d_m d_ffn``, mixture of SwiGLU experts ``T d_m E`` (router) ``+ 3 k T d_m d_ffn``."""
    d, f = config.d_model, config.ffn_dim
    if config.ffn == "moe_swiglu":
        return tokens * d * config.ffn_experts + 3 * config.ffn_top_k * tokens * d * f
    return (3 if config.ffn == "swiglu" else 2) * tokens * d * f


def ffn_parameters(config: ModelConfig) -> int:
    """Parameters of one feed-forward sublayer: MLP ``2 d_m d_ffn`` (+ ``d_ffn + d_m`` biases), SwiGLU
    ``3 d_m d_ffn`` (+ ``2 d_ffn + d_m``), mixture of SwiGLU experts ``3 E d_m d_ffn + d_m E`` (+ ``d_m``)."""
    d, f = config.d_model, config.ffn_dim
    if config.ffn == "moe_swiglu":
        return 3 * config.ffn_experts * d * f + d * config.ffn_experts + (d if config.bias else 0)
    if config.ffn == "swiglu":
        return 3 * d * f + ((2 * f + d) if config.bias else 0)
    return 2 * d * f + ((f + d) if config.bias else 0)


def resolve_lengths(config: ModelConfig, src_len: int | None = None, tgt_len: int | None = None) -> tuple[int | None, int | None]:
    """``(src_len, tgt_len)`` with Appendix E's defaults; ``None`` for the side a task does not have."""
    default_src, default_tgt = APPENDIX_E_LENGTHS[config.task]
    if default_tgt is None and tgt_len is not None:
        raise ValueError(f"tgt_len={tgt_len} given, but a masked LM has no target sequence: give its input length as src_len")
    if default_src is None and src_len is not None:
        raise ValueError(f"src_len={src_len} given, but a causal LM has no source sequence: give its input length as tgt_len")
    src = default_src if src_len is None else src_len
    tgt = default_tgt if tgt_len is None else tgt_len
    for name, v in (("src_len", src), ("tgt_len", tgt)):
        if v is not None and (not isinstance(v, int) or v <= 0):
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return src, tgt


def analytic_macs(config: ModelConfig, src_len: int | None = None, tgt_len: int | None = None,
                  batch_size: int = 1, attention: str = "full") -> Count:
    """MACs of one forward pass, per component (see the module docstring for ``full`` vs ``paper``, and for the
    ``attention`` conventions of :data:`ATTENTION_MACS`: ``"causal"`` counts the decoder's self-attention as a
    causal flash kernel computes it).

    ``src_len`` is the encoder's input length (translation, masked LM), ``tgt_len`` the decoder's
    (translation, causal LM); defaults are Appendix E's (10 and 10 for translation, 128 for the LMs).
    Per layer: FFN ``2 T d_m d_ffn``; output projection ``T d_m V``; RoBERTa LM head ``T d_m^2``; attention
    by :func:`attention_macs`; FFN by :func:`ffn_macs` (SwiGLU: gate, up and down projections).
    """
    src, tgt = resolve_lengths(config, src_len, tgt_len)
    causal = check_convention(attention) == "causal"
    d, v = config.d_model, config.vocab_size
    full: dict[str, int] = {"embeddings": 0}
    paper: dict[str, int] = {"embeddings": 0}

    def add(name: str, count_full: int, count_paper: int | None = None) -> None:
        full[name] = full.get(name, 0) + batch_size * count_full
        paper[name] = paper.get(name, 0) + batch_size * (count_full if count_paper is None else count_paper)

    if config.encoder_layers:
        a_full, a_paper = attention_macs(config.encoder_self_attention, d, src, src)
        add("encoder.self_attention", config.encoder_layers * a_full, config.encoder_layers * a_paper)
        add("encoder.ffn", config.encoder_layers * ffn_macs(config, src))
    if config.decoder_layers:
        n = config.decoder_layers
        a_full, a_paper = attention_macs(config.decoder_self_attention, d, tgt, tgt, causal=causal)
        add("decoder.self_attention", n * a_full, n * a_paper)
        if config.cross_attention is not None:
            c_full, c_paper = attention_macs(config.cross_attention, d, tgt, src)
            add("decoder.cross_attention", n * c_full, n * c_paper)
        add("decoder.ffn", n * ffn_macs(config, tgt))
    out_len = src if tgt is None else tgt  # the decoder's tokens, or the encoder's for the masked LM
    if tgt is None:  # the masked LM's RoBERTa head
        add("lm_head", out_len * d * d)
    add("output_projection", out_len * d * v)
    return Count(full, paper)


def analytic_parameters(config: ModelConfig) -> Count:
    """Parameters per component, exact (``full``, equal to :func:`count_parameters` of the built model)
    and with attention by eq. 20 (``paper``)."""
    d, v = config.d_model, config.vocab_size
    full: dict[str, int] = {}
    paper: dict[str, int] = {}

    def add(name: str, count_full: int, count_paper: int | None = None) -> None:
        full[name] = full.get(name, 0) + count_full
        paper[name] = paper.get(name, 0) + (count_full if count_paper is None else count_paper)

    stacks = [s for s, n in (("encoder", config.encoder_layers), ("decoder", config.decoder_layers)) if n]
    # token embeddings: one joint matrix when shared, else one per stack (plus the output projection below)
    add("embeddings", v * d * (1 if config.share_embeddings else len(stacks)))
    if config.positions == "learned":
        add("positions", len(stacks) * config.max_positions * d)
    layer_norm = d if config.norm_type == "rmsnorm" or not config.bias else 2 * d  # gain (+ bias)
    for stack in stacks:
        n = getattr(config, f"{stack}_layers")
        roles = ["self_attention"] + (["cross_attention"] if stack == "decoder" and config.cross_attention else [])
        for role in roles:
            att = getattr(config, f"{stack}_{role}" if role == "self_attention" else role)
            a_full, a_paper = attention_parameters(att, d)
            add(f"{stack}.{role}", n * a_full, n * a_paper)
        add(f"{stack}.ffn", n * ffn_parameters(config))
        norms = n * (len(roles) + 1) + int(config.norm == "pre") + int(config.embedding_norm)
        add(f"{stack}.norms", norms * layer_norm)
    if not config.decoder_layers:  # encoder only: the masked LM, with its RoBERTa head
        add("lm_head", d * d + d + 2 * d + v)  # dense, its bias, LayerNorm (always with a bias), output bias
    if not config.share_embeddings:
        add("output_projection", v * d)
    return Count(full, paper)


# --------------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------------
def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """The CPU attention kernel's FLOPs: ``q k^T`` and ``p v`` for every query head, ``2 b h s_q s_k (d_qk +
    d_v)``, the formula of torch's ``sdpa_flop_count``, written out because torch 2.10's asserts that keys and
    values have as many heads as the queries (grouped-query attention passes fewer, ``enable_gqa``)."""
    b, h, s_q, d_qk = query_shape
    return 2 * b * h * s_q * key_shape[-2] * (d_qk + value_shape[-1])


def _flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    # FlopCounterMode knows the CUDA attention kernels but not the CPU one that
    # F.scaled_dot_product_attention dispatches to: give it the same formula (2 bmm's).
    mapping = {}
    if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_sdpa_flops
    return FlopCounterMode(display=False, custom_mapping=mapping)


def with_sorted_experts(config: ModelConfig) -> ModelConfig:
    """A copy whose MoA and SwitchHead layers (and mixture-of-experts FFN) use ``expert_impl="sorted"``
    (exactly ``k`` expert projections per token)."""
    changes = {"ffn_expert_impl": "sorted"} if config.ffn == "moe_swiglu" else {}
    for role in config.attention_roles():
        att = getattr(config, role)
        if att.kind in ("moa", "switchhead"):
            changes[role] = dataclasses.replace(att, expert_impl="sorted")
    return config.replace(**changes) if changes else config


_COMPONENT_RE = [
    (re.compile(r"^(encoder|decoder)\.layers\.\d+\.self_attn$"), "{}.self_attention"),
    (re.compile(r"^(decoder)\.layers\.\d+\.cross_attn$"), "{}.cross_attention"),
    (re.compile(r"^(encoder|decoder)\.layers\.\d+\.ffn$"), "{}.ffn"),
    (re.compile(r"^(lm_head)$"), "{}"),
]


def measure_macs(config: ModelConfig, src_len: int | None = None, tgt_len: int | None = None,
                 batch_size: int = 1) -> dict[str, int]:
    """MACs counted by ``FlopCounterMode`` (FLOPs / 2) on one forward pass of random tokens, per component
    (the keys of :func:`analytic_macs`; ``output_projection`` is what the model computes outside its
    layers). The model is built on the meta device and materialised with zero weights (no initialisers),
    so even the big presets measure in seconds.
    """
    from .transformer import build_model

    src, tgt = resolve_lengths(config, src_len, tgt_len)
    config = with_sorted_experts(config)
    # Only shapes matter: build on the meta device, materialise and zero the weights instead of running
    # the initialisers (MoA's sorted kernel multiplies exactly k*N rows whatever the routing is).
    model = build_model(config, device="meta").to_empty(device="cpu").eval()
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.zero_()
    gen = torch.Generator().manual_seed(0)

    def tokens(length: int) -> torch.Tensor:
        ids = torch.randint(0, config.vocab_size, (batch_size, length), generator=gen)
        if config.pad_id is None:
            return ids
        return ids.masked_fill(ids.eq(config.pad_id), (config.pad_id + 1) % config.vocab_size)

    counter = _flop_counter()
    with torch.no_grad(), counter:
        model(*(tokens(n) for n in (src, tgt) if n is not None))  # (src, tgt_in), or one LM's input_ids
    counts = {}
    root = type(model).__name__
    for name, ops in counter.get_flop_counts().items():
        if not name.startswith(root + "."):
            continue
        for pattern, key in _COMPONENT_RE:
            m = pattern.match(name[len(root) + 1:])
            if m:
                key = key.format(m.group(1))
                counts[key] = counts.get(key, 0) + sum(ops.values()) // 2
    counts["output_projection"] = counter.get_total_flops() // 2 - sum(counts.values())
    return {"embeddings": 0, **counts}
