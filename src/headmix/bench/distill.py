"""``headmix bench distill``: what distillation (:mod:`headmix.distillation`) adds to a training step, in memory
and in time, at a real vocabulary (issue 60).

A small Llama-style decoder (``--d-model`` 64, ``--layers`` 1, 8 query heads on 2 K/V heads, SwiGLU) and a parent of
the same shape take one training step (forward, backward, AdamW) on ``--batch`` x ``--length`` token ids, for each
``--vocab``:

* ``plain``: the student's own loss (the baseline);
* ``distilled``: what ``headmix train --distill-from`` runs, :class:`~headmix.distillation.loop.Distiller`: the
  parent's forward (no graph), the chunked KL and its gradient, the mixed loss;
* ``parent forward``: the parent's forward alone, under ``torch.no_grad`` (what distillation cannot avoid).

Memory: each of ``plain`` and ``distilled`` runs in a fresh process, which takes one step (the optimizer's state
created), then one more, measured: the process's peak resident memory (``VmHWM``, reset before the step with
``/proc/self/clear_refs``) above its resident memory after importing torch; on CUDA, ``max_memory_allocated``.
Time: the three interleaved in this process, median of ``--repeats`` after one warm-up. Targets (issue 60):
distilled peak <= 1.25x plain, distilled step <= 1.1 x (plain step + parent forward).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import torch
from torch import Tensor

from .timing import add_clock_arguments, check_positive, clock_setup, interleaved_timings

SIZES = ("vocab", "batch", "length", "d_model", "layers", "repeats")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256], help="vocabulary sizes, one table row each")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--length", type=int, default=512, help="tokens per sequence")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed steps of each (interleaved)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--temperature", type=float, default=2.0)
    add_clock_arguments(p)


def _model(vocab: int, d_model: int, layers: int, length: int, seed: int):
    from ..models import build_model, get_config

    config = get_config("llama3-tiny-gqa", task="lm", vocab_size=vocab).replace(
        d_model=d_model, decoder_layers=layers, max_positions=length + 2, dropout=0.0, pad_id=None)
    torch.manual_seed(seed)
    return build_model(config)


def _setup(vocab: int, batch: int, length: int, d_model: int, layers: int, device: str, temperature: float):
    """``{"plain": step, "distilled": step, "parent forward": call}`` on one batch."""
    from ..distillation.loop import Distiller

    student = _model(vocab, d_model, layers, length, 0).to(device).train()
    parent = _model(vocab, d_model, layers, length, 1)
    distiller = Distiller(parent, weight=0.5, temperature=temperature, input_names=("input_ids",), pad_id=None,
                          device=device, dtype=torch.float32)
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (batch, length + 1), generator=generator).to(device)
    inputs = {"input_ids": ids[:, :-1], "targets": ids[:, 1:]}
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-5)

    # as headmix.training.trainer's loop takes them: the model output held across the backward (its loss read after)
    def plain() -> Tensor:
        optimizer.zero_grad(set_to_none=True)
        out = student(**inputs)
        out.total_loss.backward()
        optimizer.step()
        return out.lm_loss.detach()

    def distilled() -> Tensor:
        optimizer.zero_grad(set_to_none=True)
        out = student(**inputs)
        loss, _ = distiller(out, inputs)
        loss.backward()
        optimizer.step()
        return out.lm_loss.detach()

    return {"plain": plain, "distilled": distilled, "parent forward": lambda: distiller.parent_logits(inputs)}


def _resident_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def measure_peak(mode: str, vocab: int, batch: int, length: int, d_model: int, layers: int, device: str,
                 temperature: float) -> dict[str, int]:
    """In this process: bytes at the peak of one ``mode`` step (the second: the optimizer's state exists), above
    the resident memory after importing torch (``whole``) and above what the process held just before the step
    (``step``); on CUDA, allocated bytes."""
    cuda = device.startswith("cuda")
    start = 0 if cuda else _resident_kib("VmRSS") * 1024
    step = _setup(vocab, batch, length, d_model, layers, device, temperature)[mode]
    step()
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return {"whole": peak, "step": peak - before}
    before = _resident_kib("VmRSS") * 1024
    with open("/proc/self/clear_refs", "w") as f:  # resets the high-water mark to the current resident size
        f.write("5")
    step()
    peak = _resident_kib("VmHWM") * 1024
    return {"whole": peak - start, "step": peak - before}


def _peak_in_a_new_process(mode: str, args: argparse.Namespace, vocab: int) -> dict[str, int]:
    code = ("import json, sys, torch; from headmix.bench.distill import measure_peak; "
            f"torch.set_num_threads({torch.get_num_threads()}); "
            f"print(json.dumps(measure_peak({mode!r}, {vocab}, {args.batch}, {args.length}, {args.d_model}, "
            f"{args.layers}, {args.device!r}, {args.temperature})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {mode} step at vocabulary {vocab} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    check_positive(args, *SIZES)
    clock, setting = clock_setup(args)
    print(f"# headmix bench distill: d_model {args.d_model}, {args.layers} layer(s), step on {args.batch} x "
          f"{args.length} tokens, temperature {args.temperature:g}, {args.device}; torch {torch.__version__}; "
          f"{setting}")
    print("| vocabulary | plain peak GB | distilled peak GB | peak ratio | step-only ratio | plain s | parent forward s "
          "| distilled s | distilled / (plain + parent forward) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for vocab in args.vocab:
        plain, distilled = (_peak_in_a_new_process(mode, args, vocab) for mode in ("plain", "distilled"))
        seconds = interleaved_timings(_setup(vocab, args.batch, args.length, args.d_model, args.layers, args.device,
                                             args.temperature),
                                      repeats=args.repeats, warmup=1, device=args.device, clock=clock)
        budget = seconds["plain"] + seconds["parent forward"]
        print(f"| {vocab} | {plain['whole'] / 1e9:.2f} | {distilled['whole'] / 1e9:.2f} | "
              f"{distilled['whole'] / plain['whole']:.2f} | {distilled['step'] / plain['step']:.2f} | "
              f"{seconds['plain']:.3f} | {seconds['parent forward']:.3f} | {seconds['distilled']:.3f} | "
              f"{seconds['distilled'] / budget:.2f} |", flush=True)
    return 0
