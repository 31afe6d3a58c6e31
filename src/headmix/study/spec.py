"""What a study is: :class:`StudySpec` (rows, seeds, the shared training setup), read from TOML or JSON.

A spec file::

    name = "my-lm-study"
    task = "lm"                       # translation, mlm or lm
    baseline = "mini-mha"             # the preset (or JSON model config) whose attention the rows match
    data = ["docs.jsonl"]             # optional: default the embedded corpus
    seeds = [1, 2, 3]
    max_steps = 600
    [training]                        # any TrainConfig option, the same for every row
    max_tokens = 2048
    lr = 2e-3
    warmup_steps = 100

    [[rows]]
    name = "MHA"                      # the first row is the baseline: its attention is the baseline's
    [[rows]]
    name = "MoA E=16"
    attention = { kind = "moa", num_experts = 16, top_k = 4 }
    solve = ["head_dim"]              # sized to the baseline's attention MACs within the tolerance
    prefer = { head_dim = 32 }
    [[rows]]
    name = "MoA E=16 random"          # a control: the same row with random routing
    attention = { kind = "moa", num_experts = 16, top_k = 4, router = "random" }
    solve = ["head_dim"]
    prefer = { head_dim = 32 }
    control_of = "MoA E=16"           # the report compares the two, paired by seed

A continuation study (``parent``) trains the baseline once and every run of every row continues it, converted as
the row's ``init_options`` say (:mod:`headmix.interop.upcycle`); its rows keep the parent's shape
(``matching = "none"``), so the report states each row's MACs instead of matching them::

    matching = "none"
    max_steps = 400                   # the continuation's steps
    [parent]
    max_steps = 1600
    seed = 1
    training = { lr = 2e-3, warmup_steps = 100 }    # the parent's options that differ from [training]
    [[rows]]
    name = "dense continued"          # the baseline row: the parent as it is
    [[rows]]
    name = "MoH query-norm 75%"
    init_options = { attention = "moh", num_shared_heads = 4, top_k = 2, router = "query_norm" }
    [[rows]]
    name = "MoH learned 75%"
    init_options = { attention = "moh", num_shared_heads = 4, top_k = 2 }
    [[rows]]
    name = "MoH learned 75% distilled"    # the same, continued with distillation from the parent
    init_options = { attention = "moh", num_shared_heads = 4, top_k = 2 }
    distill = { weight = 0.5, temperature = 1.0 }
    [[rows]]
    name = "pruned 75%"
    init_options = { attention = "mha", keep_heads = 3 }
    control_of = ["MoH query-norm 75%", "MoH learned 75%"]   # a control may serve several rows

Relative paths in a spec file are relative to the file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..models import ModelConfig, get_config
from ..models.counting import check_convention
from .matching import MOH_COUNTS, SOLVABLE

#: TrainConfig options a spec may not set: the study sets them itself for every run.
STUDY_OWNED = ("task", "preset", "out", "data", "seed", "tokenizer", "progress", "init_from", "init_options",
               "distill_from", "distill_weight", "distill_temperature")
#: How rows are sized: "macs" (to the baseline's attention MACs, within ``tolerance``) or "none" (each row keeps
#: the shape it is given, or its parent's; the report states every row's MACs).
MATCHING = ("macs", "none")


def controlled_rows(control_of: str | list[str] | None) -> list[str]:
    """A row's ``control_of`` as a list of the rows it controls (empty for a row that controls none)."""
    if control_of is None:
        return []
    return [control_of] if isinstance(control_of, str) else list(control_of)


def undistilled_twins(rows: list["RowSpec"]) -> list[tuple[str, str]]:
    """Each distilled row (``distill`` set) with its undistilled twin, ``(distilled, twin)``: the one row without
    distillation that converts and trains as it does (every field the same but the name, ``distill`` and
    ``control_of``). A distilled row with no such row, or with more than one, has no twin."""
    def converts(row: RowSpec) -> tuple:
        return (row.attention, row.solve, row.prefer, row.init_options, row.causal_eval)

    plain = [r for r in rows if r.distill is None]
    pairs = []
    for row in (r for r in rows if r.distill is not None):
        twins = [r.name for r in plain if converts(r) == converts(row)]
        if len(twins) == 1:
            pairs.append((row.name, twins[0]))
    return pairs


