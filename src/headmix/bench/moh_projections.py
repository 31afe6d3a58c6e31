"""``headmix bench moh-projections``: would MoH gain from computing only the selected heads' projections?  A measurement, not a feature.

MoH (Jin et al. 2024) weights each routed head per token and zeroes the unselected ones.  Its attention
over all heads is dense either way (skipping (token, head) pairs needs a variable-length attention
kernel), but the query and output projections of the unselected routed heads could be skipped with the
grouped kernels MoA uses (``expert_map`` / ``expert_reduce``, one "expert" per routed head).  This times
the query and output projections both ways, forward and backward, interleaved, median of the repeats:

* dense: ``Linear(d, H*dh)`` for the queries and ``Linear(H*dh, d)`` for the output, as
  :class:`headmix.attention.MixtureOfHeadsAttention` computes them;
* grouped: the shared heads through ``Linear``, the routed heads through ``expert_map`` /
  ``expert_reduce`` for the ``top_k`` selected heads only.

Usage: ``headmix bench moh-projections [--tokens 4096 --heads 8 --shared 2 --top-k 3]``.
"""

from __future__ import annotations

import argparse

import torch

from ..kernels import IMPLS, expert_map, expert_reduce, expert_routing
from .timing import check_positive, interleaved_timings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--shared", type=int, default=2)
    p.add_argument("--top-k", type=int, default=3, help="routed heads active per token")
    p.add_argument("--impl", default="auto", choices=IMPLS, metavar="IMPL", help="expert_map / expert_reduce implementation")
    p.add_argument("--repeats", type=int, default=15)


def run(args: argparse.Namespace) -> int:
    check_positive(args, "tokens", "embed_dim", "heads", "top_k", "repeats")
    if not 0 <= args.shared < args.heads:
        raise ValueError(f"--shared must be >= 0 and below --heads ({args.heads}), got {args.shared}")
    if args.top_k > args.heads - args.shared:
        raise ValueError(f"--top-k must be at most the routed heads (--heads - --shared = "
                         f"{args.heads - args.shared}), got {args.top_k}")
    if args.embed_dim % args.heads:
        raise ValueError(f"--heads must divide --embed-dim ({args.embed_dim}), got {args.heads}")
    torch.manual_seed(0)
    n, d, h, s, k = args.tokens, args.embed_dim, args.heads, args.shared, args.top_k
    dh, r = d // h, h - s
    x = torch.randn(n, d, requires_grad=True)
    heads = torch.randn(n, h, dh, requires_grad=True)  # attention outputs per head
    q_all, o_all = torch.nn.Linear(d, h * dh), torch.nn.Linear(h * dh, d)
    q_shared, o_shared = (torch.nn.Linear(d, s * dh), torch.nn.Linear(s * dh, d)) if s else (None, None)
    w_q = (torch.randn(r, d, dh) / d**0.5).requires_grad_()
    w_o = (torch.randn(r, dh, d) / dh**0.5).requires_grad_()
    index = torch.rand(n, r).topk(k, dim=-1).indices
    gates = torch.rand(n, k, requires_grad=True)
    # the selected routed heads' outputs, as the grouped path would gather them
    selected = torch.randn(n, k, dh, requires_grad=True)

    def dense() -> None:
        (q_all(x).sum() + o_all(heads.reshape(n, h * dh)).sum()).backward()

    def grouped() -> None:
        routing = expert_routing(index, r)
        loss = expert_map(x, w_q, routing, args.impl).sum() + expert_reduce(selected, w_o, gates, routing, args.impl).sum()
        if s:
            loss = loss + q_shared(x).sum() + o_shared(heads[:, :s].reshape(n, s * dh)).sum()
        loss.backward()

    fns = {"dense (as MoH computes)": dense, f"grouped ({k} of {r} routed)": grouped}
    times = interleaved_timings(fns, args.repeats, 3, "cpu")
    base = times["dense (as MoH computes)"]
    print(f"# MoH query + output projections, fwd+bwd: {n} tokens, d {d}, {h} heads of {dh} ({s} shared), "
          f"top-{k} routed; {torch.get_num_threads()} threads, median of {args.repeats}")
    print("| projections | ms | vs dense |\n|---|---|---|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / base:.2f} |")
    return 0
