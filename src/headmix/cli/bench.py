"""``headmix bench attention``: timing tables (see :mod:`headmix.bench.attention`)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from ..bench import attention

    p = sub.add_parser("bench", help="benchmarks against torch.nn.MultiheadAttention")
    what = p.add_subparsers(dest="bench", required=True)
    attention.add_arguments(what.add_parser("attention", help="MoA and SwitchHead vs torch MHA: time, memory, decoding",
                                            description=attention.__doc__,
                                            formatter_class=argparse.RawDescriptionHelpFormatter))


def run(args: argparse.Namespace) -> int:
    from ..bench import attention

    return attention.run(args)
