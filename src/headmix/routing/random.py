"""The random-routing control: each token's experts chosen uniformly at random, with no router to learn.

A learned router is worth its cost only if it beats a router that chooses at random. ``router="random"`` on
MoA, MoH (routed per K/V group included), GQE and SwitchHead replaces the learned router with :class:`RandomRouter`: the same number
of experts per token, chosen uniformly at random, weighted as the layer weights them when every router score
is equal; no router parameters and no auxiliary loss.

The choice is a hash, not a draw from a random number generator: expert ``e`` of token ``(b, t)`` in group
``g`` gets the key ``splitmix64`` of (seed, stream, salt, ``b``, ``t``, ``g``, ``e``), and the token takes the
``k`` experts with the largest keys (the first ``k`` of a random permutation: every set of ``k`` experts is
equally likely). ``seed`` is drawn when the layer is built (from torch's generator, like its weights, so a
run's seed fixes it) or given, and kept as a buffer in the state dict. In training every call takes a new
``salt`` (a call counter, also a buffer): the choice changes from step to step, and a run resumed from a
checkpoint continues with the same choices as a run that never stopped. In evaluation the salt is fixed, so
the choice depends only on the seed and the token's place (batch row, position), and a cached decoding step
chooses what the full forward pass chooses. Nothing reads or advances a global random state.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

_MASK64 = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
#: The salt of evaluation calls (training calls use their call counter, from 0 up).
EVAL_SALT = -1


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 it is stored as."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 (torch's ``>>`` extends the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: Tensor) -> Tensor:
    """SplitMix64's finaliser on int64 tensors (arithmetic modulo 2^64): ``z = x + golden``,
    ``z = (z ^ z >>> 30) * m1``, ``z = (z ^ z >>> 27) * m2``, ``z ^ z >>> 31``."""
    z = x + _signed(_GOLDEN)
    z = (z ^ _shift_right(z, 30)) * _signed(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(_MIX2)
    return z ^ _shift_right(z, 31)


def splitmix64_int(x: int) -> int:
    """:func:`splitmix64` on a Python integer (the plain reference)."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def check_random_router(router: str, choices: tuple[str, ...]) -> bool:
    """Whether ``router`` (one of ``choices``) is the random control; ``ValueError`` naming the argument
    otherwise."""
    if router not in choices:
        raise ValueError(f"router must be one of {choices}, got {router!r}")
    return router == "random"


class RandomRouter(nn.Module):
    """Chooses ``top_k`` of ``num_experts`` experts per token and group uniformly at random (see the module
    docstring). No parameters; buffers ``seed`` (the layer's seed) and ``calls`` (training calls so far).

    ``router_seed``: an integer in ``[0, 2^62)``, or None to draw one from torch's default generator (the
    way weights are initialised).
    """

    def __init__(self, num_experts: int, top_k: int, groups: int = 1, router_seed: int | None = None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and num_experts ({num_experts}), got {top_k}")
        if router_seed is None:
            router_seed = int(torch.randint(0, 1 << 62, (), device="cpu"))  # the default generator, as weights
        elif isinstance(router_seed, bool) or not isinstance(router_seed, int) or not 0 <= router_seed < 1 << 62:
            raise ValueError(f"router_seed must be an integer in [0, 2^62), got {router_seed!r}")
        self.num_experts, self.top_k, self.groups = num_experts, top_k, groups
        self.register_buffer("seed", torch.tensor(router_seed, dtype=torch.long))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}, groups={self.groups}"

    def choose(self, batch: int, time: int, offset: int | Tensor = 0, stream: int = 0) -> Tensor:
        """The experts of each token ``(batch * time, groups, top_k)`` (long, distinct within a group, in
        decreasing key order), for the tokens at positions ``offset .. offset + time`` of each batch row.
        ``stream`` separates the choices of two routers of one layer (SwitchHead's value and output sides).
        A training call advances the call counter."""
        device = self.seed.device
        if self.training:
            salt = self.calls.clone()
            with torch.no_grad():
                self.calls.add_(1)
        else:
            salt = torch.full((), EVAL_SALT, dtype=torch.long, device=device)
        h = splitmix64(splitmix64(self.seed + stream) + salt)
        b = torch.arange(batch, device=device)[:, None, None, None]
        t = (torch.arange(time, device=device) + offset)[None, :, None, None]
        g = torch.arange(self.groups, device=device)[None, None, :, None]
        e = torch.arange(self.num_experts, device=device)
        key = splitmix64(splitmix64(splitmix64(splitmix64(h + b) + t) + g) + e)
        # distinct keys (no ties): the hash's top 48 bits, then the expert
        key = _shift_right(key, 16) * self.num_experts + e
        index = key.topk(self.top_k, dim=-1).indices
        return index.reshape(batch * time, self.groups, self.top_k)


def reference_random_choice(seed: int, salt: int, stream: int, b: int, t: int, g: int, num_experts: int,
                            top_k: int) -> list[int]:
    """:meth:`RandomRouter.choose` for one token and group, in plain Python integers: the ``top_k`` experts
    with the largest keys ``splitmix64(... (seed + stream), salt, b, t, g, e)``."""
    h = splitmix64_int((splitmix64_int(seed + stream) + salt) & _MASK64)
    keys = []
    for e in range(num_experts):
        z = h
        for v in (b, t, g, e):
            z = splitmix64_int((z + v) & _MASK64)
        keys.append(((z >> 16) * num_experts + e, e))
    return [e for _, e in sorted(keys, reverse=True)[:top_k]]


def uniform_routing(index: Tensor, num_experts: int, gate: float, token_mask: Tensor | None,
                    batch_shape: tuple[int, int], dtype: torch.dtype) -> "Routing":
    """The :class:`~headmix.routing.Routing` of a random choice ``index`` ``(N, slots)``: zero logits, the
    uniform distribution ``1 / num_experts`` as ``probs``, every selected expert weighted ``gate``."""
    from .router import Routing

    n = index.shape[0]
    logits = torch.zeros(n, num_experts, device=index.device, dtype=torch.float32 if dtype in (
        torch.float16, torch.bfloat16) else dtype)
    gates = torch.full(index.shape, gate, device=index.device, dtype=dtype)
    mask = None if token_mask is None else token_mask.reshape(n)
    return Routing(logits, logits + 1.0 / num_experts, index, gates, mask, batch_shape)
