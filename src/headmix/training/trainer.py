"""The training loop for translation, masked LM and causal LM, on one process or under ``torchrun``.

A run lives in one folder (``TrainConfig.out``)::

    train_config.json        the options of the run
    data/                    the train/valid/test splits actually used (TSV pairs or JSONL documents)
    tokenizer/               the joint BPE trained on the train split
    checkpoints/step_*/      atomic checkpoints (see headmix.training.checkpoint)
    metrics.jsonl            one record per log step and per validation
    config.json, model.safetensors   the final model (the average of the last checkpoints)
    summary.json             final numbers: steps, tokens, time, validation loss, expert load

Running the same command again on the same folder resumes from the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data import (
    CausalLMCollator,
    MLMCollator,
    PackedBlockDataset,
    CausalLMBlockDataset,
    ReadReport,
    TokenBatchSampler,
    Tokenizer,
    TranslationCollator,
    TranslationDataset,
    load_embedded_documents,
    load_embedded_translation,
    read_aligned_pairs,
    read_jsonl_documents,
    read_tsv_pairs,
    split_documents,
    split_pairs,
    train_tokenizer,
    write_jsonl_documents,
    write_tsv_pairs,
)
from ..models import build_model, count_parameters, get_config
from . import checkpoint as ckpt
from .distributed import Dist, Parallel, init_distributed
from ..routing import load_summary
from .metrics import MetricsLog
from .schedule import SCHEDULES, lr_multiplier

TASKS = ("translation", "mlm", "lm")


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss, for example); the last good checkpoint is kept."""


