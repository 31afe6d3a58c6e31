"""A study's report as Markdown: the tables and verdict sentences written from :mod:`headmix.study.comparison`'s
data."""

from __future__ import annotations

from typing import Any

from ..models.config import AttentionConfig
from ..models.counting import FLASH_TILE
from ..provenance import describe_machine
from ..routing.task_gradient import ALLOW_FLAG
from .comparison import LOWER_IS_BETTER, along_training, other_convention
from .stats import FEW_SEEDS, NOT_DECIDED

_CONVENTION_TEXT = {"full": "every query-key pair, the MoA and SwitchHead papers' count",
                    "causal": f"causal self-attention as a flash kernel computes it, in "
                              f"{FLASH_TILE[0]} x {FLASH_TILE[1]} tiles"}


def along_training_markdown(table: dict[str, Any]) -> list[str]:
    steps, deltas = along_training(table)
    if not steps or not deltas:
        return []
    lines = ["#### Along training: does a gap open or close?", "",
             f"Δ validation NLL against **{table['baseline']}** at a quarter, half, three quarters and the end of the "
             "steps (each row's validation curve minus the baseline's at the same step, paired by seed, with its 95% "
             "Student-t interval; the end is the last validation, before any averaging of the final weights). "
             + ("Rows are at equal MACs and equal steps, as in the first table." if _matched(table)
                else "Rows are at equal steps, each at its own MACs, as in the first table."), "",
             "| row | " + " | ".join(f"step {s}" for s in steps) + " |", "|" + "---|" * (len(steps) + 1)]
    for name, cells in deltas.items():
        lines.append(f"| {name} | " + " | ".join("–" if d is None else _delta_text(d) for d in cells) + " |")
    return lines


def _fmt(summary: dict[str, Any] | None, digits: int = 3) -> str:
    if not summary:
        return "–"
    if summary["std"] is None:
        return f"{summary['mean']:.{digits}f}"
    return f"{summary['mean']:.{digits}f} ± {summary['std']:.{digits}f}"


def to_markdown(table: dict[str, Any], machine: str = "") -> str:
    """The study's table in Markdown: one line per row, with the paired difference from the baseline and what
    it shows for the main metric (BLEU for translation, else validation NLL) and, for translation, also for the
    validation NLL."""
    main = "bleu" if "bleu" in table["metrics"] else "valid_nll"
    compared = [main] + (["valid_nll"] if main != "valid_nll" and "valid_nll" in table["metrics"] else [])
    matched = table.get("attention_macs", "full")
    other = other_convention(matched)
    matched_text = (f"every row's attention MACs within {table['tolerance']:.0%} of its, counted `{matched}` "
                    f"({_CONVENTION_TEXT[matched]}); beside it the ratio counted `{other}` ({_CONVENTION_TEXT[other]})"
                    if _matched(table) else
                    f"the rows are not matched to its MACs (`matching = \"none\"`): each keeps its shape, and its "
                    f"attention MACs are stated, counted `{matched}` ({_CONVENTION_TEXT[matched]}), with the ratio "
                    f"counted `{other}` ({_CONVENTION_TEXT[other]}) beside them")
    title = ("#### Equal MACs: which method is better per unit of compute" if _matched(table)
             else "#### Equal steps: every row the same steps, at its own MACs")
    lines = [f"### {table['name']}: {table['task']}, {table['max_steps']} steps, seeds {table['seeds']}",
             "", *headline_markdown(table), "", *continuation_markdown(table),
             title,
             "",
             f"Baseline: **{table['baseline']}** (`{table['baseline_preset']}`); {matched_text}. Every run the same "
             f"steps. "
             f"Mean ± standard deviation over seeds; Δ is "
             f"the row minus the baseline, paired by seed, with its 95% Student-t interval."
             + (f" {machine}" if machine else "")
             + (f" Sparse MoH rows are counted by their {'dense count (as if every head ran)' if table.get('moh_count') == 'dense' else 'computed MACs (the heads they run)'}."
                if any(r["attention"].get("moh_impl") == "sparse" for r in table["rows"]) else ""),
             ""]
    verdicts = ["verdict"] if len(compared) == 1 else [f"verdict ({m})" for m in compared]
    cols = ["row", "attention", "attn MACs", f"ratio, {other} count", "params", "seeds"] + [m for m in table["metrics"]] + \
        [c for m, v in zip(compared, verdicts) for c in (f"Δ {m} [95% CI]", v)] + ["tokens/s"]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for row in table["rows"]:
        cells = [row["name"], _attention_text(row["attention"]), f"{row['attention_macs'] / 1e6:.2f}M "
                 f"({row['attention_macs_ratio']:.3f}x)", _ratio_text(row.get("attention_macs_ratio_other")),
                 f"{row['parameters'] / 1e6:.2f}M", str(len(row["seeds"]))]
        cells += [_fmt(row["metrics"].get(m), 2 if m in ("bleu", "chrf", "valid_ppl") else 3) for m in table["metrics"]]
        for m in compared:
            cells += _difference_cells(row, m, table["baseline"])
        tps = row["metrics"].get("tokens_per_second")
        cells.append(f"{tps['mean']:,.0f}" if tps else "–")
        lines.append("| " + " | ".join(cells) + " |")
    along = along_training_markdown(table)
    lines += [""] + (along + [""] if along else []) + controls_markdown(table) + interleaved_markdown(table) + [""] + equal_time_markdown(table) \
        + [""] + machines_markdown(table)
    return "\n".join(lines) + "\n"


