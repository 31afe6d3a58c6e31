"""What a kind of training is: :class:`Task`.

A task owns everything that differs between translation, masked LM and causal LM: reading and splitting
its corpus (the embedded one or the user's files), the file format of the stored splits, the datasets,
batching and collation, the model's inputs, its evaluation metric and its defaults (learning rate,
schedule). The training loop, the run folder, evaluation and analysis only call these methods; a new
task is one new module that subclasses :class:`Task` and calls :func:`headmix.tasks.register`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterable, Sequence

import torch

from ..data import ReadReport, Split, TokenBatchSampler, Tokenizer

#: ``RUN/data/SHARED_SPLITS``: the run read its splits from a shared folder (a study's ``shared/``), whose
#: ``data/`` this file names relative to ``RUN/data`` (``{"data": "../../../shared/data"}``)
SHARED_SPLITS = "shared.json"


@dataclass
class EvaluationOptions:
    """The options of ``headmix evaluate``; each task reads those that apply to it."""

    split: str = "test"
    beam_size: int = 4
    length_penalty: float = 1.0
    limit: int | None = None  # only the first N items of the split
    compound_split: bool = False
    output: str | os.PathLike | None = None  # translation: write the hypotheses here
    max_tokens: int = 8192
    device: str = "cpu"
    progress: bool = False  # a progress bar on stderr (on a terminal only)


class Task:
    """One kind of training. Subclasses set the class attributes and implement the corpus, dataset and
    metric methods."""

    #: the name used on the command line and stored in ``train_config.json`` and ``config.json``
    name: ClassVar[str]
    #: the extension of the stored splits ``RUN/data/{train,valid,test}.EXT``
    data_extension: ClassVar[str]
    #: the peak learning rate when ``TrainConfig.lr`` is None
    default_lr: ClassVar[float]
    #: the learning-rate schedule when ``TrainConfig.schedule`` is None
    default_schedule: ClassVar[str]
    #: how many ``--data`` files the task reads at most
    max_data_files: ClassVar[int] = 1
    #: what ``--data`` should be, for messages and help
    data_description: ClassVar[str]
    #: the model's forward inputs that are not targets (analysis feeds these)
    input_names: ClassVar[tuple[str, ...]]
    #: the model's forward inputs, targets included, as named in a collated batch
    batch_names: ClassVar[tuple[str, ...]]
    #: what one item of the corpus is, for messages
    item_name: ClassVar[str]
    #: whether :meth:`evaluate` scores generated text (translation: BLEU, chrF) beyond the validation loss a
    #: run's summary already holds (a study evaluates such runs on their test split)
    scores_generations: ClassVar[bool] = False

    # ------------------------------------------------------------------------------------------- corpus

    def read_corpus(self, files: Sequence[str], *, strict: bool, src_lang: str, tgt_lang: str,
                    report: ReadReport) -> list:
        """The whole corpus: ``files`` ([] = the embedded corpus), malformed lines counted in ``report``."""
        raise NotImplementedError

    def split_corpus(self, items: list, *, valid_size: float, test_size: float, seed: int) -> Split:
        raise NotImplementedError

    def read_items(self, path: str | os.PathLike, *, strict: bool = True) -> list:
        """Read a stored split (or a user file of the same format)."""
        raise NotImplementedError

    def write_items(self, items: Iterable, path: str | os.PathLike) -> None:
        raise NotImplementedError

    def tokenizer_texts(self, items: list) -> Iterable[str]:
        """The texts a tokenizer is trained on."""
        raise NotImplementedError

    def check_data_files(self, files: Sequence[str]) -> None:
        """``ValueError`` when ``files`` cannot be this task's ``--data``."""
        if len(files) > self.max_data_files:
            raise ValueError(f"data for task {self.name!r} is {self.data_description}, got {len(files)} files")

    def split_path(self, data_dir: str | os.PathLike, split: str) -> Path:
        return Path(data_dir) / f"{split}.{self.data_extension}"

    def stored_split(self, run_dir: str | os.PathLike, split: str) -> Path:
        """The split a run trained with: ``RUN/data/SPLIT.EXT``, or the shared folder's that
        ``RUN/data/shared.json`` names (a study's runs keep no copy of the splits)."""
        data_dir = Path(run_dir) / "data"
        own = self.split_path(data_dir, split)
        pointer = data_dir / SHARED_SPLITS
        if own.is_file() or not pointer.is_file():
            return own
        return self.split_path(data_dir / json.loads(pointer.read_text())["data"], split)

    # ------------------------------------------------------------------------------------------ batches

    def dataset(self, items: list, tokenizer: Tokenizer, max_len: int, *,
                sequence_start: str | None = None) -> torch.utils.data.Dataset:
        """The blocks or pairs of ``items``; ``sequence_start``: how a causal LM's document starts (its model config's
        :attr:`~headmix.models.ModelConfig.sequence_start`, which the causal LM needs; the other tasks take none)."""
        raise NotImplementedError

    def collator(self, tokenizer: Tokenizer, *, seed: int):
        """The batch collation function. ``seed`` seeds any randomness of the batches (MLM masking)."""
        raise NotImplementedError

    def loader(self, dataset, tokenizer: Tokenizer, *, max_tokens: int, train: bool, seed: int, rank: int = 0,
               world_size: int = 1) -> torch.utils.data.DataLoader:
        """Batches of about ``max_tokens`` tokens, length-bucketed; shuffled and split across ranks for
        training, in order and whole for evaluation."""
        sampler = TokenBatchSampler(dataset.lengths, max_tokens, shuffle=train, seed=seed,
                                    rank=rank if train else 0, world_size=world_size if train else 1)
        # Validation batches are masked with another seed than the training ones (MLM).
        collate = self.collator(tokenizer, seed=seed + (0 if train else 7919))
        # A generator of its own: creating an iterator would otherwise draw from the global RNG and shift the
        # dropout masks of a resumed run.
        return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                                           generator=torch.Generator().manual_seed(seed))

    def model_inputs(self, batch: dict[str, Any], device: torch.device | str) -> dict[str, torch.Tensor]:
        """The keyword arguments of the model's forward (targets included) for a collated batch."""
        return {name: batch[name].to(device) for name in self.batch_names}

    def analysis_inputs(self, batch: dict[str, Any], tokenizer: Tokenizer, *, mlm_masking: bool = False
                        ) -> dict[str, torch.Tensor]:
        """The forward inputs without targets, as the analyses feed them."""
        return {name: batch[name] for name in self.input_names}

    # --------------------------------------------------------------------------------------- evaluation

    def evaluate(self, run: Any, options: EvaluationOptions) -> dict[str, Any]:
        """This task's metric on a split of a finished run (a :class:`headmix.runs.LoadedRun`)."""
        raise NotImplementedError
