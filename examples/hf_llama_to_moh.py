"""A Llama checkpoint -> Mixture-of-Head attention -> continue training with Hugging Face Trainer ->
save_pretrained -> AutoModelForCausalLM.from_pretrained -> generate (docs/hf.md, "The recipe").

The MoH authors' workflow (MoH-LLaMA3-8B was continue-tuned from LLaMA3-8B), end to end on the CPU in a few
minutes: a small Llama is built from a config here (pass ``--llama FOLDER`` for a real checkpoint folder), its
attention converted to MoH with the same heads and zero routers (``headmix.interop.load_llama``), trained for
``--steps`` steps on a real text file (default: the English documents embedded in headmix, at the byte level:
token = byte + 3, after pad / bos / eos), saved, reloaded through the Auto classes and sampled.

    python examples/hf_llama_to_moh.py --out runs/hf-moh    # 483 s on 2 busy CPU cores (docs/hf.md)
    python examples/hf_llama_to_moh.py --llama path/to/llama --text my.txt --out runs/x
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import transformers

from headmix.hf import HeadmixForCausalLM
from headmix.interop import load_llama

SPECIALS = 3  # pad 0, bos 1, eos 2; byte b is token b + 3


def encode(text: str) -> list[int]:
    return [b + SPECIALS for b in text.encode("utf-8")]


def decode(ids: list[int]) -> str:
    return bytes(i - SPECIALS for i in ids if i >= SPECIALS).decode("utf-8", errors="replace")


def tiny_llama(folder: Path, d_model: int, layers: int, heads: int, kv_heads: int) -> None:
    """A freshly initialised Llama over the byte vocabulary, saved as a checkpoint folder."""
    config = transformers.LlamaConfig(vocab_size=256 + SPECIALS, hidden_size=d_model, intermediate_size=4 * d_model,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def text_blocks(path: Path | None, block: int, limit_bytes: int) -> list[dict]:
    """Training examples: consecutive ``block``-token slices of the text's bytes (``labels`` = inputs: the
    model shifts them)."""
    if path is None:
        from headmix.data import load_embedded_documents

        text = "\n\n".join(doc.text for doc in load_embedded_documents())
    else:
        text = path.read_text(encoding="utf-8")
    ids = torch.tensor(encode(text[:limit_bytes]))
    rows = ids[: len(ids) // block * block].view(-1, block)
    return [{"input_ids": row, "labels": row} for row in rows]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="a new folder: the Hugging Face model is saved here")
    parser.add_argument("--llama", type=Path, help="a Llama checkpoint folder (default: build a small one)")
    parser.add_argument("--text", type=Path, help="a UTF-8 text file (default: headmix's embedded English documents)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2, help="Llama's grouped K/V heads")
    parser.add_argument("--shared-heads", type=int, default=2, help="MoH heads every token uses")
    parser.add_argument("--top-k", type=int, default=4, help="MoH routed heads each token selects")
    parser.add_argument("--route-per-group", action="store_true",
                        help="route inside each K/V group (MoH per K/V group): --shared-heads and --top-k then count per group")
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--text-bytes", type=int, default=2_000_000)
    args = parser.parse_args(argv)
    if args.out.exists():
        parser.error(f"--out {args.out} exists: choose a new folder")

    with tempfile.TemporaryDirectory() as tmp:
        llama = args.llama
        if llama is None:
            llama = Path(tmp) / "llama"
            tiny_llama(llama, args.d_model, args.layers, args.heads, args.kv_heads)
        # 1. Llama -> headmix MoH (same heads, zero routers), wrapped as a transformers model
        moh = load_llama(llama, attention="moh", num_shared_heads=args.shared_heads, top_k=args.top_k, pad_id=0,
                         route_per_group=args.route_per_group)
        model = HeadmixForCausalLM.from_headmix(moh)
        # 2. continue training with Trainer: loss = next-token cross-entropy + MoH's load-balancing loss
        training = transformers.TrainingArguments(
            output_dir=str(Path(tmp) / "trainer"), per_device_train_batch_size=args.batch, max_steps=args.steps,
            learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 10), logging_steps=max(1, args.steps // 20),
            report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
        trainer = transformers.Trainer(model=model, args=training,
                                       train_dataset=text_blocks(args.text, args.block, args.text_bytes))
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    # 3. save_pretrained, 4. reload with the Auto classes (headmix.hf, imported above, registered them)
    model.save_pretrained(args.out)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(args.out).eval()
    # 5. generate
    prompt = torch.tensor([[1] + encode("In the beginning")])
    out = reloaded.generate(prompt, max_new_tokens=60, do_sample=True, top_k=20, temperature=0.8,
                            pad_token_id=0, eos_token_id=2)
    sample = decode(out[0, prompt.shape[1]:].tolist())
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps; saved to {args.out}")
    print(f"sample: In the beginning{sample!r}")
    return {"losses": losses, "sample": sample, "out": args.out}


if __name__ == "__main__":
    main()
