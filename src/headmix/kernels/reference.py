"""Plain-PyTorch expert map / reduce: the ground truth and two simple fast paths.

MoA (Zhang et al. 2022, arXiv 2210.05144) gives every expert ``i`` its own query
projection ``W_q^i`` and output projection ``W_o^i``.  With ``e = expert_index[n, j]``:

* **map** (eq. 10, query projection):
  ``y[n, j, :] = x[n, :] @ W[e]``                      -> (N, k, d_out)
* **reduce** (eq. 12 output projection + eq. 6 gate-weighted sum):
  ``y[n, :] = sum_j gates[n, j] * (h[n, j, :] @ W[e])`` -> (N, d_out)

``W`` is stacked as (E, d_in, d_out).  Everything here is differentiated by
autograd; no custom backward.

* ``reference_*``: loop over experts with boolean masks, straight from the
  equations.  Slow (E dense matmuls) but obviously right: the tests' ground truth.
* ``dense_*``: one dense matmul over all experts, then gather (map) or a
  gate-weighted scatter of the inputs before the matmul (reduce).  Costs
  ``E/k`` times the useful FLOPs, but is a single large GEMM: the best choice
  when ``k == E`` or ``E`` is small.
* ``gather_*``: index the weights per slot, ``W[expert_index]`` -> (N, k, d_in,
  d_out), and do a batched vector-matrix product.  Moves ``N*k*d_in*d_out``
  weight elements, so it is only for tiny ``N*k`` (decoding).
* ``bag_*``: each slot's product as a weighted sum of its expert's weight rows,
  ``x[n] @ W[e] = sum_i x[n, i] W[e, i, :]``, in one
  ``torch.nn.functional.embedding_bag`` call (rows of ``W`` viewed as an
  ``(E*d_in, d_out)`` table, ``x``'s entries as the per-sample weights): the
  selected rows are read in place, nothing is copied and there is no loop over
  experts.  For small ``N*k`` without gradients (decoding); differentiable
  (``embedding_bag``'s backward), but far slower than a GEMM for training.

Every function accepts repeated experts within a row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "bag_map",
    "bag_reduce",
    "dense_map",
    "dense_reduce",
    "gather_map",
    "gather_reduce",
    "reference_map",
    "reference_reduce",
]


def reference_map(x: Tensor, weight: Tensor, expert_index: Tensor) -> Tensor:
    """MoA eq. 10: ``y[n, j] = x[n] @ W[expert_index[n, j]]``; loop over experts."""
    n, k = expert_index.shape
    y = x.new_zeros(n, k, weight.shape[2])
    for e in range(weight.shape[0]):
        selected = (expert_index == e).unsqueeze(-1)  # (N, k, 1)
        y = torch.where(selected, (x @ weight[e]).unsqueeze(1), y)
    return y


def reference_reduce(h: Tensor, weight: Tensor, gates: Tensor, expert_index: Tensor) -> Tensor:
    """MoA eq. 12 + 6: ``y[n] = sum_j gates[n, j] * (h[n, j] @ W[expert_index[n, j]])``."""
    y = h.new_zeros(expert_index.shape[0], weight.shape[2])
    for e in range(weight.shape[0]):
        coef = gates * (expert_index == e)  # (N, k): the gate where expert e was chosen, else 0
        y = y + (coef.unsqueeze(-1) * (h @ weight[e])).sum(1)
    return y


def dense_map(x: Tensor, weight: Tensor, expert_index: Tensor) -> Tensor:
    """MoA eq. 10 via one (N, d_in) @ (d_in, E*d_out) matmul, then a gather of the k columns."""
    n, k = expert_index.shape
    num_experts, d_in, d_out = weight.shape
    w_all = weight.permute(1, 0, 2).reshape(d_in, num_experts * d_out)
    y_all = (x @ w_all).view(n, num_experts, d_out)
    return torch.gather(y_all, 1, expert_index.unsqueeze(-1).expand(n, k, d_out))


def dense_reduce(h: Tensor, weight: Tensor, gates: Tensor, expert_index: Tensor) -> Tensor:
    """MoA eq. 12 + 6 via a gate-weighted scatter into (N, E, d_in), then one matmul.

    ``H[n, e] = sum_{j: expert_index[n, j] = e} gates[n, j] * h[n, j]`` and
    ``y = H.view(N, E*d_in) @ W.view(E*d_in, d_out)``.
    """
    n, k = expert_index.shape
    num_experts, d_in, d_out = weight.shape
    weighted = h * gates.unsqueeze(-1)
    h_all = h.new_zeros(n, num_experts, d_in).scatter_add(
        1, expert_index.unsqueeze(-1).expand(n, k, d_in), weighted
    )
    return h_all.view(n, num_experts * d_in) @ weight.reshape(num_experts * d_in, d_out)


def gather_map(x: Tensor, weight: Tensor, expert_index: Tensor) -> Tensor:
    """MoA eq. 10 with per-slot weights ``W[expert_index]``: for tiny N*k (decoding)."""
    n, k = expert_index.shape
    w = weight[expert_index.reshape(-1)]  # (N*k, d_in, d_out)
    xs = x.unsqueeze(1).expand(n, k, x.shape[1]).reshape(n * k, 1, x.shape[1])
    return torch.bmm(xs, w).view(n, k, weight.shape[2])


def gather_reduce(h: Tensor, weight: Tensor, gates: Tensor, expert_index: Tensor) -> Tensor:
    """MoA eq. 12 + 6 with per-slot weights ``W[expert_index]``: for tiny N*k (decoding)."""
    n, k = expert_index.shape
    w = weight[expert_index.reshape(-1)]  # (N*k, d_in, d_out)
    z = torch.bmm(h.reshape(n * k, 1, h.shape[2]), w).view(n, k, weight.shape[2])
    return torch.bmm(gates.unsqueeze(1), z).squeeze(1)


def _row_ids(expert_index: Tensor, rows_per_expert: int) -> Tensor:
    """``(N, k, rows)`` ids ``e * rows + i`` of the rows of the selected experts in the ``(E*rows, d_out)`` table."""
    return expert_index.unsqueeze(-1) * rows_per_expert + torch.arange(rows_per_expert, device=expert_index.device)


def bag_map(x: Tensor, weight: Tensor, expert_index: Tensor) -> Tensor:
    """MoA eq. 10 as one ``embedding_bag``: ``y[n, j] = sum_i x[n, i] W[e, i, :]`` (bag ``(n, j)``)."""
    n, k = expert_index.shape
    num_experts, d_in, d_out = weight.shape
    ids = _row_ids(expert_index, d_in).view(n * k, d_in)
    coef = x.unsqueeze(1).expand(n, k, d_in).reshape(n * k, d_in)
    table = weight.reshape(num_experts * d_in, d_out)
    return F.embedding_bag(ids, table, mode="sum", per_sample_weights=coef).view(n, k, d_out)


def bag_reduce(h: Tensor, weight: Tensor, gates: Tensor, expert_index: Tensor) -> Tensor:
    """MoA eq. 12 + 6 as one ``embedding_bag``: ``y[n] = sum_j sum_i gates[n, j] h[n, j, i] W[e, i, :]`` (bag ``n``)."""
    n, k = expert_index.shape
    num_experts, d_in, d_out = weight.shape
    ids = _row_ids(expert_index, d_in).view(n, k * d_in)
    coef = (gates.unsqueeze(-1) * h).reshape(n, k * d_in)
    return F.embedding_bag(ids, weight.reshape(num_experts * d_in, d_out), mode="sum", per_sample_weights=coef)
