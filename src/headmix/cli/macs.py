"""``headmix macs``: parameters and MACs of a preset (MoA paper eq. 18-20, Appendix E setup).

    headmix macs moa-base                 # per-component table: params, MACs (full, paper eq., measured)
    headmix macs 8K32E256D --json         # one JSON object
    headmix macs roberta-medium --task mlm
    headmix macs --table                  # Markdown table of the paper's presets (docs/models.md)
    headmix macs llama3-mini-gqa --tgt-len 1024 --attention-macs causal   # as a causal flash kernel computes it

``--attention-macs full`` (the default, the MoA and SwitchHead papers' convention) counts every query-key pair
of attention's two products; ``causal`` counts the decoder's self-attention in the 128 x 128 tiles of a causal
flash kernel (tiles on the diagonal whole, above it none: about half the square for long sequences, all of it
up to 128 tokens). The paper-equation column is unchanged; the measured column counts every pair.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from ..models import analytic_macs, analytic_parameters, get_config, measure_macs
from ..models.counting import ATTENTION_MACS, FLASH_TILE, check_convention, resolve_lengths
from ..models.presets import MOA_PATTERN, PAPER_MLM, PAPER_TRANSLATION


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("macs", help="parameters and MACs of a preset (paper eq. 18-20)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("preset", nargs="?", help="preset name, {K}K{E}E{D}D string, or JSON config file")
    p.add_argument("--task", choices=["translation", "mlm", "lm"], default=None)
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary size (default 32000 translation, 50265 masked LM)")
    p.add_argument("--src-len", type=int, default=None, help="encoder input length (default: Appendix E)")
    p.add_argument("--tgt-len", type=int, default=None, help="decoder input length (default: Appendix E)")
    p.add_argument("--attention-macs", choices=ATTENTION_MACS, default="full",
                   help="count attention's products over every query-key pair (full, default) or as a causal flash "
                        "kernel computes the decoder's self-attention (causal: 128 x 128 tiles)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-measure", action="store_true", help="skip the FlopCounterMode measurement")
    p.add_argument("--table", action="store_true", help="Markdown table of the paper's presets")
    p.add_argument("--measure", action="store_true", help="with --table: add a measured MACs column")
    return p


def report(preset: str, task: str | None = None, vocab: int | None = None, src_len: int | None = None,
           tgt_len: int | None = None, measure: bool = True, attention: str = "full") -> dict:
    """Everything ``headmix macs`` prints, as a dict (``params`` and ``macs`` = the full analytic count, attention
    counted per ``attention``: :data:`headmix.models.counting.ATTENTION_MACS`; ``macs_other`` is the total under
    the other convention)."""
    check_convention(attention)
    config = get_config(preset, task=task, vocab_size=vocab)
    src_len, tgt_len = resolve_lengths(config, src_len, tgt_len)
    macs = analytic_macs(config, src_len, tgt_len, attention=attention)
    other = next(c for c in ATTENTION_MACS if c != attention)
    params = analytic_parameters(config)
    out = {"preset": preset, "task": config.task, "vocab_size": config.vocab_size, "batch_size": 1,
           "d_model": config.d_model, "src_len": src_len, "tgt_len": tgt_len, "attention_macs": attention,
           "flash_tile": list(FLASH_TILE), "params": params.total, "params_paper": params.paper_total,
           "macs": macs.total, "macs_paper": macs.paper_total,
           "macs_other": {"attention_macs": other,
                          "macs": analytic_macs(config, src_len, tgt_len, attention=other).total}}
    components = {name: {"params": params.full.get(name, 0), "params_paper": params.paper.get(name, 0),
                         "macs": macs.full.get(name, 0), "macs_paper": macs.paper.get(name, 0)}
                  for name in list(dict.fromkeys(list(params.full) + list(macs.full)))}
    if measure:
        measured = measure_macs(config, src_len, tgt_len)
        out["macs_measured"] = sum(measured.values())
        for name, value in measured.items():
            empty = {"params": 0, "params_paper": 0, "macs": 0, "macs_paper": 0}
            components.setdefault(name, empty)["macs_measured"] = value
    out["components"] = components
    moh = [role for role in config.attention_roles() if getattr(config, role).kind == "moh"]
    if moh:  # MoH: what the sparse layer computes next to the dense count
        for impl in ("dense", "sparse"):
            variant = dataclasses.replace(config, **{role: dataclasses.replace(getattr(config, role), moh_impl=impl)
                                                     for role in moh})
            out[f"macs_moh_{impl}"] = analytic_macs(variant, src_len, tgt_len, attention=attention).total
    return out


def _m(n: int) -> str:
    return f"{n / 1e6:,.1f}M"


def _print_report(r: dict) -> None:
    lengths = {"translation": f"source {r['src_len']}, target {r['tgt_len']}", "mlm": f"length {r['src_len']}",
               "lm": f"length {r['tgt_len']}"}[r["task"]]
    print(f"{r['preset']}: task {r['task']}, vocab {r['vocab_size']}, batch 1, {lengths}")
    measured = "macs_measured" in r
    header = ["component", "params", "params (eq. 20)", "MACs", "MACs (paper eq.)"] + (["MACs measured"] if measured else [])
    rows = [[name, f"{c['params']:,}", f"{c['params_paper']:,}", f"{c['macs']:,}", f"{c['macs_paper']:,}"]
            + ([f"{c.get('macs_measured', 0):,}"] if measured else []) for name, c in r["components"].items()]
    rows.append(["total", f"{r['params']:,}", f"{r['params_paper']:,}", f"{r['macs']:,}", f"{r['macs_paper']:,}"]
                + ([f"{r['macs_measured']:,}"] if measured else []))
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    for i, row in enumerate([header] + rows):
        print("  ".join(cell.ljust(w) if j == 0 else cell.rjust(w) for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0 or i == len(rows) - 1:
            print("  ".join("-" * w for w in widths))
    if "macs_moh_sparse" in r:
        print(f"MoH: {r['macs_moh_sparse']:,} MACs with sparse MoH (moh_impl='sparse': the shared and selected heads' "
              f"queries, attention and outputs), {r['macs_moh_dense']:,} dense "
              f"({r['macs_moh_sparse'] / r['macs_moh_dense']:.3f}x)")
    other = r["macs_other"]
    counted = ("every query-key pair" if r["attention_macs"] == "full" else
               f"causal self-attention as a flash kernel computes it, in {r['flash_tile'][0]} x {r['flash_tile'][1]} tiles")
    print(f"attention counted {r['attention_macs']} ({counted}); counted {other['attention_macs']}: "
          f"{other['macs']:,} MACs in all ({other['macs'] / r['macs']:.3f}x)")
    print("MACs: every multiply-accumulate of the matrix products (Q K^T and weights x V both counted); "
          "paper eq.: attention by eq. 18/19 as printed (one T^2 term, no router), SwitchHead by its authors' count "
          "(get_attention_flops: both attention products, selectors as E d); measured: torch FlopCounterMode / 2 with MoA and "
          "SwitchHead on expert_impl='sorted' (every query-key pair).")


def table(measure: bool = False) -> str:
    """Markdown table of the paper's presets, like the paper's Table 1 (Appendix E setup)."""
    cols = ["Model", "Task", "K", "E", "D", "#Params", "MACs", "MACs (paper eq. 18/19)"] + (["MACs measured"] if measure else [])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" if i < 2 else "---:" for i in range(len(cols))) + "|"]
    for task, names in (("translation", PAPER_TRANSLATION), ("mlm", PAPER_MLM)):
        for name in names:
            r = report(name, task=task, measure=measure)
            att = get_config(name, task=task).encoder_self_attention
            if att.kind == "moa":
                k, e, d = att.top_k, att.num_experts, att.head_dim
            else:  # MHA: E heads of size D, all of them used
                k, e, d = "-", att.num_heads, att.resolved_head_dim(r["d_model"])
            label = f"MoA {name}" if MOA_PATTERN.match(name) else name
            row = [label, task, str(k), str(e), str(d), _m(r["params"]), _m(r["macs"]), _m(r["macs_paper"])]
            if measure:
                row.append(_m(r["macs_measured"]))
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def run(args) -> int:
    if args.table:
        if args.preset:
            raise ValueError("--table prints every paper preset; give no PRESET with it")
        text = table(measure=args.measure)
        print(json.dumps({"table": text}) if args.json else text)
        return 0
    if not args.preset:
        raise ValueError("give a PRESET (a preset name, a {K}K{E}E{D}D string or a JSON config) or --table")
    r = report(args.preset, args.task, args.vocab, args.src_len, args.tgt_len, measure=not args.no_measure,
               attention=args.attention_macs)
    if args.json:
        print(json.dumps(r))
    else:
        _print_report(r)
    return 0
