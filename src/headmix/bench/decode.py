"""``headmix bench decode``: MoA decoding speed against the memory-bandwidth bound of the weights it reads.

At one new token per sequence a decoding step does little arithmetic and reads a lot: every expert that
some sequence of the batch selects must be read once, besides the shared key/value projections, the
router and the cache. With ``E`` experts that is up to ``E / k`` times the weights of a dense layer, so
the speed to expect is set by the machine's memory bandwidth, not by MACs.

For each batch size and number of experts this prints, for one MoA layer (``headmix bench attention``'s
sizes: embed 512, k 8, head_dim 64) after a prompt, generating one token at a time with the cache:

- tokens per second and microseconds per step, per ``expert_impl`` (``auto`` and the forced ones);
- the bytes a step must read: the weights of the distinct experts the step selected (query and output
  projection), the shared key/value projections and router, and the cache;
- the bound: those bytes at the read bandwidth measured in the same run (the median time of summing a
  256 MiB tensor), and the fraction of it reached (bound time / measured time; 1.0 = at the bound).

The headmix MHA layer of equal ``k * head_dim`` is the named baseline (its 4 d^2 weights and its cache).
Timings are interleaved over all variants, medians over repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..attention import MixtureOfAttentionHeads, MultiHeadAttention
from ..kernels.dispatch import IMPLS
from .attention import format_rows
from .timing import add_clock_arguments, clock_setup, interleaved_timings


def read_bandwidth(mib: int = 256, repeats: int = 5, clock=time.perf_counter) -> float:
    """Bytes per second of reading a ``mib`` MiB float32 tensor once (``sum``), median of ``repeats``,
    timed with ``clock`` (as the decoding it is compared with)."""
    t = torch.ones(mib * 2**20 // 4)
    t.sum()
    times = []
    for _ in range(repeats):
        t0 = clock()
        t.sum()
        times.append(clock() - t0)
    return t.nbytes / statistics.median(times)


def _tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def step_bytes(layer, cache_bytes: float, expert_index: torch.Tensor | None) -> float:
    """Bytes one decoding step must read: the weights it uses (for MoA only the distinct selected
    experts') and the cache."""
    if isinstance(layer, MixtureOfAttentionHeads):
        experts = int(torch.unique(expert_index).numel())
        per_expert = _tensor_bytes(layer.query_experts[0], layer.output_experts[0])
        shared = _tensor_bytes(layer.router.gate.weight, layer.k_proj.weight, layer.k_proj.bias,
                               layer.v_proj.weight, layer.v_proj.bias, layer.out_bias)
        return experts * per_expert + shared + cache_bytes
    return _tensor_bytes(*layer.parameters()) + cache_bytes


@torch.no_grad()
def bench_decode(*, batches: list[int], experts: list[int], impls: list[str], embed_dim: int, top_k: int,
                 head_dim: int, prompt: int, steps: int, repeats: int, seed: int = 0,
                 clock=time.perf_counter) -> tuple[list[dict], float]:
    bandwidth = read_bandwidth(clock=clock)
    rows = []
    for batch in batches:
        torch.manual_seed(seed)
        x = torch.randn(batch, prompt + steps, embed_dim)
        layers = {"headmix MHA": (MultiHeadAttention(embed_dim, top_k).eval(), None)}
        for e in experts:
            moa = MixtureOfAttentionHeads(embed_dim, e, top_k, head_dim).eval()
            for impl in impls:
                layers[f"MoA {top_k}K{e}E{head_dim}D {impl}"] = (moa, impl)

        start = {}
        for name, (layer, _) in layers.items():
            if id(layer) not in start:
                start[id(layer)] = layer(x[:, :prompt], is_causal=True, use_cache=True).cache

        def decode(layer, impl, record=None):
            if impl is not None:
                layer.expert_impl = impl
            cache = start[id(layer)]
            for t in range(prompt, prompt + steps):
                out = layer(x[:, t:t + 1], is_causal=True, use_cache=True, cache=cache)
                cache = out.cache
                if record is not None:
                    record.append(step_bytes(layer, cache.nbytes, None if out.routing is None else out.routing.expert_index))

        times = interleaved_timings({n: (lambda l=l, i=i: decode(l, i)) for n, (l, i) in layers.items()},
                                    repeats, 1, "cpu", clock=clock)
        for name, (layer, impl) in layers.items():
            record: list[float] = []
            decode(layer, impl, record)
            step_s = times[name] / steps
            mean_bytes = sum(record) / len(record)
            rows.append({"batch": batch, "layer": name, "tokens_per_s": batch / step_s, "step_us": 1e6 * step_s,
                         "mib": mean_bytes / 2**20, "bound_us": 1e6 * mean_bytes / bandwidth,
                         "fraction": (mean_bytes / bandwidth) / step_s})
    return rows, bandwidth


DECODE_COLUMNS = [("batch", "batch", "{}"), ("layer", "layer, expert_impl", "{}"),
                  ("tokens_per_s", "tokens/s", "{:.0f}"), ("step_us", "us / step", "{:.0f}"),
                  ("mib", "MiB read / step", "{:.2f}"), ("bound_us", "bound us", "{:.0f}"),
                  ("fraction", "of bound", "{:.2f}")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--experts", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--impls", nargs="+", default=["auto", "dense", "sorted", "gather", "bag"],
                   choices=[i for i in IMPLS if i not in ("reference", "triton")])
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    add_clock_arguments(p)


def run(args: argparse.Namespace) -> int:
    for name in ("prompt", "steps", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    clock, setup = clock_setup(args)
    rows, bandwidth = bench_decode(batches=args.batches, experts=args.experts, impls=args.impls,
                                   embed_dim=args.embed_dim, top_k=args.top_k, head_dim=args.head_dim,
                                   prompt=args.prompt, steps=args.steps, repeats=args.repeats, clock=clock)
    print(f"# headmix bench decode: cpu, float32, torch {torch.__version__}, {setup}; "
          f"embed {args.embed_dim}, k {args.top_k}, head_dim {args.head_dim}; prompt {args.prompt}, then "
          f"{args.steps} steps of one token; read bandwidth {bandwidth / 1e9:.1f} GB/s (sum of 256 MiB); "
          f"median of {args.repeats} interleaved runs")
    print(format_rows(rows, DECODE_COLUMNS))
    return 0
