"""``headmix analyze``: what a trained run's routed attention learned (MoA paper Figure 3, Appendix A, Table 4).

    headmix analyze load RUN_DIR --out DIR            # expert load per layer on the validation split
    headmix analyze load RUN_DIR --data FILE --out DIR
    headmix analyze pmi RUN_DIR --out DIR             # top tokens per expert by PMI, first encoder layer
    headmix analyze pmi RUN_DIR --layer 3 --top 10 --min-count 5 --out DIR
    headmix analyze heads RUN_DIR --out DIR           # MoH head usage / Talking-Heads mixing matrices

Each writes JSON, Markdown and PNG files to --out and prints the Markdown summary.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..devices import pick_device
from .main import add_device_option


def _data_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run folder (from `headmix train`)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--data", default=None, metavar="FILE",
                   help="TSV of pairs (translation) or documents, JSONL or plain text (mlm/lm); default: the run's --split")
    p.add_argument("--split", choices=["train", "valid", "test"], default="valid",
                   help="the run's split to analyse when --data is not given (default: valid)")
    p.add_argument("--limit", type=int, default=None, help="only the first N sentence pairs / documents")
    p.add_argument("--max-tokens", type=int, default=8192, help="tokens per batch")
    add_device_option(p)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("analyze", help="expert load, token-expert PMI and head usage of a trained run",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="analysis", required=True)

    load = sub.add_parser("load", help="share of tokens routed to each expert/head, per layer (paper Figure 3)",
                          description="Fraction of routing slots each MoA expert, MoH routed head (per K/V group "
                                      "when routed per group), GQE query-head expert (per K/V group, with each "
                                      "group's share of the weighted slot's w) or SwitchHead expert (per head, value "
                                      "and output sides) receives, per layer: load.json, load.md, load.png (all "
                                      "layers), load_summary.png (max/min share, CV, entropy per layer) and "
                                      "load_layers/NN_<layer>.png.")
    _data_options(load)

    pmi = sub.add_parser("pmi", help="top tokens per expert by PMI (paper Table 4)",
                         description="Top tokens per expert of one routed layer by PMI(token, expert) = "
                                     "p(token, expert) / (p(token) p(expert)): pmi.json, pmi.md, pmi.png.")
    _data_options(pmi)
    pmi.add_argument("--layer", default=None,
                     help="routed layer index (0 = first routed layer) or name; default: the first encoder "
                          "self-attention layer (the paper's choice)")
    pmi.add_argument("--top", type=int, default=10, help="tokens per expert")
    pmi.add_argument("--min-count", type=int, default=5, help="rank only tokens seen at least this often")
    pmi.add_argument("--include-special", action="store_true", help="rank special tokens (<s>, </s>, ...) too")

    heads = sub.add_parser("heads", help="MoH head usage and shared/routed balance; Talking-Heads mixing matrices",
                           description="MoH layers: per-head mean weight, activation rate, routed-head shares and "
                                       "the mean group weights (moh_heads.json/.md/.png, needs data). Talking-Heads "
                                       "layers: the pre- and post-softmax mixing matrices as heatmaps "
                                       "(talking_heads.json/.md/.png, and talking_heads_deviation.png showing M - I; "
                                       "no data needed). GQE layers have no head weights: use `load` and `pmi`.")
    _data_options(heads)
    return p


def _batches(args, tokenizer, task: str):
    from ..analysis import dataset_path, run_batches

    path = dataset_path(args.run, task, args.split, args.data)  # fail before any work when it is missing
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    return run_batches(args.run, tokenizer, task=task, split=args.split, data=args.data, max_tokens=args.max_tokens,
                       limit=args.limit), str(path)


def _write_report(report, out: Path, stem: str) -> tuple[list[Path], str]:
    """Write ``OUT/STEM.json`` and ``OUT/STEM.md``; return their paths and the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    report.to_json(paths[0])
    md = report.to_markdown()
    paths[1].write_text(md, encoding="utf-8")
    return paths, md


def _written(paths: list[Path]) -> None:
    print("wrote: " + ", ".join(str(p) for p in paths))


def run(args) -> int:
    from ..analysis import (expert_load, head_utilities, load_analysis_run, routed_layers, talking_heads_matrices,
                            token_expert_pmi)
    from ..analysis.heads import gqe_hint, moh_layers
    from ..analysis.layers import describe_attention, require_routed

    model, tok = load_analysis_run(args.run, pick_device(args.device))
    task = model.config.task
    out = Path(args.out)
    meta = {"run": str(args.run), "task": task}
    if args.analysis == "load":
        require_routed(model, "the load analysis")
        batches, source = _batches(args, tok, task)
        report = expert_load(model, batches, source=source)
        report.meta.update(meta)
        paths, md = _write_report(report, out, "load")
        paths.append(report.plot(out / "load.png"))
        paths.append(report.plot_summary(out / "load_summary.png"))
        layer_paths = report.plot_layers(out / "load_layers")
        print(md)
        _written(paths + [Path(f"{out / 'load_layers'}/ ({len(layer_paths)} PNGs, one per layer)")])
        return 0

    if args.analysis == "pmi":
        from ..analysis import select_layer

        layer = select_layer(model, args.layer)  # a bad --layer fails before the data is read
        batches, source = _batches(args, tok, task)
        report = token_expert_pmi(model, batches, layer=layer.name, top=args.top, min_count=args.min_count,
                                  tokenizer=tok, include_special=args.include_special, source=source)
        report.meta.update(meta)
        paths, _ = _write_report(report, out, "pmi")
        paths.append(report.plot(out / "pmi.png"))
        print(report.to_markdown(details=False))
        _written(paths)
        return 0

    # heads
    moh = moh_layers(model)
    try:
        talking = talking_heads_matrices(model)
    except ValueError:
        talking = None
    if not moh and talking is None:
        hint = gqe_hint(model) or (" (use `headmix analyze load` for MoA experts)" if routed_layers(model) else "")
        raise ValueError("`analyze heads` needs MoH layers with routed heads or Talking-Heads layers, but this model "
                         f"has neither; its attention layers are: {describe_attention(model)}{hint}")
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    if moh:
        batches, source = _batches(args, tok, task)
        report = head_utilities(model, batches, source=source)
        report.meta.update(meta)
        written, md = _write_report(report, out, "moh_heads")
        paths += written + [report.plot(out / "moh_heads.png")]
        print(md)
    if talking is not None:
        talking.meta.update(meta)
        written, md = _write_report(talking, out, "talking_heads")
        paths += written + [talking.plot(out / "talking_heads.png"),
                            talking.plot(out / "talking_heads_deviation.png", deviation=True)]
        print(md)
    _written(paths)
    return 0
