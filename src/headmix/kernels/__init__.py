"""Grouped expert matmuls for Mixture of Attention Heads (MoA, arXiv 2210.05144).

Per layer call::

    routing = expert_routing(expert_index, num_experts)      # (N, k) router choice
    q = expert_map(x, w_q, routing)                          # eq. 10 -> (N, k, d_head)
    y = expert_reduce(o, w_o, gates, routing)                # eq. 12 + 6 -> (N, d_model)

Implementations: ``reference``, ``dense``, ``sorted`` (CPU), ``gather`` (tiny N),
``bag`` (one ``embedding_bag``; decoding), ``triton`` (GPU; imported lazily,
optional) and ``auto`` (see
:func:`headmix.kernels.dispatch.choose_impl`).
"""

from .dispatch import IMPLS, choose_impl, expert_map, expert_map_weighted, expert_reduce
from .routing_info import ExpertRouting, expert_routing

__all__ = [
    "IMPLS", "ExpertRouting", "choose_impl", "expert_map", "expert_map_weighted", "expert_reduce", "expert_routing",
]
