"""The ``headmix`` command: ``demo``, ``train``, ``translate``, ``evaluate``, ``macs``, ``bench``, ``analyze``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def _add_train(sub) -> None:
    from ..training.trainer import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train", help="train a model (translation, masked LM or causal LM)",
                       description="Train a model; running it again on the same --out resumes the run.")
    p.add_argument("task", choices=["translation", "mlm", "lm"])
    p.add_argument("--preset", default=d.preset, help="preset name, {K}K{E}E{D}D string, or JSON config file")
    p.add_argument("--data", nargs="+", default=[], metavar="FILE",
                   help="translation: a TSV of pairs or two aligned text files; mlm/lm: a JSONL of documents. "
                        "Default: the embedded corpus")
    p.add_argument("--out", required=True, help="run folder")
    p.add_argument("--src-lang", default=d.src_lang)
    p.add_argument("--tgt-lang", default=d.tgt_lang)
    p.add_argument("--strict", action="store_true", help="a malformed input line is an error")
    p.add_argument("--tokenizer", default=None, help="use this tokenizer folder instead of training one")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--valid-size", type=float, default=d.valid_size, help="held-out fraction for validation")
    p.add_argument("--test-size", type=float, default=d.test_size, help="held-out fraction for test")
    p.add_argument("--max-steps", type=int, default=d.max_steps)
    p.add_argument("--max-time", type=float, default=None, help="stop (and save) after this many seconds")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens per batch per process")
    p.add_argument("--max-len", type=int, default=d.max_len, help="tokens per sentence (translation) or block (LM)")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 7e-4 translation, 5e-4 LM)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--schedule", choices=["inverse_sqrt", "linear", "constant"], default=None)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--clip-norm", type=float, default=d.clip_norm, help="0 = no clipping")
    p.add_argument("--dropout", type=float, default=None)
    p.add_argument("--bf16", choices=["auto", "on", "off"], default=d.bf16)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    p.add_argument("--average-last", type=int, default=d.average_last)
    p.add_argument("--distributed", choices=["ddp", "fsdp"], default=d.distributed, help="under torchrun")
    p.add_argument("--device", default=d.device)
    p.add_argument("--no-progress", action="store_true")


def _run_train(args) -> int:
    from ..training.trainer import TrainConfig, train

    cfg = TrainConfig(task=args.task, preset=args.preset, out=args.out, data=args.data, src_lang=args.src_lang,
                      tgt_lang=args.tgt_lang, strict=args.strict, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                      valid_size=args.valid_size, test_size=args.test_size,
                      max_steps=args.max_steps, max_time=args.max_time, max_tokens=args.max_tokens, max_len=args.max_len,
                      grad_accum=args.grad_accum, lr=args.lr or (7e-4 if args.task == "translation" else 5e-4),
                      warmup_steps=args.warmup_steps, schedule=args.schedule, weight_decay=args.weight_decay,
                      clip_norm=args.clip_norm, dropout=args.dropout, bf16=args.bf16, seed=args.seed,
                      log_every=args.log_every, eval_every=args.eval_every, save_every=args.save_every,
                      keep_checkpoints=args.keep_checkpoints, average_last=args.average_last,
                      distributed=args.distributed, device=args.device, progress=not args.no_progress)
    summary = train(cfg)
    if summary:
        print(json.dumps({k: v for k, v in summary.items() if k != "valid"} | {"valid_loss": summary["valid"]["loss"],
                                                                             "valid_ppl": summary["valid"]["ppl"]}))
    return 0


def _add_translate(sub) -> None:
    p = sub.add_parser("translate", help="translate lines of text with a trained run (beam search)")
    p.add_argument("run", help="run folder")
    p.add_argument("--input", default="-", help="file of source lines (default: standard input)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument("--device", default="cpu")


def _run_translate(args) -> int:
    from ..training.evaluate import load_run, translate

    model, tok = load_run(args.run, args.device)
    lines = (sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")).read().splitlines()
    for hyp in translate(model, tok, lines, beam_size=args.beam, length_penalty=args.length_penalty, device=args.device):
        print(hyp)
    return 0


def _add_evaluate(sub) -> None:
    p = sub.add_parser("evaluate", help="BLEU/chrF (translation) or perplexity (LM) of a run on its held-out split")
    p.add_argument("run", help="run folder")
    p.add_argument("--split", choices=["valid", "test"], default="test")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument("--limit", type=int, default=None, help="score only the first N sentences")
    p.add_argument("--compound-split", action="store_true", help="German compound splitting before BLEU (the paper's)")
    p.add_argument("--output", default=None, help="write the translations to this file")
    p.add_argument("--device", default="cpu")


def _run_evaluate(args) -> int:
    from ..training.evaluate import evaluate_language_model, evaluate_translation
    from ..training.trainer import TrainConfig

    task = TrainConfig.load(args.run).task
    if task == "translation":
        result = evaluate_translation(args.run, split=args.split, beam_size=args.beam, length_penalty=args.length_penalty,
                                      limit=args.limit, compound_split=args.compound_split, device=args.device,
                                      output=args.output)
    else:
        result = evaluate_language_model(args.run, split=args.split, device=args.device)
    print(json.dumps(result, indent=2, ensure_ascii=False))
    return 0


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="train MoA and an MHA baseline of equal MACs on the embedded corpus and compare")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--train-seconds", type=float, default=260.0,
                   help="MoA's training time; MHA then trains for the same number of steps")
    p.add_argument("--eval-sentences", type=int, default=400)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-progress", action="store_true")


def _run_demo(args) -> int:
    from ..training.demo import run_demo

    run_demo(args.out, train_seconds=args.train_seconds, eval_sentences=args.eval_sentences, beam_size=args.beam,
             seed=args.seed, progress=not args.no_progress)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headmix", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_train(sub)
    _add_translate(sub)
    _add_evaluate(sub)
    for optional in ("macs", "bench", "analyze"):
        try:
            module = __import__(f"headmix.cli.{optional}", fromlist=["add_parser"])
        except ImportError:
            continue
        module.add_parser(sub)
    return parser


RUNNERS = {"demo": _run_demo, "train": _run_train, "translate": _run_translate, "evaluate": _run_evaluate}


def keep_freed_memory() -> None:
    """Ask glibc to keep freed memory instead of returning it to the system at once.

    PyTorch's CPU tensors of more than 128 KiB are mmap'ed and unmapped on free, so every training step
    page-faults its activations back in: on the 2-core reference machine that was 40% of the wall time
    (system time) and this setting makes a training step of the demo's models about 1.5x faster. It
    changes nothing on other C libraries, and only for the ``headmix`` command, not for library users.
    """
    if sys.platform != "linux":
        return
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 1 << 30)
        libc.mallopt(m_trim_threshold, 1 << 30)
    except (OSError, AttributeError):  # not glibc
        pass


def main(argv: Sequence[str] | None = None) -> int:
    keep_freed_memory()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command in RUNNERS:
            return RUNNERS[args.command](args)
        return _dispatch(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"headmix {args.command}: error: {err}", file=sys.stderr)
        return 2


def _dispatch(args) -> int:
    module = __import__(f"headmix.cli.{args.command}", fromlist=["run"])
    return module.run(args)


if __name__ == "__main__":
    sys.exit(main())
