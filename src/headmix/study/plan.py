"""Planning a study: each row matched to the baseline's attention MACs, and the plan a study folder stores
(``study.json``) and checks when the study is continued."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models import AttentionConfig, ModelConfig, analytic_macs, analytic_parameters
from ..storage.files import atomic_write
from .matching import Match, attention_macs_of, match_attention, with_attention
from .spec import StudySpec


@dataclass
class PlannedRow:
    """A row with its matched model config."""

    name: str
    config: ModelConfig
    attention_macs: int
    macs: int
    parameters: int
    macs_ratio: float  # attention MACs / the baseline's

    def to_dict(self) -> dict[str, Any]:
        att = self.config.attention_roles()[0]
        attention = getattr(self.config, att)
        return {"name": self.name, "attention": {**attention.to_dict(),
                                                 "head_dim": attention.resolved_head_dim(self.config.d_model)},
                "attention_macs": self.attention_macs, "macs": self.macs, "parameters": self.parameters,
                "attention_macs_ratio": self.macs_ratio}


def macs_lengths(spec: StudySpec, baseline: ModelConfig) -> tuple[int | None, int | None]:
    """The lengths MACs are counted at: the spec's, else the block length for LMs (``max_len``) and
    Appendix E's for translation."""
    if spec.macs_src_len is not None or spec.macs_tgt_len is not None:
        return spec.macs_src_len, spec.macs_tgt_len
    block = spec.training.get("max_len", 128)
    if not baseline.encoder_layers:  # decoder only: the causal LM
        return None, block
    if not baseline.decoder_layers:  # encoder only: the masked LM
        return block, None
    return None, None


def plan(spec: StudySpec) -> list[PlannedRow]:
    """Each row's model config, sized to the baseline's attention MACs (see :mod:`headmix.study.matching`); with
    ``matching = "none"`` as given, and in a continuation study the parent's (the baseline's) converted by the
    row's ``init_options`` (:func:`headmix.interop.upcycle.upcycled_config`)."""
    baseline = spec.baseline_config()
    src_len, tgt_len = macs_lengths(spec, baseline)
    target = attention_macs_of(baseline, src_len, tgt_len, attention=spec.attention_macs)
    rows = []
    for row in spec.rows:
        if row.init_options:
            from ..interop.upcycle import upcycled_config

            try:
                config = upcycled_config(baseline, **row.init_options)
            except (TypeError, ValueError) as err:
                raise ValueError(f"row {row.name!r}: init_options: {err}") from None
        elif not row.attention:
            config = baseline
        elif row.solve:
            try:
                match: Match = match_attention(baseline, row.attention, row.solve, prefer=row.prefer,
                                               tolerance=spec.tolerance, src_len=src_len, tgt_len=tgt_len,
                                               moh_count=spec.moh_count, attention=spec.attention_macs)
            except ValueError as err:
                raise ValueError(f"row {row.name!r}: {err}") from None
            config = with_attention(baseline, match.attention)
        else:
            try:
                config = with_attention(baseline, AttentionConfig(**row.attention))
            except (TypeError, ValueError) as err:
                raise ValueError(f"row {row.name!r}: {err}") from None
        att_macs = attention_macs_of(config, src_len, tgt_len, spec.moh_count, spec.attention_macs)
        if spec.matching == "macs" and abs(att_macs / target - 1) > spec.tolerance:
            raise ValueError(f"row {row.name!r}: its attention costs {att_macs / target:.3f}x the baseline's MACs, "
                             f"outside the tolerance {spec.tolerance:.0%}; name fields to solve for")
        rows.append(PlannedRow(row.name, config, att_macs,
                               analytic_macs(config, src_len, tgt_len, attention=spec.attention_macs).total,
                               analytic_parameters(config).total, att_macs / target))
    return rows


def slug(name: str) -> str:
    """A folder name for a row name (``MoA E=16`` -> ``MoA_E-16``)."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", name.replace("=", "-")).strip("_") or "row"


def check_plan(spec: StudySpec, planned: list[PlannedRow], out: Path) -> dict[str, Any]:
    """``study.json``'s record of ``spec``; ``ValueError`` when ``out`` holds another study."""
    record = {"spec": spec.to_dict(), "rows": [r.to_dict() for r in planned]}
    path = out / "study.json"
    if path.is_file():
        stored = _with_new_defaults(json.loads(path.read_text()))
        if not _extends(stored, record):
            raise ValueError(f"{out} holds another study ({path}): use another --out, or the same spec "
                             f"(only seeds and rows may be added)")
    return record


