"""Convert a Hugging Face Llama to Mixture-of-Head attention (MoH) and continue training it with headmix, then
generate text with it: the Python API of ``headmix train --init-from FOLDER --init-options JSON`` and
``headmix generate``.

    python examples/continue_training_llama.py --llama path/to/llama-folder --data docs.jsonl --out runs/moh

``--llama`` is a local ``save_pretrained`` folder of a ``LlamaForCausalLM`` (no download happens here);
without it, a tiny random Llama is built from a config and saved in ``OUT/llama`` with a byte-level BPE trained
on ``--data`` (a JSONL of documents; default: the embedded English corpus) as its tokenizer, to show the steps.
The run takes the folder's own tokenizer (``tokenizer.json``, with the special tokens its
``tokenizer_config.json`` and ``config.json`` name) unless ``--tokenizer`` names another one the model was
trained with; a folder without one is refused, since a new tokenizer would give the embeddings other ids.
Needs ``pip install "headmix[hf]"``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from headmix.models import generate_text
from headmix.runs import load_run
from headmix.training import TrainConfig, train


def tiny_llama(folder: Path, vocab_size: int, data: list[str]) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from headmix.data import ReadReport, train_tokenizer
    from headmix.tasks import get_task

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(folder)
    task = get_task("lm")  # its tokenizer: headmix's ids (LlamaConfig's bos 1, eos 2), at most vocab_size of them
    docs = task.read_corpus(data, strict=False, src_lang="en", tgt_lang="de", report=ReadReport(warn=False))
    train_tokenizer(task.tokenizer_texts(docs), vocab_size).save(folder)
    return folder


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama", help="a local Hugging Face Llama folder (default: a tiny random one)")
    parser.add_argument("--data", nargs="*", default=[], help="JSONL documents (default: the embedded corpus)")
    parser.add_argument("--tokenizer", default=None, help="another tokenizer folder (default: the Llama folder's own)")
    parser.add_argument("--out", default="runs/llama-to-moh")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--vocab-size", type=int, default=2000, help="the tiny Llama's vocabulary (without --llama)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    llama = Path(args.llama) if args.llama else tiny_llama(out / "llama", args.vocab_size, args.data)
    cfg = TrainConfig(task="lm", init_from=str(llama), out=str(out / "run"), data=args.data, tokenizer=args.tokenizer,
                      # 4 heads: 1 shared, 3 routed of which 2 per token (the MoH layers start with zero routers)
                      init_options='{"attention": "moh", "num_shared_heads": 1, "top_k": 2}',
                      max_steps=args.steps, max_len=64, max_tokens=1024,
                      eval_every=max(args.steps // 2, 1), save_every=max(args.steps // 2, 1), average_last=1,
                      progress=False)
    summary = train(cfg)  # running it again resumes
    print(f"trained {summary['steps']} steps from {summary['init_from']['path']}: valid ppl {summary['valid']['ppl']:.1f}")
    run = load_run(out / "run")
    texts = generate_text(run.model, run.tokenizer, ["The "], max_new_tokens=20, temperature=0.8, top_p=0.9, seed=1)
    print("The " + texts[0])
    return texts


if __name__ == "__main__":
    main()