@dataclass
class RowSpec:
    """One row of a study: an attention variant."""

    name: str
    #: AttentionConfig fields fixed for this row; empty for the baseline row (the baseline's attention)
    attention: dict[str, Any] = field(default_factory=dict)
    #: AttentionConfig fields chosen to match the baseline's attention MACs
    solve: list[str] = field(default_factory=list)
    #: preferred values of the solved fields (the closest feasible one wins)
    prefer: dict[str, Any] = field(default_factory=dict)
    #: the name of the (routed) row this row is a control of, or a list of such rows: its random-routing twin, or
    #: the dense model with the same active compute; the report shows each of them minus this one, paired by seed
    control_of: str | list[str] | None = None
    #: MoSA rows: also evaluate each run's final model with the causal threshold rule (beside the top-k over
    #: the whole sequence it trains with); the report shows the gap, paired by seed
    causal_eval: bool = False
    #: a continuation study's rows (``StudySpec.parent``): how this row converts the parent before it continues
    #: training, as ``headmix train --init-options`` takes it (:mod:`headmix.interop.upcycle`: ``attention``,
    #: ``num_shared_heads``, ``top_k``, ``router``, ``route_per_group``, ``keep_heads``...); empty: the parent as
    #: it is (the dense continuation)
    init_options: dict[str, Any] = field(default_factory=dict)
    #: a continuation study's rows: distil from the study's parent while continuing (``headmix train
    #: --distill-from``), with these options: ``weight`` (in [0, 1], default 0.5) and ``temperature`` (> 0, default
    #: 1); an empty table distils with the defaults; ``None`` (the default): no distillation
    distill: dict[str, Any] | None = None

    @property
    def controls(self) -> list[str]:
        """The rows this row is a control of (:func:`controlled_rows`)."""
        return controlled_rows(self.control_of)

    @property
    def distill_options(self) -> dict[str, Any]:
        """The TrainConfig options of this row's distillation from ``parent`` (``{}`` without one)."""
        if self.distill is None:
            return {}
        return {f"distill_{k}": v for k, v in self.distill.items()}

    def validate(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"rows[].name must be a non-empty string, got {self.name!r}")
        for f in self.solve:
            if f not in SOLVABLE:
                raise ValueError(f"rows[{self.name!r}].solve must name fields of {SOLVABLE}, got {f!r}")
        if self.solve and not self.attention:
            raise ValueError(f"rows[{self.name!r}].solve needs rows[{self.name!r}].attention (at least its kind)")
        controls = self.control_of if isinstance(self.control_of, list) else [self.control_of]
        if self.control_of is not None and (not controls or any(not isinstance(c, str) or c == self.name
                                                                for c in controls) or len(set(controls)) < len(controls)):
            raise ValueError(f"rows[{self.name!r}].control_of must name another row, or a list of other rows, got "
                             f"{self.control_of!r}")
        if self.distill is not None:
            if not isinstance(self.distill, dict) or set(self.distill) - {"weight", "temperature"}:
                raise ValueError(f"rows[{self.name!r}].distill must be a table of weight and temperature (empty: the "
                                 f"defaults), got {self.distill!r}")
            from ..distillation.kl import DEFAULT_TEMPERATURE, DEFAULT_WEIGHT, check_distill_values

            check_distill_values(self.distill.get("weight", DEFAULT_WEIGHT),
                                 self.distill.get("temperature", DEFAULT_TEMPERATURE), prefix=f"rows[{self.name!r}].distill.")
        if not isinstance(self.causal_eval, bool):
            raise ValueError(f"rows[{self.name!r}].causal_eval must be true or false, got {self.causal_eval!r}")
        if not isinstance(self.init_options, dict):
            raise ValueError(f"rows[{self.name!r}].init_options must be a table of upcycling options, got "
                             f"{self.init_options!r}")
        if self.init_options and (self.attention or self.solve):
            raise ValueError(f"rows[{self.name!r}]: init_options convert the parent, whose attention is the row's: "
                             f"give init_options or attention/solve, not both")
        if self.causal_eval and self.attention.get("kind") != "mosa":
            raise ValueError(f"rows[{self.name!r}].causal_eval applies to MoSA rows (attention kind 'mosa'), got "
                             f"kind {self.attention.get('kind')!r}")