def _extends(stored: dict[str, Any], record: dict[str, Any]) -> bool:
    """Whether the study ``record`` is the ``stored`` one with seeds or rows added: every stored row (its spec and
    its matched attention) is in ``record`` unchanged, and the rest of the spec is the same. A row's
    ``control_of`` may change (e.g. a static control that also serves a row added later): it says how the report
    pairs finished runs, not what a run trains."""
    def by_name(rows: list[Any]) -> dict[str, Any]:
        return {r.get("name"): r for r in rows if isinstance(r, dict)}

    def trained(row: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if row is None else {k: v for k, v in row.items() if k != "control_of"}

    old_spec, new_spec = stored.get("spec", {}), record["spec"]
    old_rows = {n: trained(r) for n, r in by_name(old_spec.get("rows", [])).items()}
    new_rows = {n: trained(r) for n, r in by_name(new_spec.get("rows", [])).items()}
    old_plan, new_plan = by_name(stored.get("rows", [])), by_name(record["rows"])
    same_rows = all(new_rows.get(n) == r for n, r in old_rows.items()) and all(
        new_plan.get(n) == r for n, r in old_plan.items()) and len(old_plan) == len(stored.get("rows", []))
    return same_rows and _comparable({**old_spec, "rows": None}) == _comparable({**new_spec, "rows": None})


def _defaults(cls) -> dict[str, Any]:
    import dataclasses

    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def _with_new_defaults(stored: dict[str, Any]) -> dict[str, Any]:
    """``study.json`` of an older version as this version writes it: the spec and attention fields added since
    (absent from the file) take their defaults, which is what the older version did without naming them; the
    file is then rewritten with them (:func:`_write_plan`)."""
    from ..models import AttentionConfig
    from ..models.config import marked_as_trained  # AttentionConfig.marked_as_trained (it builds the config it reads)
    from ..models.config_migrations import shared_head_kv_as_trained, with_kind_defaults, without_foreign_defaults
    from ..routing.task_gradient import ALLOW_FLAG

    def as_trained(stored_attention: dict[str, Any]) -> dict[str, Any]:
        # a router without a task gradient, stored before the rule that refuses it, is the ablation it was trained
        # as; a GQE shared head stored before shared_head_kv read K/V head 0
        return shared_head_kv_as_trained(marked_as_trained(without_foreign_defaults(stored_attention)))

    def attention(stored_attention: dict[str, Any]) -> dict[str, Any]:
        # fields added since take their defaults; the defaults older files stored for kinds that do not use a
        # field are unset (None), as this version writes them
        # (and the unset fields the kind resolves on construction take the value it resolves them to)
        kept = as_trained(stored_attention)
        unset = {k: None for k in stored_attention.keys() - kept.keys()}
        return with_kind_defaults({**_defaults(AttentionConfig), **kept, **unset})

    from .spec import RowSpec

    stored_rows = [r for r in stored.get("rows", []) if isinstance(r, dict)]
    rows = [{**r, "attention": attention(r.get("attention", {}))} if isinstance(r, dict) else r
            for r in stored.get("rows", [])]
    # the keys set above on each planned row that lacked them, by row name
    marks = {r.get("name"): {k: v for k, v in as_trained(r.get("attention", {})).items()
                             if k in (ALLOW_FLAG, "shared_head_kv") and k not in r.get("attention", {})}
             for r in stored_rows}

    def spec_row(row: dict[str, Any]) -> dict[str, Any]:
        # the spec row of a planned row marked above, marked as well (its matched attention came from it)
        added = {k: v for k, v in marks.get(row.get("name"), {}).items() if k not in row.get("attention", {})}
        return {**row, "attention": {**row.get("attention", {}), **added}} if added else row

    spec = {**_defaults(StudySpec), **stored.get("spec", {})}
    spec["rows"] = [{**_defaults(RowSpec), **spec_row(r)} if isinstance(r, dict) else r for r in spec.get("rows", [])]
    return {**stored, "rows": rows, "spec": spec}


def _write_plan(spec: StudySpec, planned: list[PlannedRow], out: Path) -> None:
    """``study.json`` and ``configs/ROW.json``; a rerun with another spec in the same folder is refused."""
    record = check_plan(spec, planned, out)
    path = out / "study.json"
    for row in planned:
        target = out / "configs" / f"{slug(row.name)}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        text = row.config.to_json()
        if not target.is_file() or target.read_text() != text:
            atomic_write(target, text)
    atomic_write(path, json.dumps(record, indent=2) + "\n")


#: Spec fields that do not define a study: adding seeds extends it; where it runs, whether it compiles and
#: whether it keeps checkpoints do not change what it measures (the report states each run's machine).
NOT_DEFINING = ("seeds", "drop_checkpoints", "keep_checkpoints", "data_note", "gpu", "timing_rounds", "timing_steps",
                "timing_warmup", "pack")


NOT_DEFINING_TRAINING = ("device", "compile", "progress")


def _comparable(spec: dict[str, Any]) -> dict[str, Any]:
    kept = {k: v for k, v in spec.items() if k not in NOT_DEFINING}
    kept["training"] = {k: v for k, v in spec.get("training", {}).items() if k not in NOT_DEFINING_TRAINING}
    return kept
