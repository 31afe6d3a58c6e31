"""``python -m headmix.serving.check FOLDER ...``: whether vLLM serves the model of each folder headmix wrote (a run,
``save_pretrained``, ``export-hf``), one line each, in a second and without vLLM (docs/serving.md).

A served folder's line names the dtype it is served in (the one its weights were saved in: no ``--dtype``, see
:func:`~headmix.serving.plugin.saved_dtype_resolver`) and the flags ``vllm serve`` needs for its form, a command
that gives headmix's tokens; a refused one's is
:func:`~headmix.serving.support.check_servable`'s reason, first naming what generates with that folder instead.
The exit status is 1 when any folder is refused or unreadable. The head size is checked against the attention
backend's sizes only where vLLM builds the model (the line names the size).
"""

from __future__ import annotations

import argparse
import sys

from .plugin import saved_dtype
from .support import check_servable, servable_config


def serve_flags(folder: str) -> str:
    """The ``vllm serve`` flags the folder's form needs: headmix's own form (a run, ``save_pretrained``) has a
    ``config.json`` without ``model_type`` (``--config-format headmix``) and no tokenizer at its top
    (``--skip-tokenizer-init``); an ``export-hf`` folder none (with its tokenizer)."""
    from pathlib import Path

    from ..models.folders import read_folder_config

    if read_folder_config(Path(folder))[1]:
        return "" if (Path(folder) / "tokenizer.json").is_file() else " --skip-tokenizer-init"
    return " --config-format headmix --skip-tokenizer-init"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m headmix.serving.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="+", help="a folder headmix wrote (run, save_pretrained, export-hf)")
    args = parser.parse_args(argv)
    status = 0
    for folder in args.folder:
        try:
            check_servable(folder)
            config = servable_config(folder)[0]
        except (OSError, ValueError) as err:  # NotServableError is a ValueError
            print(f"{folder}: not served: {err}")
            status = 1
            continue
        att = config.decoder_self_attention
        print(f"{folder}: served ({att.kind}, heads of {att.resolved_head_dim(config.d_model)}, in "
              f"{saved_dtype(folder)} as saved): vllm serve {folder}{serve_flags(folder)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
