"""``headmix bench gemm-shapes``: how fast are the GEMMs the ``sorted`` CPU kernels run, against one dense GEMM of the same FLOPs?

``sorted`` (``headmix.kernels.grouped_cpu``) runs, per expert, six GEMMs for map + reduce, forward and
backward: with ``R = N k / E`` rows per expert, ``d = d_model``, ``h = head_dim``

=============  ================================  ==========================
product        per expert                        what it computes
=============  ================================  ==========================
map fwd        ``(R x d) @ (d x h)``             ``x W_q[e]`` (eq. 10)
map dgrad      ``(R x h) @ (h x d)``             ``grad_q W_q[e]^T``
map wgrad      ``(d x R) @ (R x h)``             ``x^T grad_q``
reduce fwd     ``(R x h) @ (h x d)``             ``(g o) W_o[e]`` (eq. 12)
reduce u       ``(R x d) @ (d x h)``             ``grad_y W_o[e]^T``
reduce wgrad   ``(h x R) @ (R x d)``             ``(g o)^T grad_y``
=============  ================================  ==========================

``dense`` at ``E = k`` runs each as one ``(N x d) @ (d x k h)``-sized GEMM instead (same FLOPs). Every
expert reads its own rows (``E`` distinct blocks, as after the kernels' gathers), so the data is not
cache-hot from one expert to the next. This isolates the GEMM cost from the gathers and scatters::

    headmix bench gemm-shapes                      # N 4096, d 512, h 64, k 8, E 64
    headmix bench gemm-shapes --tokens 2688 --d-model 128 --head-dim 48 --top-k 4 --experts 16

One thread, CPU time of this process (robust on a shared machine), median of ``--repeats`` interleaved
runs (``headmix.bench.timing.interleaved_timings``).
"""

from __future__ import annotations

import argparse
import time

import torch

from .timing import check_positive, interleaved_timings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)


def run(args: argparse.Namespace) -> int:
    check_positive(args, "tokens", "d_model", "head_dim", "top_k", "experts", "repeats")
    if args.tokens * args.top_k < args.experts:
        raise ValueError(f"--tokens x --top-k must be >= --experts (a row per expert), got {args.tokens} x "
                         f"{args.top_k} < {args.experts}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n, d, h, k, e = args.tokens, args.d_model, args.head_dim, args.top_k, args.experts
    rows = n * k // e  # per expert, balanced
    slots = rows * e
    x, g = torch.randn(slots, d), torch.randn(slots, h)
    w_q, w_o = torch.randn(e, d, h), torch.randn(e, h, d)
    out_h, out_d = torch.empty(slots, h), torch.empty(slots, d)
    grad_wq, grad_wo = torch.empty(e, d, h), torch.empty(e, h, d)
    part = [slice(i * rows, (i + 1) * rows) for i in range(e)]
    per_expert = {
        "map fwd": lambda: [torch.mm(x[s], w_q[i], out=out_h[s]) for i, s in enumerate(part)],
        "map dgrad": lambda: [torch.mm(g[s], w_q[i].t(), out=out_d[s]) for i, s in enumerate(part)],
        "map wgrad": lambda: [torch.mm(x[s].t(), g[s], out=grad_wq[i]) for i, s in enumerate(part)],
        "reduce fwd": lambda: [torch.mm(g[s], w_o[i], out=out_d[s]) for i, s in enumerate(part)],
        "reduce u": lambda: [torch.mm(x[s], w_o[i].t(), out=out_h[s]) for i, s in enumerate(part)],
        "reduce wgrad": lambda: [torch.mm(g[s].t(), x[s], out=grad_wo[i]) for i, s in enumerate(part)],
    }
    width = k * h  # dense at E = k: one (N x d) @ (d x k h) product, same FLOPs
    xd, gd, wd = torch.randn(n, d), torch.randn(n, width), torch.randn(d, width)
    out_w, out_dd, grad_wd = torch.empty(n, width), torch.empty(n, d), torch.empty(d, width)
    dense = {
        "map fwd": lambda: torch.mm(xd, wd, out=out_w),
        "map dgrad": lambda: torch.mm(gd, wd.t(), out=out_dd),
        "map wgrad": lambda: torch.mm(xd.t(), gd, out=grad_wd),
        "reduce fwd": lambda: torch.mm(gd, wd.t(), out=out_dd),
        "reduce u": lambda: torch.mm(xd, wd, out=out_w),
        "reduce wgrad": lambda: torch.mm(xd.t(), gd, out=grad_wd),
    }
    print(f"# {n} tokens, d_model {d}, head_dim {h}, k {k}, E {e} ({rows} rows per expert); one thread, "
          f"CPU time, median of {args.repeats} interleaved; torch {torch.__version__}")
    print("| product | per-expert GEMMs ms | dense GEMM ms | per-expert / dense |")
    print("|---|---|---|---|")
    total_e = total_d = 0.0
    for name in per_expert:
        t = interleaved_timings({"per expert": per_expert[name], "dense": dense[name]}, args.repeats, 1, "cpu",
                                clock=time.process_time)
        te, td = t["per expert"], t["dense"]
        total_e, total_d = total_e + te, total_d + td
        print(f"| {name} | {1e3 * te:.1f} | {1e3 * td:.1f} | {te / td:.2f} |")
    print(f"| all six | {1e3 * total_e:.1f} | {1e3 * total_d:.1f} | {total_e / total_d:.2f} |")
    return 0
