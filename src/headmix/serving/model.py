"""A headmix causal language model inside vLLM: :class:`VllmHeadmixForCausalLM` (docs/serving.md).

The decoder is headmix's (:class:`headmix.models.transformer.CausalLanguageModel`), rebuilt from vLLM's layers:
``Attention`` (the paged KV cache, continuous batching), ``get_rope`` (RoFormer's rotation, half-split as
headmix's, ``rotary_fraction`` of each head), ``RMSNorm`` / ``LayerNorm`` (the sublayer norms; ``RMSNorm`` also
for QK-norm, which it computes as headmix's ``HeadRMSNorm`` does), ``QKVParallelLinear`` (MHA's and MoH's
q/k/v projections, one GEMM), ``MergedColumnParallelLinear`` (MoA's k/v, SwiGLU's gate/up) with ``SiluAndMul``,
``FusedMoE`` (JetMoE's expert feed-forward, with headmix's routing), ``ColumnParallelLinear`` /
``RowParallelLinear``, ``VocabParallelEmbedding`` / ``ParallelLMHead`` and ``LogitsProcessor``. vLLM hands the
model the tokens of all its running sequences flattened, ``(tokens, d_model)``, with each token's position;
every routing decision headmix makes is per token, so it is the same in any batch.

The routers are headmix's own code, called on the modules here, which hold the same parameters under the same
names: MoA's and the expert feed-forward's :class:`~headmix.routing.TopKRouter` (eq. 7-9; the noisy router
without its noise, which is training-only), MoH's head weights
(:meth:`~headmix.attention.MixtureOfHeadsAttention.head_weights`, eq. 5-6 or the authors' form) and SwitchHead's
selectors (:meth:`~headmix.attention.SwitchHeadAttention.select`); the grouped expert projections of the attention
kinds are headmix's kernels (:func:`~headmix.kernels.expert_map`, :func:`~headmix.kernels.expert_reduce`), the
expert feed-forward's vLLM's ``FusedMoE``. So vLLM computes what headmix computes, up to the order of float
operations.

What the paged cache holds per token and layer: MHA/MoH ``kv_heads`` heads (``num_heads`` without GQA), MoA its
``kv_heads`` shared K/V heads (the selected experts' ``top_k * kv_heads`` queries are the attention's query
heads, query head ``g * top_k + j`` reading K/V head ``g``, as in headmix), SwitchHead its ``num_heads`` keys and
expert-mixed values.

Across ranks (vLLM's ``tensor_parallel_size``; :func:`~headmix.serving.support.check_tensor_parallel` refuses
a size that does not divide what is split) each rank holds its share of the heads (their query, K/V, gate and
expert projections, their attention and cache), of MoA's K/V heads or else of its experts, of GQE's K/V groups,
and of the feed-forward's hidden units; the routers are replicated (every rank makes the same choice), the output
projections sum the ranks' shares (all-reduce), the vocabulary is split by vLLM's embedding and output layers.

vLLM compiles the decoder (:class:`Decoder`, ``@support_torch_compile``, the token count dynamic) unless
``enforce_eager``: nothing in it branches on the token count, reads a value back to the host or makes a shape from
the data (docs/serving.md, "Compiled").

The weights load from headmix's safetensors names (a Hugging Face folder's ``model.`` prefix dropped, a tied
output projection stored once); a merged layer's separate tensors go to their shards (:data:`MERGED`). The padding
token (``pad_id``) is never generated: its logit is ``-inf``, as
headmix's decoding removes it, so vLLM's log-probabilities are over the tokens the model can emit (docs/serving.md).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import (get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                              tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce)
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import LayerNorm, RMSNorm
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.fused_moe import FusedMoEFactory
from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                               RowParallelLinear)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.utils import set_weight_attrs

from ..attention import GroupedQueryExpertsAttention, SwitchHeadAttention
from ..attention.mha import QK_NORM_EPS
from ..attention.moh import MoHHeadWeighting, head_ids
from ..kernels import ExpertRouting, choose_impl, expert_map, expert_map_weighted, expert_reduce, expert_routing
from ..kernels.dispatch import DENSE_MAX_EXPERTS_PER_K
from ..models.config import AttentionConfig, ModelConfig
from ..models.blocks import sinusoidal_table
from ..models.folders import HF_PREFIX
from ..routing import TopKRouter
from .support import check_head_size, check_servable, check_tensor_parallel


def _ranks() -> tuple[int, int]:
    """vLLM's tensor-parallel ranks and this process's rank among them."""
    return get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()


def _column(d_in: int, d_out: int, bias: bool, prefix: str, replicas: int = 1) -> ColumnParallelLinear:
    """A projection whose outputs (heads, feed-forward units) are split over the ranks, each rank computing its
    share; ``replicas``: how many consecutive ranks hold the same share (K/V heads fewer than ranks, each held
    whole by ``ranks / kv_heads`` ranks, as vLLM's ``QKVParallelLinear`` does; ``ranks``: replicated)."""
    ranks, rank = _ranks()
    return ColumnParallelLinear(d_in, d_out, bias=bias, prefix=prefix, tp_size=ranks // replicas,
                                tp_rank=rank // replicas)


def _row(d_in: int, d_out: int, bias: bool, prefix: str) -> RowParallelLinear:
    """A projection from the split outputs back to ``d_out``: each rank's partial product, summed over the ranks
    (all-reduce), the bias added once."""
    return RowParallelLinear(d_in, d_out, bias=bias, input_is_parallel=True, prefix=prefix)


def _reduce(y: Tensor, bias: Tensor | None) -> Tensor:
    """Each rank's partial output summed over the ranks, then ``bias`` (once)."""
    if get_tensor_model_parallel_world_size() > 1:
        y = tensor_model_parallel_all_reduce(y)
    return y if bias is None else y + bias


def _kernel(impl: str, x: Tensor, routing: ExpertRouting) -> str:
    """The grouped expert kernel for ``routing``'s slots: ``impl`` as configured, eagerly; in the forward vLLM
    compiles (one graph for every batch size, the token count symbolic), ``"auto"`` resolved without reading the
    token count (:func:`~headmix.kernels.choose_impl` reads it on the CPU): ``dense`` where its rule holds for every
    batch (``E <= 1.5 k``), else ``sorted`` (a custom op: one opaque node, its fake implementation giving the shape);
    off the CPU :func:`~headmix.kernels.choose_impl`'s choice, which reads no token count there."""
    if impl != "auto" or not torch.compiler.is_compiling():
        return impl
    e, k = routing.num_experts, routing.top_k
    if x.device.type != "cpu":
        return choose_impl(x.device, e * k, e, k, needs_grad=False, dtype=x.dtype)
    return "dense" if e <= DENSE_MAX_EXPERTS_PER_K * k else "sorted"


def _split(shape: tuple[int, ...] | nn.Parameter, dim: int, parts: int = 1) -> nn.Parameter:
    """A parameter (new, of local ``shape``, or the one given) holding this rank's share of headmix's tensor along
    ``dim``: the tensor there is ``parts`` equal blocks (JetMoE's ``[W1 | W3]``: 2), each cut into one slice per
    rank; the loader copies this rank's slice of each block."""
    param = shape if isinstance(shape, nn.Parameter) else nn.Parameter(torch.empty(shape), requires_grad=False)
    shape = tuple(param.shape)
    ranks, rank = _ranks()
    whole = shape[:dim] + (shape[dim] * ranks,) + shape[dim + 1:]

    def load(param: nn.Parameter, tensor: Tensor) -> None:
        if tuple(tensor.shape) != whole:
            raise ValueError(f"a headmix tensor of shape {tuple(tensor.shape)} where the model has {whole}")
        size = shape[dim] // parts
        param.data.copy_(torch.cat([block.narrow(dim, rank * size, size) for block in tensor.chunk(parts, dim)], dim))

    set_weight_attrs(param, {"weight_loader": load})
    return param


def _norm(config: ModelConfig, size: int | None = None) -> nn.Module:
    """headmix's :func:`~headmix.models.blocks.make_norm` from vLLM's layers."""
    size = config.d_model if size is None else size
    if config.norm_type == "rmsnorm":
        return RMSNorm(size, eps=config.norm_eps)
    return LayerNorm(size, eps=config.norm_eps, bias=config.bias)


def _rope(att: AttentionConfig, head_size: int, max_positions: int) -> nn.Module | None:
    """vLLM's rotary embedding for ``att`` (None without rotary): half-split pairs (``is_neox_style``), the first
    ``int(head_size * rotary_fraction)`` dimensions rounded down to even rotated, as headmix's RotaryEmbedding."""
    if not att.rotary:
        return None
    rotary_dim = int(head_size * att.rotary_fraction) // 2 * 2
    return get_rope(head_size, max_position=max_positions, is_neox_style=True,
                    rope_parameters={"rope_theta": float(att.rotary_base), "rope_dim": rotary_dim},
                    dtype=torch.float32)


def _paged_attention(vllm_config: VllmConfig, heads: int, head_size: int, kv_heads: int, prefix: str,
                     name: str = "attn") -> Attention:
    """vLLM's paged attention (the module's ``name`` under ``prefix``), refused in one line for a head size its
    backend does not take."""
    attn = Attention(heads, head_size, head_size ** -0.5, num_kv_heads=kv_heads,
                     cache_config=vllm_config.cache_config, prefix=f"{prefix}.{name}")
    backend = attn.attn_backend
    check_head_size(head_size, backend.get_supported_head_sizes(), backend.get_name(), vllm_config.model_config.model)
    return attn


class _Rotated(nn.Module):
    """The shared part of the attention modules: rotary positions on queries and keys, then paged attention."""

    rotary_emb: nn.Module | None
    attn: Attention

    def _attend(self, positions: Tensor, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.rotary_emb is not None:
            if torch.compiler.is_compiling():
                # vLLM's rotary views q and k as (tokens, heads, head_size), which a slice of a merged projection's
                # output (q/k/v, MoA's k/v) cannot be without a guard on the token count (refused when it is
                # unbacked); compiled, the copy fuses into the rotation; eagerly the slices rotate as they are
                q, k = q.contiguous(), k.contiguous()
            q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k, v)


class HeadsAttention(_Rotated):
    """Multi-head attention (:class:`~headmix.attention.MultiHeadAttention`): GQA / MQA (``kv_heads``), QK-norm
    (an RMSNorm over each head's queries and keys before rotary) and Gated Attention's G1 output gate
    (``sigmoid(x W_theta)`` per head or per element, before ``out_proj``). Across ranks each holds
    ``num_heads / ranks`` consecutive heads (their queries, gates and attention) and their K/V heads (split, or,
    fewer K/V heads than ranks, the one their group reads, held by ``ranks / kv_heads`` ranks); ``out_proj``
    sums the ranks' shares."""

    def __init__(self, vllm_config: VllmConfig, config: ModelConfig, prefix: str):
        super().__init__()
        att, d = config.decoder_self_attention, config.d_model
        q_bias, kv_bias, out_bias = att.resolved_biases()
        self.num_heads, self.head_dim = att.num_heads, att.resolved_head_dim(d)
        self.kv_heads = att.kv_heads or att.num_heads
        h, g, dh = self.num_heads, self.kv_heads, self.head_dim
        ranks, rank = _ranks()
        kv_replicas = max(1, ranks // g)
        #: This rank's heads: ``first_head ..`` (``local_heads`` of them), over ``local_kv_heads`` K/V heads.
        self.local_heads, self.local_kv_heads = h // ranks, g * kv_replicas // ranks
        self.first_head = rank * self.local_heads
        #: headmix's ``q_proj``, ``k_proj`` and ``v_proj`` as vLLM's one merged layer (one GEMM; vLLM splits and, with
        #: fewer K/V heads than ranks, replicates the K/V heads as above); a bias of one of them alone is zeros in the
        #: others' rows.
        self.qkv_proj = QKVParallelLinear(d, dh, h, g, bias=q_bias or kv_bias, prefix=f"{prefix}.qkv_proj")
        if self.qkv_proj.bias is not None:
            self.qkv_proj.bias.data.zero_()
        self.qkv_sizes = [self.local_heads * dh, self.local_kv_heads * dh, self.local_kv_heads * dh]
        self.out_proj = _row(h * dh, d, out_bias, f"{prefix}.out_proj")
        self.q_norm = self.k_norm = self.gate_proj = None
        if att.qk_norm:
            # vLLM's RMSNorm, which computes headmix's HeadRMSNorm (float32, cast back before the weight), with its
            # epsilon (configs have no field for it), on (tokens, heads, head_dim)
            self.q_norm, self.k_norm = RMSNorm(dh, eps=QK_NORM_EPS), RMSNorm(dh, eps=QK_NORM_EPS)
        if att.output_gate is not None:
            #: The gate's size per head: one (headwise) or ``head_dim`` (elementwise).
            self.gate_size = 1 if att.output_gate == "headwise" else dh
            gates = h * self.gate_size
            self.gate_proj = _column(d, gates, q_bias, f"{prefix}.gate_proj")
        self.rotary_emb = _rope(att, dh, config.max_positions)
        self.attn = _paged_attention(vllm_config, self.local_heads, dh, self.local_kv_heads, prefix)

    def _heads_norm(self, x: Tensor, norm: nn.Module | None) -> Tensor:
        """QK-norm of ``x`` ``(tokens, heads * head_dim)``: over each head's last dimension of a ``(tokens, heads,
        head_dim)`` view. Not of a ``(tokens * heads, head_dim)`` reshape: inductor (torch 2.13) compiles that
        reshape, with the token count unbacked, into code right for at most 2 tokens (it guards on it, and vLLM drops
        the guards), which changed the tokens of every compiled kind with QK-norm."""
        if norm is None:
            return x
        return norm(x.view(x.shape[0], x.shape[1] // self.head_dim, self.head_dim)).view(x.shape)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's queries, keys and values ``(tokens, heads * head_dim)``, from one merged GEMM."""
        return self.qkv_proj(x)[0].split(self.qkv_sizes, dim=-1)

    def head_outputs(self, positions: Tensor, x: Tensor, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """The gated attention output of this rank's heads, ``(tokens, local_heads, head_dim)``, from their
        projections (:meth:`project`)."""
        q, k = self._heads_norm(q, self.q_norm), self._heads_norm(k, self.k_norm)
        o = self._attend(positions, q, k, v).view(x.shape[0], self.local_heads, self.head_dim)
        if self.gate_proj is not None:
            o = o * torch.sigmoid(self.gate_proj(x)[0]).view(x.shape[0], self.local_heads, self.gate_size)
        return o

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        return self.out_proj(self.head_outputs(positions, x, *self.project(x)).flatten(1))[0]


class MixtureOfHeads(MoHHeadWeighting, HeadsAttention):
    """MoH (:class:`~headmix.attention.MixtureOfHeadsAttention`, Jin et al. 2024, eq. 3): every head's attention
    weighted by headmix's head weights ``g`` (0 for the routed heads a token did not select; eq. 5-6, or the
    authors' form per ``head_weighting``; per K/V group with ``route_per_group``), then ``out_proj``. The weights
    are headmix's own (:class:`~headmix.attention.moh.MoHHeadWeighting`, which the layer uses too), run on this
    module's gates (``routed_gate``, ``shared_gate``, ``group_gate``), or with ``router="query_norm"``
    (MoH-LLaMA3's parameter-free rule: no gates) on the routed heads' raw queries, ``q_proj``'s output before
    QK-norm and rotary, in headmix's ``routed_head_ids`` order. Across ranks the gates are replicated: every
    rank computes every head's weight (the same choice) and uses its own heads'; the query-norm rule reads the
    queries of every rank (all-gathered)."""

    def __init__(self, vllm_config: VllmConfig, config: ModelConfig, prefix: str):
        super().__init__(vllm_config, config, prefix)
        att, d = config.decoder_self_attention, config.d_model
        self.route_groups = self.kv_heads if att.route_per_group else 1
        group_heads = self.num_heads // self.route_groups
        self.num_shared_heads, self.top_k = att.num_shared_heads, att.top_k
        self.num_routed_per_group = group_heads - att.num_shared_heads
        self.num_routed_heads = self.num_routed_per_group * self.route_groups
        self.head_weighting = att.head_weighting or "renormalized"
        self.random_router = None  # refused by check_servable
        self.query_norm_routing = att.router == "query_norm"
        #: The routed heads (each group's heads after its shared ones), in headmix's order.
        _, self.routed_head_ids = head_ids(self.route_groups, group_heads, self.num_shared_heads)
        self.routed_gate = self.shared_gate = self.group_gate = None
        if self.num_routed_heads and not self.query_norm_routing:
            self.routed_gate = nn.Linear(d, self.num_routed_heads, bias=False)
            if self.num_shared_heads:
                self.shared_gate = nn.Linear(d, self.num_shared_heads * self.route_groups, bias=False)
                self.group_gate = nn.Linear(d, 2 * self.route_groups, bias=False)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        queries, keys, values = self.project(x)
        routed_queries = None
        if self.query_norm_routing:  # the rule reads the raw queries of the routed heads, on every rank
            # (contiguous: the queries are a slice of the merged q/k/v output, which the all-gather does not take)
            every = queries if self.local_heads == self.num_heads else tensor_model_parallel_all_gather(
                queries.contiguous())
            routed_queries = every.view(x.shape[0], self.num_heads, self.head_dim)[:, self.routed_head_ids]
        o = self.head_outputs(positions, x, queries, keys, values)
        g, _ = self.head_weights(x[None], None, routed_queries=routed_queries)
        if g is not None:
            g = g[0, :, self.first_head:self.first_head + self.local_heads]
            o = o * g.unsqueeze(-1).to(o.dtype)
        return self.out_proj(o.flatten(1))[0]


class MixtureOfAttentionHeads(_Rotated):
    """MoA (:class:`~headmix.attention.MixtureOfAttentionHeads`, Zhang et al. 2022, eq. 6-12): headmix's router
    picks ``top_k`` of ``num_experts`` experts per token; their queries ``x W_q^i`` (``kv_heads`` heads each) are
    the query heads of one grouped-query paged attention over the ``kv_heads`` shared K/V heads, and
    ``y = sum_i w_i o_i W_o^i`` (+ the output bias).

    Across ranks the router is replicated (every rank makes the same choice). With ``kv_heads`` a multiple of the
    ranks each rank holds its K/V heads and every expert's query and output rows for them (each expert split as
    vLLM splits a mixture of experts' width): its share of the cache, the attention and the projections. With
    fewer K/V heads than ranks (or not a multiple) each rank holds ``num_experts / ranks`` whole experts and the K/V
    heads (replicated, as vLLM does for GQA): it computes the slots whose expert it holds, the others' gates set to
    0, and attends every slot (the attention and the cache are not split). The ranks' outputs are summed."""

    def __init__(self, vllm_config: VllmConfig, config: ModelConfig, prefix: str):
        super().__init__()
        att, d = config.decoder_self_attention, config.d_model
        _, kv_bias, out_bias = att.resolved_biases()
        self.num_experts, self.top_k, self.head_dim = att.num_experts, att.top_k, att.head_dim
        self.kv_heads, self.expert_impl = att.kv_heads or 1, att.expert_impl
        e, k, g, dh = self.num_experts, self.top_k, self.kv_heads, self.head_dim
        ranks, rank = _ranks()
        self.split_experts = g % ranks != 0
        #: This rank's experts ``first_expert ..`` (``local_experts``) and K/V heads (``local_kv_heads``).
        self.local_experts, self.local_kv_heads = (e // ranks, g) if self.split_experts else (e, g // ranks)
        self.first_expert = rank * self.local_experts if self.split_experts else 0
        el, gl = self.local_experts, self.local_kv_heads
        self.router = TopKRouter(d, e, k, router=att.router, renormalize=att.renormalize)
        if self.split_experts:
            self.query_experts, self.output_experts = _split((el, d, g * dh), 0), _split((el, g * dh, d), 0)
        else:
            self.query_experts, self.output_experts = _split((e, d, gl * dh), 2), _split((e, gl * dh, d), 1)
        #: headmix's ``k_proj`` and ``v_proj`` as one merged layer (one GEMM): split by K/V head, or replicated.
        self.kv_proj = MergedColumnParallelLinear(d, [g * dh, g * dh], bias=kv_bias, prefix=f"{prefix}.kv_proj",
                                                  disable_tp=self.split_experts)
        self.out_bias = nn.Parameter(torch.empty(d)) if out_bias else None
        self.rotary_emb = _rope(att, dh, config.max_positions)
        self.attn = _paged_attention(vllm_config, k * gl, dh, gl, prefix)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        n, k, g, dh = x.shape[0], self.top_k, self.local_kv_heads, self.head_dim
        routing = self.router(x[None])
        index, gates = routing.expert_index, routing.gates.to(x.dtype)
        if self.split_experts:  # the slots of this rank's experts; the others' gates 0
            local = (index >= self.first_expert) & (index < self.first_expert + self.local_experts)
            index, gates = torch.where(local, index - self.first_expert, 0), gates * local
        info = expert_routing(index, self.local_experts, check_range=False)
        # query head g * k + j: expert slot j's query for K/V head g (headmix's order)
        impl = _kernel(self.expert_impl, x, info)
        q = expert_map(x, self.query_experts, info, impl=impl).view(n, k, g, dh).transpose(1, 2)
        keys, values = self.kv_proj(x)[0].chunk(2, dim=-1)
        o = self._attend(positions, q.reshape(n, g * k * dh), keys, values)
        o = o.view(n, g, k, dh).transpose(1, 2).reshape(n, k, g * dh)
        return _reduce(expert_reduce(o, self.output_experts, gates, info, impl=impl), self.out_bias)


class SwitchHead(_Rotated):
    """SwitchHead (:class:`~headmix.attention.SwitchHeadAttention`, Csordás et al., arXiv 2312.07987): per head
    ``top_k`` value experts mixed by the value-side sigmoid selector (cached mixed), ``top_k`` output experts by
    the output-side one; the selectors are headmix's :meth:`~headmix.attention.SwitchHeadAttention.select`.
    Across ranks each holds ``num_heads / ranks`` consecutive heads whole (``num_heads`` counts this rank's):
    their queries, keys, experts and selectors (each head's choice is its own); the ranks' outputs are summed."""

    select = SwitchHeadAttention.select

    def __init__(self, vllm_config: VllmConfig, config: ModelConfig, prefix: str):
        super().__init__()
        att, d = config.decoder_self_attention, config.d_model
        ranks, _ = _ranks()
        self.num_heads, self.num_experts, self.top_k = att.num_heads // ranks, att.num_experts, att.top_k
        self.head_dim, self.expert_impl = att.resolved_head_dim(d), att.expert_impl
        self.expert_dropout, self.random_router = 0.0, None  # training-only; random routing refused
        h, e, dh = self.num_heads, self.num_experts, self.head_dim
        self.q_proj = _column(d, att.num_heads * dh, att.bias, f"{prefix}.q_proj")
        self.k_proj = _column(d, att.num_heads * dh, att.bias, f"{prefix}.k_proj")
        self.value_experts = _split((h * e, d, dh), 0)
        self.output_experts = _split((h * e, dh, d), 0)
        # nn.Linear: select reads their weights (vLLM's CPU build repacks a parallel layer's and empties it)
        self.value_selector = nn.Linear(d, h * e, bias=False) if e > 1 else None
        self.output_selector = nn.Linear(d, h * e, bias=False)
        for selector in (self.value_selector, self.output_selector):
            if selector is not None:
                _split(selector.weight, 0)
        self.out_bias = nn.Parameter(torch.empty(d)) if att.bias else None
        self.rotary_emb = _rope(att, dh, config.max_positions)
        self.attn = _paged_attention(vllm_config, h, dh, h, prefix)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        n, h, k, dh = x.shape[0], self.num_heads, self.top_k, self.head_dim
        space = h * self.num_experts
        if self.value_selector is None:  # one expert per head: no value selector
            info = expert_routing(torch.arange(h, device=x.device).expand(n, h), space, check_range=False)
            v = expert_map(x, self.value_experts, info, impl=_kernel(self.expert_impl, x, info))
        else:
            routing = self.select(x[None], self.value_selector, None)
            info = expert_routing(routing.expert_index, space, check_range=False)
            v = expert_map_weighted(x, self.value_experts, routing.gates.to(x.dtype), info, h,
                                    impl=_kernel(self.expert_impl, x, info))
        o = self._attend(positions, self.q_proj(x)[0], self.k_proj(x)[0], v.reshape(n, h * dh))
        routing = self.select(x[None], self.output_selector, None, stream=1)
        info = expert_routing(routing.expert_index, space, check_range=False)
        o = o.view(n, h, 1, dh).expand(n, h, k, dh)
        return _reduce(expert_reduce(o, self.output_experts, routing.gates.to(o.dtype), info,
                                     impl=_kernel(self.expert_impl, x, info)), self.out_bias)


class GroupedQueryExperts(nn.Module):
    """GQE (:class:`~headmix.attention.GroupedQueryExpertsAttention`, Tripathi, Kumar 2026, eq. 6): headmix's router
    (:meth:`~headmix.attention.GroupedQueryExpertsAttention.route`) picks ``top_k`` of each K/V group's experts per
    token; their queries (gathered from ``q_proj``, all experts' queries in one GEMM as headmix's layer) are the
    ``top_k * kv_heads`` query heads of one grouped-query paged attention over the ``kv_heads`` K/V heads (slot
    ``(g, j)`` is query head ``g * top_k + j``, reading K/V head ``g``). The shared head (``q_proj``'s last rows)
    is a second paged attention with one K/V head of its own, caching the shared head's K/V as headmix's
    :meth:`~headmix.attention.GroupedQueryExpertsAttention.shared_kv` forms it (``shared_head_kv``: the mean of
    the ``kv_heads`` rotated K/V heads, or K/V head 0): ``2 * head_dim`` more cached numbers per token and layer
    than GQA's ``2 * kv_heads * head_dim``. ``y = Concat(hard slots, weighted slot, shared head) W_O``.

    Across ranks, split by K/V group (``kv_heads / ranks`` consecutive groups each): a rank holds its groups' K/V
    heads, their experts' query rows and their slots' rows of ``W_O``, attends its groups' slots and caches its
    K/V heads. The router is replicated (``num_experts x d_model``; every rank makes the same choice and renormalises
    the weighted slot over every group's selection, as one rank does). The weighted slot is a sum over the groups:
    each rank sums its own and multiplies by the weighted slot's rows of ``W_O`` (held by every rank), and the
    output all-reduce adds the ranks' sums. The shared head's K/V is formed across ranks: the mean of the K/V heads
    as the all-reduced sum of each rank's rotated K/V heads over ``kv_heads`` (``head0``: rank 0's head 0, the
    others adding zeros); every rank holds the shared head's query rows and attends it (one head, its own cache),
    and rank 0 holds its rows of ``W_O`` (the others zeros, so the all-reduce adds it once). The local layouts
    (``q_proj``: this rank's experts then the shared head; ``out_proj``: this rank's hard slots, the weighted slot,
    the shared head) are arranged from headmix's tensors at loading (:meth:`arrange_weight`)."""

    route = GroupedQueryExpertsAttention.route
    router_logits = GroupedQueryExpertsAttention.router_logits
    slot_weights = GroupedQueryExpertsAttention.slot_weights
    shared_kv = GroupedQueryExpertsAttention.shared_kv

    def __init__(self, vllm_config: VllmConfig, config: ModelConfig, prefix: str):
        super().__init__()
        att, d = config.decoder_self_attention, config.d_model
        q_bias, kv_bias, out_bias = att.resolved_biases()
        self.num_experts, self.kv_heads, self.top_k = att.gqe_sizes()
        self.head_dim = att.resolved_head_dim(d)
        e, g, k, dh = self.num_experts, self.kv_heads, self.top_k, self.head_dim
        self.experts_per_group = e // g
        self.weighted_slot = att.weighted_slot is not False
        self.weighted_slot_renormalize = att.weighted_slot_renormalize is not False
        self.shared_head = att.shared_head is not False
        self.hard_slot_scale, self.shared_head_kv = att.hard_slot_scale or "none", att.shared_head_kv or "mean"
        self.num_slots = k * g + int(self.weighted_slot) + int(self.shared_head)
        self.random_router = None  # refused by check_servable
        ranks, rank = _ranks()
        self.ranks, self.rank = ranks, rank
        #: This rank's K/V groups ``first_group ..`` (``local_groups`` of them).
        self.local_groups = g // ranks
        self.first_group = rank * self.local_groups
        gl, shared = self.local_groups, int(self.shared_head)
        #: This rank's slots in ``out_proj``'s input: its hard slots, the weighted slot, the shared head.
        self.local_slots = gl * k + int(self.weighted_slot) + shared
        self.router_gate = nn.Linear(d, e, bias=False)
        self.q_proj = _column(d, ranks * (gl * self.experts_per_group + shared) * dh, q_bias, f"{prefix}.q_proj")
        self.k_proj = _column(d, g * dh, kv_bias, f"{prefix}.k_proj")
        self.v_proj = _column(d, g * dh, kv_bias, f"{prefix}.v_proj")
        self.out_proj = _row(ranks * self.local_slots * dh, d, out_bias, f"{prefix}.out_proj")
        self.rotary_emb = _rope(att, dh, config.max_positions)
        self.attn = _paged_attention(vllm_config, k * gl, dh, gl, prefix)
        self.shared_attn = _paged_attention(vllm_config, 1, dh, 1, prefix, "shared_attn") if self.shared_head else None

    def arrange_weight(self, name: str, tensor: Tensor) -> Tensor:
        """headmix's ``q_proj`` / ``out_proj`` tensor (``name``: ``q_proj.weight`` ...) laid out rank after rank as
        the parallel layers split it (the identity on one rank): ``q_proj``'s rows, each rank's experts' then the
        shared head's; ``out_proj``'s input columns, each rank's hard slots, the weighted slot's, then the shared
        head's (zeros but on rank 0)."""
        dh, ranks, gl, k = self.head_dim, self.ranks, self.local_groups, self.top_k
        if ranks == 1 or name not in ("q_proj.weight", "q_proj.bias", "out_proj.weight"):
            return tensor
        if name.startswith("q_proj"):
            rows = gl * self.experts_per_group * dh
            shared = [tensor[self.num_experts * dh:]]
            return torch.cat([part for r in range(ranks) for part in [tensor[r * rows:(r + 1) * rows], *shared]])
        hard, cols = self.kv_heads * k * dh, gl * k * dh
        weighted = [tensor[:, hard:hard + dh]] if self.weighted_slot else []
        shared = tensor[:, self.num_slots * dh - dh:] if self.shared_head else None
        parts = []
        for r in range(ranks):
            parts += [tensor[:, r * cols:(r + 1) * cols], *weighted]
            if shared is not None:
                parts.append(shared if r == 0 else torch.zeros_like(shared))
        return torch.cat(parts, 1)

    def _shared_kv(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """The shared head's K/V ``(tokens, head_dim)`` from this rank's rotated K/V heads ``(tokens, local_groups,
        head_dim)``: headmix's :meth:`shared_kv` on one rank, formed across ranks on more (class docstring)."""
        n = keys.shape[0]
        if self.ranks == 1:
            k_s, v_s = self.shared_kv(keys, values)
            return k_s.reshape(n, self.head_dim), v_s.reshape(n, self.head_dim)
        if self.shared_head_kv == "head0":
            both = torch.cat([keys[:, 0], values[:, 0]], 1) * float(self.rank == 0)
        else:
            both = torch.cat([keys.sum(1), values.sum(1)], 1) / self.kv_heads
        return tensor_model_parallel_all_reduce(both).split(self.head_dim, 1)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        n, g, k, dh = x.shape[0], self.local_groups, self.top_k, self.head_dim
        _, _, index, top_p = self.route(x[None])  # (n, G, k) every group's, slot order
        mine = slice(self.first_group, self.first_group + g)
        q_all = self.q_proj(x)[0]
        experts = g * self.experts_per_group * dh  # this rank's experts' queries, then the shared head's
        pick = index[:, mine].unsqueeze(-1).expand(-1, -1, -1, dh)
        q = q_all[:, :experts].view(n, g, self.experts_per_group, dh).gather(2, pick).reshape(n, g * k * dh)
        q = torch.cat([q, q_all[:, experts:]], 1)  # the slots' queries, then the shared head's
        keys, values = self.k_proj(x)[0], self.v_proj(x)[0]
        if self.rotary_emb is not None:
            q, keys = self.rotary_emb(positions, q, keys)
        o = self.attn(q[:, :g * k * dh].contiguous(), keys, values).view(n, g * k, dh)
        local_p = top_p[:, mine].reshape(n, g * k, 1).to(o.dtype)
        slots = [o * local_p if self.hard_slot_scale == "p" else o]
        if self.weighted_slot:  # this rank's groups' share of the sum (the output all-reduce adds the ranks')
            w = self.slot_weights(top_p)[:, mine].reshape(n, g * k, 1).to(o.dtype)
            slots.append((o * w).sum(1, keepdim=True))
        if self.shared_attn is not None:
            k_s, v_s = self._shared_kv(keys.view(n, g, dh), values.view(n, g, dh))
            o_s = self.shared_attn(q[:, g * k * dh:].contiguous(), k_s.contiguous(), v_s.contiguous())
            slots.append(o_s.view(n, 1, dh))
        return self.out_proj(torch.cat(slots, 1).reshape(n, self.local_slots * dh))[0]


ATTENTION = {"mha": HeadsAttention, "moh": MixtureOfHeads, "moa": MixtureOfAttentionHeads, "switchhead": SwitchHead,
             "gqe": GroupedQueryExperts}


class DenseFeedForward(nn.Module):
    """headmix's ``mlp`` (``fc2(act(fc1 x))``, ReLU or GELU) or ``swiglu`` (``down(silu(gate x) * up x)``); across
    ranks each holds ``ffn_dim / ranks`` of the hidden units (``fc2`` / ``down_proj`` sum the ranks' shares)."""

    def __init__(self, config: ModelConfig, prefix: str):
        super().__init__()
        d, f, b = config.d_model, config.ffn_dim, config.bias
        self.swiglu = config.ffn == "swiglu"
        if self.swiglu:  # headmix's gate_proj and up_proj as one merged layer (one GEMM), vLLM's fused SiLU-and-mul
            self.gate_up_proj = MergedColumnParallelLinear(d, [f, f], bias=b, prefix=f"{prefix}.gate_up_proj")
            self.silu_and_mul = SiluAndMul()
            self.down_proj = _row(f, d, b, f"{prefix}.down_proj")
        else:
            self.fc1 = _column(d, f, b, f"{prefix}.fc1")
            self.fc2 = _row(f, d, b, f"{prefix}.fc2")
            self.activation = F.relu if config.activation == "relu" else F.gelu

    def forward(self, x: Tensor) -> Tensor:
        if self.swiglu:
            return self.down_proj(self.silu_and_mul(self.gate_up_proj(x)[0]))[0]
        return self.fc2(self.activation(self.fc1(x)[0]))[0]


class ExpertFeedForward(nn.Module):
    """JetMoE's mixture of SwiGLU experts (:class:`~headmix.models.blocks.MixtureOfSwiGLUExperts`) on vLLM's
    ``FusedMoE`` (``FusedMoEFactory``: one fused grouped kernel, SiLU-and-mul inside), on ``(tokens, d)``.

    The routing is headmix's: the router's float32 logits (:meth:`~headmix.routing.TopKRouter.logits`) go in as
    FusedMoE's router logits, and its routing function is :meth:`route` (headmix's softmax over all experts, top-k,
    ``p_i / sum_{j in G} p_j``), not vLLM's own softmax routing, which takes the top-k of the logits and a softmax over
    those: the same gates but for rounding. The experts' weights are FusedMoE's ``w13`` (``[W1^T; W3^T]`` per expert,
    gate then up) and ``w2`` (``W2^T``), loaded from headmix's ``input_experts`` / ``output_experts``
    (:meth:`load_headmix_tensor`). Across ranks the router is replicated and each rank holds ``ffn_dim / ranks`` of
    every expert's hidden units (FusedMoE's tensor-parallel split); FusedMoE sums the ranks' outputs, then the bias
    is added (once)."""

    #: headmix's tensors of the experts, which :meth:`load_headmix_tensor` maps onto FusedMoE's parameters.
    HEADMIX_TENSORS = ("input_experts", "output_experts")

    def __init__(self, config: ModelConfig, prefix: str):
        super().__init__()
        d, e, f = config.d_model, config.ffn_experts, config.ffn_dim
        self.num_experts, self.d_model, self.ffn_dim = e, d, f
        self.router = TopKRouter(d, e, config.ffn_top_k, renormalize="live")
        try:
            self.experts = FusedMoEFactory(num_experts=e, top_k=config.ffn_top_k, hidden_size=d, intermediate_size=f,
                                           renormalize=True, custom_routing_function=self.route, activation="silu",
                                           prefix=f"{prefix}.experts")
        except (ValueError, NotImplementedError) as err:  # no FusedMoE kernel of this vLLM build takes these sizes
            raise FusedMoEUnavailable(f"vLLM's FusedMoE does not take JetMoE's expert feed-forward of d_model={d}, "
                                      f"ffn_dim={f} ({err} vLLM's CPU kernel needs d_model divisible by 32)") from None
        self.out_bias = nn.Parameter(torch.empty(d), requires_grad=False) if config.bias else None

    def route(self, hidden_states: Tensor, gating_output: Tensor, topk: int,
              renormalize: bool) -> tuple[Tensor, Tensor]:
        """FusedMoE's routing function: headmix's gates (in the activations' dtype, as headmix casts them) and
        expert ids from the router logits :meth:`forward` passes (``topk`` and ``renormalize`` are the router's)."""
        gates, index = self.router.select(gating_output.softmax(dim=-1))
        return gates.to(hidden_states.dtype), index

    def load_headmix_tensor(self, leaf: str, tensor: Tensor) -> str:
        """Copy headmix's ``input_experts`` ``(E, d, 2 ffn_dim)``, ``[W1 | W3]`` per expert, into FusedMoE's ``w13``
        (``(E, 2 ffn_dim, d)``: shard ``w1`` the gate ``W1^T``, shard ``w3`` the up ``W3^T``), or ``output_experts``
        ``(E, ffn_dim, d)`` into ``w2`` (``(E, d, ffn_dim)``, ``W2^T``), through FusedMoE's expert loader (all experts
        at once, this rank's hidden units of each); returns the parameter's name under this module."""
        e, d, f = self.num_experts, self.d_model, self.ffn_dim
        whole = (e, d, 2 * f) if leaf == "input_experts" else (e, f, d)
        if tuple(tensor.shape) != whole:
            raise ValueError(f"a headmix {leaf} tensor of shape {tuple(tensor.shape)} where the model has {whole}")
        routed = self.experts.routed_experts
        if leaf == "input_experts":
            gate, up = tensor.transpose(1, 2).chunk(2, dim=1)
            for shard, part in (("w1", gate), ("w3", up)):
                routed.w13_weight.weight_loader(routed.w13_weight, part, "w13_weight", shard, 0)
            return "experts.routed_experts.w13_weight"
        routed.w2_weight.weight_loader(routed.w2_weight, tensor.transpose(1, 2), "w2_weight", "w2", 0)
        return "experts.routed_experts.w2_weight"

    def forward(self, x: Tensor) -> Tensor:
        # FusedMoE returns early on an empty batch, a branch on the token count, which vLLM never runs the model with:
        # said here, so that the compiled graph (the token count unbacked: docs/serving.md, "Compiled") needs no guard
        torch._check(x.shape[0] > 0)
        y = self.experts(x, self.router.logits(x))  # the router replicated: every rank makes the same choice
        return y if self.out_bias is None else y + self.out_bias


class FusedMoEUnavailable(ValueError):
    """vLLM's ``FusedMoE`` has no kernel for an expert feed-forward's sizes (:func:`expert_feed_forward` then serves it
    on headmix's kernels)."""


class HeadmixExpertFeedForward(nn.Module):
    """JetMoE's mixture of SwiGLU experts on headmix's router and grouped kernels (:func:`~headmix.kernels.expert_map`,
    :func:`~headmix.kernels.expert_reduce`), for sizes vLLM's ``FusedMoE`` does not take (:func:`expert_feed_forward`).
    Across ranks the router is replicated and each rank holds ``ffn_dim / ranks`` of every expert's hidden units; the
    ranks' outputs are summed."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, e, ranks = config.d_model, config.ffn_experts, _ranks()[0]
        self.num_experts, self.ffn_dim, self.expert_impl = e, config.ffn_dim // ranks, config.ffn_expert_impl
        self.router = TopKRouter(d, e, config.ffn_top_k, renormalize="live")
        self.input_experts = _split((e, d, 2 * self.ffn_dim), 2, parts=2)  # [W1 | W3], this rank's units of each
        self.output_experts = _split((e, self.ffn_dim, d), 1)
        self.out_bias = nn.Parameter(torch.empty(d), requires_grad=False) if config.bias else None

    def forward(self, x: Tensor) -> Tensor:
        routing = self.router(x[None])  # replicated: every rank makes the same choice
        info = expert_routing(routing.expert_index, self.num_experts, check_range=False)
        impl = _kernel(self.expert_impl, x, info)
        gate, up = expert_map(x, self.input_experts, info, impl=impl).split(self.ffn_dim, dim=-1)
        y = expert_reduce(F.silu(gate) * up, self.output_experts, routing.gates.to(x.dtype), info, impl=impl)
        return _reduce(y, self.out_bias)


def expert_feed_forward(config: ModelConfig, prefix: str) -> nn.Module:
    """JetMoE's expert feed-forward on vLLM's ``FusedMoE`` (:class:`ExpertFeedForward`), or on headmix's kernels
    (:class:`HeadmixExpertFeedForward`) where this vLLM build's ``FusedMoE`` has no kernel for its sizes (the CPU
    build: ``d_model`` not a multiple of 32); a warning says which and why."""
    try:
        return ExpertFeedForward(config, prefix)
    except FusedMoEUnavailable as err:
        warnings.warn(f"{err}: {prefix} runs on headmix's grouped kernels instead", RuntimeWarning, stacklevel=2)
        return HeadmixExpertFeedForward(config)


class SublayerNorm(nn.Module):
    """headmix's ``ResidualNorm``: pre-norm ``x + f(norm(x))`` or post-norm ``norm(x + f(x))``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = _norm(config)
        self.pre_norm = config.norm == "pre"

    def input(self, x: Tensor) -> Tensor:
        return self.norm(x) if self.pre_norm else x

    def add(self, x: Tensor, y: Tensor) -> Tensor:
        x = x + y
        return x if self.pre_norm else self.norm(x)


class DecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, config: ModelConfig, prefix: str):
        super().__init__()
        self.self_attn = ATTENTION[config.decoder_self_attention.kind](vllm_config, config, f"{prefix}.self_attn")
        self.self_attn_norm = SublayerNorm(config)
        ffn = expert_feed_forward if config.ffn == "moe_swiglu" else DenseFeedForward
        self.ffn = ffn(config, f"{prefix}.ffn")
        self.ffn_norm = SublayerNorm(config)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        x = self.self_attn_norm.add(x, self.self_attn(positions, self.self_attn_norm.input(x)))
        return self.ffn_norm.add(x, self.ffn(self.ffn_norm.input(x)))


class Embeddings(nn.Module):
    """Token embedding (times ``sqrt(d_model)`` with ``scale_embeddings``), plus learned or sinusoidal positions
    (none with rotary), then the optional embedding norm: headmix's ``Embeddings`` at vLLM's positions."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.tokens = VocabParallelEmbedding(config.vocab_size, config.d_model)
        self.scale = math.sqrt(config.d_model) if config.scale_embeddings else 1.0
        self.positions = None
        if config.positions == "learned":
            self.positions = VocabParallelEmbedding(config.max_positions, config.d_model)
        table = sinusoidal_table(config.max_positions, config.d_model) if config.positions == "sinusoidal" else None
        self.register_buffer("sinusoids", table, persistent=False)
        self.norm = _norm(config) if config.embedding_norm else None

    def forward(self, ids: Tensor, positions: Tensor) -> Tensor:
        x = self.tokens(ids) * self.scale
        if self.positions is not None:
            x = x + self.positions(positions)
        elif self.sinusoids is not None:
            x = x + self.sinusoids[positions].to(x.dtype)
        return x if self.norm is None else self.norm(x)


@support_torch_compile(dynamic_arg_dims={"ids": 0, "positions": 0})
class Decoder(nn.Module):
    """The embeddings, the decoder layers and the final norm: the part vLLM compiles (``@support_torch_compile``,
    the batch's token dimension dynamic; ``enforce_eager`` runs it eagerly). Built with keyword arguments only (the
    decorator checks positional ones against the annotations)."""

    def __init__(self, *, vllm_config: VllmConfig, config: ModelConfig, prefix: str = ""):
        super().__init__()
        self.embed = Embeddings(config)
        self.layers = nn.ModuleList(DecoderLayer(vllm_config, config, f"{prefix}.layers.{i}")
                                    for i in range(config.decoder_layers))
        self.final_norm = _norm(config) if config.norm == "pre" else None

    def forward(self, ids: Tensor, positions: Tensor) -> Tensor:
        x = self.embed(ids, positions)
        for layer in self.layers:
            x = layer(positions, x)
        return x if self.final_norm is None else self.final_norm(x)


class VllmHeadmixForCausalLM(nn.Module):
    """A headmix causal LM as a vLLM text-generation model (module docstring); built from
    ``vllm_config.model_config.hf_config`` (a :class:`~headmix.hf.HeadmixConfig`), refused in one line
    (:func:`~headmix.serving.support.check_servable`) when vLLM cannot compute what headmix computes."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        hf_config = vllm_config.model_config.hf_config
        config = hf_config.model_config()
        check_servable(config)
        check_tensor_parallel(config, _ranks()[0])
        self.config = hf_config
        self.headmix_config = config
        self.decoder = Decoder(vllm_config=vllm_config, config=config, prefix=f"{prefix}decoder")
        self.output_proj = ParallelLMHead(config.vocab_size, config.d_model, prefix=f"{prefix}output_proj")
        if config.share_embeddings:
            self.output_proj = self.output_proj.tie_weights(self.decoder.embed.tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.decoder.embed.tokens(input_ids)

    def forward(self, input_ids: Tensor, positions: Tensor, intermediate_tensors=None,
                inputs_embeds: Tensor | None = None, **kwargs) -> Tensor:
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds is not supported: headmix models embed token ids themselves")
        return self.decoder(input_ids, positions)

    def compute_logits(self, hidden_states: Tensor) -> Tensor | None:
        logits = self.logits_processor(self.output_proj, hidden_states)
        pad = self.headmix_config.pad_id
        if logits is not None and pad is not None:
            logits[:, pad] = float("-inf")  # never generated (headmix's decoding removes it too)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Copy headmix's tensors (names as headmix saves them; ``model.`` of a Hugging Face folder dropped); a tensor
        of a merged layer (:data:`MERGED`) into its shard of the merged parameter, by vLLM's weight loader."""
        params, modules = dict(self.named_parameters()), dict(self.named_modules())
        loaded = set()
        for name, tensor in weights:
            if name.startswith(HF_PREFIX) and _known(name[len(HF_PREFIX):], params, modules):
                name = name[len(HF_PREFIX):]
            merged = _merged(name, params)
            if merged is not None:
                param = params[merged[0]]
                param.weight_loader(param, tensor, merged[1])
                loaded.add(merged[0])
                continue
            experts = _experts_tensor(name, modules)
            if experts is not None:  # JetMoE's experts: onto FusedMoE's parameters
                loaded.add(f"{experts[0]}.{modules[experts[0]].load_headmix_tensor(experts[1], tensor)}")
                continue
            if name not in params:
                raise ValueError(f"the weights hold {name!r}, which the model its config describes does not have")
            param = params[name]
            layer, _, leaf = name.rpartition(".")
            owner, _, child = layer.rpartition(".")
            arrange = getattr(self.get_submodule(owner), "arrange_weight", None) if owner else None
            if arrange is not None:  # a layer whose local layout is not one slice of headmix's tensor (GQE)
                tensor = arrange(f"{child}.{leaf}", tensor)
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded


#: headmix's separate projections held by one of vLLM's merged layers: (headmix's module, the merged module, the
#: shard id vLLM's weight loader takes): the attention's q/k/v (``QKVParallelLinear``), MoA's k/v and the SwiGLU
#: gate/up (``MergedColumnParallelLinear``). Applied where the model has the merged module (GQE keeps its own).
MERGED = ((".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"), (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
          (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"), (".self_attn.k_proj.", ".self_attn.kv_proj.", 0),
          (".self_attn.v_proj.", ".self_attn.kv_proj.", 1), (".ffn.gate_proj.", ".ffn.gate_up_proj.", 0),
          (".ffn.up_proj.", ".ffn.gate_up_proj.", 1))


def _merged(name: str, params: dict) -> tuple[str, str | int] | None:
    """The merged parameter that holds headmix's tensor ``name`` and its shard id, or None (:data:`MERGED`)."""
    for ours, theirs, shard in MERGED:
        if ours in name and name.replace(ours, theirs) in params:
            return name.replace(ours, theirs), shard
    return None


def _experts_tensor(name: str, modules: dict) -> tuple[str, str] | None:
    """``(module, leaf)`` when ``name`` is one of headmix's expert tensors of an :class:`ExpertFeedForward` (held by
    its FusedMoE's parameters), else None."""
    module, _, leaf = name.rpartition(".")
    owner = modules.get(module)
    return (module, leaf) if isinstance(owner, ExpertFeedForward) and leaf in owner.HEADMIX_TENSORS else None


def _known(name: str, params: dict, modules: dict) -> bool:
    """Whether ``name`` is a parameter of the model or a tensor one of its merged or expert parameters holds."""
    return name in params or _merged(name, params) is not None or _experts_tensor(name, modules) is not None
