"""Equal time from side-by-side timing: each row's training-step time against the baseline's, measured in one
process, interleaved, so that a machine whose load changes slows both alike.

**How a row is timed** (:func:`measure_row`, once per row, stored in ``OUT/timing/ROW.json``). The baseline's
model and the row's are built side by side on the study's device, with its precision (bf16 autocast) and
compile setting, each with its own AdamW; both train on the *same* batches of the study's shared train split.
After ``warmup`` steps of each (compilation and allocator warm-up), ``rounds`` rounds follow; in each round
both models take ``steps`` steps, one after the other, the order alternating from round to round (baseline
first in even rounds, the row first in odd ones), and the round's ratio is the row's time over the baseline's
(:func:`interleaved_ratios`). The ratio reported is the median of the rounds' ratios, with the distribution-free
order-statistic interval of the median (:func:`median_interval`: at least 95% coverage, no assumption on the
shape of the noise). A slow-down of the machine that lasts longer than a round changes both models' times in
that round alike and leaves its ratio alone; a burst inside one round moves that round only, and the median
ignores a few such rounds. A row that distils from a continuation study's parent (``RowSpec.distill``) is timed
with the parent's forward pass in each of its steps (a frozen model of the baseline's shape: the parent's cost),
as its runs train.

**How equal time is read** (:func:`equal_time_steps`). A row whose step takes ``ratio`` times the baseline's
reaches, in the time the baseline needs for ``s`` steps, step ``s / ratio``. The study trains every run for
the same steps ``S``, so the two are compared at the time the *faster* of them needs for its ``S`` steps, read
within both runs, never beyond one (no extrapolation): a slower row (``ratio > 1``) is read at step
``S / ratio`` of its validation curve against the baseline at ``S``; a faster row (``ratio < 1``) at its own
``S`` against the baseline at step ``S * ratio``. Steps between validations are interpolated linearly.
"""

from __future__ import annotations

import json
import math
import platform
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from ..storage.files import atomic_write
from .stats import interpolate

