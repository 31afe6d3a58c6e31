"""Sizing an attention variant to a baseline's attention MACs (``headmix study`` sizes its rows with it,
:mod:`headmix.study.matching`; ``headmix demo`` its MoA model).

Variants are compared at equal compute: every row's attention must cost the baseline's
MACs within a tolerance (2% by default), counted by :func:`headmix.models.analytic_macs` (the ``full``
count of ``headmix macs``), with attention's products counted by the study's convention (``attention_macs``:
``"full"``, every (query, key) pair, the default; or ``"causal"``, as a causal flash kernel computes them,
:data:`headmix.models.counting.ATTENTION_MACS`). Only the attention layers differ between the rows of a study, so the rows are
matched on the attention layers' MACs, which is stricter than matching whole models (the FFN and the
output projection, equal in every row, would hide a gap in attention).

A variant fixes some attention fields and names the ones to solve for (``top_k``, ``head_dim``,
``num_heads``, ``key_dim``, ``num_experts``, ``num_shared_heads``). :func:`match_attention` enumerates
the candidate values of those fields, keeps the configurations within the tolerance and picks, in order:
the one closest to the ``prefer`` values (e.g. the baseline's head size, so MoA rows at several ``E``
keep one ``k`` and ``d_h``), then the one closest to the baseline's MACs. When no candidate is within the
tolerance and the row's kind has a separate query/key size, a finer step is taken (see :func:`match_attention`).

Rows may fix (or solve, ``kv_heads``) the grouped-query options too: ``kv_heads`` (fewer K/V projections),
``output_gate`` (its projection is counted) and ``qk_norm`` (element-wise, no MACs) are counted by
:func:`headmix.models.counting.attention_macs` as the layer computes them, as is MoH's ``route_per_group``
(its shared and selected heads per group, with ``moh_impl="sparse"``). A GQE row (``kind="gqe"``) fixes
``num_experts``, ``kv_heads`` and ``top_k`` (the paper's 16 on 8, top 1) and solves ``head_dim``: it computes
``k G + 1`` of the baseline's attention heads but every expert's query and a ``W_O`` of ``(k G + 2) d_h``
inputs, and its head size is what brings that to the baseline's MACs.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Iterable

from .config import AttentionConfig, ModelConfig
from .config_values import field_applies
from .counting import analytic_macs, attention_macs, mosa_macs

#: The fields a variant may ask to solve for.
SOLVABLE = ("top_k", "head_dim", "num_heads", "key_dim", "num_experts", "num_shared_heads", "kv_heads",
            "num_sparse_heads", "sparsity")

#: Options every row takes from the baseline's attention unless it fixes them: a row changes the kind of
#: attention, not the model's conventions (a Llama-style baseline has no biases and rotary positions).
INHERITED = ("bias", "q_bias", "kv_bias", "out_bias", "dropout", "rotary", "rotary_base", "rotary_fraction")
#: Conventions a row takes from the baseline only when its kind has them (a Qwen3-style baseline's QK-norm
#: and output gate go to MHA / MoH / Talking-Heads rows, not to MoA or SwitchHead rows). ``kv_heads`` is
#: not inherited: it shapes the layer's cost, a row sets (or solves) it.
INHERITED_WHERE_SUPPORTED = ("qk_norm", "output_gate")


def inherited_options(baseline: ModelConfig) -> dict[str, Any]:
    """The :data:`INHERITED` options of ``baseline``'s attention (its first attention role), unset ones left out."""
    att = getattr(baseline, baseline.attention_roles()[0])
    return {name: getattr(att, name) for name in INHERITED if getattr(att, name) is not None}


def conventions_for(kind: str, baseline: ModelConfig) -> dict[str, Any]:
    """The :data:`INHERITED_WHERE_SUPPORTED` options of ``baseline``'s attention that a row of ``kind`` has."""
    att = getattr(baseline, baseline.attention_roles()[0])
    return {name: getattr(att, name) for name in INHERITED_WHERE_SUPPORTED
            if getattr(att, name) is not None and field_applies(name, kind)}
ROLES = ("encoder_self_attention", "decoder_self_attention", "cross_attention")


#: How a study counts a sparse MoH row's MACs: ``"computed"``, what the layer computes (the shared and selected
#: heads' queries, attention and outputs, every head's keys and values), or ``"dense"``, as if every head ran.
MOH_COUNTS = ("computed", "dense")


def attention_macs_of(config: ModelConfig, src_len: int | None, tgt_len: int | None,
                      moh_count: str = "computed", attention: str = "full") -> int:
    """MACs of all attention layers of ``config`` (the components named ``*attention``); ``moh_count``: see
    :data:`MOH_COUNTS`; ``attention``: the convention of :data:`headmix.models.counting.ATTENTION_MACS`."""
    if moh_count == "dense":
        config = config.replace(**{role: dataclasses.replace(getattr(config, role), moh_impl=None)
                                   for role in config.attention_roles() if getattr(config, role).kind == "moh"})
    count = analytic_macs(config, src_len, tgt_len, attention=attention)
    return sum(v for name, v in count.full.items() if name.endswith("attention"))


