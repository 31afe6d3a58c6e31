"""``headmix export-hf``: a causal LM run (or a folder headmix's ``save_pretrained`` wrote) as a Hugging Face
folder that ``AutoModelForCausalLM.from_pretrained`` loads (docs/hf.md); needs ``pip install 'headmix[hf]'``.

    headmix export-hf runs/lm runs/lm-hf
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export-hf", help="write a causal LM run as a Hugging Face transformers folder",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a finished `headmix train lm` run folder (config.json, model.safetensors)")
    p.add_argument("out", help="a new folder for config.json, model.safetensors, the tokenizer and auto_map code")
    return p


def run(args) -> int:
    from ..hf import run_to_hf  # transformers loads only for this command

    out = run_to_hf(args.run, args.out)
    print(f"wrote {out}: load it with transformers.AutoModelForCausalLM.from_pretrained after `import headmix.hf`")
    return 0