#: The timing phase's defaults (a spec may change them: ``timing_rounds``, ``timing_steps``, ``timing_warmup``).
#: 10 rounds give the median an order-statistic interval of 97.9% coverage from the 2nd to the 9th smallest
#: ratio; 3 steps per model per round make a round long enough that one slow step moves its ratio by a third,
#: not fully; 5 warm-up steps cover allocation and the first (compiling) steps. In all, 35 steps of each model.
ROUNDS, STEPS_PER_ROUND, WARMUP_STEPS = 10, 3, 5
TIMING_DIR = "timing"


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("values must not be empty")
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float | None, float | None]:
    """The order-statistic interval of the median: ``[x_(j), x_(n+1-j)]`` (sorted values, 1-based) with the
    largest ``j`` whose coverage ``1 - 2 P(Binomial(n, 1/2) < j)`` is at least ``confidence``; ``(None, None)``
    for too few values (fewer than 6 for 95%)."""
    n = len(values)
    v = sorted(values)

    def coverage(j: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2 ** n

    best = None
    for j in range(1, n // 2 + 1):
        if coverage(j) < confidence:
            break
        best = j
    if best is None:
        return None, None
    return v[best - 1], v[n - best]


def interleaved_ratios(step_baseline: Callable[[], None], step_row: Callable[[], None], *, rounds: int,
                       steps: int, warmup: int, clock: Callable[[], float] = time.perf_counter,
                       sync: Callable[[], None] = lambda: None) -> list[dict[str, float]]:
    """Time two training steps side by side: ``warmup`` steps of each (not timed), then ``rounds`` rounds of
    ``steps`` steps of each, the order alternating by round. Each round gives ``{"baseline": s, "row": s,
    "ratio": row / baseline}`` (seconds of its ``steps`` steps). ``sync`` waits for the device (CUDA runs
    asynchronously); ``clock`` is the time source (tests pass a simulated one)."""
    for name, value in (("rounds", rounds), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative integer, got {warmup!r}")
    for _ in range(warmup):
        step_baseline()
        step_row()
    sync()

    def timed(step: Callable[[], None]) -> float:
        start = clock()
        for _ in range(steps):
            step()
        sync()
        return clock() - start

    result = []
    for r in range(rounds):
        if r % 2 == 0:
            base = timed(step_baseline)
            row = timed(step_row)
        else:
            row = timed(step_row)
            base = timed(step_baseline)
        result.append({"baseline": base, "row": row, "ratio": row / base})
    return result


def summarize_rounds(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """The median ratio with its interval, and each model's median step time (seconds per round / steps is
    left to the caller)."""
    ratios = [r["ratio"] for r in rounds]
    low, high = median_interval(ratios)
    return {"ratio": median(ratios), "low": low, "high": high, "rounds": rounds,
            "baseline_round_seconds": median([r["baseline"] for r in rounds]),
            "row_round_seconds": median([r["row"] for r in rounds])}


def timing_path(out: Path, row_slug: str) -> Path:
    return Path(out) / TIMING_DIR / f"{row_slug}.json"


def read_timing(out: Path, row_slug: str) -> dict[str, Any] | None:
    """A row's timing record (JSON), or ``None`` when the row has not been timed (or the file is unreadable:
    it is then measured again)."""
    path = timing_path(out, row_slug)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("ratio"), (int, float)) else None


def software_record() -> dict[str, str]:
    import torch

    from .. import __version__
    from ..provenance import source_commit

    return {"headmix": __version__, "commit": source_commit(), "torch": torch.__version__,
            "python": platform.python_version()}


def measure_row(spec, out: Path, baseline_config: Path, row_config: Path, row_name: str, *,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Time ``row_config``'s training step against ``baseline_config``'s (both model config files of the study
    ``out``) as the module docstring says, on the study's shared train split, device, precision and compile
    setting; returns the record :func:`write_timing` stores, with the machine's 1-minute load average before and
    after (``load_average``) and whether the process kept freed memory (``freed_memory``: ``"kept"`` by
    :func:`headmix.keep_freed_memory`, as ``headmix study`` does, or ``"returned"``). The study's runner times
    holding its machine lock alone (:func:`headmix.study.runner.machine_turn`) and adds ``study_workers_excluded``;
    records written before it lack the field, and the report says their conditions were not recorded."""
    import torch

    from ..data import Tokenizer
    from ..models import build_model
    from ..training import TrainConfig
    from ..devices import pick_device
    from ..training.sequence_start import run_sequence_start
    from ..process import freed_memory_kept
    from ..provenance import load_average, machine_record
    from ..training.setup import (autocast_for, cached_dataset, compile_model, forever, model_config,
                                  optimizer_and_schedule, read_pack)
    from .spec import data_options

    load_before = load_average()
    shared = Path(out) / "shared"
    cfg = TrainConfig(task=spec.task, preset=str(baseline_config), out=str(shared), seed=spec.split_seed,
                      split_seed=spec.split_seed, max_steps=spec.max_steps, progress=False,
                      **data_options(spec, out), **spec.training)
    task = cfg.task_spec
    device = pick_device(cfg.device)
    if cfg.pack is not None:  # the pack's train stream and tokenizer
        streams, tok = read_pack(cfg)
        dataset = cached_dataset(cfg, "train", streams["train"], tok, None)
    else:
        tok = Tokenizer.load(shared / "tokenizer")
        items = task.read_items(task.split_path(shared / "data", "train"))
        dataset = cached_dataset(cfg, "train", items, tok, shared / "tokenizer" / "tokenizer.json",
                                 run_sequence_start(cfg))
    batches = forever(task.loader(dataset, tok, max_tokens=cfg.max_tokens, train=True, seed=spec.split_seed))
    autocast = autocast_for(cfg, device)

    def build(config_file: Path):
        return build_model(model_config(TrainConfig(**{**cfg.to_dict(), "preset": str(config_file)}), tok)).to(device)

    def trainer(config_file: Path, distill: dict[str, Any] | None = None) -> Callable[[Any], None]:
        torch.manual_seed(spec.split_seed)
        model = build(config_file)
        model.train()
        forward = compile_model(model) if cfg.compile else model
        optimizer, schedule = optimizer_and_schedule(cfg, model.parameters())
        distiller = None
        if distill is not None:  # the parent's forward is part of a distilled step: the baseline's shape, frozen
            from ..distillation import DEFAULT_TEMPERATURE, DEFAULT_WEIGHT, Distiller

            distiller = Distiller(build(baseline_config), weight=distill.get("weight", DEFAULT_WEIGHT),
                                  temperature=distill.get("temperature", DEFAULT_TEMPERATURE),
                                  input_names=task.input_names, pad_id=model.config.pad_id, device=device,
                                  dtype=next(model.parameters()).dtype, autocast=autocast)

        def step(micro_batches: list) -> None:
            """The trainer's step: forward, backward, the gradient norm (clipped when ``clip_norm`` > 0), the
            loss and norm read on the host (the trainer's finiteness check), the optimizer and schedule."""
            optimizer.zero_grad(set_to_none=True)
            loss = torch.zeros((), device=device)
            for batch in micro_batches:
                inputs = task.model_inputs(batch, device)
                with autocast():
                    output = forward(**inputs)
                total = output.total_loss if distiller is None else distiller(output, inputs)[0]
                (total / len(micro_batches)).backward()
                loss += output.lm_loss.detach()
            norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                                  cfg.clip_norm if cfg.clip_norm > 0 else float("inf"))
            if not (math.isfinite(float(loss)) and bool(torch.isfinite(norm))):
                raise ValueError(f"timing {row_name!r}: a non-finite loss or gradient norm; the study's training "
                                 f"options do not train this model")
            optimizer.step()
            schedule.step()

        return step

    distill = next((r.distill for r in spec.rows if r.name == row_name), None)
    step_base, step_row = trainer(baseline_config), trainer(row_config, distill)
    # the same batches for both: each model's k-th step takes the k-th batch group
    queue: dict[str, list] = {"baseline": [], "row": []}

    def batch_for(which: str) -> list:
        if not queue[which]:
            group = [next(batches) for _ in range(cfg.grad_accum)]
            queue["baseline"].append(group)
            queue["row"].append(group)
        return queue[which].pop(0)

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rounds = interleaved_ratios(lambda: step_base(batch_for("baseline")), lambda: step_row(batch_for("row")),
                                rounds=spec.timing_rounds, steps=spec.timing_steps, warmup=spec.timing_warmup,
                                clock=clock, sync=sync)
    return {"row": row_name, **summarize_rounds(rounds), "steps_per_round": spec.timing_steps,
            "warmup_steps": spec.timing_warmup, "batch_tokens": cfg.max_tokens, "grad_accum": cfg.grad_accum,
            "device": str(device), "bf16": cfg.bf16, "compile": cfg.compile, "machine": machine_record(device),
            "software": software_record(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average": [load_before, load_average()],
            "freed_memory": "kept" if freed_memory_kept() else "returned",
            **({"distill": {**distill, "parent_forward": "timed: the baseline's model, frozen, in each of the row's "
                                                         "steps"}} if distill is not None else {}),
            "method": f"interleaved in one process: {spec.timing_warmup} warm-up steps of each model, then "
                      f"{spec.timing_rounds} rounds of {spec.timing_steps} steps of each on the same batches, the "
                      f"order alternating by round; median of the rounds' ratios, order-statistic interval"}


def write_timing(out: Path, row_slug: str, record: dict[str, Any]) -> Path:
    path = timing_path(out, row_slug)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(record, indent=2) + "\n")
    return path


def read_at(curve: dict[int, float], step: float) -> float | None:
    """The validation NLL at ``step`` on a run's curve (periodic validations), interpolated linearly;
    ``None`` outside the validated steps (never extrapolated)."""
    steps = sorted(curve)
    return interpolate(steps, [curve[s] for s in steps], step)


def equal_time_steps(ratio: float, baseline_steps: int) -> tuple[float, float]:
    """``(row step, baseline step)`` at which a row whose training step takes ``ratio`` times the baseline's is
    compared with it at equal time, both runs having trained ``baseline_steps`` steps: the time the faster of
    the two needs for its steps, read within both runs (see the module docstring)."""
    if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 0):
        raise ValueError(f"ratio must be a positive number, got {ratio!r}")
    if ratio >= 1:
        return baseline_steps / ratio, float(baseline_steps)
    return float(baseline_steps), baseline_steps * ratio
