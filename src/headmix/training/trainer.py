"""The training loop for translation, masked LM and causal LM, on one process or under ``torchrun``.

``train(cfg)`` reads top to bottom: set up (task, run folder, data, model, optimizer, schedule, resume),
then for each step: batch, forward, backward, clip, step, log, evaluate, save; then finish (average the
last checkpoints, save the final model, write the summary). What a task does lives in
:mod:`headmix.tasks`, what a run folder holds in :mod:`headmix.runs`, the set-up pieces in
:mod:`headmix.training.setup`. Running the same command again on the same folder resumes from the newest
intact checkpoint, bit for bit.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from typing import Any, Callable

import torch

from ..evaluation import validation_loss
from ..models import build_model, calibrate_mosa, count_parameters
from ..models.generation import mosa_layers
from ..runs import Run, average_checkpoints, rng_state, set_rng_state
from ..runs.checkpoints import averaging_window_start, checkpoint_step
from .calibrate import calibration_batches
from ..devices import pick_device
from .config import IDENTITY, TrainConfig
from .distributed import Parallel, init_distributed
from .metrics import MetricsLog, TrainingWindow
from ..provenance import machine_record
from .progress import Progress
from .sequence_start import STORED_KEY as SEQUENCE_START_KEY, run_sequence_start
from .setup import (autocast_for, cached_dataset, compile_model, compiled_graphs, forever, initial_model,
                    optimizer_and_schedule, prepare_data, removed_if_unstarted)


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss, for example); the last good checkpoint is kept."""


