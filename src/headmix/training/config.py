"""The options of a training run, :class:`TrainConfig`: each field's default and help text live here, and
the ``headmix train`` flags are generated from these fields (``headmix.cli.main``)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..data.tokenizer import SPECIAL_TOKENS
from ..devices import check_device_name, pick_device  # noqa: F401  (live in headmix.devices; imported from here too)
from ..models.folders import is_headmix_folder, is_headmix_run  # noqa: F401  (setup imports them from here)
from ..runs.tokenizer import tokenizer_of  # noqa: F401  (lives in headmix.runs.tokenizer; imported from here too)
from ..tasks import TASKS, get_task
from .schedule import SCHEDULES


def option(default: Any = dataclasses.MISSING, help: str = "", *, choices: tuple | None = None,
           factory: Any = dataclasses.MISSING, cli: str | None = None, metavar: str | None = None) -> Any:
    """A :class:`TrainConfig` field with its command-line help. ``cli``: ``"positional"`` for a positional
    argument, ``"required"`` for a flag the command requires although the dataclass has a default."""
    metadata = {"help": help, "choices": choices, "cli": cli, "metavar": metavar}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


#: Fields that define a run: resuming with another value is refused (headmix.runs.RunMismatchError).
IDENTITY = ("task", "preset", "data", "src_lang", "tgt_lang", "tokenizer", "vocab_size", "valid_size",
            "test_size", "max_len", "seed", "split_seed", "init_from", "init_options", "pack", "distill_from",
            "distill_weight", "distill_temperature")


@dataclass
class TrainConfig:
    """Options of a training run. The translation defaults are the MoA paper's (Adam 0.9/0.98/1e-9,
    learning rate 7e-4, inverse square root schedule with warm-up, label smoothing 0.1 in the model
    config, auxiliary loss weights 0.01/0.001 in the attention config); the language models' are
    RoBERTa's (learning rate 5e-4, linear schedule)."""

    task: str = option("translation", "what to train", choices=tuple(TASKS), cli="positional")
    preset: str | None = option(None, "preset name, {K}K{E}E{D}D string, JSON model config file, or a JSON model "
                                      "config itself (a string starting with '{') (default: tiny-moa; not with "
                                      "--init-from, whose model is used)")
    out: str = option("runs/run", "run folder (created, or resumed when it holds a run)", cli="required")
    data: list[str] = option(factory=list, metavar="FILE",
                             help="translation: a TSV of pairs or two aligned text files; mlm/lm: a JSONL of "
                                  "documents (a \"text\" field) or plain text (.txt; documents separated by "
                                  "blank lines). Default: the embedded corpus")
    src_lang: str = option("en", "source language (translation)")
    tgt_lang: str = option("de", "target language (translation)")
    strict: bool = option(False, "a malformed input line is an error")
    tokenizer: str | None = option(None, "use this tokenizer folder instead of training one")
    shared_data: str | None = option(None, "read the splits (and cached token ids) of this folder, prepared once "
                                           "for several runs (a study's shared/), instead of splitting the corpus "
                                           "into the run folder; it must come from the same data and split")
    pack: str | None = option(None, "causal LM: train on this token pack (headmix data pack): its split, tokenizer "
                                    "and token ids, checked against its checksums; no corpus is read", metavar="DIR")
    vocab_size: int | None = option(None, "size of the BPE vocabulary trained on the train split (default: the "
                                          "vocab_size of a JSON --preset, else 8000)")
    valid_size: float = option(0.02, "held-out fraction for validation, in [0, 1)")
    test_size: float = option(0.02, "held-out fraction for test, in [0, 1)")
    max_len: int = option(128, "tokens per sentence (translation) or per block (mlm/lm)")
    max_steps: int = option(1000, "optimizer steps to train")
    max_time: float | None = option(None, "stop (and save) after this many seconds of training")
    max_tokens: int = option(4096, "tokens per batch per process")
    grad_accum: int = option(1, "batches accumulated per optimizer step")
    lr: float | None = option(None, "peak learning rate (default: the task's, 7e-4 translation, 5e-4 mlm/lm)")
    warmup_steps: int | None = option(None, "linear warm-up steps of the learning rate (default: a tenth of "
                                            "--max-steps)")
    schedule: str | None = option(None, "learning-rate schedule (default: inverse_sqrt for translation, linear "
                                        "for mlm/lm)", choices=SCHEDULES)
    betas: tuple[float, float] = option((0.9, 0.98), "Adam's beta1 and beta2")
    eps: float = option(1e-9, "Adam's epsilon")
    weight_decay: float = option(0.0, "AdamW's weight decay")
    clip_norm: float = option(0.0, "clip the gradient norm to this (0: no clipping, fairseq's default)")
    dropout: float | None = option(None, "override the preset's dropout")
    bf16: str = option("auto", "bf16 autocast (auto: on for CUDA devices that support it)", choices=("auto", "on", "off"))
    seed: int = option(1, "seed of the initialisation, the batches, dropout and (unless --split-seed) the split")
    split_seed: int | None = option(None, "seed of the train/valid/test split (default: --seed); runs that "
                                          "differ only in --seed then share one split, as a study's seeds do")
    log_every: int = option(20, "steps between training records in metrics.jsonl")
    eval_every: int = option(200, "steps between validations")
    save_every: int = option(200, "steps between checkpoints")
    keep_checkpoints: int = option(10, "checkpoints kept (at least --average-last)")
    average_last: int = option(10, "average the last N checkpoints (the paper's 10); the final model is the "
                                   "average or the last weights, whichever scores better on validation")
    average_window: float = option(0.1, "only checkpoints from this last fraction of the steps join the "
                                        "average (0.1: the last tenth; 1: any of the last --average-last)")
    distributed: str = option("ddp", "data parallelism under torchrun", choices=("ddp", "fsdp"))
    device: str = option("auto", "cpu, cuda, cuda:N, or auto (cuda when available)")
    compile: bool = option(False, "torch.compile the model for training (the compile time is reported once and "
                                  "left out of tokens/s)")
    progress: bool = option(True, "show progress: a bar on a terminal, a line every 30 seconds off one")
    init_from: str | None = option(None, "start from these weights (and their model): a finished headmix run "
                                         "folder, or a local Hugging Face folder converted by "
                                         "headmix.interop.from_pretrained; its tokenizer too, unless --tokenizer",
                                   metavar="RUN_DIR|HF_FOLDER")
    init_options: str | None = option(None, "convert the --init-from model (upcycling, any source): a JSON object, "
                                            "e.g. '{\"attention\": \"moh\", \"num_shared_heads\": 2, \"top_k\": "
                                            "2, \"router\": \"query_norm\"}' or the pruning control '{\"attention\": "
                                            "\"mha\", \"keep_heads\": 2}' (docs/hf.md, \"From a checkpoint to a "
                                            "routed model\")", metavar="JSON")
    distill_from: str | None = option(None, "distil from this parent (frozen): a finished headmix run, a folder headmix "
                                            "wrote, or a local Hugging Face folder, with the run's tokenizer; the loss is "
                                            "(1 - w) * task loss + w * T^2 * KL(parent || student) at temperature T "
                                            "(docs/training.md, \"Distillation\")", metavar="RUN_DIR|HF_FOLDER")
    distill_weight: float | None = option(None, "w, the distillation term's weight in [0, 1] (with --distill-from; "
                                                "default 0.5)")
    distill_temperature: float | None = option(None, "T, the softmax temperature of parent and student, > 0 (with "
                                                     "--distill-from; default 1)")

    def __post_init__(self) -> None:
        if self.preset is None and self.init_from is None:
            self.preset = DEFAULT_PRESET
        # whether the tokenizer comes from init_from and the vocabulary size was asked for (validate checks both)
        self._parent_tokenizer, self._vocab_size_given = False, self.vocab_size is not None
        if self.init_from is not None and self.tokenizer is None:
            found = tokenizer_of(self.init_from)  # the ids its embeddings were trained on
            if found is not None:
                self.tokenizer, self._parent_tokenizer = found, True
        if self.vocab_size is None:
            self.vocab_size = _json_preset_vocab_size(self.preset) or DEFAULT_VOCAB_SIZE
        self.check_values()  # a bad value fails here, on construction

    @property
    def task_spec(self):
        """The :class:`headmix.tasks.Task` of ``task``."""
        return get_task(self.task)

    @property
    def resolved_split_seed(self) -> int:
        return self.seed if self.split_seed is None else self.split_seed

    @property
    def resolved_lr(self) -> float:
        return self.lr if self.lr is not None else self.task_spec.default_lr

    @property
    def resolved_schedule(self) -> str:
        return self.schedule or self.task_spec.default_schedule

    @property
    def resolved_init_options(self) -> dict[str, Any]:
        """``init_options`` parsed (``{}`` when unset); ``ValueError`` for anything but a JSON object given with a
        Hugging Face ``init_from``."""
        if self.init_options is None:
            return {}
        import json

        try:
            options = json.loads(self.init_options)
        except ValueError as err:
            raise ValueError(f"init_options must be a JSON object, got {self.init_options!r} ({err})") from None
        if not isinstance(options, dict):
            raise ValueError(f"init_options must be a JSON object, got {self.init_options!r}")
        if self.init_from is None:
            raise ValueError("init_options apply to an init_from (the model they convert)")
        return options

    @property
    def resolved_distill_weight(self) -> float:
        """``distill_weight``, or 0.5 when unset."""
        from ..distillation.kl import DEFAULT_WEIGHT

        return DEFAULT_WEIGHT if self.distill_weight is None else self.distill_weight

    @property
    def resolved_distill_temperature(self) -> float:
        """``distill_temperature``, or 1 when unset."""
        from ..distillation.kl import DEFAULT_TEMPERATURE

        return DEFAULT_TEMPERATURE if self.distill_temperature is None else self.distill_temperature

    @property
    def resolved_warmup_steps(self) -> int:
        """``warmup_steps``, or a tenth of ``max_steps`` when unset."""
        return self.warmup_steps if self.warmup_steps is not None else self.max_steps // 10

    def schedule_warning(self) -> str | None:
        """A line saying why the schedule is not what the user likely meant (warm-up as long as the run: the
        learning rate never reaches its peak nor decays), or ``None``."""
        if self.resolved_warmup_steps >= self.max_steps > 0:
            return (f"warmup_steps ({self.resolved_warmup_steps}) >= max_steps ({self.max_steps}): the learning "
                    f"rate stays in its warm-up, at most {self.max_steps / max(self.resolved_warmup_steps, 1):.2g} "
                    f"of lr, and never decays")
        return None

    def check_values(self) -> None:
        """``ValueError`` naming the first option with a value it cannot take; the checks that need no file nor
        device (run on construction; :meth:`validate` adds those)."""
        get_task(self.task)
        for name, choices in (("schedule", SCHEDULES), ("distributed", ("ddp", "fsdp")), ("bf16", ("auto", "on", "off"))):
            value = getattr(self, name)
            if value is not None and value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        for name in ("max_steps", "max_tokens", "grad_accum", "max_len", "log_every", "eval_every", "save_every",
                     "keep_checkpoints", "average_last", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.pack is not None:
            given = [name for name in ("data", "tokenizer", "shared_data") if getattr(self, name) not in (None, [])]
            if self.task != "lm" or given:
                raise ValueError(f"pack {self.pack}: a token pack is a causal LM's whole data (task lm, no "
                                 f"{', '.join(given) or 'data, tokenizer or shared_data'} beside it), got task "
                                 f"{self.task!r}" + (f" and {', '.join(given)}" if given else ""))
        if self.tokenizer is None and self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (5 special tokens + 256 bytes + 1 merge), "
                             f"got {self.vocab_size}")
        if self.max_tokens < self.max_len:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be >= max_len ({self.max_len}): a batch holds "
                             f"at least one example of up to max_len tokens")
        if self.split_seed is not None and (isinstance(self.split_seed, bool) or not isinstance(self.split_seed, int)
                                            or self.split_seed < 0):
            raise ValueError(f"split_seed must be a non-negative integer, got {self.split_seed!r}")
        for name in ("seed", "warmup_steps"):
            value = getattr(self, name)
            if name == "warmup_steps" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if isinstance(self.average_window, bool) or not isinstance(self.average_window, (int, float)) \
                or not 0 < self.average_window <= 1:
            raise ValueError(f"average_window must be a fraction in (0, 1], got {self.average_window!r}")
        _positive("lr", self.lr, allow_none=True)
        _positive("max_time", self.max_time, allow_none=True)
        _positive("eps", self.eps)
        for name in ("weight_decay", "clip_norm"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("valid_size", "test_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"{name} must be a fraction in [0, 1), got {value!r}")
        if self.dropout is not None and not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.init_from is not None and self.preset is not None:
            raise ValueError(f"preset {self.preset!r} and init_from {self.init_from!r} both give the model: leave "
                             f"out preset (the model of init_from is trained on)")
        self.resolved_init_options  # noqa: B018 - checks the JSON
        if self.distill_from is None:
            given = [n for n in ("distill_weight", "distill_temperature") if getattr(self, n) is not None]
            if given:
                raise ValueError(f"{given[0]} applies to a distill_from (the parent to distil from), got none")
        else:
            from ..distillation.kl import check_distill_values

            check_distill_values(self.resolved_distill_weight, self.resolved_distill_temperature)

    def validate(self) -> None:
        """``ValueError`` naming the first option with a value it cannot take, ``FileNotFoundError`` for a
        missing input: everything that can be checked before a run writes anything (the values, the preset,
        the device, the input files)."""
        self.check_values()
        pick_device(self.device)
        self.task_spec.check_data_files(self.data)
        for p in self.data:
            if Path(p).is_dir():
                raise ValueError(f"data {p} is a folder; expected a file ({self.task_spec.name}: "
                                 f"{DATA_FORMS.get(self.task, 'a corpus file')})")
            if not Path(p).is_file():
                raise FileNotFoundError(f"data file not found: {p}")
        if self.shared_data is not None and not (Path(self.shared_data) / "train_config.json").is_file():
            raise FileNotFoundError(f"shared_data {self.shared_data} is not a folder of shared splits (no "
                                    f"train_config.json)")
        if self.tokenizer is not None and not Path(self.tokenizer).exists():
            raise FileNotFoundError(f"tokenizer not found: {self.tokenizer}")
        if self.init_from is not None and not Path(self.init_from).exists():
            raise FileNotFoundError(f"init_from {self.init_from} not found")
        if self.pack is not None and not (Path(self.pack) / "manifest.json").is_file():
            raise FileNotFoundError(f"pack {self.pack} is not a token pack (no manifest.json): build one with "
                                    f"`headmix data pack`")
        if Path(self.out).exists() and not Path(self.out).is_dir():
            raise ValueError(f"out {self.out} is a file, expected a run folder")
        if self.preset is not None:
            from ..models import get_config  # the preset (name, K/E/D string or JSON file) and its fields

            get_config(self.preset, task=self.task, vocab_size=self.vocab_size)
        if self.init_from is not None:
            source = Path(self.init_from)
            if not (source / "config.json").is_file():
                raise FileNotFoundError(f"init_from {source} holds no model (no config.json): expected a folder headmix wrote (a "
                                        f"finished run, save_pretrained, export-hf, a Trainer checkpoint-N) or a "
                                        f"local Hugging Face Llama / Qwen3 / JetMoe folder")
            if is_headmix_run(source) and not (source / "model.safetensors").is_file():
                raise FileNotFoundError(f"init_from {source} is a headmix run without its final model "
                                        f"(model.safetensors): finish it first (run its command again)")
            if self.tokenizer is None:
                raise ValueError(f"init_from {source} has no tokenizer (tokenizer/tokenizer.json or tokenizer.json): "
                                 f"give --tokenizer, the folder of the tokenizer its model was trained with (a new "
                                 f"one would give its embeddings other ids)")
            if self.init_options is not None:  # an impossible upcycling is refused before anything is written
                from ..interop.upcycle import check_upcycle

                try:
                    check_upcycle(source, self.resolved_init_options)
                except ValueError as err:
                    raise ValueError(f"init_options: {err}") from None
        if self.tokenizer is not None:  # its special ids, against the task and the parent model, before any write
            from .tokens import check_tokenizer

            check_tokenizer(self)
        if self.distill_from is not None:  # the parent, its tokenizer and vocabulary: before anything is written
            from ..distillation.parent import check_parent

            check_parent(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: ``preset`` when none is given (and no ``init_from``).
DEFAULT_PRESET = "tiny-moa"


#: ``vocab_size`` when neither the option nor a JSON preset gives one.
DEFAULT_VOCAB_SIZE = 8000
#: The smallest vocabulary of the byte-level BPE (:func:`headmix.data.train_tokenizer`): the special tokens, the
#: 256 bytes and one merge.
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256 + 1
#: What ``--data`` takes, per task (for the error on a folder).
DATA_FORMS = {"translation": "a TSV of pairs (src<TAB>tgt) or two aligned text files",
              "mlm": "a JSONL or plain-text file of documents", "lm": "a JSONL or plain-text file of documents"}


def _json_preset_vocab_size(preset: str) -> int | None:
    """The ``vocab_size`` a JSON model config ``preset`` holds, a file or given inline (``None`` for a preset name,
    or a config that does not hold one: :meth:`TrainConfig.validate` reports a bad one)."""
    import json

    inline = str(preset).lstrip().startswith("{")
    if not inline and (not str(preset).endswith(".json") or not Path(preset).is_file()):
        return None
    try:
        value = json.loads(preset if inline else Path(preset).read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _positive(name: str, value: float | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
