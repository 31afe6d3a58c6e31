"""A headmix layer in your own PyTorch model: a small causal Transformer block with Mixture of Attention Heads
(MoA), trained for a few steps to copy a sequence. The only headmix-specific line in the training step is
adding the layer's ``aux_loss`` (its load-balancing and z-losses) to your loss.

    python examples/layer_in_your_model.py --steps 200
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from headmix import MixtureOfAttentionHeads


class Block(nn.Module):
    """Pre-norm Transformer block whose attention is MoA: 4 of 16 experts of size 16 per token."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = MixtureOfAttentionHeads(embed_dim=dim, num_experts=16, top_k=4, head_dim=16, rotary=True)
        self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.attention(self.norm1(x), is_causal=True)  # an AttentionOutput: output, aux_loss, routing
        x = x + out.output
        return x + self.ffn(self.norm2(x)), out.aux_loss


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, aux = self.embed(tokens), torch.zeros(())
        for block in self.blocks:
            x, block_aux = block(x)
            aux = aux + block_aux
        return self.head(x), aux


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    vocab, half = 16, 8
    model = TinyLM(vocab)
    print(model.blocks[0].attention)  # the repr names the sizes: embed_dim, num_experts, top_k, head_dim
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(1, args.steps + 1):
        first = torch.randint(1, vocab, (32, half))
        tokens = torch.cat([first, first], dim=1)  # the second half repeats the first: learnable by attention
        logits, aux = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits[:, half - 1:].reshape(-1, vocab), tokens[:, half:].reshape(-1))
        (loss + aux).backward()  # add the layers' auxiliary loss to yours
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == args.steps:
            print(f"step {step}: copy loss {loss.item():.3f}, aux {aux.item():.4f}")
    return loss.item()


if __name__ == "__main__":
    main()
