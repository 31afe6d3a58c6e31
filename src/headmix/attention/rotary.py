"""Rotary position embeddings (RoPE; Su, Lu, Pan, Murtadha, Wen, Liu 2021, "RoFormer", arXiv 2104.09864).

Each pair of dimensions ``(x_a, x_b)`` of a query or key head at position ``m`` is rotated by the angle
``m * theta_i`` with ``theta_i = base^(-2i / d)`` (eq. 15 and the efficient form of eq. 34):
``(x_a, x_b) -> (x_a cos m theta_i - x_b sin m theta_i, x_b cos m theta_i + x_a sin m theta_i)``, so the
score ``q_m . k_n`` depends on the positions only through ``m - n``.

Pairing: by default dimension ``i`` is paired with ``i + d/2`` (the "half-split" layout, ``rotate_half``,
of Hugging Face Llama / JetMoe and x-transformers); ``interleaved=True`` pairs ``2i`` with ``2i + 1``
(RoFormer's eq. 34 as written, GPT-J / Mesh-Transformer-JAX). The two layouts are the same rotation up to a
fixed permutation of the head dimensions, so they differ only when weights are copied from a model.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RotaryEmbedding(nn.Module):
    """RoFormer / Llama rotary position embedding (Su et al. 2021, eq. 34).

    ``head_dim`` is the size of each query/key head; the first ``int(head_dim * fraction)`` dimensions
    (rounded down to an even number) are rotated, the rest pass unchanged (partial rotary, as GPT-NeoX and
    x-transformers' ``rotary_emb_dim``). ``base`` is the ``10000`` of ``theta_i = base^(-2i/d)``, with ``d``
    the number of rotated dimensions.

    ``forward(x, offset)`` takes ``(batch, heads, time, head_dim)`` and gives ``x[:, :, t]`` the position
    ``offset + t``. The angles are computed in float32 and the rotation in ``x``'s dtype, as Hugging Face
    Llama does. The module holds no tensors (the frequencies are recomputed on each call, ``rotary_dim / 2``
    numbers): a layer's ``state_dict`` does not change, and a model built on the meta device and
    materialised later needs nothing re-initialised.
    """

    def __init__(self, head_dim: int, *, base: float = 10000.0, fraction: float = 1.0, interleaved: bool = False):
        super().__init__()
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
            raise ValueError(f"head_dim must be a positive integer, got {head_dim!r}")
        check_rotary_numbers(base, fraction)
        rotary_dim = int(head_dim * fraction) // 2 * 2
        if rotary_dim < 2:
            raise ValueError(f"fraction ({fraction}) of head_dim ({head_dim}) rotates fewer than 2 dimensions")
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.base, self.fraction, self.interleaved = float(base), float(fraction), bool(interleaved)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}"
                + (", interleaved=True" if self.interleaved else ""))

    def inv_freq(self, device: torch.device | None = None) -> Tensor:
        """``theta_i = base^(-2i / d)``, ``i < d/2``, in float32 (``d`` = ``rotary_dim``)."""
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
        return 1.0 / (self.base ** exponents)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``cos(m theta)``, ``sin(m theta)`` of shape ``(len(positions), rotary_dim)`` in the layout of
        the pairs (each angle twice: ``[theta_0..theta_{d/2-1}, theta_0..]`` half-split, or
        ``[theta_0, theta_0, theta_1, theta_1, ..]`` interleaved)."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq(positions.device)[None, :]
        if self.interleaved:
            angles = angles.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """``offset``: a non-negative int, or a 0-d integer tensor (a static cache's position: the
        positions are then computed on the device, with no host synchronisation)."""
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x must have shape (batch, heads, time, {self.head_dim}), got {tuple(x.shape)}")
        time = x.shape[2]
        if isinstance(offset, Tensor) and offset.dim() == 0 and not offset.is_floating_point():
            positions = offset + torch.arange(time, device=x.device)
        elif not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"offset must be a non-negative integer, got {offset!r}")
        else:
            positions = torch.arange(offset, offset + time, device=x.device)
        cos, sin = self.cos_sin(positions, x.dtype)
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        rotated = rot * cos + self._turn(rot) * sin
        return rotated if rest.shape[-1] == 0 else torch.cat([rotated, rest], dim=-1)

    def rotate_at(self, x: Tensor, positions: Tensor) -> Tensor:
        """``x`` ``(..., head_dim)`` with each row rotated to its own position: ``positions`` has the shape
        ``x.shape[:-1]`` (rows gathered from several positions, e.g. the tokens that chose a MoH head)."""
        if x.shape[-1] != self.head_dim or tuple(positions.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"x must have shape (..., {self.head_dim}) and positions x's shape without the last "
                             f"dimension, got {tuple(x.shape)} and {tuple(positions.shape)}")
        cos, sin = self.cos_sin(positions.reshape(-1), x.dtype)
        cos, sin = cos.view(*x.shape[:-1], -1), sin.view(*x.shape[:-1], -1)
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        rotated = rot * cos + self._turn(rot) * sin
        return rotated if rest.shape[-1] == 0 else torch.cat([rotated, rest], dim=-1)

    def _turn(self, x: Tensor) -> Tensor:
        """Each pair ``(x_a, x_b)`` -> ``(-x_b, x_a)``: the 90-degree turn that ``sin`` multiplies."""
        if self.interleaved:
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def check_rotary_numbers(base: float, fraction: float) -> None:
    """One-line errors for the rotary base and fraction."""
    if not isinstance(base, (int, float)) or isinstance(base, bool) or not base > 1.0:
        raise ValueError(f"rotary_base must be a number > 1, got {base!r}")
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0.0 < fraction <= 1.0:
        raise ValueError(f"rotary_fraction must be a number in (0, 1], got {fraction!r}")


def make_rotary(rotary: bool | RotaryEmbedding, base: float, fraction: float, head_dim: int) -> RotaryEmbedding | None:
    """The layers' ``rotary`` option: ``False`` -> None, ``True`` -> a new :class:`RotaryEmbedding` for
    ``head_dim`` from ``base``/``fraction``, a module -> that module (its ``head_dim`` must match)."""
    if isinstance(rotary, RotaryEmbedding):
        if rotary.head_dim != head_dim:
            raise ValueError(f"rotary has head_dim {rotary.head_dim}, but this layer's query/key heads have {head_dim}")
        return rotary
    if not isinstance(rotary, bool):
        raise ValueError(f"rotary must be a bool or a RotaryEmbedding, got {type(rotary).__name__}")
    check_rotary_numbers(base, fraction)
    if not rotary:
        return None
    return RotaryEmbedding(head_dim, base=base, fraction=fraction)