def with_attention(config: ModelConfig, attention: AttentionConfig) -> ModelConfig:
    """``config`` with every attention role it has set to a copy of ``attention``."""
    roles = {role: dataclasses.replace(attention) for role in config.attention_roles()}
    return config.replace(**roles)


def _candidates(field: str, fixed: dict[str, Any], d_model: int) -> list[int]:
    if field == "top_k":
        if "num_experts" in fixed:
            return list(range(1, fixed["num_experts"] + 1))
        if "num_heads" in fixed:
            return list(range(1, fixed["num_heads"] - fixed.get("num_shared_heads", 0) + 1))
        return list(range(1, 33))
    if field in ("head_dim", "key_dim"):
        return list(range(1, 2 * d_model + 1))
    if field == "num_heads":
        return list(range(1, 33))
    if field == "num_experts":
        return list(range(1, 129))
    if field == "num_shared_heads":
        return list(range(0, fixed.get("num_heads", 32)))
    if field == "kv_heads":  # the divisors of num_heads (the others fail validation anyway)
        heads = fixed.get("num_heads", 32)
        return [g for g in range(1, heads + 1) if heads % g == 0] if "num_heads" in fixed else list(range(1, 33))
    if field == "num_sparse_heads":  # MoSA: many cheap heads
        return list(range(1, 257))
    if field == "sparsity":  # MoSA: k = T // sparsity, in quarter steps from 1 to 128
        return [q / 4 for q in range(4, 513)]
    raise ValueError(f"solve must name fields of {SOLVABLE}, got {field!r}")


@dataclass
class Match:
    """The chosen attention config and how close it came."""

    attention: AttentionConfig
    macs: int
    baseline_macs: int

    @property
    def ratio(self) -> float:
        return self.macs / self.baseline_macs


def match_attention(baseline: ModelConfig, fixed: dict[str, Any], solve: Iterable[str], *,
                    prefer: dict[str, Any] | None = None, tolerance: float = 0.02,
                    src_len: int | None = None, tgt_len: int | None = None, moh_count: str = "computed",
                    attention: str = "full") -> Match:
    """The attention config with the fields ``fixed`` and the ``solve`` fields chosen so that the model
    (``baseline`` with this attention in every role) costs the baseline's attention MACs within
    ``tolerance`` (sparse MoH counted per ``moh_count``, :data:`MOH_COUNTS`; attention's products per the
    convention ``attention``, :data:`headmix.models.counting.ATTENTION_MACS`); options ``fixed`` leaves out are
    the baseline's (:data:`INHERITED`).

    **A finer step** (:func:`_finer_step`): a small model's head sizes step by several percent of its MACs (at
    a head size of 11, one unit is 9%), so no head size may fall within 2%. When ``head_dim`` is solved and no
    candidate is within the tolerance, a kind with a separate query/key size (MHA, Talking-Heads: ``key_dim``)
    gets it solved too, as close to the head size as reaches the tolerance (a query/key size one unit off moves
    the MACs by about half a head-size step). ``ValueError`` naming the variant's fields, the closest
    candidate and, where the head-size step itself is wider than the tolerance allows, the step and the
    spec's ``tolerance`` (docs/study.md) when no candidate is within it."""
    solve = tuple(solve)
    for field in solve:
        if field not in SOLVABLE:
            raise ValueError(f"solve must name fields of {SOLVABLE}, got {field!r}")
        if field in fixed:
            raise ValueError(f"{field} is both fixed ({fixed[field]!r}) and to be solved")
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
    prefer = prefer or {}
    target = attention_macs_of(baseline, src_len, tgt_len, attention=attention)
    refused: list[Exception] = []  # why candidates were refused, for the error when none can be built
    inherited = {**inherited_options(baseline), **conventions_for(fixed.get("kind", "mha"), baseline)}

    def count(fields: dict[str, Any]) -> Match | None:
        try:
            att = AttentionConfig(**fields)
            model = with_attention(baseline, att)
        except (ValueError, TypeError) as err:
            refused.append(err)
            return None
        return Match(att, attention_macs_of(model, src_len, tgt_len, moh_count, attention), target)

    def preference(fields: dict[str, Any]) -> int:
        return sum(abs(fields[f] - prefer[f]) for f in solve if f in prefer)

    candidates = [{**inherited, **fixed, **dict(zip(solve, values))}
                  for values in itertools.product(*(_candidates(f, fixed, baseline.d_model) for f in solve))]
    counted = [(fields, m) for fields in candidates if (m := count(fields)) is not None]
    best = _closest_preferred(counted, tolerance, preference)
    if best is None and _finer_step(fixed, solve):
        best = _finer_step_match(counted, tolerance, preference, count)
    if best is None:
        closest = min((m for _, m in counted), key=lambda m: abs(m.ratio - 1), default=None)
        near = (f"; the closest is {closest.ratio:.3f}x ({_describe(closest.attention)})" if closest
                else f"; every candidate is refused, e.g. {refused[0]}" if refused else "")
        raise ValueError(f"no attention with {fixed} and {list(solve)} solved is within {tolerance:.0%} of the "
                         f"baseline's attention MACs ({target:,}){near}{_step_note(counted, solve, tolerance)}")
    return best