def train(cfg: TrainConfig, *, stop: Callable[[], str | None] | None = None) -> dict[str, Any]:
    """Train (or resume) the run ``cfg.out``; returns the summary written to ``summary.json``.

    ``stop`` is polled between steps: when it returns a reason (``"signal 15"``), a checkpoint is written
    (one that never joins the final average) and ``train`` returns ``{"stopped_by": reason, "steps": ...}``
    without finishing the run; the same call later resumes it."""
    # ------------------------------------------------------------------------------------------ set up
    cfg.validate()
    task = cfg.task_spec
    device = pick_device(cfg.device)
    d = init_distributed(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)

    def log(msg: str) -> None:
        if d.main:
            print(f"[headmix] {msg}", file=sys.stderr, flush=True)

    stored, identity, parent = cfg.to_dict(), IDENTITY, None
    sequence_start = run_sequence_start(cfg)  # how each document starts: kept for good once the run trains
    if sequence_start is not None:
        stored[SEQUENCE_START_KEY] = sequence_start
    if cfg.distill_from is not None:  # the parent's weights, identified and loaded before the folder is touched
        from ..distillation.parent import check_recorded_parent, load_parent, shared_parent_identity

        stored["distill_parent"] = shared_parent_identity(cfg.distill_from)  # hashed by rank 0 alone
        identity = (*IDENTITY, "distill_parent")
        if d.main:
            check_recorded_parent(cfg.out, stored["distill_parent"])
        # once per process, on its device, in the dtype build_model gives the student
        parent = load_parent(cfg.distill_from, device, torch.get_default_dtype())

    with contextlib.ExitStack() as cleanup:
        started = cleanup.enter_context(removed_if_unstarted(cfg.out, d.main))  # a failed start leaves no folder
        # Rank 0 owns the folder (its lock, the stored config, every write); the other ranks read it.
        run = cleanup.enter_context(Run.create_or_resume(cfg.out, stored, identity=identity,
                                                         restart_untrained=True)) if d.main else Run(cfg.out)
        warning = cfg.schedule_warning()
        if warning:
            log(f"warning: {warning}")
        torch.manual_seed(cfg.seed)
        if d.main:
            prepare_data(cfg, run, log)
        d.barrier()
        parts, tok = prepare_data(cfg, run, log)  # every rank reads the stored splits and tokenizer

        tok_file = run.tokenizer_dir / "tokenizer.json"
        train_dataset = cached_dataset(cfg, "train", parts["train"], tok, tok_file, sequence_start)
        mcfg, initial_weights, init_record = initial_model(
            cfg, tok, log, lambda count: calibration_batches(task, train_dataset, tok, max_tokens=cfg.max_tokens,
                                                             seed=cfg.seed, device="cpu", limit=count))
        if sequence_start is not None:
            mcfg = mcfg.replace(sequence_start=sequence_start)
        torch.manual_seed(cfg.seed)
        model = build_model(mcfg)
        if initial_weights is not None:
            model.load_state_dict(initial_weights)
        model = model.to(device)
        params = count_parameters(model)
        train_loader = task.loader(train_dataset, tok,
                                   max_tokens=cfg.max_tokens, train=True, seed=cfg.seed, rank=d.rank,
                                   world_size=d.world_size)
        valid_loader = task.loader(cached_dataset(cfg, "valid", parts["valid"], tok, tok_file, sequence_start), tok,
                                   max_tokens=cfg.max_tokens, train=False, seed=cfg.seed)
        sampler = train_loader.batch_sampler

        # Resume: the weights go in before wrapping, the optimizer state after (FSDP needs its params).
        step, tokens_seen, seconds_before = 0, 0, 0.0
        resumed = run.latest_intact_checkpoint(model)
        if resumed is not None:
            path, state, info = resumed
            step, tokens_seen, seconds_before = info["step"], info["tokens"], info.get("train_seconds", 0.0)
        par = Parallel(model, cfg.distributed if d.world_size > 1 else "none", device,
                       make_plain=lambda: build_model(mcfg))
        model = par.module
        # The training forward runs the compiled module (parameters shared); validation runs the eager one.
        forward = compile_model(model) if cfg.compile else model
        optimizer, schedule = optimizer_and_schedule(cfg, model.parameters())
        if resumed is not None:
            par.load_optimizer_state(optimizer, state["optimizer"])
            schedule.load_state_dict(state["schedule"])
            sampler.load_state_dict(state["sampler"])
            set_rng_state(state["rng"])
            log(f"resuming from {path} (step {step})")
        if d.main:
            run.truncate_metrics(step)  # records of steps after the checkpoint are replayed
        autocast = autocast_for(cfg, device)
        distiller = None
        if parent is not None:  # frozen, unwrapped, on the student's device and dtype, under its autocast
            from ..distillation.loop import Distiller
            from .distributed import shard_by_layer

            if parent.config.vocab_size != mcfg.vocab_size:
                raise ValueError(f"distill_from {cfg.distill_from}: its model has {parent.config.vocab_size} logits "
                                 f"per position, the run's {mcfg.vocab_size}: distillation needs the same vocabulary")
            distiller = Distiller(parent, weight=cfg.resolved_distill_weight,
                                  temperature=cfg.resolved_distill_temperature, input_names=task.input_names,
                                  pad_id=mcfg.pad_id, device=device, dtype=next(model.parameters()).dtype, autocast=autocast,
                                  shard=shard_by_layer if par.kind == "fsdp" else None)
            log(f"distilling from {cfg.distill_from} (weight {distiller.weight:g}, temperature "
                f"{distiller.temperature:g})")
        metrics = MetricsLog(run.path, enabled=d.main)
        cleanup.callback(metrics.close)
        log(f"model {cfg.preset or cfg.init_from} ({params / 1e6:.2f}M parameters) on {device}, world size "
            f"{d.world_size}")

        t_start = time.time()

        def seconds() -> float:
            return seconds_before + time.time() - t_start

        def save(reason: str) -> None:
            state = {"optimizer": par.optimizer_state(optimizer), "schedule": schedule.state_dict(),
                     "sampler": sampler.state_dict(), "rng": rng_state()}
            full = par.full_model()  # a collective call under FSDP
            if d.main:
                run.save_checkpoint(step, full, state, {"tokens": tokens_seen, "train_seconds": seconds()},
                                    reason=reason, keep=max(cfg.keep_checkpoints, cfg.average_last))

        if init_record and resumed is None:
            # the model as converted from init_from, before any step: what the conversion cost, beside the curve
            valid = validation_loss(model, valid_loader, task, device, autocast)
            metrics.write({"split": "valid", "step": 0, **_numbers(valid), "time": 0.0})

        # ----------------------------------------------------------------------------------- the loop
        started()
        model.train()
        batches = forever(train_loader)
        window = TrainingWindow()
        stopped_by = "max_steps"
        progress = _progress(cfg, d.main, step)
        compile_seconds, compile_steps = 0.0, 0
        while step < cfg.max_steps:
            reason = stop() if stop is not None else None
            if reason is None and cfg.max_time is not None and seconds() >= cfg.max_time:
                reason = "max_time"
            if reason is not None:
                stopped_by = reason
                break
            # batch, forward, backward (gradients synchronised across ranks on the last micro-batch only)
            step_start, graphs_before = time.time(), (compiled_graphs() if cfg.compile else 0)
            optimizer.zero_grad(set_to_none=True)
            step_loss, step_tokens = torch.zeros((), device=device), 0
            for micro in range(cfg.grad_accum):
                batch = next(batches)
                last = micro == cfg.grad_accum - 1 or d.world_size == 1
                with contextlib.nullcontext() if last else par.no_sync():
                    inputs = task.model_inputs(batch, device)
                    with autocast():
                        out = forward(**inputs)
                    total, kl = (out.total_loss, None) if distiller is None else distiller(out, inputs)
                    (total / cfg.grad_accum).backward()
                step_loss += out.lm_loss.detach()
                step_tokens += int(out.num_tokens)
                window.add_batch(out, cfg.grad_accum, kl)
            # clip, step
            grad_norm = par.clip_grad_norm(cfg.clip_norm)
            loss = float(step_loss) / cfg.grad_accum
            if not math.isfinite(loss) or not torch.isfinite(grad_norm):
                kept = run.checkpoints()[-1] if run.checkpoints() else "none"
                raise TrainingError(f"non-finite loss ({loss}) or gradient norm ({float(grad_norm)}) at step "
                                    f"{step + 1}; stopped without saving. Last good checkpoint: {kept}")
            optimizer.step()
            schedule.step()
            step += 1
            tokens_seen += step_tokens
            compiling = cfg.compile and compiled_graphs() > graphs_before  # this step (re)compiled the model
            window.add_step(loss, step_tokens, timed=not compiling)
            if compiling:  # its time is the compile time, left out of tokens/s
                seconds_compiling = time.time() - step_start
                window.exclude_time(seconds_compiling)
                compile_seconds += seconds_compiling
                compile_steps += 1
                metrics.write({"split": "compile", "step": step, "compile_seconds": seconds_compiling,
                               "graphs": compiled_graphs()})
            if progress is not None:
                progress.update(step, loss, step_tokens * d.world_size)
            # log, evaluate, save
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                metrics.write({"split": "train", "step": step, **window.record(d.world_size),
                               "lr": schedule.get_last_lr()[0], "grad_norm": float(grad_norm),
                               "tokens": tokens_seen * d.world_size, "time": seconds()})
                window = TrainingWindow()
            if step % cfg.eval_every == 0:
                reached = seconds()  # the training time of the model validated (the validation not included)
                valid = validation_loss(model, valid_loader, task, device, autocast)
                metrics.write({"split": "valid", "step": step, **_numbers(valid), "time": reached})
            if step % cfg.save_every == 0:
                save("periodic")
        if progress is not None:
            progress.close()

        # ------------------------------------------------------------------------------------- finish
        if stopped_by not in ("max_steps", "max_time"):  # asked to stop: keep the state, finish later
            save(stopped_by)
            log(f"stopped ({stopped_by}) at step {step}; run the same command to resume")
            return {"stopped_by": stopped_by, "steps": step}
        save("final")
        train_seconds = seconds()
        d.barrier()
        final = par.full_model()
        summary: dict[str, Any] = {}
        if d.main:
            window_start = averaging_window_start(step, cfg.average_window)
            averaged = run.checkpoints_to_average(cfg.average_last, from_step=window_start)
            valid, final_weights = choose_final_weights(
                final, averaged, lambda: validation_loss(final, valid_loader, task, device, autocast))
            final_weights["window_from_step"] = window_start
            log(final_weights["text"])
            if cfg.task == "lm" and mosa_layers(final):  # generation needs the threshold rule's calibrated thresholds: stored with it
                calibrate_mosa(final, calibration_batches(task, train_dataset, tok, max_tokens=cfg.max_tokens,
                                                          seed=cfg.seed, device=device))
                valid = validation_loss(final, valid_loader, task, device, autocast)
            run.save_final_model(final)
            averaged_count = len(averaged) if final_weights["final"] == "averaged" else 1
            metrics.write({"split": "valid", "step": step, "averaged": averaged_count, **_numbers(valid)})
            summary = {"preset": cfg.preset, "task": cfg.task, "steps": step, "tokens": tokens_seen * d.world_size,
                       "train_seconds": train_seconds, "parameters": params, "averaged_checkpoints": averaged_count,
                       "final_weights": final_weights, "stopped_by": stopped_by, "valid": valid,
                       "world_size": d.world_size, "machine": machine_record(device)}
            if cfg.compile:
                summary.update(compile_seconds=compile_seconds, compile_steps=compile_steps)
            if init_record:
                summary["init_from"] = {**init_record, "valid_at_start": _valid_at_start(run.path)}
            if distiller is not None:
                summary["distill_from"] = {**stored["distill_parent"], "weight": distiller.weight,
                                           "temperature": distiller.temperature}
            run.write_summary(summary)
            log(f"done: {step} steps in {train_seconds:.0f}s, valid loss {valid['loss']:.3f}, ppl {valid['ppl']:.1f}")
        d.barrier()
        return summary