@dataclass
class TrainConfig:
    """Options of a training run. The translation defaults are the MoA paper's (Adam 0.9/0.98/1e-9,
    learning rate 7e-4, inverse square root schedule with warm-up, label smoothing 0.1 in the model
    config, auxiliary loss weights 0.01/0.001 in the attention config)."""

    task: str = "translation"
    preset: str = "tiny-moa"
    out: str = "runs/run"
    data: list[str] = field(default_factory=list)  # [] = the embedded corpus; 1 TSV/JSONL file or 2 aligned files
    src_lang: str = "en"
    tgt_lang: str = "de"
    strict: bool = False
    tokenizer: str | None = None  # an existing tokenizer folder to use instead of training one
    vocab_size: int = 8000
    valid_size: float = 0.02
    test_size: float = 0.02
    max_len: int = 128  # translation: tokens per side; mlm/lm: block size
    max_steps: int = 1000
    max_time: float | None = None  # seconds of training after which the run stops (and saves)
    max_tokens: int = 4096  # tokens per batch per process
    grad_accum: int = 1
    lr: float = 7e-4
    warmup_steps: int = 4000
    schedule: str | None = None  # default: inverse_sqrt for translation, linear for mlm/lm
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-9
    weight_decay: float = 0.0
    clip_norm: float = 0.0  # 0 = no clipping (fairseq's default, the paper's setup)
    dropout: float | None = None  # override the preset's dropout
    bf16: str = "auto"  # "auto" (on for CUDA devices with bf16), "on", "off"
    seed: int = 1
    log_every: int = 20
    eval_every: int = 200
    save_every: int = 200
    keep_checkpoints: int = 10
    average_last: int = 10  # the paper averages the last 10 checkpoints
    distributed: str = "ddp"  # "ddp" or "fsdp" under torchrun
    device: str = "auto"
    progress: bool = True

    def validate(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.distributed not in ("ddp", "fsdp"):
            raise ValueError(f"distributed must be 'ddp' or 'fsdp', got {self.distributed!r}")
        if self.bf16 not in ("auto", "on", "off"):
            raise ValueError(f"bf16 must be 'auto', 'on' or 'off', got {self.bf16!r}")
        for name in ("max_steps", "max_tokens", "grad_accum", "max_len", "log_every", "eval_every", "save_every",
                     "keep_checkpoints", "average_last", "vocab_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if len(self.data) > 2:
            raise ValueError(f"data takes one file (TSV pairs or JSONL documents) or two aligned files, got {len(self.data)}")
        if len(self.data) == 2 and self.task != "translation":
            raise ValueError("two aligned files (data) are for translation; mlm/lm read one JSONL or text file")
        for p in self.data:
            if not Path(p).is_file():
                raise FileNotFoundError(f"data file not found: {p}")
        if self.tokenizer is not None and not Path(self.tokenizer).exists():
            raise FileNotFoundError(f"tokenizer not found: {self.tokenizer}")

    @property
    def resolved_schedule(self) -> str:
        return self.schedule or ("inverse_sqrt" if self.task == "translation" else "linear")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def load(cls, run_dir: str | os.PathLike) -> TrainConfig:
        """The options a run was trained with (``RUN/train_config.json``); unknown keys are ignored."""
        path = Path(run_dir) / "train_config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: {run_dir} is not a headmix training run")
        values = json.loads(path.read_text())
        cfg = cls(**{k: v for k, v in values.items() if k in cls.__dataclass_fields__})
        cfg.betas = tuple(cfg.betas)
        return cfg


# ----------------------------------------------------------------------------------------------- setup

def pick_device(name: str) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def prepare_data(cfg: TrainConfig, run: Path, log) -> tuple[dict[str, list], Tokenizer]:
    """Read the corpus, split it, train the tokenizer; store all three in the run folder. On a resumed
    run, read them back instead, so the splits and vocabulary never change mid-run."""
    data_dir = run / "data"
    tok_dir = run / "tokenizer"
    ext = "tsv" if cfg.task == "translation" else "jsonl"
    files = {s: data_dir / f"{s}.{ext}" for s in ("train", "valid", "test")}
    if all(f.is_file() for f in files.values()) and (tok_dir / "tokenizer.json").is_file():
        if cfg.task == "translation":
            parts = {s: read_tsv_pairs(f, strict=True) for s, f in files.items()}
        else:
            parts = {s: read_jsonl_documents(f, strict=True) for s, f in files.items()}
        return parts, Tokenizer.load(tok_dir)

    report = ReadReport()
    if cfg.task == "translation":
        if not cfg.data:
            items = load_embedded_translation(src_lang=cfg.src_lang, tgt_lang=cfg.tgt_lang, report=report)
        elif len(cfg.data) == 1:
            items = read_tsv_pairs(cfg.data[0], strict=cfg.strict, report=report,
                                   src_lang=cfg.src_lang, tgt_lang=cfg.tgt_lang, file_langs=(cfg.src_lang, cfg.tgt_lang))
        else:
            items = read_aligned_pairs(cfg.data[0], cfg.data[1], strict=cfg.strict, report=report)
        split = split_pairs(items, valid_size=cfg.valid_size, test_size=cfg.test_size, seed=cfg.seed)
    else:
        items = load_embedded_documents(report=report) if not cfg.data else \
            read_jsonl_documents(cfg.data[0], strict=cfg.strict, report=report)
        split = split_documents(items, valid_size=cfg.valid_size, test_size=cfg.test_size, seed=cfg.seed)
    if report.malformed:
        log(report.summary())
    parts = {"train": split.train, "valid": split.valid, "test": split.test}
    for name, part in parts.items():
        if not part:
            raise ValueError(f"the {name} split is empty ({split.sizes.as_dict()}): give a larger corpus or "
                             f"change valid_size/test_size")
    data_dir.mkdir(parents=True, exist_ok=True)
    for s, part in parts.items():
        tmp = files[s].with_name(files[s].name + ".tmp")
        (write_tsv_pairs if cfg.task == "translation" else write_jsonl_documents)(part, tmp)
        os.replace(tmp, files[s])
    if cfg.tokenizer:
        tok = Tokenizer.load(cfg.tokenizer)
    elif cfg.task == "translation":
        tok = train_tokenizer((t for p in split.train for t in (p.src, p.tgt)), cfg.vocab_size)
    else:
        tok = train_tokenizer((d.text for d in split.train), cfg.vocab_size)
    tok.save(tok_dir)
    log(f"data: {split.sizes.as_dict()}, vocabulary {tok.vocab_size}")
    return parts, tok


def build_dataset(cfg: TrainConfig, items: list, tok: Tokenizer):
    if cfg.task == "translation":
        return TranslationDataset.from_pairs(items, tok, max_len=cfg.max_len)
    if cfg.task == "mlm":
        return PackedBlockDataset.from_documents(items, tok, cfg.max_len)
    return CausalLMBlockDataset.from_documents(items, tok, cfg.max_len)


def build_loader(cfg: TrainConfig, dataset, tok: Tokenizer, *, train: bool, d: Dist, seed: int):
    sampler = TokenBatchSampler(dataset.lengths, cfg.max_tokens, shuffle=train, seed=seed,
                                rank=d.rank if train else 0, world_size=d.world_size if train else 1)
    if cfg.task == "translation":
        collate = TranslationCollator.from_tokenizer(tok)
    elif cfg.task == "mlm":
        collate = MLMCollator.from_tokenizer(tok, seed=seed + (0 if train else 7919))
    else:
        collate = CausalLMCollator(tok.pad_id)
    # A generator of its own: creating an iterator would otherwise draw from the global RNG and shift the
    # dropout masks of a resumed run.
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                                       generator=torch.Generator().manual_seed(seed))


