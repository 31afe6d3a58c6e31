"""The ``headmix`` command: ``demo``, ``train``, ``translate``, ``evaluate``, ``macs``, ``bench``, ``analyze``.

The process-wide settings (the allocator's, signal handlers) are made here, at the entry point, never by
the library functions the commands call. Expected failures print one line on stderr: exit code 2 for a
bad command line, 1 for a run that failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import errno
import json
import signal
import sys
import types
import typing
from typing import Any, Callable, Iterator, Sequence

from ..process import keep_freed_memory

#: What ``headmix --help`` says above the commands.
DESCRIPTION = """Attention layers that select or mix heads per token (MoA, MoH, Talking-Heads, SwitchHead, MHA):
train, evaluate and compare models that use them. `headmix COMMAND --help` describes a command.

Exit codes: 0 done, 1 a run failed, 2 a bad command line (one line on stderr says why)."""

#: Exit codes: 2 for a bad command line, 1 for a run that failed.
USAGE_ERROR, RUN_FAILED = 2, 1


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad command line reported in one line (``headmix train: error: ...``); an unknown flag
    names the nearest flag of its command (``did you mean --max-steps?``)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}{_nearest_flag(unknown, self, parsed)}")
        return parsed


def _nearest_flag(unknown: list[str], parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> str:
    """`` (did you mean --x?)`` for the first unknown flag, ``x`` the nearest option of the (sub)command the command
    line chose (difflib's closest match); ``""`` when no flag is near."""
    options: list[str] = []
    while parser is not None:
        options += [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
        chosen = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = chosen[0].choices.get(getattr(parsed, chosen[0].dest, None)) if chosen else None
    flags = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")]
    near = difflib.get_close_matches(flags[0], options, n=1) if flags else []
    return f" (did you mean {near[0]}?)" if near else ""


# ------------------------------------------------------------------------------ flags from a dataclass

def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _option_type(hint: Any) -> tuple[Any, bool]:
    """``(base type, optional)`` of a field's type hint (``float | None`` -> ``(float, True)``)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return hint, False


def add_dataclass_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """One argument per field of ``cls``: ``name`` -> ``--name`` (kebab case), with the field's type, default,
    choices and help text (``field(metadata={"help": ..., "choices": ..., "cli": ...})``). A bool field is a
    switch (``--strict``; ``--no-progress`` when its default is True); a list is ``nargs="+"``; a tuple of
    n items is ``nargs=n``; ``cli="positional"`` makes a positional argument, ``cli="required"`` a required flag."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        base, _ = _option_type(hints[f.name])
        kwargs: dict[str, Any] = {"help": meta.get("help", "")}
        if meta.get("choices"):
            kwargs["choices"] = list(meta["choices"])
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        if meta.get("cli") == "positional":
            parser.add_argument(f.name, **kwargs)
            continue
        if base is bool:
            if default:
                parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                                    help=f"do not {kwargs['help']}")
            else:
                parser.add_argument(_flag(f.name), dest=f.name, action="store_true", help=kwargs["help"])
            parser.set_defaults(**{f.name: default})
            continue
        origin = typing.get_origin(base)
        if origin is list:
            kwargs.update(nargs="+", type=typing.get_args(base)[0])
        elif origin is tuple:
            item_types = typing.get_args(base)
            kwargs.update(nargs=len(item_types), type=item_types[0])
        else:
            kwargs["type"] = base
        if meta.get("cli") == "required":
            kwargs["required"] = True
        else:
            kwargs["default"] = default
            kwargs["help"] += f" (default: {default})" if default not in (None, [], "") else ""
        parser.add_argument(_flag(f.name), dest=f.name, **kwargs)


def dataclass_from_args(cls: type, args: argparse.Namespace) -> Any:
    """An instance of ``cls`` from the arguments :func:`add_dataclass_options` added."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    for name, value in values.items():
        if isinstance(value, list) and typing.get_origin(typing.get_type_hints(cls)[name]) is tuple:
            values[name] = tuple(value)
    return cls(**values)


def _number(convert: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse ``type``: ``convert(text)``, refused with "expected {expected}, got ..." when it fails or when
    ``ok(value)`` is false (argparse turns that into a one-line usage error naming the option)."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value
    return parse


_positive_int = _number(int, lambda v: v > 0, "a positive integer")
_probability = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
_non_negative_float = _number(float, lambda v: v >= 0, "a number >= 0")


def device_option(text: str) -> str:
    """The ``--device`` argument type of every command: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``, checked by
    :func:`headmix.devices.pick_device` (a bad name is a one-line usage error naming ``--device``)."""
    from ..devices import pick_device

    try:
        pick_device(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def device_name_option(text: str) -> str:
    """A ``--device`` argument that names the device of runs made elsewhere (``headmix study``): the name's form
    is checked here (:func:`headmix.devices.check_device_name`), the device when a run starts."""
    from ..devices import check_device_name

    try:
        return check_device_name(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_device_option(parser: argparse.ArgumentParser, default: str = "cpu") -> None:
    parser.add_argument("--device", type=device_option, default=default,
                        help=f"cpu, cuda, cuda:N or auto (cuda when available; default: {default})")


# ------------------------------------------------------------------------------------------ commands

def _add_train(sub) -> None:
    from ..training.config import TrainConfig

    p = sub.add_parser("train", help="train a model (translation, masked LM or causal LM)",
                       description="Train a model; running it again on the same --out resumes the run.")
    add_dataclass_options(p, TrainConfig)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[Callable[[], str | None]]:
    """SIGINT/SIGTERM ask the training to stop after its current step (it saves a checkpoint first); a
    second signal stops at once. Yields the ``stop`` callable ``train()`` polls."""
    received: list[int] = []

    def handle(signum, frame):
        if received:
            raise KeyboardInterrupt
        received.append(signum)

    old = {}
    for s in (signal.SIGINT, signal.SIGTERM):
        try:
            old[s] = signal.signal(s, handle)
        except ValueError:  # not the main thread
            pass
    try:
        yield lambda: f"signal {received[0]}" if received else None
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _run_train(args) -> int:
    from ..training import TrainConfig, train

    try:
        cfg = dataclass_from_args(TrainConfig, args)
        cfg.validate()
    except (ValueError, FileNotFoundError) as err:  # name the option as typed: "seed must be" -> "--seed must be"
        field, _, rest = str(err).partition(" ")
        if field in {f.name for f in dataclasses.fields(TrainConfig)}:
            raise type(err)(f"{_flag(field)} {rest}") from None
        raise
    with stop_on_signals() as stop:
        summary = train(cfg, stop=stop)
    if summary.get("stopped_by", "").startswith("signal "):
        signum = int(summary["stopped_by"].split()[1])
        print(f"headmix train: stopped by signal {signum}; run the same command to resume", file=sys.stderr)
        return 128 + signum
    if summary:
        print(json.dumps({k: v for k, v in summary.items() if k != "valid"} | {"valid_loss": summary["valid"]["loss"],
                                                                             "valid_ppl": summary["valid"]["ppl"]}))
    return 0


def _add_translate(sub) -> None:
    p = sub.add_parser("translate", help="translate lines of text with a trained run (beam search)")
    p.add_argument("run", help="run folder")
    p.add_argument("--input", default="-", help="file of source lines (default: standard input)")
    p.add_argument("--beam", type=_positive_int, default=4)
    p.add_argument("--length-penalty", type=float, default=1.0)
    add_device_option(p)


def _run_translate(args) -> int:
    from ..evaluation import translate
    from ..runs import load_run
    from ..devices import pick_device

    device = pick_device(args.device)
    run = load_run(args.run, device)
    if run.model.config.task != "translation":
        raise ValueError(f"{args.run} is a {run.model.config.task!r} run; headmix translate needs a translation run "
                         f"(for a language model: headmix generate {args.run} --prompt TEXT)")
    if args.input == "-":
        lines = sys.stdin.read().splitlines()
    else:
        with open(args.input, encoding="utf-8") as f:
            lines = f.read().splitlines()
    for hyp in translate(run.model, run.tokenizer, lines, beam_size=args.beam, length_penalty=args.length_penalty,
                         device=device):
        print(hyp)
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="continue text prompts with a trained language model (greedy or sampled)",
                       description="Continue each prompt with a causal LM run (task lm): text in, text out, with "
                                   "the run's tokenizer. Greedy by default; --temperature > 0 samples.")
    p.add_argument("run", help="run folder of a finished 'lm' run")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    given.add_argument("--prompts", metavar="FILE", help="a file of prompts, one a line ('-': standard input)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64, help="tokens generated per prompt at most "
                                                                          "(default: 64)")
    p.add_argument("--temperature", type=_non_negative_float, default=0.0,
                   help="0: greedy (the default); > 0: sample from the distribution divided by it")
    p.add_argument("--top-k", type=_positive_int, default=None, help="sample among the k most likely tokens only")
    p.add_argument("--top-p", type=_probability, default=None,
                   help="sample within the smallest set of most likely tokens holding this probability (nucleus)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws (default: 0)")
    p.add_argument("--jsonl", action="store_true", help='write one {"prompt", "continuation"} JSON object a line')
    add_device_option(p)


def _run_generate(args) -> int:
    from ..models import CausalLanguageModel, generate_text
    from ..runs import load_run
    from ..devices import pick_device

    if args.prompts is None:
        prompts = args.prompt
    elif args.prompts == "-":
        prompts = sys.stdin.read().splitlines()
    else:
        with open(args.prompts, encoding="utf-8") as f:
            prompts = f.read().splitlines()
    if (args.top_k is not None or args.top_p is not None) and args.temperature == 0:
        raise ValueError("--top-k and --top-p choose among the tokens a sample is drawn from: give --temperature > 0 "
                         "(the default, 0, is greedy)")
    device = pick_device(args.device)
    run = load_run(args.run, device)
    if not isinstance(run.model, CausalLanguageModel):
        raise ValueError(f"{args.run} is a {run.model.config.task!r} run; headmix generate continues text with a "
                         f"language model (task 'lm'); for translation use headmix translate")
    texts = generate_text(run.model, run.tokenizer, prompts, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          device=device)
    for prompt, text in zip(prompts, texts):
        if args.jsonl:
            print(json.dumps({"prompt": prompt, "continuation": text}, ensure_ascii=False))
        else:
            print(prompt + text)
    return 0


def _add_evaluate(sub) -> None:
    p = sub.add_parser("evaluate", help="BLEU/chrF (translation) or perplexity (LM) of a run on its held-out split")
    p.add_argument("run", help="run folder")
    p.add_argument("--split", choices=["valid", "test"], default="test",
                   help="the run's split to score (default: test; training reports the valid split)")
    p.add_argument("--beam", type=_positive_int, default=4)
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument("--limit", type=_positive_int, default=None, help="score only the first N sentences / documents")
    p.add_argument("--compound-split", action="store_true", help="German compound splitting before BLEU (the paper's)")
    p.add_argument("--output", default=None, help="write the translations to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it is shown on a terminal only)")
    add_device_option(p)


def _run_evaluate(args) -> int:
    from ..tasks import evaluate_run
    from ..devices import pick_device

    result = evaluate_run(args.run, split=args.split, beam_size=args.beam, length_penalty=args.length_penalty,
                          limit=args.limit, compound_split=args.compound_split, device=pick_device(args.device),
                          output=args.output, progress=not args.no_progress)
    note = "" if args.split == "valid" else " (training reports the valid split: --split valid to compare)"
    print(f"[headmix] evaluate scored the {args.split} split of {args.run}{note}", file=sys.stderr)
    print(json.dumps(result, indent=2, ensure_ascii=False))
    return 0


def _add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="calibrate the MoSA thresholds of a language model run (for generation)",
                       description="Calibrate the score thresholds of every MoSA layer of a finished 'lm' run from "
                                   "its training split and store them in its model.safetensors, so that headmix "
                                   "generate, export-hf and Hugging Face generate() work: runs trained by this "
                                   "headmix have them already.")
    p.add_argument("run", help="run folder of a finished 'lm' run with MoSA attention")
    add_device_option(p)


def _run_calibrate(args) -> int:
    from ..training.calibrate import calibrate_run
    from ..devices import pick_device

    thresholds = calibrate_run(args.run, device=pick_device(args.device))
    for name, values in thresholds.items():
        print(f"{name}: " + " ".join(f"{v:.4f}" for v in values))
    print(f"stored in {args.run}/model.safetensors")
    return 0


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="train MoA (4 of 16 experts) and an MHA baseline of equal attention MACs on the "
                                    "embedded corpus and compare")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--size", choices=("cpu", "gpu"), default=None,
                   help="the demo's size regardless of the device (default: the device's)")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help="training steps of each model (default: the size's, 450 on CPU; steps, not seconds: a "
                        "seed gives the same numbers everywhere)")
    p.add_argument("--eval-sentences", type=_positive_int, default=None,
                   help="test sentences scored (default: the size's, 400 on CPU, all on GPU)")
    p.add_argument("--beam", type=_positive_int, default=None, help="beam size (default: the size's, 4)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-progress", action="store_true")
    add_device_option(p, default="auto")
    p.add_argument("--compile", action="store_true", help="torch.compile both models for training")


def _run_demo(args) -> int:
    from ..training.demo import SIZES, run_demo

    with stop_on_signals() as stop:
        report = run_demo(args.out, steps=args.steps, eval_sentences=args.eval_sentences,
                          beam_size=args.beam, seed=args.seed, progress=not args.no_progress, device=args.device,
                          size=SIZES[args.size] if args.size else None, stop=stop, compile=args.compile)
    if report.get("stopped_by", "").startswith("signal "):
        signum = int(report["stopped_by"].split()[1])
        print(f"headmix demo: stopped by signal {signum}", file=sys.stderr)
        return 128 + signum
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = _Parser(prog="headmix", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"headmix {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_demo(sub)
    _add_train(sub)
    _add_translate(sub)
    _add_generate(sub)
    _add_evaluate(sub)
    _add_calibrate(sub)
    for optional in ("macs", "bench", "analyze", "study", "data", "export_hf", "harness"):
        try:
            module = __import__(f"headmix.cli.{optional}", fromlist=["add_parser"])
        except ImportError:
            continue
        module.add_parser(sub)
    return parser


RUNNERS = {"demo": _run_demo, "train": _run_train, "translate": _run_translate, "generate": _run_generate,
           "evaluate": _run_evaluate, "calibrate": _run_calibrate}


def _fail(command: str, message: Any, code: int) -> int:
    text = " ".join(str(message).split("\n")).strip()
    print(f"headmix {command}: error: {text}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``headmix`` command with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lm-eval"]:  # lm_eval's own arguments, passed on unparsed (headmix.cli.harness)
        from .harness import run as run_harness

        try:
            return run_harness(argv[1:])
        except ValueError as err:
            return _fail("lm-eval", err, USAGE_ERROR)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, or a bad command line (already reported)
        return stop.code if isinstance(stop.code, int) else USAGE_ERROR
    if args.command in MEMORY_KEEPING_COMMANDS:
        keep_freed_memory()
    from ..runs import RunError, RunFileNotFoundError, RunMismatchError
    from ..training import TrainingError

    try:
        if args.command in RUNNERS:
            return RUNNERS[args.command](args)
        return _dispatch(args)
    except (RunMismatchError, RunFileNotFoundError) as err:  # the command contradicts or misnames its run
        return _fail(args.command, err, USAGE_ERROR)
    except (RunError, TrainingError) as err:
        return _fail(args.command, err, RUN_FAILED)
    except (ValueError, FileNotFoundError) as err:
        return _fail(args.command, err, USAGE_ERROR)
    except KeyboardInterrupt:  # a second SIGINT/SIGTERM: stopped at once, without a checkpoint
        return _fail(args.command, "interrupted; the newest checkpoint is kept, run the same command to resume",
                     128 + signal.SIGINT)
    except OSError as err:
        if err.errno == errno.ENOSPC:
            return _fail(args.command, f"no space left on device ({err.filename or err})", RUN_FAILED)
        raise


#: The commands that train or time models: they keep freed memory (:func:`headmix.keep_freed_memory`; without it a
#: CPU training step page-faults its activations back in, and a study paid that in every run and timing). ``bench``
#: makes the setting per benchmark (:func:`headmix.cli.bench.run`: ``bench compute --malloc default`` leaves it).
MEMORY_KEEPING_COMMANDS = ("train", "study", "demo")


def _dispatch(args) -> int:
    module = __import__(f"headmix.cli.{args.command.replace('-', '_')}", fromlist=["run"])
    return module.run(args)


if __name__ == "__main__":
    sys.exit(main())