def choose_final_weights(model: torch.nn.Module, averaged: list, validate: Callable[[], dict[str, Any]]
                         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The final model: ``model`` holds the last weights; with more than one checkpoint in ``averaged`` (the
    window's, oldest first) their average is scored too, and the weights with the lower validation loss stay in
    ``model`` (the last ones on a tie: no averaging without a gain). Returns the validation result of the weights
    kept and the summary's ``final_weights`` record: ``final`` (``"averaged"`` or ``"last"``), ``valid_loss_last``,
    ``valid_loss_averaged`` (``None`` without a second checkpoint in the window), ``averaged_steps`` and a
    ``text`` saying it in one line. ``validate`` scores ``model`` as it is when called (the validation split:
    the test split never takes part in the choice)."""
    last = validate()
    steps = [checkpoint_step(p) for p in averaged]
    record: dict[str, Any] = {"final": "last", "valid_loss_last": last["loss"], "valid_loss_averaged": None,
                              "averaged_steps": steps}
    if len(averaged) < 2:
        record["text"] = (f"final model: the last weights (valid loss {last['loss']:.4f}); no average: "
                          f"{len(averaged)} checkpoint{'s' if len(averaged) != 1 else ''} in the averaging window")
        return last, record
    last_weights = {name: value.detach().to("cpu", copy=True) for name, value in model.state_dict().items()}
    model.load_state_dict(average_checkpoints(averaged), strict=False)
    mean = validate()
    record["valid_loss_averaged"] = mean["loss"]
    where = f"the average of the checkpoints at steps {', '.join(map(str, steps))}"
    if mean["loss"] < last["loss"]:
        record.update(final="averaged", text=f"final model: {where} (valid loss {mean['loss']:.4f}; the last "
                                             f"weights {last['loss']:.4f})")
        return mean, record
    model.load_state_dict(last_weights)
    record["text"] = (f"final model: the last weights (valid loss {last['loss']:.4f}), not {where} "
                      f"({mean['loss']:.4f}: no better on validation)")
    return last, record


def _valid_at_start(folder) -> dict[str, Any] | None:
    """The validation of a run's initial model (step 0, written before its first step), from ``metrics.jsonl``."""
    from .metrics import read_metrics

    found = [r for r in read_metrics(folder) if r.get("split") == "valid" and r.get("step") == 0]
    return {k: v for k, v in found[-1].items() if k not in ("split", "step", "time")} if found else None


def _numbers(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != "expert_load"}


def _progress(cfg: TrainConfig, main: bool, start: int) -> Progress | None:
    """A bar on a terminal, a line every 30 seconds off one (:class:`Progress`); a run bounded by time has no
    meaningful step total."""
    if not (cfg.progress and main):
        return None
    return Progress(None if cfg.max_time is not None else cfg.max_steps, start)