def headline_markdown(table: dict[str, Any]) -> list[str]:
    """The report's opening lines, written from its table (never by hand): which row won at equal MACs and at
    equal time and which rows were better, worse or not separated from the baseline, the controls' verdicts, and
    how sure that is (the seeds, the equal-time rule, rows with fewer than :data:`FEW_SEEDS` seeds)."""
    main = "bleu" if "bleu" in table["metrics"] else "valid_nll"
    base, rows = table["baseline"], table["rows"][1:]
    equal = _equal_budget(table)
    equal = equal[0].upper() + equal[1:]
    lines = ["#### In short (generated from the records)", "",
             f"- **{equal}** (final {main}, each row minus **{base}**): "
             + _verdicts_text([(r["name"], r["vs_baseline"].get(main)) for r in rows], base, LOWER_IS_BETTER[main])]
    timed = [r for r in rows if (r.get("equal_time_interleaved") or {}).get("timing")]
    if timed:
        devices = sorted({_timing_device(r["equal_time_interleaved"]["timing"]) for r in timed})
        lines.append(f"- **Equal time** (validation NLL, step times measured side by side on {', '.join(devices)}): "
                     + _verdicts_text([(r["name"], r["equal_time_interleaved"].get("vs_baseline")) for r in rows],
                                      base, True))
    else:
        lines.append("- **Equal time**: not measured (no row was timed side by side with the baseline).")
    for c in table.get("controls") or []:
        verdicts = [f"{where}: {'–' if d is None else d['verdict'].replace(NOT_DECIDED + ': ', 'not decided, ')}"
                    for where, d in
                    ((f"at {_equal_budget(table)}", c.get("equal_macs")), ("at equal time", c.get("equal_time")))]
        lines.append(f"- **Control**: {c['row']} against {c['control']}, {'; '.join(verdicts)}.")
    twins = table.get("distillation") or []
    for where, key in ((_equal_budget(table), "equal_macs"), ("equal time", "equal_time")) if twins else ():
        lines.append(f"- **Distillation at {where}** (each distilled row minus its undistilled twin): "
                     + _verdicts_text([(c["row"], c.get(key)) for c in twins], "its undistilled twin", True,
                                      winner=False))
    seeds = sorted({len(r["seeds"]) for r in table["rows"] if r["seeds"]})
    if not seeds:
        return lines + ["- **How sure**: no run has finished yet."]
    few = [f"{r['name']} ({len(r['seeds'])})" for r in table["rows"] if 0 < len(r["seeds"]) < FEW_SEEDS]
    counts = str(seeds[0]) if len(seeds) == 1 else f"{seeds[0]} to {seeds[-1]}"
    seed_counts = (f"Fewer than {FEW_SEEDS} seeds, so their verdicts rest on too few: {', '.join(few)}." if few
                   else f"Every row has at least {FEW_SEEDS} seeds.")
    incomplete = ("" if table.get("complete", True) else
                  " The study is not complete: runs or side-by-side timings are missing.")
    lines.append(f"- **How sure**: every verdict is a 95% Student-t interval of the difference paired by seed "
                 f"({counts} seed{'s' if counts != '1' else ''} per row); at equal time it must hold at the "
                 f"step-time ratio's median and at both ends of its 95% interval. {seed_counts}{incomplete}")
    return lines