@dataclass
class ParentSpec:
    """The run every row of a continuation study starts from: the study's baseline model, trained once (in
    ``OUT/parent/``) on the study's data, split and tokenizer, and shared by every row and seed."""

    #: the parent's optimizer steps
    max_steps: int
    #: the parent's seed (initialisation, batch order): one parent, so the rows' intervals hold the variance of
    #: the continuations' seeds, not parent to parent
    seed: int = 1
    #: TrainConfig options of the parent that differ from the study's ``training`` (which the rows' continuation
    #: runs take: a fresh optimizer and their own schedule)
    training: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps <= 0:
            raise ValueError(f"parent.max_steps must be a positive integer, got {self.max_steps!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"parent.seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.training, dict):
            raise ValueError(f"parent.training must be a table of training options, got {self.training!r}")
        owned = sorted(set(self.training) & set(STUDY_OWNED + ("max_steps", "split_seed")))
        if owned:
            raise ValueError(f"parent.training must not set {owned}: the study sets them for the parent")


@dataclass
class StudySpec:
    """A comparison of attention variants at equal compute."""

    #: the study's name (its folder name by default)
    name: str
    #: translation, mlm or lm
    task: str
    #: preset name, JSON model config file, or a model config given inline (a table / dict): the model every
    #: row shares; its attention is the baseline's
    baseline: str | dict[str, Any]
    rows: list[RowSpec]
    #: seeds of every row (initialisation, batch order, dropout); at least 3 for an interval worth reading
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    #: optimizer steps of every run (steps, not seconds: the result must not depend on the machine)
    max_steps: int = 500
    #: corpus files (TrainConfig.data); [] = the task's embedded corpus
    data: list[str] = field(default_factory=list)
    #: causal LM: a token pack folder (``headmix data pack``) instead of ``data``: its split, tokenizer and token
    #: ids, checked against its checksums before any work; where it lives does not define the study
    pack: str = ""
    #: the pack's checksum (``headmix data pack`` prints it): the pack the study was designed for (another is
    #: refused)
    pack_sha256: str = ""
    #: seed of the train/valid/test split and of the shared tokenizer, the same for every run
    split_seed: int = 1
    #: the attention MACs of every row within this fraction of the baseline's
    tolerance: float = 0.02
    #: sparse MoH rows (moh_impl = "sparse") sized by what they compute ("computed") or by the dense count
    #: ("dense": the same head sizes as a dense MoH row); the report says which
    moh_count: str = "computed"
    #: how attention's score and weights x values products are counted when the rows are matched: "full" (every
    #: query-key pair, the MoA and SwitchHead papers' convention) or "causal" (the decoder's self-attention as a
    #: causal flash kernel computes it, in 128 x 128 tiles); the report shows the ratio under the other beside it
    attention_macs: str = "full"
    #: sequence lengths at which MACs are counted (default: the model's block length for LMs, the
    #: paper's Appendix E lengths for translation)
    macs_src_len: int | None = None
    macs_tgt_len: int | None = None
    #: translation: test sentences scored with BLEU per run (beam 1 keeps the study affordable)
    bleu_sentences: int = 300
    bleu_beam: int = 1
    #: other TrainConfig options, the same for every run (``device``, ``bf16`` and ``compile`` included)
    training: dict[str, Any] = field(default_factory=dict)
    #: checkpoints each run keeps once it has finished: its newest ``keep_checkpoints`` intact ones (1: enough to
    #: train it further; 0: none, its final model, metrics and summary stay; ``None``: all its training kept).
    #: While a run trains it keeps what its averaging needs (``training.keep_checkpoints``, ``average_last``)
    keep_checkpoints: int | None = 1
    #: true: keep no checkpoint of a finished run (``keep_checkpoints = 0``, the older spelling)
    drop_checkpoints: bool = False
    #: where the corpus comes from, for the message when a data file is missing (``headmix data ...``)
    data_note: str = ""
    #: "": a study sized for the CPU; else that it wants a GPU and roughly how long a row takes on one H100,
    #: with how that was found (measured or estimated), for ``headmix study --list``
    gpu: str = ""
    #: the equal-time phase (:mod:`headmix.study.timing`): rounds of interleaved timing of each row against the
    #: baseline (the median ratio over rounds is reported, with an order-statistic interval: at least 6 rounds)
    timing_rounds: int = 10
    #: training steps of each model per round
    timing_steps: int = 3
    #: untimed steps of each model before the first round (allocation, compilation)
    timing_warmup: int = 5
    #: how rows are sized (:data:`MATCHING`): "macs", to the baseline's attention MACs within ``tolerance``
    #: (rows name the fields to solve); "none", each row keeps its shape (its ``attention`` as given, or its
    #: parent's converted by ``init_options``) and the report states each row's MACs
    matching: str = "macs"
    #: a continuation study: the run every row starts from (:class:`ParentSpec`); ``max_steps`` and ``training``
    #: are then the continuation's, the rows set ``init_options`` (not ``attention``) and ``matching`` is "none"
    parent: ParentSpec | None = None

    def validate(self) -> None:
        from ..tasks import TASKS  # the task registry

        if self.task not in TASKS:
            raise ValueError(f"task must be one of {tuple(TASKS)}, got {self.task!r}")
        self.baseline_config()  # a clear error for a bad baseline
        if not self.rows:
            raise ValueError("rows must list at least the baseline row")
        if self.rows[0].attention or self.rows[0].solve or self.rows[0].init_options or self.rows[0].distill is not None:
            raise ValueError(f"the first row ({self.rows[0].name!r}) is the baseline: it takes the baseline's "
                             f"attention and training, so it sets neither attention, solve, init_options nor distill")
        names = [r.name for r in self.rows]
        if len(set(names)) != len(names):
            raise ValueError(f"rows must have distinct names, got {names}")
        for row in self.rows:
            row.validate()
            unknown = [c for c in row.controls if c not in names]
            if unknown:
                raise ValueError(f"rows[{row.name!r}].control_of must name a row of the study, got {unknown[0]!r}")
        if self.matching not in MATCHING:
            raise ValueError(f"matching must be one of {MATCHING}, got {self.matching!r}")
        if self.parent is not None:
            if not isinstance(self.parent, ParentSpec):
                raise ValueError(f"parent must be a table (max_steps, seed, training), got {self.parent!r}")
            self.parent.validate()
            if self.matching != "none":
                raise ValueError('a study with a parent keeps the parent\'s shape in every row: set matching = "none"')
            if self.pack:
                raise ValueError("parent: a continuation study reads data (the shared split), not a pack")
            shaped = [r.name for r in self.rows if r.attention or r.solve]
            if shaped:
                raise ValueError(f"rows {shaped}: in a study with a parent a row converts the parent with "
                                 f"init_options, it sets no attention or solve")
        else:
            converting = [r.name for r in self.rows if r.init_options]
            if converting:
                raise ValueError(f"rows {converting} set init_options, which convert a parent: give the study a "
                                 f"parent (max_steps, seed)")
            distilling = [r.name for r in self.rows if r.distill is not None]
            if distilling:
                raise ValueError(f"rows {distilling} set distill, which distils from the study's parent: give the "
                                 f"study a parent (max_steps, seed)")
        if self.matching == "none":
            solving = [r.name for r in self.rows if r.solve]
            if solving:
                raise ValueError(f'rows {solving} solve fields to match MACs, but matching is "none"')
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or any(
                isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in self.seeds):
            raise ValueError(f"seeds must be distinct non-negative integers, got {self.seeds!r}")
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps <= 0:
            raise ValueError(f"max_steps must be a positive integer, got {self.max_steps!r}")
        if not 0 < self.tolerance < 1:
            raise ValueError(f"tolerance must be in (0, 1), got {self.tolerance!r}")
        check_convention(self.attention_macs)
        if self.pack and (self.data or self.task != "lm"):
            raise ValueError(f"pack {self.pack!r}: a token pack is a causal LM's whole data: give either data or "
                             f"pack (task lm), got task {self.task!r} and data {self.data!r}")
        if self.pack_sha256 and (not self.pack or len(self.pack_sha256) != 64
                                 or set(self.pack_sha256) - set("0123456789abcdef")):
            raise ValueError(f"pack_sha256 must be the pack's checksum (64 hex digits), with pack set, got "
                             f"{self.pack_sha256!r}")
        if self.moh_count not in MOH_COUNTS:
            raise ValueError(f"moh_count must be one of {MOH_COUNTS}, got {self.moh_count!r}")
        if not isinstance(self.drop_checkpoints, bool):
            raise ValueError(f"drop_checkpoints must be true or false, got {self.drop_checkpoints!r}")
        if self.keep_checkpoints is not None and (isinstance(self.keep_checkpoints, bool) or not isinstance(
                self.keep_checkpoints, int) or self.keep_checkpoints < 0):
            raise ValueError(f"keep_checkpoints must be an integer >= 0 or null (all), got {self.keep_checkpoints!r}")
        for name, least in (("timing_rounds", 6), ("timing_steps", 1), ("timing_warmup", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        owned = sorted(set(self.training) & set(STUDY_OWNED + ("max_steps", "split_seed")))
        if owned:
            raise ValueError(f"training must not set {owned}: the study sets them for every run")

    @property
    def finished_checkpoints(self) -> int | None:
        """How many checkpoints a finished run keeps (``None``: all): ``keep_checkpoints``, 0 with
        ``drop_checkpoints``."""
        return 0 if self.drop_checkpoints else self.keep_checkpoints

    def baseline_config(self) -> ModelConfig:
        """The baseline's model config (a preset, a JSON file, or the inline config)."""
        if isinstance(self.baseline, dict):
            try:
                config = ModelConfig.from_dict(self.baseline)
            except (TypeError, ValueError) as err:
                raise ValueError(f"baseline: not a model config: {err}") from None
            if config.task != self.task:
                raise ValueError(f"baseline is a {config.task!r} model, the study's task is {self.task!r}")
            return config
        return get_config(self.baseline, task=self.task)

    @property
    def baseline_name(self) -> str:
        """The baseline for a report: its preset or file name, or a short description of an inline config."""
        if isinstance(self.baseline, dict):
            b = self.baseline
            return f"inline config: d_model {b.get('d_model')}, {b.get('decoder_layers') or b.get('encoder_layers')} layers"
        return str(self.baseline)

    @classmethod
    def from_dict(cls, data: dict[str, Any], base_dir: str | os.PathLike | None = None) -> StudySpec:
        if not isinstance(data, dict):
            raise ValueError(f"a study spec must be a table/object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown field(s) {unknown} in the study spec; known fields: {sorted(known)}")
        data = dict(data)
        rows = []
        for r in data.get("rows", []):
            row_known = {f.name for f in dataclasses.fields(RowSpec)}
            if not isinstance(r, dict) or set(r) - row_known:
                raise ValueError(f"rows[] entries take the fields {sorted(row_known)}, got {r!r}")
            rows.append(RowSpec(**r))
        data["rows"] = rows
        if isinstance(data.get("parent"), dict):
            parent_known = {f.name for f in dataclasses.fields(ParentSpec)}
            if set(data["parent"]) - parent_known or "max_steps" not in data["parent"]:
                raise ValueError(f"parent takes the fields {sorted(parent_known)} (max_steps at least), got "
                                 f"{data['parent']!r}")
            data["parent"] = ParentSpec(**data["parent"])
        if base_dir is not None:
            base = Path(base_dir)
            data["data"] = [str(base / p) for p in data.get("data", [])]
            if data.get("pack"):
                data["pack"] = str(base / data["pack"])
            if str(data.get("baseline", "")).endswith(".json"):
                data["baseline"] = str(base / data["baseline"])
        try:
            spec = cls(**data)
        except TypeError as err:
            raise ValueError(f"study spec: {err}") from None
        spec.validate()
        return spec

    @classmethod
    def load(cls, path: str | os.PathLike) -> StudySpec:
        """Read a ``.toml`` or ``.json`` spec file."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"study spec not found: {path}")
        text = path.read_text()
        if path.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10: the same parser, packaged as tomli
                import tomli as tomllib

            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as err:
                raise ValueError(f"{path} is not valid TOML: {err}") from None
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} is not valid JSON: {err}") from None
        return cls.from_dict(data, base_dir=path.parent)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def data_options(spec: StudySpec, out: Path) -> dict[str, Any]:
    """The TrainConfig options that give a study's run its data: the token pack, or the corpus with the splits
    and tokenizer prepared once in ``OUT/shared/``."""
    if spec.pack:
        return {"pack": os.path.abspath(spec.pack)}
    shared = Path(out) / "shared"
    return {"data": list(spec.data), "tokenizer": str(shared / "tokenizer"), "shared_data": str(shared)}
