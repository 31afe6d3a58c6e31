"""``headmix bench mosa``: Mixture of Sparse Attention against multi-head attention of equal attention MACs.

For each sequence length ``T`` the MoSA layer (``--dense-heads`` dense heads and sparse heads of
``--head-dim`` keeping ``T // sparsity`` tokens each) gets the number of sparse heads whose attention MACs
(:func:`headmix.models.counting.mosa_macs`: router, the chosen tokens' projections, the ``k^2`` attention,
the dense heads) are closest to headmix MHA's (``--heads`` heads of ``d_model / heads``, no biases, as the
MoSA authors' layers). Both run causal self-attention on the same input, in one process, interleaved (every
repeat runs each layer once, in turn; the median over repeats is reported):

- ``fwd+bwd``: forward and backward of ``output.square().mean()``;
- memory: on CUDA the peak allocated memory of a forward+backward; on CPU the bytes of the tensors autograd
  saves for backward (see :func:`headmix.bench.attention.peak_memory`), which counts the weights autograd keeps
  (MoSA at MHA's MACs has many more heads, so many more weights), and beside it the same without the layer's
  parameters (the activations alone);

and the ratios MoSA / MHA. The KV cache per token of generation follows: MHA's ``2 H d_h`` numbers, and
MoSA's under the causal threshold rule (the only rule with a cache: sparse heads keep only the tokens they
choose), expected ``2 H_s d_h k / T + 2 H_d d_h`` numbers and measured on a prompt of ``T`` random tokens fed
with the cache 128 tokens at a time, after calibrating the thresholds on top-k routings of random inputs (the
measured cache pads every head to the largest number of tokens any head of any sequence chose).
"""

from __future__ import annotations

import argparse
import time

import torch

from ..attention import MixtureOfSparseAttention, MultiHeadAttention
from ..models.matching import matched_sparse_heads
from ..devices import pick_device
from .attention import _device_name, format_rows, peak_memory
from .timing import add_clock_arguments, bench_dtype, clock_setup, interleaved_timings


