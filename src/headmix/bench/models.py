"""``headmix bench models``: whole-model training steps, MoA against the MHA model of (nearly) equal MACs.

For each size (``tiny``, ``mini``, ``small``: the CPU presets of :mod:`headmix.models.presets`) it builds
the ``{size}-mha`` and ``{size}-moa`` translation models (``demo``: ``headmix demo``'s pair, ``mini-mha``
against MoA 4K16E48D at equal attention MACs, see :func:`headmix.training.demo.demo_models`) and times,
in one process and interleaved (every repeat runs each model's step once, in turn; the median over
repeats is reported), one training step as the trainer does it: forward with the label-smoothed loss
plus the router losses, backward, gradient clipping and an AdamW step. The batch is synthetic:
``--batch`` sentence pairs of random lengths up to ``--src-len`` / ``--tgt-len`` tokens, padded, so the
padding masks are exercised as in real batches (the demo's batches hold about 2000 target tokens).

Printed per model: ms per step, the ratio to the size's MHA model measured in the same run, the ratio of
the analytic forward MACs (``headmix macs``) at the batch's mean lengths, and target tokens per second.
``--impls`` adds MoA rows with a forced ``expert_impl`` (e.g. ``dense sorted``) beside ``auto``.

``--presets llama-mini-mha llama-mini-moa ...`` times instead whole Llama-style (causal LM) training steps
(forward, loss, backward, AdamW) of those presets on ``--device`` (bf16 autocast on CUDA), eager and, with
``--compile``, ``torch.compile``d (``--compile-mode``, e.g. ``reduce-overhead`` for CUDA graphs): ms per
step, the ratio to the first preset (the MHA baseline) in the same mode, compiled over eager, and the
compile time (the first compiled call, which traces and compiles). For issue 20's H100 table:
``headmix bench models --presets llama-mini-mha llama-mini-moa llama-mini-moh llama-mini-switchhead
--device cuda --compile --lm-batch 8 --lm-len 1024``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from ..models import analytic_macs, build_model, get_config
from ..models.config import ModelConfig
from ..devices import pick_device
from .attention import format_rows
from .timing import add_clock_arguments, check_positive, clock_setup, interleaved_timings, sync

SIZES = ("tiny", "mini", "small", "demo")


def with_expert_impl(config: ModelConfig, impl: str) -> ModelConfig:
    """``config`` with every MoA attention layer on ``expert_impl=impl``."""
    changes = {}
    for role in config.attention_roles():
        att = getattr(config, role)
        if att is not None and att.kind == "moa":
            changes[role] = dataclasses.replace(att, expert_impl=impl)
    return config.replace(**changes)


def model_pair(size: str) -> tuple[str, ModelConfig, str, ModelConfig]:
    """``(mha name, mha config, moa name, moa config)`` of one size (translation)."""
    if size == "demo":
        from ..training.demo import demo_models, describe_attention

        models = demo_models()
        return (f"demo mini-mha ({describe_attention(models['mha'])})", models["mha"],
                f"demo {describe_attention(models['moa'])}", models["moa"])
    return (f"{size}-mha", get_config(f"{size}-mha", task="translation"),
            f"{size}-moa", get_config(f"{size}-moa", task="translation"))


def synthetic_batch(config: ModelConfig, batch: int, src_len: int, tgt_len: int,
                    generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random translation batch: lengths uniform in ``[len/2, len]``, padded with ``pad_id``."""
    def ids(length: int) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = torch.randint(max(1, length // 2), length + 1, (batch,), generator=generator)
        low = max(config.pad_id, config.bos_id, config.eos_id) + 1
        tokens = torch.randint(low, config.vocab_size, (batch, length + 1), generator=generator)
        pad = torch.arange(length + 1)[None, :] >= lengths[:, None]
        return tokens.masked_fill(pad, config.pad_id), lengths

    src, src_lengths = ids(src_len)
    tgt, tgt_lengths = ids(tgt_len)
    return {"src": src[:, :-1], "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:],
            "mean_src": float(src_lengths.float().mean()), "mean_tgt": float(tgt_lengths.float().mean())}


def make_step(model: torch.nn.Module, batch: dict, lr: float = 1e-4, clip_norm: float = 1.0):
    """One training step as :func:`headmix.training.trainer.train` runs it (AdamW, clipping)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        out = model(batch["src"], batch["tgt_in"], batch["tgt_out"])
        out.total_loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        optimizer.step()

    return step


def bench_models(sizes: list[str], *, batch: int, src_len: int, tgt_len: int, impls: list[str], repeats: int,
                 warmup: int, seed: int = 0, clock=time.perf_counter) -> list[dict]:
    rows = []
    for size in sizes:
        base, base_cfg, moa, moa_cfg = model_pair(size)
        variants = {base: base_cfg}
        for impl in ["auto", *[i for i in impls if i != "auto"]]:
            variants[moa + ("" if impl == "auto" else f" ({impl})")] = with_expert_impl(moa_cfg, impl)
        data = synthetic_batch(base_cfg, batch, src_len, tgt_len, torch.Generator().manual_seed(seed))
        steps, macs = {}, {}
        for name, cfg in variants.items():
            torch.manual_seed(seed)
            model = build_model(cfg).train()
            steps[name] = make_step(model, data)
            macs[name] = analytic_macs(cfg, round(data["mean_src"]), round(data["mean_tgt"]), batch).total
        times = interleaved_timings(steps, repeats, warmup, "cpu", clock=clock)
        for name in variants:
            rows.append({"size": size, "model": name, "ms": 1e3 * times[name], "ratio": times[name] / times[base],
                         "macs_ratio": macs[name] / macs[base],
                         "tokens_per_s": data["mean_tgt"] * batch / times[name]})
    return rows


def lm_batch(config: ModelConfig, batch: int, length: int, device: torch.device,
             generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random causal-LM block ``(input_ids, targets)`` of ``batch x length`` tokens (no padding; ``targets``
    aligned with the logits: the model's ``targets=``)."""
    low = max(config.pad_id, config.bos_id, config.eos_id) + 1
    ids = torch.randint(low, config.vocab_size, (batch, length + 1), generator=generator).to(device)
    return ids[:, :-1], ids[:, 1:]


def lm_training_step(model: torch.nn.Module, forward, batch: tuple[torch.Tensor, torch.Tensor], autocast: bool):
    """One training step of a causal LM (``forward`` is the model or its compiled form; AdamW on ``model``)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    device_type = batch[0].device.type

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            out = forward(batch[0], targets=batch[1])
        out.total_loss.backward()
        optimizer.step()

    return step


def bench_lm_steps(presets: list[str], *, batch: int, length: int, device: torch.device, compile: bool,
                   compile_mode: str | None = None, compile_backend: str = "inductor", repeats: int, warmup: int,
                   seed: int = 0, clock=time.perf_counter) -> list[dict]:
    """Whole-model training steps of the causal-LM ``presets`` (the first is the baseline), eager and, with
    ``compile``, compiled; all timed interleaved in one run. Rows: ``model``, ``mode`` (eager/compiled),
    ``ms``, ``ratio`` (to the baseline in the same mode), ``compiled_over_eager``, ``compile_s``."""
    autocast = device.type == "cuda"
    data = None
    steps, compile_seconds = {}, {}
    for preset in presets:
        config = get_config(preset, task="lm")
        if data is None:
            data = lm_batch(config, batch, length, device, torch.Generator().manual_seed(seed))
        for mode in ("eager", "compiled") if compile else ("eager",):
            torch.manual_seed(seed)
            model = build_model(config).to(device).train()
            forward = model
            if mode == "compiled":
                forward = torch.compile(model, mode=compile_mode, backend=compile_backend, fullgraph=True)
            step = lm_training_step(model, forward, data, autocast)
            if mode == "compiled":  # the first call traces and compiles: its time is the compile time
                t0 = clock()
                step()
                sync(device)
                compile_seconds[(preset, mode)] = clock() - t0
            steps[(preset, mode)] = step
    times = interleaved_timings({f"{p} {m}": s for (p, m), s in steps.items()}, repeats, warmup, device, clock=clock)
    rows = []
    for (preset, mode) in steps:
        t = times[f"{preset} {mode}"]
        rows.append({"model": preset, "mode": mode, "ms": 1e3 * t, "ratio": t / times[f"{presets[0]} {mode}"],
                     "compiled_over_eager": t / times[f"{preset} eager"],
                     "compile_s": compile_seconds.get((preset, mode), float("nan")),
                     "tokens_per_s": batch * length / t})
    return rows


LM_COLUMNS = [("model", "model", "{}"), ("mode", "mode", "{}"), ("ms", "ms / step", "{:.2f}"),
              ("ratio", "time / first", "{:.2f}"), ("compiled_over_eager", "time / eager", "{:.2f}"),
              ("compile_s", "compile s", "{:.1f}"), ("tokens_per_s", "tokens/s", "{:.0f}")]

MODEL_COLUMNS = [("model", "model", "{}"), ("ms", "ms / step", "{:.1f}"), ("ratio", "time / MHA", "{:.2f}"),
                 ("macs_ratio", "MACs / MHA", "{:.2f}"), ("tokens_per_s", "target tokens/s", "{:.0f}")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES))
    p.add_argument("--batch", type=int, default=96, help="sentence pairs per batch")
    p.add_argument("--src-len", type=int, default=28, help="longest source sentence (tokens)")
    p.add_argument("--tgt-len", type=int, default=28, help="longest target sentence (tokens)")
    p.add_argument("--impls", nargs="*", default=[], help="extra MoA rows with this expert_impl (dense, sorted, ...)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--presets", nargs="+", default=None, metavar="PRESET",
                   help="causal-LM presets to time instead (the first is the baseline), e.g. llama-mini-mha llama-mini-moa")
    p.add_argument("--device", default="cpu", help="with --presets: cpu, cuda, cuda:N or auto")
    p.add_argument("--compile", action="store_true", help="with --presets: also time torch.compile'd steps")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode (e.g. reduce-overhead: CUDA graphs)")
    p.add_argument("--lm-batch", type=int, default=8, help="with --presets: sequences per batch")
    p.add_argument("--lm-len", type=int, default=256, help="with --presets: tokens per sequence")
    add_clock_arguments(p)


def run_lm(args: argparse.Namespace) -> int:
    device = pick_device(args.device)
    check_positive(args, "lm_batch", "lm_len", "repeats")
    clock, setup = clock_setup(args)
    print(f"# headmix bench models --presets: {device}, {'bf16 autocast' if device.type == 'cuda' else 'float32'}, "
          f"torch {torch.__version__}, {setup}; causal-LM training steps (forward, loss, backward, AdamW), batch "
          f"{args.lm_batch} x {args.lm_len}; median of {args.repeats} interleaved runs")
    rows = bench_lm_steps(args.presets, batch=args.lm_batch, length=args.lm_len, device=device, compile=args.compile,
                          compile_mode=args.compile_mode, repeats=args.repeats, warmup=args.warmup, clock=clock)
    print(format_rows(rows, LM_COLUMNS))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.presets:
        return run_lm(args)
    check_positive(args, "batch", "src_len", "tgt_len", "repeats")
    clock, setup = clock_setup(args)
    print(f"# headmix bench models: cpu, float32, torch {torch.__version__}, {setup}; translation training steps "
          f"(forward, backward, clip, AdamW), batch {args.batch} pairs of up to {args.src_len} / {args.tgt_len} "
          f"tokens; median of {args.repeats} interleaved runs")
    rows = bench_models(args.sizes, batch=args.batch, src_len=args.src_len, tgt_len=args.tgt_len, impls=args.impls,
                        repeats=args.repeats, warmup=args.warmup, clock=clock)
    print(format_rows(rows, MODEL_COLUMNS))
    return 0

