"""Top-k routers (MoA eq. 2-3 and 7-9) and the routing state they return.

The routing state is returned to the caller (``AttentionOutput.routing``), never kept on the module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

RENORMALIZE = ("detached", "live", "none")
ROUTERS = ("softmax", "noisy_topk")


@dataclass
class Routing:
    """Per-token routing decisions of one routed layer call.

    Shapes, with ``N`` tokens of the call flattened in ``(batch, time)`` order:
    ``logits`` ``(N, E)`` pre-softmax router logits (for the z-loss, eq. 16);
    ``probs`` ``(N, E)`` the router distribution ``p`` (eq. 7) used by the load-balancing loss;
    ``expert_index`` ``(N, k)`` selected experts (eq. 8); ``gates`` ``(N, k)`` their weights (eq. 9);
    ``token_mask`` ``(N,)`` True for real (non-padding) tokens, or None when every token is real.
    ``batch_shape`` is ``(batch, time)``.
    """

    logits: Tensor
    probs: Tensor
    expert_index: Tensor
    gates: Tensor
    token_mask: Tensor | None
    batch_shape: tuple[int, int]

    @property
    def num_experts(self) -> int:
        return self.probs.shape[-1]

    def expert_counts(self) -> Tensor:
        """Number of real tokens routed to each expert, ``(E,)`` long."""
        idx = self.expert_index
        if self.token_mask is not None:
            idx = idx[self.token_mask]
        return torch.bincount(idx.reshape(-1), minlength=self.num_experts)


def router_dtype(x: Tensor) -> torch.dtype:
    """float32 for half-precision inputs, else the input's own dtype (float64 stays float64)."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


class TopKRouter(nn.Module):
    """Chooses ``top_k`` of ``num_experts`` experts per token.

    ``router="softmax"`` (default, MoA eq. 7-9): ``p = softmax(x W_g)``, ``G = TopK(p, k)`` and the gate
    weights are the selected probabilities renormalised according to ``renormalize``:

    - ``"detached"`` (the paper, eq. 9): ``w_i = p_i / Detach(sum_{j in G} p_j)``; the authors found the
      detached denominator helps the router learn;
    - ``"live"``: the same ratio with the gradient flowing through the denominator;
    - ``"none"``: ``w_i = p_i`` (what the authors' released code does).

    ``router="noisy_topk"`` (Shazeer et al. 2017, MoA eq. 2-3): ``H = x W_g + N(0,1) * softplus(x W_noise)``
    during training (no noise in eval), ``G = softmax(TopK(H, k))`` over the kept logits; ``p`` for the
    load-balancing loss is ``softmax(x W_g)``. ``renormalize`` does not apply to it.

    ``W_g`` has no bias, as in the paper. It starts small and random (std ``0.1 / sqrt(embed_dim)``), so
    a fresh router is close to uniform but still spreads tokens over experts; ``W_noise`` starts at zero
    (unit-scale ``softplus(0)`` noise).
    """

    def __init__(self, embed_dim: int, num_experts: int, top_k: int, *, router: str = "softmax",
                 renormalize: str = "detached"):
        super().__init__()
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
        if renormalize not in RENORMALIZE:
            raise ValueError(f"renormalize must be one of {RENORMALIZE}, got {renormalize!r}")
        if router == "noisy_topk" and renormalize != "detached":
            raise ValueError("renormalize applies to router='softmax' only; noisy_topk gates are a softmax over the kept logits (eq. 3)")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and num_experts ({num_experts}), got {top_k}")
        self.num_experts, self.top_k = num_experts, top_k
        self.router_type, self.renormalize = router, renormalize
        self.gate = nn.Linear(embed_dim, num_experts, bias=False)
        nn.init.normal_(self.gate.weight, std=embed_dim ** -0.5 * 0.1)
        self.noise = nn.Linear(embed_dim, num_experts, bias=False) if router == "noisy_topk" else None
        if self.noise is not None:
            nn.init.zeros_(self.noise.weight)

    def logits(self, x: Tensor) -> Tensor:
        """The router logits ``x W_g`` ``(batch * time, num_experts)`` of ``x`` ``(batch, time, embed_dim)``, in
        (at least) float32, also under autocast: softmax / top-k on bf16 logits flips near-ties."""
        flat = x.reshape(-1, x.shape[-1]).to(router_dtype(x))
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(flat, self.gate.weight.to(flat.dtype))

    def select(self, probs: Tensor) -> tuple[Tensor, Tensor]:
        """The softmax router's choice from ``probs = softmax(x W_g)`` ``(N, E)``: the gates ``(N, k)`` of the
        ``top_k`` experts (eq. 9, renormalised as ``renormalize`` says) and their indices ``(N, k)`` (eq. 8), in
        ``probs``' dtype. (Also vLLM's routing function for JetMoE's experts: headmix.serving.)"""
        top_p, index = probs.topk(self.top_k, dim=-1)
        if self.renormalize == "detached":
            gates = top_p / top_p.sum(-1, keepdim=True).detach()
        elif self.renormalize == "live":
            gates = top_p / top_p.sum(-1, keepdim=True)
        else:
            gates = top_p
        return gates, index

    def forward(self, x: Tensor, token_mask: Tensor | None = None) -> Routing:
        """``x``: ``(batch, time, embed_dim)``; ``token_mask``: ``(batch, time)`` True for real tokens."""
        batch, time, dim = x.shape
        flat = x.reshape(batch * time, dim).to(router_dtype(x))
        logits = self.logits(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            probs = logits.softmax(dim=-1)
            if self.noise is None:
                gates, index = self.select(probs)
            else:
                noisy = logits
                if self.training:
                    noise_std = F.softplus(F.linear(flat, self.noise.weight.to(flat.dtype)))
                    noisy = logits + torch.randn_like(logits) * noise_std
                top_logits, index = noisy.topk(self.top_k, dim=-1)
                gates = top_logits.softmax(dim=-1)
        mask = None if token_mask is None else token_mask.reshape(batch * time)
        return Routing(logits, probs, index, gates.to(x.dtype), mask, (batch, time))
