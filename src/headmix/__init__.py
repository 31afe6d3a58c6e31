"""headmix: attention that selects or mixes heads per token.

The layers share one interface (see :mod:`headmix.attention`)::

    from headmix import MixtureOfAttentionHeads
    layer = MixtureOfAttentionHeads(embed_dim=512, num_experts=32, top_k=8, head_dim=64)
    out = layer(x)            # x: (batch, time, 512)
    out.output, out.aux_loss, out.routing
"""

from .attention import (
    AttentionOutput,
    GroupedQueryExpertsAttention,
    KVCache,
    MixtureOfAttentionHeads,
    MixtureOfHeadsAttention,
    MixtureOfSparseAttention,
    MoSARouting,
    MultiHeadAttention,
    RotaryEmbedding,
    SwitchHeadAttention,
    SwitchHeadRouting,
    TalkingHeadsAttention,
)
from .process import keep_freed_memory
from .routing import Routing, TopKRouter

__version__ = "0.1.0"

__all__ = [
    "AttentionOutput",
    "GroupedQueryExpertsAttention",
    "KVCache",
    "MixtureOfAttentionHeads",
    "MixtureOfHeadsAttention",
    "MixtureOfSparseAttention",
    "MoSARouting",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "SwitchHeadAttention",
    "SwitchHeadRouting",
    "TalkingHeadsAttention",
    "Routing",
    "TopKRouter",
    "keep_freed_memory",
]