def bench_mosa(seq_lens: list[int], *, embed_dim: int, heads: int, head_dim: int, sparsity: float, dense_heads: int,
               batch_tokens: int, repeats: int, warmup: int, device: torch.device, dtype: torch.dtype,
               clock=time.perf_counter) -> list[dict]:
    rows = []
    for seq in seq_lens:
        sparse, macs_ratio = matched_sparse_heads(embed_dim, heads, seq, head_dim=head_dim, sparsity=sparsity,
                                                  dense_heads=dense_heads)
        mha = MultiHeadAttention(embed_dim, heads, bias=False, rotary=True, rotary_fraction=0.5).to(device, dtype)
        mosa = MixtureOfSparseAttention(embed_dim, sparse, head_dim, sparsity=sparsity,
                                        num_dense_heads=dense_heads).to(device, dtype)
        layers = {"MHA": mha, "MoSA": mosa}
        batch = max(1, batch_tokens // seq)
        x = torch.randn(batch, seq, embed_dim, device=device, dtype=dtype, requires_grad=True)

        def step(layer):
            for p in layer.parameters():
                p.grad = None
            x.grad = None
            layer(x, is_causal=True).output.float().square().mean().backward()

        times = interleaved_timings({n: (lambda l=l: step(l)) for n, l in layers.items()}, repeats, warmup, device,
                                    clock=clock)
        memory = {n: peak_memory(lambda l=l: step(l), device) for n, l in layers.items()}
        activations = {n: saved_activation_bytes(lambda l=l: step(l), l) for n, l in layers.items()}
        rows.append({"seq": seq, "batch": batch, "mosa": f"{sparse} sparse + {dense_heads} dense x {head_dim}, "
                     f"k {mosa.tokens_for(seq)}", "macs_ratio": macs_ratio,
                     "mha_ms": 1e3 * times["MHA"], "mosa_ms": 1e3 * times["MoSA"],
                     "time_ratio": times["MoSA"] / times["MHA"], "mha_mib": memory["MHA"] / 2**20,
                     "mosa_mib": memory["MoSA"] / 2**20, "memory_ratio": memory["MoSA"] / max(memory["MHA"], 1),
                     "activation_ratio": activations["MoSA"] / max(activations["MHA"], 1),
                     "params_ratio": sum(p.numel() for p in mosa.parameters()) / sum(p.numel() for p in mha.parameters())})
    return rows


def saved_activation_bytes(fn, layer: torch.nn.Module) -> int:
    """Bytes of the distinct storages autograd saves during ``fn()``, the storages of ``layer``'s parameters
    left out."""
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@torch.no_grad()
def cache_bytes(seq: int, *, embed_dim: int, heads: int, head_dim: int, sparsity: float, dense_heads: int,
                batch: int, device: torch.device, dtype: torch.dtype) -> dict:
    """KV-cache bytes per token: MHA's, MoSA's expected under the threshold rule, and MoSA's measured."""
    sparse, _ = matched_sparse_heads(embed_dim, heads, seq, head_dim=head_dim, sparsity=sparsity,
                                     dense_heads=dense_heads)
    size = torch.tensor([], dtype=dtype).element_size()
    mosa = MixtureOfSparseAttention(embed_dim, sparse, head_dim, sparsity=sparsity,
                                    num_dense_heads=dense_heads).to(device, dtype).eval()
    x = torch.randn(batch, seq, embed_dim, device=device, dtype=dtype)
    k = mosa.tokens_for(seq)
    mosa.calibrate_thresholds([mosa(torch.randn_like(x), is_causal=True).routing for _ in range(2)])
    mosa.selection = "threshold"
    cache = None
    for start in range(0, seq, 128):  # the prompt in chunks: the threshold rule's forward is dense over a chunk
        cache = mosa(x[:, start:start + 128], is_causal=True, use_cache=True, cache=cache).cache
    return {"seq": seq, "mosa": f"{sparse} sparse + {dense_heads} dense x {head_dim}",
            "mha_bytes": 2 * embed_dim * size,
            "mosa_expected_bytes": (2 * sparse * head_dim * k / seq + 2 * dense_heads * head_dim) * size,
            "mosa_measured_bytes": cache.nbytes / (batch * seq)}


ROW_COLUMNS = [("seq", "seq", "{}"), ("batch", "batch", "{}"), ("mosa", "MoSA", "{}"),
               ("macs_ratio", "attention MACs / MHA", "{:.3f}"), ("mha_ms", "MHA fwd+bwd ms", "{:.1f}"),
               ("mosa_ms", "MoSA fwd+bwd ms", "{:.1f}"), ("time_ratio", "time / MHA", "{:.2f}"),
               ("mha_mib", "MHA memory MiB", "{:.1f}"), ("mosa_mib", "MoSA memory MiB", "{:.1f}"),
               ("memory_ratio", "memory / MHA", "{:.2f}"), ("activation_ratio", "activations / MHA", "{:.2f}"),
               ("params_ratio", "parameters / MHA", "{:.1f}")]
CACHE_COLUMNS = [("seq", "seq", "{}"), ("mosa", "MoSA", "{}"), ("mha_bytes", "MHA bytes/token/layer", "{:.0f}"),
                 ("mosa_expected_bytes", "MoSA expected", "{:.0f}"),
                 ("mosa_measured_bytes", "MoSA measured (threshold rule)", "{:.0f}")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bfloat16 on CUDA, else float32)")
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8, help="MHA heads (of embed_dim / heads)")
    p.add_argument("--head-dim", type=int, default=64, help="MoSA head size (sparse and dense)")
    p.add_argument("--sparsity", type=float, default=16.0, help="each sparse head keeps T // sparsity tokens")
    p.add_argument("--dense-heads", type=int, default=1)
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--batch-tokens", type=int, default=4096, help="batch = batch_tokens // seq")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    add_clock_arguments(p)
    p.add_argument("--no-cache", action="store_true", help="skip the KV-cache table")


def run(args: argparse.Namespace) -> int:
    device = pick_device(args.device)
    dtype = bench_dtype(args.dtype, device)
    if args.clock == "cpu" and device.type != "cpu":
        raise ValueError(f"--clock cpu measures CPU time and needs --device cpu, got {device}")
    clock, setup = clock_setup(args)
    torch.manual_seed(0)
    print(f"# headmix bench mosa: {device} ({_device_name(device)}), {dtype}, torch {torch.__version__}, {setup}; "
          f"d_model {args.embed_dim}, MHA {args.heads} heads, MoSA head_dim {args.head_dim}, sparsity "
          f"{args.sparsity:g}, {args.dense_heads} dense; causal fwd+bwd, median of {args.repeats} interleaved runs")
    rows = bench_mosa(args.seq, embed_dim=args.embed_dim, heads=args.heads, head_dim=args.head_dim,
                      sparsity=args.sparsity, dense_heads=args.dense_heads, batch_tokens=args.batch_tokens,
                      repeats=args.repeats, warmup=args.warmup, device=device, dtype=dtype, clock=clock)
    print(format_rows(rows, ROW_COLUMNS))
    if not args.no_cache:
        print()
        print("# KV cache per token and layer (generation; MoSA under the threshold rule, batch 2)")
        caches = [cache_bytes(seq, embed_dim=args.embed_dim, heads=args.heads, head_dim=args.head_dim,
                              sparsity=args.sparsity, dense_heads=args.dense_heads, batch=2, device=device,
                              dtype=dtype) for seq in args.seq]
        print(format_rows(caches, CACHE_COLUMNS))
    return 0
