"""What the training loop sets up before its first step: the data and tokenizer of the run, the model
config, bf16 autocast, the optimizer and the learning-rate schedule."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

from ..data import ReadReport, Tokenizer, train_tokenizer
from ..models import ModelConfig, get_config
from .config import TrainConfig
from .schedule import lr_multiplier
from .tokens import special_ids

SPLITS = ("train", "valid", "test")


def prepare_data(cfg: TrainConfig, run, log: Callable[[str], None]) -> tuple[dict[str, list], Tokenizer]:
    """Read the corpus, split it, train the tokenizer; store all three in the run folder (atomically).
    On a resumed run, read them back instead, so the splits and vocabulary never change mid-run. A run
    folder that kept its tokenizer but not its splits (a study's results committed without the data) gets
    the same splits again (they are seeded) and keeps its tokenizer."""
    from ..runs import atomic_output

    task = cfg.task_spec
    if cfg.pack is not None:
        return read_pack(cfg, run)
    files = {s: task.split_path(run.data_dir, s) for s in SPLITS}
    if all(f.is_file() for f in files.values()) and (run.tokenizer_dir / "tokenizer.json").is_file():
        # a resumed run reads its own splits (also one that stored them before it shared a study's)
        return {s: task.read_items(f) for s, f in files.items()}, Tokenizer.load(run.tokenizer_dir)
    if cfg.shared_data is not None:
        return read_shared_splits(cfg, run, log)

    report = ReadReport(max_examples=1, warn=False)  # reported here, in one line
    items = task.read_corpus(cfg.data, strict=cfg.strict, src_lang=cfg.src_lang, tgt_lang=cfg.tgt_lang, report=report)
    split = task.split_corpus(items, valid_size=cfg.valid_size, test_size=cfg.test_size,
                              seed=cfg.resolved_split_seed)
    if report.malformed:
        log(f"skipped {report.malformed:,} malformed line(s) (--strict makes them an error): {report.summary()}")
    parts = {"train": split.train, "valid": split.valid, "test": split.test}
    for name, part in parts.items():
        if not part:
            raise ValueError(f"the {name} split is empty ({split.sizes.as_dict()}): give a larger corpus or "
                             f"change valid_size/test_size")
    stored = run.tokenizer_dir / "tokenizer.json"
    if cfg.tokenizer:
        tok = Tokenizer.load(cfg.tokenizer)
    elif stored.is_file():  # the splits were removed (or not kept with the folder): the vocabulary stays
        tok = Tokenizer.load(run.tokenizer_dir)
    else:
        tok = train_tokenizer(task.tokenizer_texts(split.train), cfg.vocab_size)
    run.data_dir.mkdir(parents=True, exist_ok=True)
    for s, part in parts.items():
        with atomic_output(files[s]) as tmp:
            task.write_items(part, tmp)
    if not stored.is_file() or cfg.tokenizer:
        run.save_tokenizer(tok)
    log(f"data: {describe_sizes(split.sizes.as_dict())}; vocabulary {tok.vocab_size:,}")
    return parts, tok


def describe_sizes(sizes: dict[str, Any]) -> str:
    """The split sizes as a line for people: ``{"train": 1383, "dropped_valid": 0}`` -> ``train 1,383, dropped
    valid 0``."""
    return ", ".join(f"{name.replace('_', ' ')} {value:,}" for name, value in sizes.items())


#: The options that decide the splits: a run reads a shared folder's splits only when they agree.
SPLIT_OPTIONS = ("task", "data", "src_lang", "tgt_lang", "strict", "valid_size", "test_size")


def read_shared_splits(cfg: TrainConfig, run, log: Callable[[str], None]) -> tuple[dict[str, list], Tokenizer]:
    """The splits of the folder ``cfg.shared_data`` (written once by :func:`prepare_shared_data`), after checking
    that they come from this run's corpus and split options; the run folder gets no copy of them (a run that
    already stored its own splits reads those: :func:`prepare_data`)."""
    from ..runs import Run, atomic_write
    from ..tasks.base import SHARED_SPLITS

    task = cfg.task_spec
    shared = Run(cfg.shared_data)
    stored = shared.read_config()
    mine = {**{k: getattr(cfg, k) for k in SPLIT_OPTIONS}, "data": [str(Path(p).expanduser().resolve()) for p in cfg.data]}
    for key in SPLIT_OPTIONS:
        theirs = stored.get(key)
        if theirs != mine[key]:
            raise ValueError(f"shared_data {cfg.shared_data} was split with {key}={stored.get(key)!r}, this run "
                             f"has {key}={mine[key]!r}: give the folder prepared for this data")
    theirs_seed = stored.get("split_seed") if stored.get("split_seed") is not None else stored.get("seed")
    if theirs_seed != cfg.resolved_split_seed:
        raise ValueError(f"shared_data {cfg.shared_data} was split with split_seed={theirs_seed!r}, this run has "
                         f"split_seed={cfg.resolved_split_seed!r}")
    files = {s: task.split_path(shared.data_dir, s) for s in SPLITS}
    missing = [str(f) for f in files.values() if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"shared_data {cfg.shared_data} lacks its splits: {', '.join(missing)}")
    tok = Tokenizer.load(cfg.tokenizer) if cfg.tokenizer else Tokenizer.load(shared.tokenizer_dir)
    if not (run.tokenizer_dir / "tokenizer.json").is_file():
        run.save_tokenizer(tok)  # the run folder stays loadable on its own (evaluate, analyze)
    pointer = run.data_dir / SHARED_SPLITS
    if not pointer.is_file():  # where evaluate and analyze find the splits (Task.stored_split)
        atomic_write(pointer, json.dumps({"data": os.path.relpath(shared.data_dir.resolve(),
                                                                  run.data_dir.resolve())}) + "\n")
    return {s: task.read_items(f) for s, f in files.items()}, tok


def read_pack(cfg: TrainConfig, run=None) -> tuple[dict[str, Any], Tokenizer]:
    """The token streams and tokenizer of the run's token pack (:func:`headmix.tasks.pack.load_pack`: every file
    checked against the pack's checksums first); the run folder gets a copy of the tokenizer, so that it stays
    loadable on its own."""
    from ..tasks.pack import load_pack

    pack = load_pack(cfg.pack)
    tok = Tokenizer.load(pack.tokenizer_dir)
    if run is not None and not (run.tokenizer_dir / "tokenizer.json").is_file():
        run.save_tokenizer(tok)
    return {s: pack.stream(s) for s in SPLITS}, tok


def cached_dataset(cfg: TrainConfig, split: str, items: list, tok: Tokenizer, tokenizer_file: Path,
                   sequence_start: str | None = None):
    """``task.dataset(items, tok, max_len, sequence_start=...)``, tokenised once per shared folder: with
    ``cfg.shared_data`` the dataset is stored in ``SHARED/tokenized/`` (keyed by split, block length, a causal
    LM's ``sequence_start``, the tokenizer's checksum and the headmix version) as a numpy archive read with
    ``allow_pickle=False`` (:func:`save_dataset`, :func:`load_dataset`): opening it never runs code, so a study
    folder from elsewhere is safe to continue. The
    pickle caches of older versions (``*.pkl``) are never opened: the ids are tokenised again. Without
    ``shared_data``, tokenised here as before."""
    from .. import __version__
    from ..runs.run import content_sha256

    task = cfg.task_spec
    if cfg.pack is not None:  # a token pack's stream (read_pack), cut into the run's blocks
        from ..data import CausalLMBlockDataset

        return CausalLMBlockDataset(items, cfg.max_len)
    if cfg.shared_data is None:
        return task.dataset(items, tok, cfg.max_len, sequence_start=sequence_start)
    digest = content_sha256(tokenizer_file)[:16]
    start = "" if sequence_start is None else f"-{sequence_start}"
    path = Path(cfg.shared_data) / "tokenized" / f"{split}-len{cfg.max_len}{start}-{digest}-v{__version__}.npz"
    if path.is_file():
        return load_dataset(path)
    dataset = task.dataset(items, tok, cfg.max_len, sequence_start=sequence_start)
    save_dataset(dataset, path)
    return dataset


#: The key of a token cache's description (class and plain fields) among its arrays.
META_KEY = "__meta__"


def save_dataset(dataset, path: Path) -> bool:
    """Store a dataset whose attributes are numpy arrays (of numbers) and plain values (numbers, strings, None)
    as a numpy archive (atomically); ``False`` (nothing written) for one that has any other attribute."""
    import numpy as np

    from ..runs import atomic_output

    arrays, fields = {}, {}
    for name, value in vars(dataset).items():
        if isinstance(value, np.ndarray) and value.dtype != object:
            arrays[name] = value
        elif isinstance(value, np.generic):
            fields[name] = value.item()
        elif value is None or isinstance(value, (bool, int, float, str)):
            fields[name] = value
        else:
            return False
    cls = type(dataset)
    meta = json.dumps({"class": f"{cls.__module__}:{cls.__qualname__}", "fields": fields})
    with atomic_output(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays, **{META_KEY: np.frombuffer(meta.encode(), dtype=np.uint8)})
    return True


def load_dataset(path: Path):
    """A dataset stored by :func:`save_dataset`, read as data only (``allow_pickle=False``; its class must be a
    ``torch`` ``Dataset`` of a ``headmix`` module); ``ValueError`` in one line for any other file."""
    import importlib

    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
        meta = json.loads(arrays.pop(META_KEY).tobytes().decode())
        module, _, qualname = meta["class"].partition(":")
        if not module.startswith("headmix."):
            raise ValueError(f"its class {meta['class']!r} is not a headmix dataset")
        cls = getattr(importlib.import_module(module), qualname)
        if not (isinstance(cls, type) and issubclass(cls, torch.utils.data.Dataset)):
            raise ValueError(f"{meta['class']!r} is not a dataset class")
    except Exception as err:  # noqa: BLE001 - every way a foreign file fails is the same answer
        text = " ".join(str(err).split())[:200]
        raise ValueError(f"token cache {path} is not a headmix token cache ({type(err).__name__}: {text}); it was "
                         f"not used: remove it to tokenise again") from None
    dataset = cls.__new__(cls)
    dataset.__dict__.update(meta["fields"])
    dataset.__dict__.update(arrays)
    return dataset


def prepare_shared_data(cfg: TrainConfig, log: Callable[[str], None]) -> Path:
    """Split the corpus and train the tokenizer once, in the run folder ``cfg.out`` (locked while it is
    written), for several runs to share: they pass the returned tokenizer folder as ``tokenizer`` and the
    same ``split_seed`` (the demo's two models, a study's runs), and a causal LM's sequence convention, which
    they all train with (:mod:`headmix.training.sequence_start`). A second call reads them back."""
    from ..runs import Run
    from .config import IDENTITY
    from .sequence_start import STORED_KEY, run_sequence_start, shared_sequence_start

    stored = cfg.to_dict()
    if cfg.task == "lm":  # the convention of every run that shares it; a folder prepared before keeps its own
        stored[STORED_KEY] = shared_sequence_start(cfg.out) or run_sequence_start(cfg)
    with Run.create_or_resume(cfg.out, stored, identity=IDENTITY) as run:
        prepare_data(cfg, run, log)
        return run.tokenizer_dir


def model_config(cfg: TrainConfig, tok: Tokenizer) -> ModelConfig:
    """The preset's config for the task, with the tokenizer's vocabulary and special ids."""
    mcfg = get_config(cfg.preset, task=cfg.task, vocab_size=tok.vocab_size)
    changes: dict[str, Any] = special_ids(cfg, tok)
    if cfg.dropout is not None:
        changes["dropout"] = cfg.dropout
    if mcfg.max_positions < cfg.max_len + 2:
        changes["max_positions"] = cfg.max_len + 2
    return mcfg.replace(**changes)


def initial_model(cfg: TrainConfig, tok: Tokenizer, log: Callable[[str], None],
                  calibration: Callable[[int], list[torch.Tensor]] | None = None) -> tuple[ModelConfig, dict | None, dict]:
    """The model config of the run and, with ``cfg.init_from``, the weights to start from and a record of their
    source (for ``summary.json``): a finished headmix run folder's final model, or a Hugging Face folder
    converted by :func:`headmix.interop.from_pretrained`; with ``cfg.init_options``, upcycled
    (:func:`headmix.interop.upcycle`: MoH or the pruning control, whose heads are ranked on
    ``calibration(count)``, that many batches of the run's training data). Without it, the preset's config
    (:func:`model_config`), no weights, and ``{}``."""
    if cfg.init_from is None:
        return model_config(cfg, tok), None, {}
    from .config import is_headmix_folder, is_headmix_run

    source = Path(cfg.init_from).expanduser().resolve()
    options = cfg.resolved_init_options
    headmix_source = is_headmix_folder(source)
    kind = ("headmix run" if is_headmix_run(source) else "headmix folder") if headmix_source else "hugging face"
    if options:
        from ..interop.upcycle import CALIBRATION_BATCHES, upcycle

        batches = None
        if options.get("keep_heads") is not None:
            if calibration is None:
                raise ValueError("init_options.keep_heads needs the run's calibration batches")
            batches = calibration(options.get("calibration_batches") or CALIBRATION_BATCHES)
        model = upcycle(source, batches=batches, **options)
    elif headmix_source:  # read as JSON and safetensors: no prompt, no code from the folder
        from ..models import load_pretrained

        try:
            model = load_pretrained(source)
        except (ValueError, FileNotFoundError) as err:
            raise ValueError(f"init_from: {err}") from None
    else:
        from ..interop import from_pretrained

        model = from_pretrained(source)
    record = {"path": str(source), "kind": kind, **({"options": options} if options else {})}
    if (source / "model.safetensors").is_file():  # which weights exactly (a study's runs share one parent)
        from ..storage.files import sha256_file

        record["sha256"] = sha256_file(source / "model.safetensors")
    config = model.config
    if config.task != cfg.task:
        raise ValueError(f"init_from {source} holds a {config.task!r} model; this run's task is {cfg.task!r}")
    changes: dict[str, Any] = special_ids(cfg, tok, config)
    if cfg.dropout is not None:
        changes["dropout"] = cfg.dropout
    if config.positions != "rotary" and config.max_positions < cfg.max_len + 2:
        raise ValueError(f"max_len {cfg.max_len} needs {cfg.max_len + 2} positions; the model of init_from {source} "
                         f"has {config.max_positions}")
    log(f"initial weights: {record['kind']} {source}" + (f" {record['options']}" if record.get("options") else ""))
    return config.replace(**changes), model.state_dict(), record


@contextlib.contextmanager
def removed_if_unstarted(out: str | os.PathLike, main: bool = True):
    """A failed start leaves no run folder behind: when the folder ``out`` did not exist before, an exception
    raised before the caller calls the yielded ``started()`` (its first training step) removes it (on the main
    rank, after the run's lock is released: enter this before the run's own context)."""
    fresh = main and not Path(out).exists()
    state = {"started": False}
    try:
        yield lambda: state.update(started=True)
    except BaseException:
        if fresh and not state["started"] and Path(out).is_dir():
            import shutil

            shutil.rmtree(out, ignore_errors=True)
        raise


def autocast_for(cfg: TrainConfig, device: torch.device) -> Callable[[], Any]:
    """A context-manager factory: bf16 autocast when ``cfg.bf16`` asks for it, else nothing."""
    on = cfg.bf16 == "on" or (cfg.bf16 == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())
    if on:
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def compile_model(model: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """``torch.compile(model)`` for the training forward (``options`` go to ``torch.compile``; the trainer uses
    the defaults: inductor, shapes made dynamic at their first change). The compiled module shares the
    model's parameters. The model compiles with no graph break (tests/test_compile.py)."""
    return torch.compile(model, **options)


def compiled_graphs() -> int:
    """How many graphs ``torch.compile`` has compiled in this process (dynamo's counter): a step that raises
    it compiled (or recompiled) the model. Dynamo is imported here, by a run that compiles, not when the
    trainer is imported (about 1.7 s of start-up)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def optimizer_and_schedule(cfg: TrainConfig, params) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW at the peak learning rate, and the schedule that multiplies it by ``lr_multiplier(step)``."""
    optimizer = torch.optim.AdamW(params, lr=cfg.resolved_lr, betas=cfg.betas, eps=cfg.eps,
                                  weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(
        s, schedule=cfg.resolved_schedule, warmup_steps=cfg.resolved_warmup_steps, max_steps=cfg.max_steps))
    return optimizer, schedule


def forever(loader):
    """The batches of ``loader``, epoch after epoch (the sampler reshuffles each epoch)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("the training split gives no batch: give more data or a larger max_tokens")