def _matched(table: dict[str, Any]) -> bool:
    """Whether the study's rows are matched to the baseline's MACs (reports written before ``matching`` existed
    were)."""
    return table.get("matching", "macs") == "macs"


def _equal_budget(table: dict[str, Any]) -> str:
    """What every row shares besides time: "equal MACs" (rows matched to the baseline's), else "equal steps"."""
    return "equal MACs" if _matched(table) else "equal steps"


def continuation_markdown(table: dict[str, Any]) -> list[str]:
    """A continuation study's table (:func:`continuation`): the parent, and per row its conversion, MACs per
    token in both conventions, the loss at conversion and after, each minus the dense continuation."""
    cont = table.get("continuation")
    if not cont:
        return []
    base = table["baseline"]
    hashes = cont["parent_sha256"]
    parent = table.get("parent") or {}
    where = (f"`{parent['folder']}/`, sha256 of its weights `{parent['sha256'][:16]}…`" if parent else "not trained yet")
    recorded = ("every run recorded these weights" if len(hashes) == 1 and (not parent or hashes[0] == parent["sha256"])
                else f"runs recorded {len(hashes)} different parents' weights: the rows did not start from one parent"
                if hashes else "no run has recorded its parent yet")
    lines = ["#### From the parent: conversion and continuation", "",
             f"One parent ({table['baseline_preset']}, {cont['parent_steps']} steps, seed {cont['parent_seed']}; "
             f"{where}; {recorded}"
             + (f"; its final validation NLL {parent['valid_nll']:.3f}" if parent.get("valid_nll") is not None else "")
             + f"). Every run continues it for {table['max_steps']} steps, converted as its row says; the seeds are "
             f"the continuation's, so the intervals hold the continuations' variance, not parent-to-parent variance. "
             f"\"At conversion\" is the converted model's validation NLL before its first step; Δ is the row minus "
             f"**{base}**, paired by seed, with its 95% Student-t interval. Attention MACs per token at the block "
             f"length, both conventions" + (" (equal here: at this block length the causal count's one tile covers "
                                            "every query-key pair)" if all(
                 r["attention_macs_per_token"]["full"] == r["attention_macs_per_token"]["causal"]
                 for r in cont["rows"]) else "") + ".", "",
             "| row | conversion | attn MACs/token full | causal | NLL at conversion | Δ at conversion | NLL after | "
             "Δ after [95% CI] | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for row in cont["rows"]:
        macs = row["attention_macs_per_token"]
        start, end = row.get("at_conversion_vs_baseline"), row.get("after_vs_baseline")
        lines.append("| " + " | ".join([
            row["name"], _options_text(row["init_options"], row.get("distill")), f"{macs['full'] / 1e3:.1f}k", f"{macs['causal'] / 1e3:.1f}k",
            _fmt(row.get("at_conversion")), _delta_text(start) if start else "–", _fmt(row.get("after")),
            _delta_text(end) if end else "–", end["verdict"] if end else "–"]) + " |")
    return lines + [""]


def _options_text(options: dict[str, Any], distill: dict[str, Any] | None = None) -> str:
    """A row's ``init_options`` in a few words, and its distillation from the parent (``distill``) if it has one."""
    if distill is not None:
        from ..distillation.kl import DEFAULT_TEMPERATURE, DEFAULT_WEIGHT

        return (f"{_options_text(options)}; distilled from the parent (weight {distill.get('weight', DEFAULT_WEIGHT):g},"
                f" temperature {distill.get('temperature', DEFAULT_TEMPERATURE):g})")
    if not options:
        return "the parent as it is"
    if options.get("attention") == "mha":
        return f"pruned: {options.get('keep_heads')} query heads kept per K/V group" if options.get("keep_heads") \
            else "dense"
    router = {"query_norm": "query-norm", "random": "random", None: "learned", "softmax": "learned"}.get(
        options.get("router"), str(options.get("router")))
    where = " per K/V group" if options.get("route_per_group") else ""
    return f"MoH, {router} router: {options.get('num_shared_heads')} shared + top {options.get('top_k')}{where}"


def _verdicts_text(cells: list[tuple[str, dict[str, Any] | None]], baseline: str, lower_is_better: bool, *,
                   winner: bool = True) -> str:
    """The rows grouped by their verdict against ``baseline``: the winner (the best mean among those better;
    ``winner=False``: not named, where each row has its own ``baseline``), then better, worse, not separated,
    not decided (with the reasons)."""
    groups: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for name, diff in cells:
        if diff is None:
            groups.setdefault("not compared", []).append((name, {}))
            continue
        verdict = diff["verdict"]
        kind = next((k for k in ("better", "worse", "no significant difference", NOT_DECIDED) if verdict.startswith(k)),
                    "too few seeds for an interval")
        groups.setdefault(kind, []).append((name, diff))

    def item(name: str, diff: dict[str, Any], reason: bool = False) -> str:
        text = name if not diff else f"{name} {_delta_text(diff)}"
        if reason:
            text += " (" + diff["verdict"].split(": ", 1)[-1] + ")"
        elif diff and diff.get("n", FEW_SEEDS) < FEW_SEEDS:
            text += f" ({diff['n']} seed{'s' if diff['n'] != 1 else ''})"
        return text

    better = groups.get("better", [])
    sign = 1 if lower_is_better else -1
    parts = ([f"**{min(better, key=lambda c: sign * c[1]['mean'])[0]}** won." if better else
              f"no row was shown better than {baseline}."] if winner else [])
    for kind, label in (("better", f"Better than {baseline}"), ("worse", f"Worse than {baseline}"),
                        ("no significant difference", "No significant difference"),
                        (NOT_DECIDED, "Not decided at equal time"), ("too few seeds for an interval",
                                                                     "Too few seeds for an interval"),
                        ("not compared", "Not compared")):
        if groups.get(kind):
            parts.append(f"{label}: " + ", ".join(item(n, d, kind == NOT_DECIDED) for n, d in groups[kind]) + ".")
    return " ".join(parts)


def interleaved_markdown(table: dict[str, Any]) -> list[str]:
    """The equal-time table from side-by-side timing: what to train on the machine the rows were timed on."""
    head = ["#### Equal time: what to train on this machine", ""]
    rows = table["rows"]
    if not any(r.get("equal_time_interleaved", {}).get("timing") for r in rows[1:]):
        return head + ["Not measured: no row of this study has been timed side by side with the baseline (its runs "
                       "predate the timing phase, or it has not run yet). Only the wall-clock reading below is "
                       "available, and it compares runs that trained under different loads."]
    lines = head + [
        f"Each row's training step was timed against **{table['baseline']}**'s in one process, interleaved (the "
        f"two models alternating on the same batches after a warm-up, several rounds): the step-time ratio is the "
        f"median over rounds with its order-statistic 95% interval. At equal time a row whose step takes `r` times "
        f"the baseline's reaches step `s / r` when the baseline reaches `s`; the two are compared at the time the "
        f"faster one needs for the study's steps, read on both validation curves by step (a slower row before its "
        f"end, a faster row at its end against the baseline before its end; never extrapolated). Δ is paired by "
        f"seed, with its 95% Student-t interval; the last column is Δ with its interval read at the two ends of the "
        f"ratio's interval. {EQUAL_TIME_RULE}",
        "",
        "| row | step time vs baseline [95% CI] | read at step (row / baseline) | valid NLL at equal time | "
        "Δ [95% CI] | verdict | Δ [95% CI] at the ratio's interval ends (low; high) |",
        "|---|---|---|---|---|---|---|"]
    measured = []
    for row in rows:
        e = row.get("equal_time_interleaved") or {}
        if e.get("ratio") is None:
            lines.append(f"| {row['name']} | not measured | – | – | – | – | – |")
            continue
        interval = f" [{e['low']:.2f}, {e['high']:.2f}]" if e.get("low") is not None and row is not rows[0] else ""
        steps = [(e["row_step"][k], e["baseline_step"][k]) for k in e["row_step"]]
        at = (f"{sum(s for s, _ in steps) / len(steps):,.0f} / {sum(b for _, b in steps) / len(steps):,.0f}"
              if steps else "–")
        cells = [row["name"], f"{e['ratio']:.2f}{interval}", at]
        if e.get("unread"):
            cells += ["; ".join(f"seed {k}: {v}" for k, v in e["unread"].items()), "–", "–", "–"]
        else:
            cells.append(_fmt(e.get("summary")))
            diff = e.get("vs_baseline")
            cells += (["–", "baseline" if row is rows[0] else "–"] if diff is None
                      else [_delta_text(diff), diff["verdict"]])
            cells.append(_ends_text(e.get("vs_baseline_at_interval_ends")))
        lines.append("| " + " | ".join(cells) + " |")
        if e.get("timing"):
            t = e["timing"]
            measured.append(f"{row['name']}: {describe_machine(t.get('machine') or {})}, {t.get('device')}, bf16 "
                            f"{t.get('bf16')}, compile {t.get('compile')}, {t.get('measured_at')}, "
                            f"{timing_conditions(t)}")
    devices = sorted({_timing_device(r["equal_time_interleaved"]["timing"]) for r in rows[1:]
                      if (r.get("equal_time_interleaved") or {}).get("timing")})
    warning = ["", f"**Warning: the rows were timed on different devices ({', '.join(devices)}): their ratios do not "
                   f"belong in one table.**"] if len(devices) > 1 else []
    return lines + ["", "Step times measured (" + ((rows[1].get("equal_time_interleaved") or {}).get("timing") or
                                                   {}).get("method", "interleaved") + "): " + "; ".join(measured) + "."]\
        + warning


def _timing_device(timing: dict[str, Any]) -> str:
    """The device a row was timed on: ``cpu``, or ``cuda`` with the GPU's name when recorded."""
    kind = str(timing.get("device")).split(":")[0]
    name = (timing.get("machine") or {}).get("device_name")
    return f"{kind} {name}" if kind != "cpu" and name else kind


def timing_conditions(timing: dict[str, Any]) -> str:
    """Under which load a row was timed: alone among the study's workers (the study's machine lock) or not
    recorded (records written before it: another worker of the study may have been training or timing), the
    machine's load average before and after, whether the process kept freed memory and the code's commit, where
    recorded."""
    alone = ("no other worker of the study training or timing" if timing.get("study_workers_excluded") else
             "other workers of the study not excluded (not recorded: one may have been training or timing)")
    load = timing.get("load_average") or []
    if len(load) == 2 and None not in load:
        alone += f", load average {load[0]:.2f} before and {load[1]:.2f} after"
    freed = timing.get("freed_memory")  # recorded since 2026-12-02 (before, a study returned it: glibc's default)
    if freed is not None:
        alone += {"kept": ", freed memory kept (headmix.keep_freed_memory)",
                  "returned": ", freed memory returned to the system (glibc's default)"}.get(freed, f", freed memory {freed}")
    commit = (timing.get("software") or {}).get("commit")  # recorded since 2026-12-02
    if commit:
        alone += f", code at {commit}"
    return alone


def equal_time_markdown(table: dict[str, Any]) -> list[str]:
    """The wall-clock reading (secondary): each run's own wall-clock, only comparable between runs that trained
    under the same load."""
    lines = ["#### Wall-clock reading (secondary: each run's own wall-clock, not measured side by side)",
             "",
             f"Tokens per second relative to **{table['baseline']}** in this study, and the validation NLL of each "
             f"row at the baseline's training time (the wall-clock of its last validation, per seed), read off the "
             f"row's validation curve against wall-clock seconds, interpolated linearly; \"not reached\" when the "
             f"row's run ended earlier. Δ is paired by seed, with its 95% Student-t interval. Times include the "
             f"periodic validations; they are only comparable between rows that ran on the same machine.",
             "",
             "| row | tokens/s vs baseline | baseline's time (s) | valid NLL at that time | Δ [95% CI] | verdict |",
             "|---|---|---|---|---|---|"]
    for row in table["rows"]:
        timed = row.get("equal_time") or {}
        ratio = timed.get("tokens_per_second_ratio")
        seconds = list((timed.get("baseline_seconds") or {}).values())
        cells = [row["name"], f"{ratio:.2f}" if ratio is not None else "–",
                 f"{sum(seconds) / len(seconds):,.0f}" if seconds else "–"]
        if timed.get("not_reached"):
            ended = timed.get("ended", {})
            cells += ["not reached (" + ", ".join(
                f"seed {s}" + (f" ended at {ended[str(s)]:,.0f} s" if ended.get(str(s)) is not None else "")
                for s in timed["not_reached"]) + ")", "–", "–"]
        else:
            cells.append(_fmt(timed.get("summary")))
            diff = timed.get("vs_baseline")
            cells += (["–", "baseline" if row["name"] == table["baseline"] else "–"] if diff is None
                      else [_delta_text(diff), diff["verdict"]])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def machines_markdown(table: dict[str, Any]) -> list[str]:
    """Where each row's runs trained (from their summaries), with a warning when rows ran on different
    machines."""
    lines = ["Machines (recorded by each run): " + "; ".join(
        f"{row['name']}: {' / '.join(row.get('machines') or ['–'])}" for row in table["rows"]) + "."]
    if table.get("machines_differ"):
        lines += ["", "**Warning: the runs did not all train on the same machine (or the machine was not recorded "
                      "for some): tokens/s and the equal-time comparison mix machines.**"]
    return lines


#: The equal-time rule, as the report states it.
EQUAL_TIME_RULE = ("A verdict (better or worse) is given only where Δ's 95% interval excludes 0, with one sign, read "
                   "at the step-time ratio's median and at both ends of the ratio's interval; else \"not decided at "
                   "equal time\", with the reason. A verdict from fewer than 3 seeds says so.")


def _ends_text(ends: list[dict[str, Any] | None] | None) -> str:
    """The differences read at the step-time ratio's two interval ends, ``low; high`` (``–`` where unread)."""
    if not ends:
        return "–"
    return "; ".join("–" if d is None else _delta_text(d) for d in ends)


def _ratio_text(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio:.3f}x"


def _difference_cells(row: dict[str, Any], metric: str, baseline: str) -> list[str]:
    """``[Δ with its interval, verdict]`` of ``row`` against the baseline for ``metric``."""
    diff = row["vs_baseline"].get(metric)
    if diff is None:
        return ["–", "baseline" if row["name"] == baseline else "–"]
    return [_delta_text(diff), diff["verdict"]]


def _delta_text(diff: dict[str, Any]) -> str:
    """A paired difference (:meth:`PairedDifference.to_dict`) as ``+0.012 [-0.003, +0.027]``, or ``+0.012`` when
    one seed gives no interval."""
    if diff["low"] is None:
        return f"{diff['mean']:+.3f}"
    return f"{diff['mean']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}]"


def _attention_text(att: dict[str, Any]) -> str:
    """The row's attention in a few words: its kind and sizes, then grouped K/V heads, per-group routing (GQE),
    the random-routing control, QK-norm and an output gate where set, and a router trained without a task-loss
    gradient (an ablation: :mod:`headmix.routing.task_gradient`)."""
    extras = []
    if att.get("kv_heads") and att["kv_heads"] != att.get("num_heads"):
        extras.append(f"{att['kv_heads']} K/V heads")
    if att.get("route_per_group"):
        extras.append("routed per group")
    if att.get("router") == "random":
        extras.append("random routing")
    if att.get("router") == "query_norm":
        extras.append("query-norm routing")
    if att.get("qk_norm"):
        extras.append("QK-norm")
    if att.get("output_gate"):
        extras.append(f"{att['output_gate']} gate")
    if att.get(ALLOW_FLAG) and AttentionConfig(**att).router_without_task_gradient():
        extras.append("ablation: router without task gradient")
    return ", ".join([_attention_sizes(att), *extras])


def _attention_sizes(att: dict[str, Any]) -> str:
    kind = att["kind"]
    if kind == "moa":
        return f"MoA {att['top_k']}K{att['num_experts']}E{att['head_dim']}D"
    if kind == "mosa":
        k = f"T/{att['sparsity']:g}" if att.get("sparsity") is not None else str(att.get("tokens_per_head"))
        return f"MoSA {att['num_sparse_heads']}×{att.get('head_dim')} sparse (k={k}) + {att.get('num_dense_heads') or 0} dense"
    if kind == "gqe":
        # the shared head's K/V: the mean of the K/V heads (unset: the authors' form) or K/V head 0
        shared = "shared head (K/V head 0)" if att.get("shared_head_kv") == "head0" else "shared head (mean K/V)"
        slots = [name for name, on in (("weighted slot", att.get("weighted_slot", True) is not False),
                                       (shared, att.get("shared_head", True) is not False)) if on]
        scaled = ", hard slots scaled by p" if att.get("hard_slot_scale") == "p" else ""
        return (f"GQE {att['num_experts']}×{att['head_dim']}, top {att['top_k']} per K/V group, "
                f"{' + '.join(slots) or 'hard slots only'}{scaled}")
    heads = f"{att['num_heads']}×{att['head_dim']}"
    if kind == "moh":
        sparse = ", sparse" if att.get("moh_impl") == "sparse" else ""
        return f"MoH {heads}, {att['num_shared_heads']} shared, top {att['top_k']}{sparse}"
    if kind == "talking_heads":
        return f"talking heads {heads}"
    if kind == "switchhead":
        return f"SwitchHead {heads}, top {att['top_k']} of {att['num_experts']} experts"
    if att.get("key_dim"):
        return f"MHA {heads}, key {att['key_dim']}"
    return f"{kind.upper() if kind == 'mha' else kind} {heads}"


def _pairs_table(entries: list[dict[str, Any]], key: str, equal: str, against: str, ratio: str) -> list[str]:
    """The table of :func:`paired_against` entries, with a blank line after it: each row, the row it is against
    (``key``, headed ``against``), Δ and verdict at the ``equal`` budget, the step-time ratio (headed ``ratio``),
    and Δ and verdict at equal time."""
    lines = [f"| row | {against} | Δ valid NLL at {equal} [95% CI] | verdict | step time, {ratio} | "
             "Δ at equal time [95% CI] | Δ at the ratio's range ends (low; high) | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for c in entries:
        macs, timed = c.get("equal_macs"), c.get("equal_time")
        ratio = "–" if c.get("ratio") is None else f"{c['ratio']:.2f}" + (
            f" [{c['ratio_range'][0]:.2f}, {c['ratio_range'][1]:.2f}]" if c.get("ratio_range") else "")
        at_time = ["–", "–", "–"] if timed is None else [
            _delta_text(timed), _ends_text(c.get("equal_time_at_ratio_ends")), timed["verdict"]]
        lines.append(f"| {c['row']} | {c[key]} | " + " | ".join(
            ["–", "–"] if macs is None else [_delta_text(macs), macs["verdict"]]) + f" | {ratio} | "
            + " | ".join(at_time) + " |")
    return lines + [""]


def controls_markdown(table: dict[str, Any]) -> list[str]:
    """The controls table (learned vs random routing, routed vs static), the distillation table (each distilled
    row vs its undistilled twin) and the MoSA causal-selection table, when the study has such rows."""
    lines = []
    equal = _equal_budget(table)
    if table.get("controls"):
        lines += ["#### Controls: is the routing learned, is the router worth its cost?", "",
                  "Each routed row against its control: its random-routing twin (the same layer, its experts or "
                  "heads chosen uniformly at random per token, no router) or the dense model with the same active "
                  "compute and no router. Δ is the routed row minus the control, paired by seed, with its 95% "
                  f"Student-t interval (negative: the routed row is better). At {equal}: the final validation "
                  "NLL. At equal time: both validation curves read by step at the time the faster of the two "
                  "needs for the study's steps; the step-time ratio of the two is the ratio of their side-by-side "
                  "ratios against the baseline (in brackets: from the ends of those two intervals), and Δ is read "
                  f"at that ratio and at both ends of its range. {EQUAL_TIME_RULE}", "",
                  *_pairs_table(table["controls"], "control", equal, "control", "row / control")]
    if table.get("distillation"):
        lines += ["#### Distillation: what the parent's signal is worth", "",
                  "Each distilled row against its undistilled twin: the same conversion of the parent, continued "
                  "with the same seeds and steps on the LM loss alone. Δ is the distilled row minus the twin, paired "
                  f"by seed, with its 95% Student-t interval (negative: distillation helped). At {equal}: the final "
                  "validation NLL. At equal time: as in the controls, from the two rows' side-by-side step times; a "
                  "distilled step includes the parent's forward pass, so in the same time it takes fewer steps. "
                  f"{EQUAL_TIME_RULE}", "",
                  *_pairs_table(table["distillation"], "undistilled", equal, "undistilled twin",
                                "distilled / undistilled")]
    if table.get("causal_selection"):
        lines += ["#### MoSA: causal selection at evaluation", "",
                  "MoSA trains and is evaluated (as in its paper) with each sparse head's top-k over the whole "
                  "sequence, which looks at later tokens; generation needs a causal rule. Each run's final model "
                  "is scored on the validation split both ways, on the same batches: top-k, and the causal "
                  "threshold rule headmix generates with (a token is chosen when its router score reaches the "
                  "head's threshold, calibrated on the top-k routings of the first training batches). The gap is "
                  "causal minus top-k, paired by seed, with its 95% Student-t interval (positive: top-k's "
                  "look-ahead was worth that much).", "",
                  "| row | seeds | valid NLL, top-k | valid NLL, causal threshold | gap [95% CI] |",
                  "|---|---|---|---|---|"]
        for c in table["causal_selection"]:
            gap = c.get("gap")
            lines.append(f"| {c['row']} | {len(c['seeds'])} | {_fmt(c.get('topk'))} | {_fmt(c.get('threshold'))} | "
                         f"{'–' if gap is None else _delta_text(gap)} |")
        lines.append("")
    return lines
