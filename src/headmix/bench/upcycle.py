"""``headmix bench upcycle``: what upcycling a dense model costs (:mod:`headmix.interop.upcycle`), on the CPU.

A dense Llama-style decoder (by default about 120M parameters: d_model 768, 12 layers, 8 query heads of 96 on 2
K/V heads, SwiGLU 2048, vocabulary 32000, random weights: time does not depend on them) is converted into each row
of the upcycling study (issue 44): MoH-LLaMA3's form (4 shared + the top 2 of 4 by query norm, 75% active), the
same rule at 50% (2 shared + the top 2 of 6), the learned router at 75% and 50%, the learned router per K/V group at
50% (the top 2 of 4 per group) and its random-routing twin, and the pruned dense controls keeping 3 and 2 query
heads per K/V group (ranked on ``--calibration-batches`` batches). Two measurements per row:

* conversion: seconds for :func:`~headmix.interop.upcycle_model` on the model in memory (median of ``--repeats``;
  the pruned rows include their importance pass over the calibration batches);
* step: one continued-training step (forward, backward, AdamW) on a ``--batch`` x ``--length`` batch of token ids,
  interleaved with the dense model's step (the baseline, timed in the same repeats), median of ``--repeats``. MoH
  runs its ``auto`` path: sparse on the CPU at 50% active, dense at 75% (docs/performance.md, "Sparse MoH").

Usage: ``headmix bench upcycle [--d-model 768 --layers 12 --repeats 3 --threads 2]``. Prints the machine's load
beside the table: on a shared machine run it with ``--threads 1 --clock cpu``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .timing import add_clock_arguments, check_positive, clock_setup, interleaved_timings

#: The rows: name -> upcycling options (``headmix train --init-options``), for 8 query heads on 2 K/V heads.
ROWS = {
    "moh query_norm 75%": dict(attention="moh", num_shared_heads=4, top_k=2, router="query_norm"),
    "moh query_norm 50%": dict(attention="moh", num_shared_heads=2, top_k=2, router="query_norm"),
    "moh learned 75%": dict(attention="moh", num_shared_heads=4, top_k=2),
    "moh learned 50%": dict(attention="moh", num_shared_heads=2, top_k=2),
    "moh per group 50%": dict(attention="moh", num_shared_heads=0, top_k=2, route_per_group=True),
    "moh per group random 50%": dict(attention="moh", num_shared_heads=0, top_k=2, route_per_group=True,
                                     router="random"),
    "pruned 75%": dict(attention="mha", keep_heads=3),
    "pruned 50%": dict(attention="mha", keep_heads=2),
}


#: The integer options and their defaults.
SIZES = {"d_model": 768, "layers": 12, "ffn_dim": 2048, "vocab_size": 32000, "batch": 4, "length": 256,
         "calibration_batches": 2, "repeats": 3}


def add_arguments(p: argparse.ArgumentParser) -> None:
    for name, default in SIZES.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    add_clock_arguments(p)


def dense_model(args: argparse.Namespace):
    """The dense source: a Llama-style decoder with 8 query heads on 2 K/V heads."""
    from ..models import AttentionConfig, ModelConfig, build_model

    att = AttentionConfig(kind="mha", num_heads=8, kv_heads=2, head_dim=args.d_model // 8, bias=False, rotary=True)
    config = ModelConfig(task="lm", vocab_size=args.vocab_size, d_model=args.d_model, ffn_dim=args.ffn_dim,
                         encoder_layers=0, decoder_layers=args.layers, decoder_self_attention=att, norm="pre",
                         norm_type="rmsnorm", positions="rotary", max_positions=args.length + 2, dropout=0.0,
                         activation_dropout=0.0, ffn="swiglu", bias=False, scale_embeddings=False,
                         embedding_norm=False, share_embeddings=False, pad_id=None, label_smoothing=0.0)
    torch.manual_seed(0)
    return build_model(config)


def run(args: argparse.Namespace) -> int:
    check_positive(args, *SIZES)
    if args.d_model % 8:
        raise ValueError(f"--d-model must be a multiple of 8 (the query heads), got {args.d_model}")
    from ..interop import upcycle_model
    from ..models import count_parameters

    clock, setting = clock_setup(args)
    dense = dense_model(args)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, args.vocab_size, (args.batch, args.length), generator=generator)
    calibration = [torch.randint(3, args.vocab_size, (args.batch, args.length), generator=generator)
                   for _ in range(args.calibration_batches)]
    print(f"# headmix bench upcycle: dense source {count_parameters(dense) / 1e6:.1f}M parameters, d_model "
          f"{args.d_model}, {args.layers} layers, 8 query heads on 2 K/V heads; step on {args.batch} x {args.length} "
          f"tokens; {setting}")
    converted, conversion = {}, {}
    for name, options in ROWS.items():
        seconds = []
        for _ in range(args.repeats):
            start = clock()
            model = upcycle_model(dense, batches=calibration, **options) if "keep_heads" in options else \
                upcycle_model(dense, **options)
            seconds.append(clock() - start)
        converted[name], conversion[name] = model, statistics.median(seconds)

    def step_of(model):
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            out = model(ids, labels=ids)
            out.total_loss.backward()
            optimizer.step()

        return step

    steps = interleaved_timings({"dense": step_of(dense), **{n: step_of(m) for n, m in converted.items()}},
                                repeats=args.repeats, warmup=1, device="cpu", clock=clock)
    print("| row | options | parameters | conversion s | step s | step / dense |")
    print("|---|---|---|---|---|---|")
    print(f"| dense (baseline) | | {count_parameters(dense) / 1e6:.1f}M | | {steps['dense']:.3f} | 1.00 |")
    for name, options in ROWS.items():
        print(f"| {name} | `{options}` | {count_parameters(converted[name]) / 1e6:.1f}M | {conversion[name]:.3f} | "
              f"{steps[name]:.3f} | {steps[name] / steps['dense']:.2f} |")
    print(f"# measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    return 0
