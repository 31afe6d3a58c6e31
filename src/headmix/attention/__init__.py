"""Attention layers with one interface: ``layer(query, key=None, value=None, *, masks..., cache...)``
returns an :class:`AttentionOutput` (``output``, ``aux_loss``, ``cache``, ``routing``)."""

from .base import AttentionLayer, AttentionOutput, KVCache
from .gqe import GroupedQueryExpertsAttention
from .mha import MultiHeadAttention
from .moa import MixtureOfAttentionHeads
from .moh import MixtureOfHeadsAttention
from .mosa import MixtureOfSparseAttention, MoSACache, MoSARouting
from .rotary import RotaryEmbedding
from .switchhead import SwitchHeadAttention, SwitchHeadRouting
from .talking_heads import TalkingHeadsAttention

__all__ = [
    "AttentionLayer",
    "AttentionOutput",
    "GroupedQueryExpertsAttention",
    "KVCache",
    "MultiHeadAttention",
    "MixtureOfAttentionHeads",
    "MixtureOfHeadsAttention",
    "MixtureOfSparseAttention",
    "MoSACache",
    "MoSARouting",
    "RotaryEmbedding",
    "SwitchHeadAttention",
    "SwitchHeadRouting",
    "TalkingHeadsAttention",
]