def _closest_preferred(counted: list[tuple[dict[str, Any], Match]], tolerance: float, preference) -> Match | None:
    """Of the counted candidates within ``tolerance``: the one closest to the preferred values, then to the
    baseline's MACs."""
    within = [(preference(fields), abs(m.ratio - 1), i, m) for i, (fields, m) in enumerate(counted)
              if abs(m.ratio - 1) <= tolerance]
    return min(within)[-1] if within else None


def _finer_step(fixed: dict[str, Any], solve: tuple[str, ...]) -> bool:
    """Whether a finer step than the head size's is open: ``head_dim`` solved, and a kind with a separate
    query/key size (``key_dim``) that the row leaves free."""
    return "head_dim" in solve and "key_dim" not in solve and "key_dim" not in fixed and \
        field_applies("key_dim", fixed.get("kind", "mha"))


def _finer_step_match(counted: list[tuple[dict[str, Any], Match]], tolerance: float, preference,
                      count) -> Match | None:
    """The candidates again with the query/key size ``d`` units from the head size, ``d = 1, 2, ...`` up to a
    quarter of it: the first ``d`` with a candidate within ``tolerance`` gives the match (closest to the
    preferred values, then to the baseline's MACs)."""
    largest = max((fields["head_dim"] for fields, _ in counted), default=0)
    for offset in range(1, largest // 4 + 1):
        shifted = [{**fields, "key_dim": fields["head_dim"] + sign * offset} for fields, _ in counted
                   for sign in (-1, 1) if fields["head_dim"] + sign * offset >= 1 and offset <= fields["head_dim"] // 4]
        found = _closest_preferred([(f, m) for f in shifted if (m := count(f)) is not None], tolerance, preference)
        if found is not None:
            return found
    return None


def _step_note(counted: list[tuple[dict[str, Any], Match]], solve: tuple[str, ...], tolerance: float) -> str:
    """Why no head size fits, when that is the reason: the two head sizes around the baseline's MACs are further
    apart than the tolerance's window (twice the tolerance), so no finer choice of this kind exists."""
    if solve != ("head_dim",):
        return ""
    below = [(m.ratio, f["head_dim"]) for f, m in counted if m.ratio < 1]
    above = [(m.ratio, f["head_dim"]) for f, m in counted if m.ratio > 1]
    if not below or not above:
        return ""
    (low, h_low), (high, h_high) = max(below), min(above)
    if high - low <= 2 * tolerance:
        return ""
    return (f"; head sizes step by {high - low:.1%} of its MACs here ({h_low}: {low:.3f}x, {h_high}: {high:.3f}x), "
            f"more than the {tolerance:.0%} tolerance can bridge: widen the spec's `tolerance` (docs/study.md, "
            f"\"The tolerance\") or give the model larger heads")


def _describe(att: AttentionConfig) -> str:
    keys = ("kind", "num_heads", "num_experts", "top_k", "head_dim", "key_dim", "num_shared_heads", "kv_heads",
            "route_per_group", "qk_norm", "output_gate", "num_sparse_heads", "num_dense_heads", "sparsity",
            "weighted_slot", "shared_head", "hard_slot_scale")
    return ", ".join(f"{k}={getattr(att, k)}" for k in keys if getattr(att, k, None) is not None)


def matched_sparse_heads(embed_dim: int, heads: int, length: int, *, head_dim: int, sparsity: float,
                         dense_heads: int) -> tuple[int, float]:
    """The number of sparse heads whose MoSA attention MACs are closest to MHA's at ``length`` tokens, and the
    ratio of the two."""
    mha = attention_macs(AttentionConfig(kind="mha", num_heads=heads, bias=False), embed_dim, length, length)[0]
    best = None
    for n in range(1, 4097):
        att = AttentionConfig(kind="mosa", num_sparse_heads=n, num_dense_heads=dense_heads, head_dim=head_dim,
                              sparsity=sparsity, bias=False)
        ratio = mosa_macs(att, embed_dim, length) / mha
        if best is None or abs(ratio - 1) < abs(best[1] - 1):
            best = (n, ratio)
        if ratio > 1:
            break
    return best
