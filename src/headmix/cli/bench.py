"""``headmix bench attention | models | decode``: timing tables (see :mod:`headmix.bench`)."""

from __future__ import annotations

import argparse


def _modules():
    from ..bench import attention, decode, gqa, models, mosa

    return {"attention": (attention, "MoA and SwitchHead vs torch MHA: time, memory, decoding"),
            "models": (models, "whole-model training steps: MoA vs the MHA model of equal MACs"),
            "decode": (decode, "decoding tokens/s against the memory-bandwidth bound of the expert weights"),
            "gqa": (gqa, "grouped-query MHA vs torch SDPA enable_gqa, GQE vs grouped MHA, gates and QK-norm"),
            "mosa": (mosa, "Mixture of Sparse Attention vs MHA of equal attention MACs: time, memory, KV cache")}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks against torch.nn.MultiheadAttention")
    what = p.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in _modules().items():
        module.add_arguments(what.add_parser(name, help=help_text, description=module.__doc__,
                                             formatter_class=argparse.RawDescriptionHelpFormatter))


def run(args: argparse.Namespace) -> int:
    return _modules()[args.bench][0].run(args)
