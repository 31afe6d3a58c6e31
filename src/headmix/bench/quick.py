"""The GPU check's whole-model tables: a Llama-style training step and greedy decoding for every attention kind.

    headmix bench quick models [--tiny] [--device cuda]   # training steps against the MHA model
    headmix bench quick decode [--tiny] [--device cuda]   # greedy decoding tokens/s, batch 1 and 8

(``python -m headmix.bench.quick models|decode`` takes the same options: the GPU check runs it so.)

The models are :func:`headmix.models.presets.llama_model` decoders (RMSNorm, SwiGLU, rotary, no biases) of
``--d-model`` (512) and ``--layers`` (4), vocabulary 8000, with each attention kind of
:data:`headmix.bench.kinds.KINDS` in every layer (MoSA's sparse heads solved for MHA's attention MACs at the
step's length). A training step is forward, loss (plus the router losses), backward and AdamW, eager, in bf16
autocast on CUDA (float32 on the CPU), on ``--batch`` x ``--len`` random tokens. Decoding is
:func:`headmix.models.generation.greedy_decode` with the growing cache, from a ``--prompt``-token prompt for
``--steps`` tokens, in bf16 on CUDA (MoSA with its causal threshold rule, calibrated on the prompt). Rows are printed one by one as they are measured, each against the MHA model
timed first in the same process (re-timed at the end: the drift line). Times on CUDA are CUDA-event medians
(``triton.testing.do_bench``), on the CPU medians of :func:`headmix.bench.timing.interleaved_timings`.
``--tiny`` runs the same code at d_model 64, 2 layers and a few tokens (the suite's check on the CPU).
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..models import build_model
from ..models.generation import calibrate_mosa, greedy_decode, mosa_layers
from ..models.presets import llama_model
from ..devices import pick_device
from .gpu_layers import _time_ms, drift_line
from .kinds import KINDS, describe, triton_usable, without_triton
from .models import lm_batch, lm_training_step
from .timing import check_positive, standalone_args

VOCAB = 8000


def model_config(kind, d_model: int, layers: int, seq: int):
    att = kind.config(d_model, seq)
    return att, llama_model(att, VOCAB, d_model=d_model, layers=layers, max_positions=max(seq, 16))


def _kinds(device: torch.device) -> list:
    return KINDS if triton_usable(device) else without_triton(KINDS)


def _emit_row(cells: list[str]) -> None:
    print("| " + " | ".join(cells) + " |", flush=True)


def model_steps(args, device: torch.device) -> list[dict]:
    """One training step per kind, each printed as measured; returns the rows."""
    print(f"## Llama-style training step (forward, loss, backward, AdamW), d_model {args.d_model}, {args.layers} "
          f"layers, batch {args.batch} x {args.len}, eager, {'bf16 autocast' if device.type == 'cuda' else 'float32'},"
          f" {device}", flush=True)
    print("\n| attention | shape | parameters | ms / step | x MHA | tokens/s | peak MiB |\n|---|---|---|---|---|---|---|",
          flush=True)
    rows, base, base_step = [], None, None
    for kind in _kinds(device):
        att, config = model_config(kind, args.d_model, args.layers, args.len)
        row = {"attention": kind.name, "shape": describe(att, args.d_model)}
        try:
            torch.manual_seed(0)
            model = build_model(config).to(device).train()
            data = lm_batch(config, args.batch, args.len, device, torch.Generator().manual_seed(0))
            step = lm_training_step(model, model, data, autocast=device.type == "cuda")
            step()
            row["parameters"] = sum(p.numel() for p in model.parameters())
            row["ms"] = _time_ms({"step": step}, device, args.repeats)["step"]
            if device.type == "cuda":
                from .attention import peak_memory

                row["peak_mib"] = peak_memory(step, device) / 2**20
            if base is None:
                base, base_step = row["ms"], step
            row["ratio"] = row["ms"] / base
            row["tokens_per_s"] = args.batch * args.len / row["ms"] * 1e3
            peak = f"{row['peak_mib']:.0f}" if "peak_mib" in row else ""
            _emit_row([kind.name, row["shape"], f"{row['parameters'] / 1e6:.2f}M", f"{row['ms']:.2f}",
                       f"{row['ratio']:.2f}", f"{row['tokens_per_s']:.0f}", peak])
        except Exception as err:  # noqa: BLE001 - the other kinds are still measured; the exit status says so
            row["failed"] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:100]}"
            _emit_row([kind.name, row["shape"], f"failed: {row['failed']}", "", "", "", ""])
        finally:
            model = step = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
    if base_step is not None:
        print("\n" + drift_line("MHA", base_step, base, device, args.repeats) + "\n", flush=True)
    return rows


def decode_rows(args, device: torch.device) -> list[dict]:
    """Greedy decoding tokens/s per kind and batch size, each printed as measured; returns the rows."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"## greedy decoding with the growing cache, d_model {args.d_model}, {args.layers} layers, prompt "
          f"{args.prompt}, {args.steps} new tokens, {str(dtype).replace('torch.', '')}, eager, {device}", flush=True)
    rows = []
    for batch in args.batches:
        print("\n| batch | attention | shape | tokens/s | x MHA |\n|---|---|---|---|---|", flush=True)
        base, base_run, base_ms = None, None, None
        for kind in _kinds(device):
            att, config = model_config(kind, args.d_model, args.layers, args.prompt + args.steps)
            row = {"batch": batch, "attention": kind.name, "shape": describe(att, args.d_model)}
            try:
                torch.manual_seed(0)
                model = build_model(config).to(device, dtype).eval()
                low = max(config.pad_id, config.bos_id, config.eos_id) + 1
                prompt = torch.randint(low, config.vocab_size, (batch, args.prompt),
                                       generator=torch.Generator().manual_seed(0)).to(device)
                if mosa_layers(model):  # greedy decoding runs MoSA under its causal threshold rule
                    calibrate_mosa(model, [prompt])
                generated = greedy_decode(model, prompt, args.steps).tokens.numel()

                def run(model=model, prompt=prompt) -> None:
                    greedy_decode(model, prompt, args.steps)

                ms = _time_ms({"decode": run}, device, args.repeats)["decode"]
                row["tokens_per_s"] = generated / ms * 1e3
                if base is None:
                    base, base_run, base_ms = row["tokens_per_s"], run, ms
                row["ratio"] = row["tokens_per_s"] / base
                _emit_row([str(batch), kind.name, row["shape"], f"{row['tokens_per_s']:.0f}", f"{row['ratio']:.2f}"])
            except Exception as err:  # noqa: BLE001 - the other kinds are still measured; the exit status says so
                row["failed"] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:100]}"
                _emit_row([str(batch), kind.name, row["shape"], f"failed: {row['failed']}", ""])
            finally:
                model = None
            rows.append(row)
        if base_run is not None:
            print("\n" + drift_line(f"MHA batch {batch}", base_run, base_ms, device, args.repeats) + "\n", flush=True)
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("table", choices=("models", "decode"))
    p.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="models: sequences per training step")
    p.add_argument("--len", type=int, default=1024, help="models: tokens per sequence")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="decode: batch sizes")
    p.add_argument("--prompt", type=int, default=128, help="decode: prompt tokens")
    p.add_argument("--steps", type=int, default=64, help="decode: new tokens")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="d_model 64, 2 layers, a few tokens (the plumbing, on CPU)")


def check_args(args: argparse.Namespace) -> None:
    """``--tiny`` applied, the sizes and the device checked (``ValueError`` naming the option)."""
    if args.tiny:
        args.d_model, args.layers, args.batch, args.len, args.batches = 64, 2, 1, 16, [1, 2]
        args.prompt, args.steps, args.repeats = 4, 3, 1
    check_positive(args, "d_model", "layers", "batch", "len", "prompt", "steps", "repeats", "batches")
    pick_device(args.device)


def parse_args(argv=None) -> argparse.Namespace:
    return standalone_args(__doc__.split("\n\n")[0], add_arguments, check_args, argv)


def main(argv=None) -> int:
    """``python -m headmix.bench.quick models|decode [options]``: ``headmix bench quick`` (a bad option exits 2)."""
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> int:
    check_args(args)
    device = pick_device(args.device)
    if device.type == "cuda":
        print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    rows = model_steps(args, device) if args.table == "models" else decode_rows(args, device)
    failed = sorted({r["attention"] for r in rows if "failed" in r})
    if failed:
        print(f"error: failed rows: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
