"""``headmix bench gqa``: grouped-query attention, MoH per K/V group and the gates, each against its named baseline in one run.

Three comparisons (issue 27), each timed interleaved (every repeat runs each layer of the comparison once, in
turn; the median over repeats is reported) and given as a ratio to the baseline measured in the same run:

- ``gqa``: headmix ``MultiHeadAttention(kv_heads=G)`` against the same projections around torch's
  ``scaled_dot_product_attention(enable_gqa=True)`` (no headmix code in the baseline), causal
  forward+backward;
- ``moh-per-group`` (named ``gqe`` before the paper's GQE was built): ``MixtureOfHeadsAttention(kv_heads=G, route_per_group=True, impl="sparse")`` with half of each
  group's routed heads active (and the global-top-k MoH with ``kv_heads=G`` and half its routed heads
  active) against ``MultiHeadAttention(kv_heads=G)``: causal forward+backward, and a causal prefill
  (forward without autograd) at ``--prefill-seq``;
- ``gates``: ``MultiHeadAttention(kv_heads=G)`` with QK-norm and a headwise / elementwise output gate against
  the same layer without them, causal forward+backward.

Defaults: fp32, d_model 512, 8 query heads of 64 on 2 K/V heads, batch 2 x 512 tokens (prefill 1 x 2048).
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import MixtureOfHeadsAttention, MultiHeadAttention
from ..devices import pick_device
from .attention import _device_name, format_rows
from .timing import add_clock_arguments, bench_dtype, clock_setup, interleaved_timings


class TorchGroupedAttention(nn.Module):
    """The baseline of ``gqa``: ``q/k/v/out`` projections of the same shapes as the headmix layer's around
    ``F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)``."""

    def __init__(self, embed_dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, embed_dim // heads
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, kv_heads * self.head_dim)
        self.v_proj = nn.Linear(embed_dim, kv_heads * self.head_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out_proj(o.transpose(1, 2).reshape(b, t, -1))


def _causal(layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    if isinstance(layer, TorchGroupedAttention):
        return layer
    return lambda x: layer(x, is_causal=True).output


def compare(layers: dict[str, nn.Module], x: torch.Tensor, *, backward: bool, repeats: int, warmup: int,
            device: torch.device, clock) -> dict[str, float]:
    """Seconds per call of each layer (causal), forward+backward of ``output.square().mean()`` (plus the
    auxiliary loss) or a forward without autograd; interleaved medians."""
    def step(layer: nn.Module) -> None:
        if not backward:
            with torch.no_grad():
                _causal(layer)(x)
            return
        for p in layer.parameters():
            p.grad = None
        if isinstance(layer, TorchGroupedAttention):
            layer(x).square().mean().backward()
        else:
            out = layer(x, is_causal=True)
            (out.output.square().mean() + out.aux_loss).backward()

    return interleaved_timings({n: (lambda m=m: step(m)) for n, m in layers.items()}, repeats, warmup, device,
                               clock=clock)


def build(embed_dim: int, heads: int, kv_heads: int, device, dtype) -> dict[str, dict[str, nn.Module]]:
    """The three comparisons' layers, baseline first."""
    per_group = heads // kv_heads
    torch.manual_seed(0)

    def mha(**kw):
        return MultiHeadAttention(embed_dim, heads, kv_heads=kv_heads, **kw)

    groups = {
        "gqa": {"torch SDPA enable_gqa": TorchGroupedAttention(embed_dim, heads, kv_heads), "headmix MHA": mha()},
        "moh-per-group": {"MHA": mha(),
                f"MoH per K/V group sparse (top {per_group // 2} of {per_group} per group)": MixtureOfHeadsAttention(
                    embed_dim, heads, 0, per_group // 2, kv_heads=kv_heads, route_per_group=True, impl="sparse",
                    allow_router_without_task_gradient=True),  # timed, not trained: top 1 of 2 costs the same
                f"MoH sparse (top {heads // 2} of {heads})": MixtureOfHeadsAttention(
                    embed_dim, heads, 0, heads // 2, kv_heads=kv_heads, impl="sparse")},
        "gates": {"MHA": mha(), "+ qk_norm": mha(qk_norm=True),
                  "+ qk_norm + headwise gate": mha(qk_norm=True, output_gate="headwise"),
                  "+ qk_norm + elementwise gate": mha(qk_norm=True, output_gate="elementwise")},
    }
    for layers in groups.values():
        for layer in layers.values():
            layer.to(device, dtype).train()
    return groups


COLUMNS = [("comparison", "comparison", "{}"), ("what", "timed", "{}"), ("layer", "layer", "{}"),
           ("ms", "ms", "{:.2f}"), ("ratio", "/ baseline", "{:.3f}")]


def run_benchmark(*, embed_dim: int, heads: int, kv_heads: int, batch: int, seq: int, prefill_seq: int,
                  repeats: int, warmup: int, device: torch.device, dtype: torch.dtype, clock=time.perf_counter,
                  only: tuple[str, ...] = ("gqa", "moh-per-group", "gates")) -> list[dict]:
    groups = build(embed_dim, heads, kv_heads, device, dtype)
    x = torch.randn(batch, seq, embed_dim, device=device, dtype=dtype, requires_grad=True)
    rows = []

    def add(name: str, what: str, times: dict[str, float]) -> None:
        base = next(iter(times))
        rows.extend({"comparison": name, "what": what, "layer": layer, "ms": 1e3 * t, "ratio": t / times[base]}
                    for layer, t in times.items())

    for name in only:
        layers = groups[name]
        add(name, f"fwd+bwd {batch}x{seq}", compare(layers, x, backward=True, repeats=repeats, warmup=warmup,
                                                   device=device, clock=clock))
        if name == "moh-per-group":
            xp = torch.randn(1, prefill_seq, embed_dim, device=device, dtype=dtype)
            add(name, f"prefill 1x{prefill_seq}", compare(layers, xp, backward=False, repeats=repeats, warmup=warmup,
                                                          device=device, clock=clock))
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bfloat16 on CUDA, else float32)")
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--prefill-seq", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--only", nargs="+", choices=("gqa", "moh-per-group", "gates"), default=["gqa", "moh-per-group", "gates"])
    add_clock_arguments(p)


def run(args: argparse.Namespace) -> int:
    device = pick_device(args.device)
    dtype = bench_dtype(args.dtype, device)
    if args.clock == "cpu" and device.type != "cpu":
        raise ValueError(f"--clock cpu measures CPU time and needs --device cpu, got {device}")
    if args.heads % args.kv_heads or (args.heads // args.kv_heads) % 2:
        raise ValueError(f"--kv-heads must divide --heads into groups of an even size, got {args.heads} and {args.kv_heads}")
    clock, setup = clock_setup(args)
    print(f"# headmix bench gqa: {device} ({_device_name(device)}), {dtype}, torch {torch.__version__}, {setup}; "
          f"d_model {args.embed_dim}, {args.heads} query heads on {args.kv_heads} K/V heads; causal; "
          f"median of {args.repeats} interleaved runs; ratios to the first layer of each comparison")
    rows = run_benchmark(embed_dim=args.embed_dim, heads=args.heads, kv_heads=args.kv_heads, batch=args.batch,
                         seq=args.seq, prefill_seq=args.prefill_seq, repeats=args.repeats, warmup=args.warmup,
                         device=device, dtype=dtype, clock=clock, only=tuple(args.only))
    print(format_rows(rows, COLUMNS))
    return 0