def model_inputs(task: str, batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    if task == "translation":
        return {"src": batch["src"].to(device), "tgt_in": batch["tgt_in"].to(device), "tgt_out": batch["tgt_out"].to(device)}
    return {"input_ids": batch["input_ids"].to(device), "labels": batch["labels"].to(device)}


def build_model_config(cfg: TrainConfig, tok: Tokenizer):
    mcfg = get_config(cfg.preset, task=cfg.task, vocab_size=tok.vocab_size)
    changes: dict[str, Any] = {"pad_id": tok.pad_id, "bos_id": tok.bos_id, "eos_id": tok.eos_id}
    if cfg.dropout is not None:
        changes["dropout"] = cfg.dropout
    if mcfg.max_positions < cfg.max_len + 2:
        changes["max_positions"] = cfg.max_len + 2
    return mcfg.replace(**changes)


# ----------------------------------------------------------------------------------------------- the loop

class _StopSignal:
    """Turns SIGINT/SIGTERM into a flag checked between steps, so a checkpoint is written first."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:  # a second signal: stop at once
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        return False


def _expert_counts(routing: list, acc: dict[str, torch.Tensor]) -> None:
    for name, r in routing:
        c = r.expert_counts().detach().cpu()
        acc[name] = acc[name] + c if name in acc else c


def _load_record(acc: dict[str, torch.Tensor]) -> dict[str, float]:
    if not acc:
        return {}
    summaries = [load_summary(c) for c in acc.values()]
    return {f"load_{k}": sum(s[k] for s in summaries) / len(summaries) for k in ("max_share", "min_share", "cv")}


@torch.no_grad()
def evaluate_loss(model: nn.Module, loader, task: str, device: torch.device, autocast) -> dict[str, float]:
    """Token-averaged validation loss (label-smoothed), NLL and perplexity, and expert load."""
    was_training = model.training
    model.eval()
    tot = {"loss": 0.0, "nll": 0.0, "tokens": 0}
    counts: dict[str, torch.Tensor] = {}
    for batch in loader:
        with autocast():
            out = model(**model_inputs(task, batch, device))
        n = int(out.num_tokens)
        tot["loss"] += float(out.loss) * n
        tot["nll"] += float(out.nll_loss) * n
        tot["tokens"] += n
        _expert_counts(out.routing, counts)
    model.train(was_training)
    n = max(tot["tokens"], 1)
    result = {"loss": tot["loss"] / n, "nll": tot["nll"] / n, "ppl": math.exp(min(tot["nll"] / n, 50.0)),
              "tokens": tot["tokens"]}
    result["expert_load"] = {k: (v / v.sum().clamp(min=1)).tolist() for k, v in counts.items()}
    return result


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train (or resume) a run; returns the summary written to ``summary.json``."""
    cfg.validate()
    device = pick_device(cfg.device)
    d = init_distributed(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    run = Path(cfg.out)
    run.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        if d.main:
            print(f"[headmix] {msg}", file=sys.stderr, flush=True)

    torch.manual_seed(cfg.seed)
    if d.main:
        (run / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        prepare_data(cfg, run, log)
    d.barrier()
    parts, tok = prepare_data(cfg, run, log)  # every rank reads the stored splits and tokenizer

    mcfg = build_model_config(cfg, tok)
    torch.manual_seed(cfg.seed)
    model = build_model(mcfg).to(device)
    train_set = build_dataset(cfg, parts["train"], tok)
    valid_set = build_dataset(cfg, parts["valid"], tok)
    train_loader = build_loader(cfg, train_set, tok, train=True, d=d, seed=cfg.seed)
    valid_loader = build_loader(cfg, valid_set, tok, train=False, d=d, seed=cfg.seed)
    sampler: TokenBatchSampler = train_loader.batch_sampler

    step, tokens_seen, elapsed_before = 0, 0, 0.0
    if d.main:
        ckpt.remove_partial_checkpoints(run)
    latest = ckpt.latest_checkpoint(run)
    state: dict[str, Any] | None = None
    if latest is not None:  # weights go in before wrapping; the optimizer state after (FSDP needs its params)
        state, info = ckpt.load_checkpoint(latest, model)
        step, tokens_seen, elapsed_before = info["step"], info["tokens"], info.get("train_seconds", 0.0)
    par = Parallel(model, cfg.distributed if d.world_size > 1 else "none", device,
                   make_plain=lambda: build_model(mcfg))
    model = par.module
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                  weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(
        s, schedule=cfg.resolved_schedule, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps))
    if state is not None:
        par.load_optimizer_state(optimizer, state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        sampler.load_state_dict(state["sampler"])
        ckpt.set_rng_state(state["rng"])
        log(f"resuming from {latest} (step {step})")
    use_bf16 = cfg.bf16 == "on" or (cfg.bf16 == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()

    metrics = MetricsLog(run, enabled=d.main)
    params = count_parameters(build_model(mcfg)) if par.kind == "fsdp" else count_parameters(model)
    log(f"model {cfg.preset} ({params / 1e6:.2f}M parameters) on {device}, world size {d.world_size}")

    def save(reason: str) -> Path | None:
        state = {"optimizer": par.optimizer_state(optimizer), "schedule": schedule.state_dict(),
                 "sampler": sampler.state_dict(), "rng": ckpt.rng_state()}
        info = {"tokens": tokens_seen, "train_seconds": elapsed_before + time.time() - t_start, "reason": reason}
        full = par.full_model()
        if not d.main:
            return None
        return ckpt.save_checkpoint(run, step, full, state, info, keep=max(cfg.keep_checkpoints, cfg.average_last))

    model.train()
    t_start = time.time()
    window = {"loss": 0.0, "aux": 0.0, "tokens": 0, "steps": 0, "t": time.time()}
    counts: dict[str, torch.Tensor] = {}
    last_valid: dict[str, Any] | None = None
    stopped_by = None
    data_iter = iter(train_loader)
    progress = _progress(cfg, d, step)
    with _StopSignal() as stop:
        while step < cfg.max_steps:
            if cfg.max_time is not None and elapsed_before + time.time() - t_start >= cfg.max_time:
                stopped_by = "max_time"
                break
            if stop.signum is not None:
                break
            optimizer.zero_grad(set_to_none=True)
            step_loss = torch.zeros((), device=device)
            step_tokens = 0
            for micro in range(cfg.grad_accum):
                batch = next(data_iter, None)
                if batch is None:  # the sampler has moved on to the next epoch
                    data_iter = iter(train_loader)
                    batch = next(data_iter)
                sync = micro == cfg.grad_accum - 1 or d.world_size == 1
                with (contextlib.nullcontext() if sync else par.no_sync()):
                    with autocast():
                        out = model(**model_inputs(cfg.task, batch, device))
                    (out.total_loss / cfg.grad_accum).backward()
                step_loss += out.loss.detach()
                window["aux"] += float(out.aux_loss.detach()) / cfg.grad_accum
                step_tokens += int(out.num_tokens)
                _expert_counts(out.routing, counts)
            grad_norm = par.clip_grad_norm(cfg.clip_norm)
            loss_value = float(step_loss) / cfg.grad_accum
            if not math.isfinite(loss_value) or not torch.isfinite(grad_norm):
                kept = ckpt.latest_checkpoint(run)
                raise TrainingError(f"non-finite loss ({loss_value}) or gradient norm ({float(grad_norm)}) at step "
                                    f"{step + 1}; stopped without saving. Last good checkpoint: {kept}")
            optimizer.step()
            schedule.step()
            step += 1
            tokens_seen += step_tokens
            window["tokens"] += step_tokens
            window["loss"] += loss_value
            window["steps"] += 1
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{loss_value:.3f}")
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                now = time.time()
                record = {"split": "train", "step": step, "loss": window["loss"] / window["steps"],
                          "aux_loss": window["aux"] / window["steps"], "lr": schedule.get_last_lr()[0],
                          "grad_norm": float(grad_norm), "tokens_per_sec": window["tokens"] * d.world_size / max(now - window["t"], 1e-9),
                          "tokens": tokens_seen * d.world_size, "time": elapsed_before + now - t_start,
                          **_load_record(counts)}
                metrics.write(record)
                window = {"loss": 0.0, "aux": 0.0, "tokens": 0, "steps": 0, "t": now}
                counts = {}
            if step % cfg.eval_every == 0:
                last_valid = evaluate_loss(model, valid_loader, cfg.task, device, autocast)
                metrics.write({"split": "valid", "step": step, **{k: v for k, v in last_valid.items() if k != "expert_load"}})
            if step % cfg.save_every == 0:
                save("periodic")
        if progress is not None:
            progress.close()
        if stop.signum is not None:
            path = save(f"signal {stop.signum}")
            log(f"stopped by signal {stop.signum}; checkpoint {path}")
            metrics.close()
            raise SystemExit(128 + stop.signum)

    save("final")
    train_seconds = elapsed_before + time.time() - t_start
    d.barrier()
    summary: dict[str, Any] = {}
    full = par.full_model()
    if d.main:
        summary = _finish(cfg, run, full, valid_loader, device, autocast, metrics, log, step=step,
                          tokens=tokens_seen * d.world_size, seconds=train_seconds, params=params,
                          stopped_by=stopped_by or "max_steps", world_size=d.world_size)
    metrics.close()
    d.barrier()
    return summary


def _finish(cfg: TrainConfig, run: Path, final: nn.Module, valid_loader, device, autocast, metrics: MetricsLog, log,
            *, step: int, tokens: int, seconds: float, params: int, stopped_by: str, world_size: int) -> dict[str, Any]:
    """Average the last checkpoints into the final model, save it, validate it, write summary.json."""
    averaged = ckpt.list_checkpoints(run)[-cfg.average_last:]
    if len(averaged) > 1:
        final.load_state_dict(ckpt.average_checkpoints(averaged), strict=False)
    final.save_pretrained(run)
    valid = evaluate_loss(final, valid_loader, cfg.task, device, autocast)
    metrics.write({"split": "valid", "step": step, "averaged": len(averaged),
                   **{k: v for k, v in valid.items() if k != "expert_load"}})
    summary = {"preset": cfg.preset, "task": cfg.task, "steps": step, "tokens": tokens,
               "train_seconds": seconds, "parameters": params, "averaged_checkpoints": len(averaged),
               "stopped_by": stopped_by, "valid": valid, "world_size": world_size}
    tmp = run / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, run / "summary.json")
    log(f"done: {step} steps in {seconds:.0f}s, valid loss {valid['loss']:.3f}, ppl {valid['ppl']:.1f}")
    return summary


def _progress(cfg: TrainConfig, d: Dist, start: int):
    if not (cfg.progress and d.main):
        return None
    from tqdm import tqdm
    # A run bounded by time has no meaningful step total; disable=None: no bar when output is not a terminal.
    total = None if cfg.max_time is not None else cfg.max_steps
    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True, disable=None)
