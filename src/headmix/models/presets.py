"""Named model configurations: the MoA paper's (Zhang et al. 2022, arXiv 2210.05144) and small ones for
CPU work.

- Translation (WMT14 setup, joint BPE vocabulary shared by encoder, decoder and output projection):
  ``transformer-base`` (d_m 512, FFN 2048, 8 heads, 6+6 layers), ``transformer-big`` (d_m 1024, FFN 4096,
  16 heads, 6+6, dropout 0.3), ``moa-base`` = ``8K8E128D`` and ``moa-big`` = ``16K32E256D``.
- Any ``{K}K{E}E{D}D`` string: the base-size model with MoA (top_k=K of E experts of head size D) in
  encoder self-attention, decoder self-attention and cross-attention (task ``translation``), or RoBERTa
  medium with MoA self-attention (task ``mlm``).
- Masked LM: ``roberta-medium`` (embedding 512, FFN 2048, 8 heads, 8 layers).
- CPU presets for every task: ``tiny-mha``, ``tiny-moa``, ``tiny-moh``, ``tiny-talking-heads``,
  ``tiny-switchhead`` (d_model 64, 2 (+2) layers), and two MHA / MoA pairs of nearly equal MACs: ``mini-*``
  (d_model 128, 3 (+3) layers; the demo's; ``mini-switchhead`` too) and ``small-*`` (d_model 256, 3 (+3)
  layers).
- Llama-style decoders (task ``lm`` only): pre-norm RMSNorm, SwiGLU, rotary positions, no biases, untied
  output projection, no dropout: ``llama-tiny-{mha,moa,moh,talking-heads,switchhead}`` (d_model 64, 2
  layers), ``llama-mini-{mha,moa,moh,switchhead}`` (d_model 128, 3 layers), ``llama-tiny-moa-kv2`` (MoA with 2 grouped K/V
  heads, JetMoE's attention) and the JetMoE-style ``llama-{tiny,mini}-jetmoe`` (MoA attention and a
  mixture of SwiGLU experts), and ``llama-{tiny,mini}-mosa`` (Mixture of Sparse Attention, see
  :data:`TINY_MOSA`).
- Llama-3-style decoders (task ``lm`` only; the ``llama-*`` options, rotary base 500000 and grouped-query
  attention, 4 query heads per K/V head): ``llama3-{tiny,mini}-gqa`` (MHA, 8 query heads on 2 K/V heads),
  ``llama3-{tiny,mini}-gated`` (the same with QK-norm and Gated Attention's elementwise output gate, as
  Qwen3-Next), ``llama3-{tiny,mini}-moh-per-group`` (MoH routed per K/V group: per group 1 shared head and the
  top 2 of the 3 others, so 6 of the 8 query heads run per token) and ``llama3-{tiny,mini}-gqe`` (the paper's
  Grouped Query Experts, kind ``"gqe"``: 8 query-head experts on the 2 K/V heads, the top 2 of each group's 4).

:func:`get_config` takes a preset name, a ``{K}K{E}E{D}D`` string or a path to a JSON config.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .config import AttentionConfig, ModelConfig
from .config_values import TASKS

#: Default vocabulary sizes: the paper's joint BPE for WMT14 En-De, GPT-2's BPE for the masked LM.
DEFAULT_VOCAB = {"translation": 32000, "mlm": 50265, "lm": 50265}
#: Vocabulary for the CPU presets (a small BPE trained on the embedded corpora).
SMALL_VOCAB = 8000

MOA_PATTERN = re.compile(r"^(\d+)K(\d+)E(\d+)D$")
MOA_PATTERN_TEXT = "{K}K{E}E{D}D (e.g. 8K8E128D: top_k K heads of E experts, head size D)"

#: The translation models of the paper's Table 1 and ablations (Table 4), in table order.
PAPER_TRANSLATION = ("transformer-base", "transformer-big", "moa-base", "moa-big",
                     "8K32E64D", "8K32E128D", "8K32E256D", "8K8E256D", "8K16E256D", "4K32E256D", "16K32E256D")
#: The masked-LM models: RoBERTa medium and MoA counterparts of the same size (a sweep over E at 8K, 128D).
PAPER_MLM = ("roberta-medium", "8K8E128D", "8K16E128D", "8K32E128D", "8K64E128D")


def mha(num_heads: int, dropout: float = 0.0) -> AttentionConfig:
    return AttentionConfig(kind="mha", num_heads=num_heads, dropout=dropout)


def moa(top_k: int, num_experts: int, head_dim: int, dropout: float = 0.0) -> AttentionConfig:
    """MoA with the paper's router settings (softmax router, detached renormalisation, alpha 0.01,
    beta 0.001)."""
    return AttentionConfig(kind="moa", top_k=top_k, num_experts=num_experts, head_dim=head_dim, dropout=dropout)


def _roles(task: str, attention: AttentionConfig) -> dict[str, AttentionConfig]:
    roles = {"translation": ("encoder_self_attention", "decoder_self_attention", "cross_attention"),
             "mlm": ("encoder_self_attention",), "lm": ("decoder_self_attention",)}[task]
    return {role: dataclasses.replace(attention) for role in roles}  # one copy per role


#: The stacks of each task's model.
STACKS = {"translation": ("encoder", "decoder"), "mlm": ("encoder",), "lm": ("decoder",)}
#: The CPU presets' label smoothing per task (the MoA paper's 0.1 for translation, none for the LMs).
CPU_LABEL_SMOOTHING = {"translation": 0.1, "mlm": 0.0, "lm": 0.0}


def _layers(task: str, n: int) -> dict[str, int]:
    return {f"{stack}_layers": n if stack in STACKS[task] else 0 for stack in ("encoder", "decoder")}


def transformer_base(vocab_size: int = 32000, attention: AttentionConfig | None = None) -> ModelConfig:
    """fairseq ``transformer_wmt_en_de``: post-norm, sinusoidal positions, ReLU, dropout 0.1, shared
    embeddings, label smoothing 0.1."""
    return ModelConfig(task="translation", vocab_size=vocab_size, d_model=512, ffn_dim=2048, encoder_layers=6,
                       decoder_layers=6, **_roles("translation", attention or mha(8)), norm="post",
                       positions="sinusoidal", max_positions=1024, dropout=0.1, activation="relu",
                       share_embeddings=True, label_smoothing=0.1)


def transformer_big(vocab_size: int = 32000) -> ModelConfig:
    """fairseq ``transformer_vaswani_wmt_en_de_big``: d_m 1024, FFN 4096, 16 heads, dropout 0.3."""
    return transformer_base(vocab_size, mha(16)).replace(d_model=1024, ffn_dim=4096, dropout=0.3)


def roberta_medium(vocab_size: int = 50265, attention: AttentionConfig | None = None) -> ModelConfig:
    """RoBERTa with embedding 512, FFN 2048, 8 heads, 8 layers (the paper's MLM baseline): post-norm,
    learned positions (512), GELU, LayerNorm on the embeddings, no embedding scaling, dropout 0.1,
    attention dropout 0.1, no label smoothing."""
    return ModelConfig(task="mlm", vocab_size=vocab_size, d_model=512, ffn_dim=2048, encoder_layers=8,
                       decoder_layers=0, encoder_self_attention=attention or mha(8, dropout=0.1), norm="post",
                       positions="learned", max_positions=512, dropout=0.1, activation="gelu",
                       scale_embeddings=False, embedding_norm=True, share_embeddings=True, label_smoothing=0.0)


def cpu_model(task: str, attention: AttentionConfig, vocab_size: int, *, d_model: int, ffn_dim: int, layers: int,
              max_positions: int) -> ModelConfig:
    """The CPU presets: pre-norm (trains without warm-up trouble), sinusoidal positions, ReLU, dropout 0.1."""
    return ModelConfig(task=task, vocab_size=vocab_size, d_model=d_model, ffn_dim=ffn_dim, **_layers(task, layers),
                       **_roles(task, attention), norm="pre", positions="sinusoidal", max_positions=max_positions,
                       dropout=0.1, activation="relu", label_smoothing=CPU_LABEL_SMOOTHING[task])


def _tiny(attention: AttentionConfig) -> Callable[[str, int], ModelConfig]:
    return lambda task, vocab: cpu_model(task, attention, vocab, d_model=64, ffn_dim=256, layers=2, max_positions=256)


def _mini(attention: AttentionConfig) -> Callable[[str, int], ModelConfig]:
    return lambda task, vocab: cpu_model(task, attention, vocab, d_model=128, ffn_dim=512, layers=3, max_positions=512)


def _small(attention: AttentionConfig) -> Callable[[str, int], ModelConfig]:
    return lambda task, vocab: cpu_model(task, attention, vocab, d_model=256, ffn_dim=1024, layers=3, max_positions=512)


def llama_ffn_dim(d_model: int, multiple_of: int = 16) -> int:
    """Llama's SwiGLU width: ``2/3 * 4 d_model`` (the parameters of a ``4 d_model`` MLP in three matrices),
    rounded up to a multiple of ``multiple_of``."""
    return -(-(8 * d_model // 3) // multiple_of) * multiple_of


def llama_model(attention: AttentionConfig, vocab_size: int, *, d_model: int, layers: int,
                max_positions: int, ffn_dim: int | None = None, share_embeddings: bool = False,
                **changes) -> ModelConfig:
    """A Llama-style decoder (Touvron et al. 2023): pre-norm with RMSNorm (eps 1e-5) and a final norm,
    SwiGLU feed-forward of width :func:`llama_ffn_dim`, rotary positions (base 10000) in the attention,
    no biases anywhere (the attention's too, unless its ``q_bias``/``kv_bias``/``out_bias`` say otherwise),
    no embedding scaling, no dropout, untied output projection (Llama 2/3 8B; ``share_embeddings=True`` ties
    it as the small Llama 3.2 models do). ``changes`` override other :class:`ModelConfig` fields."""
    attention = dataclasses.replace(attention, bias=False, rotary=True)
    fields = dict(task="lm", vocab_size=vocab_size, d_model=d_model, ffn_dim=ffn_dim or llama_ffn_dim(d_model),
                  encoder_layers=0, decoder_layers=layers, decoder_self_attention=attention, norm="pre",
                  norm_type="rmsnorm", norm_eps=1e-5, positions="rotary", max_positions=max_positions,
                  dropout=0.0, activation_dropout=0.0, ffn="swiglu", bias=False, scale_embeddings=False,
                  embedding_norm=False, share_embeddings=share_embeddings, label_smoothing=0.0)
    fields.update(changes)
    return ModelConfig(**fields)


def jetmoe_attention(top_k: int, num_experts: int, head_dim: int, kv_heads: int) -> AttentionConfig:
    """JetMoE's MoA (Shen et al. 2024): ``kv_heads`` grouped K/V heads, gates a softmax over the top-k
    logits (``renormalize="live"``), an output bias only, no z-loss."""
    return AttentionConfig(kind="moa", top_k=top_k, num_experts=num_experts, head_dim=head_dim, kv_heads=kv_heads,
                           renormalize="live", kv_bias=False, out_bias=True, z_loss_weight=0.0)


def jetmoe_model(vocab_size: int, *, d_model: int, layers: int, max_positions: int, top_k: int, num_experts: int,
                 head_dim: int, kv_heads: int) -> ModelConfig:
    """A JetMoE-style decoder: :func:`llama_model` with :func:`jetmoe_attention` and the same ``top_k`` of
    ``num_experts`` SwiGLU experts in the feed-forward (``ffn="moe_swiglu"``, width
    ``llama_ffn_dim(d_model) / top_k`` each, so a token's FFN costs what the dense SwiGLU's does, plus an
    output bias), RMSNorm eps 1e-6 and tied embeddings, as JetMoE; converts to and from Hugging Face
    ``JetMoeForCausalLM`` (:mod:`headmix.interop.jetmoe`)."""
    return llama_model(jetmoe_attention(top_k, num_experts, head_dim, kv_heads), vocab_size, d_model=d_model,
                       layers=layers, max_positions=max_positions, ffn_dim=llama_ffn_dim(d_model) // top_k,
                       share_embeddings=True, ffn="moe_swiglu", ffn_experts=num_experts, ffn_top_k=top_k, bias=True,
                       norm_eps=1e-6)


def _llama_tiny(attention: AttentionConfig) -> Callable[[str, int], ModelConfig]:
    return lambda task, vocab: llama_model(attention, vocab, d_model=64, layers=2, max_positions=256)


def _llama_mini(attention: AttentionConfig) -> Callable[[str, int], ModelConfig]:
    return lambda task, vocab: llama_model(attention, vocab, d_model=128, layers=3, max_positions=512)


#: Llama 3's rotary base (``rope_theta``).
LLAMA3_ROTARY_BASE = 500000.0
#: The llama3-* presets' attention: 8 query heads on 2 K/V heads (Llama-3-8B's 4 query heads per K/V head).
LLAMA3_GQA = AttentionConfig(kind="mha", num_heads=8, kv_heads=2, rotary_base=LLAMA3_ROTARY_BASE)
#: The same with QK-norm (Qwen3) and the elementwise G1 output gate (Gated Attention's best variant, Qwen3-Next).
LLAMA3_GATED = dataclasses.replace(LLAMA3_GQA, qk_norm=True, output_gate="elementwise")
#: MoH routed inside each K/V group on the same groups: per group 1 shared head and the top 2 of its 3 routed heads
#: (the ``llama3-*-gqe`` presets until 2026-11-28, named before the paper's GQE was built).
LLAMA3_MOH_PER_GROUP = AttentionConfig(kind="moh", num_heads=8, kv_heads=2, route_per_group=True, num_shared_heads=1,
                                       top_k=2, rotary_base=LLAMA3_ROTARY_BASE)
#: Grouped Query Experts as its paper defines it (``kind="gqe"``, arXiv 2606.20945) on the same 2 K/V heads: the GQA
#: presets' 8 query heads as experts, 4 per K/V head, top 2 per group (half of the routed experts active, as in
#: the paper's main setting), with the weighted-sum slot and the shared head.
LLAMA3_GQE = AttentionConfig(kind="gqe", num_experts=8, kv_heads=2, top_k=2, rotary_base=LLAMA3_ROTARY_BASE)


def _llama3(attention: AttentionConfig, d_model: int, layers: int,
            max_positions: int) -> Callable[[str, int], ModelConfig]:
    # llama_model sets rotary=True and no biases; the rotary base stays the attention config's (Llama 3's)
    return lambda task, vocab: llama_model(attention, vocab, d_model=d_model, layers=layers,
                                           max_positions=max_positions)


@dataclass(frozen=True)
class Preset:
    name: str
    tasks: tuple[str, ...]
    default_vocab: int | None  # None: the task's DEFAULT_VOCAB
    build: Callable[[str, int], ModelConfig]
    description: str


#: small-moa's attention: 6 of 8 experts of size 64 per token. Its MACs are within ~3% of small-mha's
#: (4 heads of 64) on 32+32-token translation batches (see docs/models.md): MoA shares one K/V head, so
#: at equal k*d_h it is cheaper than MHA and can afford k=6.
SMALL_MOA = (6, 8, 64)
#: mini-moa's attention, chosen the same way against mini-mha (4 heads of 32).
MINI_MOA = (6, 8, 32)
#: SwitchHead presets (arXiv 2312.07987) as ``(num_heads, num_experts, top_k, head_dim)``: 2 heads (half
#: the attention matrices of tiny-/mini-mha's 4), each with 4 value and 4 output experts of which 2 are
#: used per token; head_dim chosen so the attention MACs are within ~2% of the MHA preset's on 32+32-token
#: translation batches (see docs/models.md).
#: Positions: the tiny-/mini-switchhead presets use the CPU presets' sinusoidal positions (no rotary), and
#: llama-{tiny,mini}-switchhead rotate the WHOLE head (``rotary_fraction=1.0``) like every llama-* preset,
#: so that they differ from llama-*-mha/moa in the attention only. The authors' ``SwitchHeadRope`` rotates
#: half of each head (``rotate_fraction=0.5``): set ``rotary_fraction=0.5`` for their layer.
TINY_SWITCHHEAD = (2, 4, 2, 22)
MINI_SWITCHHEAD = (2, 4, 2, 44)


def switchhead(num_heads: int, num_experts: int, top_k: int, head_dim: int, dropout: float = 0.0) -> AttentionConfig:
    """SwitchHead as the authors build it: no biases, no expert dropout, init scale 1; ``dropout`` on the
    attention probabilities (``dropout_on`` unset, as every other preset; the authors drop the queries:
    ``dropout_on="queries"``). Rotary positions come from the model (see :data:`TINY_SWITCHHEAD`)."""
    return AttentionConfig(kind="switchhead", num_heads=num_heads, num_experts=num_experts, top_k=top_k,
                           head_dim=head_dim, dropout=dropout, bias=False)


#: MoSA presets (arXiv 2505.00315) as ``(num_sparse_heads, num_dense_heads, head_dim, sparsity)``: one dense
#: head and many sparse heads of the MHA preset's head size, each keeping 1/8 of the tokens; the number of
#: sparse heads solved (``headmix.models.matching``) so the attention MACs equal llama-{tiny,mini}-mha's at
#: 128 tokens (the count's default LM length): 0.992x and 1.000x. They rotate the whole head like every
#: llama-* preset (the MoSA authors rotate half: ``rotary_fraction=0.5``).
TINY_MOSA = (38, 1, 16, 8)
MINI_MOSA = (32, 1, 32, 8)


def mosa(num_sparse_heads: int, num_dense_heads: int, head_dim: int, sparsity: float) -> AttentionConfig:
    """MoSA as the authors build it: no biases, no dropout, ``include_first`` off."""
    return AttentionConfig(kind="mosa", num_sparse_heads=num_sparse_heads, num_dense_heads=num_dense_heads,
                           head_dim=head_dim, sparsity=sparsity, bias=False)


#: MoH of the tiny and mini presets: 4 heads, 1 shared, top 2 of the 3 routed.
MOH_4_HEADS = AttentionConfig(kind="moh", num_heads=4, num_shared_heads=1, top_k=2)
TALKING_HEADS_4 = AttentionConfig(kind="talking_heads", num_heads=4)

_PRESETS = [
    Preset("transformer-base", ("translation",), None, lambda t, v: transformer_base(v),
           "Transformer base: d 512, FFN 2048, 8 heads, 6+6 layers"),
    Preset("transformer-big", ("translation",), None, lambda t, v: transformer_big(v),
           "Transformer big: d 1024, FFN 4096, 16 heads, 6+6 layers, dropout 0.3"),
    Preset("moa-base", ("translation",), None, lambda t, v: transformer_base(v, moa(8, 8, 128)),
           "MoA base = 8K8E128D on the base-size Transformer"),
    Preset("moa-big", ("translation",), None, lambda t, v: transformer_base(v, moa(16, 32, 256)),
           "MoA big = 16K32E256D on the base-size Transformer"),
    Preset("roberta-medium", ("mlm",), None, lambda t, v: roberta_medium(v),
           "RoBERTa medium: d 512, FFN 2048, 8 heads, 8 layers"),
    Preset("tiny-mha", TASKS, 1000, _tiny(mha(4)), "d 64, FFN 256, 2(+2) layers, MHA 4 heads of 16"),
    Preset("tiny-moa", TASKS, 1000, _tiny(moa(2, 4, 32)), "d 64, FFN 256, 2(+2) layers, MoA 2K4E32D"),
    Preset("tiny-moh", TASKS, 1000, _tiny(MOH_4_HEADS),
           "d 64, FFN 256, 2(+2) layers, MoH 4 heads of 16 (1 shared, top 2 of 3 routed)"),
    Preset("tiny-talking-heads", TASKS, 1000, _tiny(TALKING_HEADS_4),
           "d 64, FFN 256, 2(+2) layers, Talking-Heads 4 heads of 16 (pre and post softmax)"),
    Preset("tiny-switchhead", TASKS, 1000, _tiny(switchhead(*TINY_SWITCHHEAD)),
           "d 64, FFN 256, 2(+2) layers, SwitchHead {} heads of {}, top {} of {} V/O experts".format(
               TINY_SWITCHHEAD[0], TINY_SWITCHHEAD[3], TINY_SWITCHHEAD[2], TINY_SWITCHHEAD[1])),
    Preset("mini-mha", TASKS, SMALL_VOCAB, _mini(mha(4)), "d 128, FFN 512, 3(+3) layers, MHA 4 heads of 32"),
    Preset("mini-moa", TASKS, SMALL_VOCAB, _mini(moa(*MINI_MOA)),
           "d 128, FFN 512, 3(+3) layers, MoA {}K{}E{}D".format(*MINI_MOA)),
    Preset("mini-switchhead", TASKS, SMALL_VOCAB, _mini(switchhead(*MINI_SWITCHHEAD)),
           "d 128, FFN 512, 3(+3) layers, SwitchHead {} heads of {}, top {} of {} V/O experts".format(
               MINI_SWITCHHEAD[0], MINI_SWITCHHEAD[3], MINI_SWITCHHEAD[2], MINI_SWITCHHEAD[1])),
    Preset("small-mha", TASKS, SMALL_VOCAB, _small(mha(4)), "d 256, FFN 1024, 3(+3) layers, MHA 4 heads of 64"),
    Preset("small-moa", TASKS, SMALL_VOCAB, _small(moa(*SMALL_MOA)),
           "d 256, FFN 1024, 3(+3) layers, MoA {}K{}E{}D".format(*SMALL_MOA)),
    Preset("llama-tiny-mha", ("lm",), 1000, _llama_tiny(mha(4)),
           "Llama-style d 64, SwiGLU 176, 2 layers, MHA 4 heads of 16"),
    Preset("llama-tiny-moa", ("lm",), 1000, _llama_tiny(moa(2, 4, 32)),
           "Llama-style d 64, SwiGLU 176, 2 layers, MoA 2K4E32D"),
    Preset("llama-tiny-moh", ("lm",), 1000, _llama_tiny(MOH_4_HEADS),
           "Llama-style d 64, SwiGLU 176, 2 layers, MoH 4 heads of 16 (1 shared, top 2 of 3 routed)"),
    Preset("llama-tiny-talking-heads", ("lm",), 1000, _llama_tiny(TALKING_HEADS_4),
           "Llama-style d 64, SwiGLU 176, 2 layers, Talking-Heads 4 heads of 16"),
    Preset("llama-mini-mha", ("lm",), SMALL_VOCAB, _llama_mini(mha(4)),
           "Llama-style d 128, SwiGLU 352, 3 layers, MHA 4 heads of 32"),
    Preset("llama-mini-moa", ("lm",), SMALL_VOCAB, _llama_mini(moa(*MINI_MOA)),
           "Llama-style d 128, SwiGLU 352, 3 layers, MoA {}K{}E{}D".format(*MINI_MOA)),
    Preset("llama-mini-moh", ("lm",), SMALL_VOCAB, _llama_mini(MOH_4_HEADS),
           "Llama-style d 128, SwiGLU 352, 3 layers, MoH 4 heads of 32 (1 shared, top 2 of 3 routed)"),
    Preset("llama-tiny-switchhead", ("lm",), 1000, _llama_tiny(switchhead(*TINY_SWITCHHEAD)),
           "Llama-style d 64, SwiGLU 176, 2 layers, SwitchHead {} heads of {}, top {} of {} V/O experts".format(
               TINY_SWITCHHEAD[0], TINY_SWITCHHEAD[3], TINY_SWITCHHEAD[2], TINY_SWITCHHEAD[1])),
    Preset("llama-mini-switchhead", ("lm",), SMALL_VOCAB, _llama_mini(switchhead(*MINI_SWITCHHEAD)),
           "Llama-style d 128, SwiGLU 352, 3 layers, SwitchHead {} heads of {}, top {} of {} V/O experts".format(
               MINI_SWITCHHEAD[0], MINI_SWITCHHEAD[3], MINI_SWITCHHEAD[2], MINI_SWITCHHEAD[1])),
    Preset("llama-tiny-mosa", ("lm",), 1000, _llama_tiny(mosa(*TINY_MOSA)),
           "Llama-style d 64, SwiGLU 176, 2 layers, MoSA {} sparse heads + {} dense of {}, sparsity {}".format(*TINY_MOSA)),
    Preset("llama-mini-mosa", ("lm",), SMALL_VOCAB, _llama_mini(mosa(*MINI_MOSA)),
           "Llama-style d 128, SwiGLU 352, 3 layers, MoSA {} sparse heads + {} dense of {}, sparsity {}".format(*MINI_MOSA)),
    Preset("llama-tiny-moa-kv2", ("lm",), 1000, _llama_tiny(jetmoe_attention(2, 4, 16, 2)),
           "Llama-style d 64, SwiGLU 176, 2 layers, MoA 2K4E16D with 2 K/V heads (JetMoE's attention)"),
    Preset("llama-tiny-jetmoe", ("lm",), 1000,
           lambda task, vocab: jetmoe_model(vocab, d_model=64, layers=2, max_positions=256, top_k=2, num_experts=4,
                                            head_dim=16, kv_heads=2),
           "JetMoE-style d 64, 2 layers, MoA 2K4E16D with 2 K/V heads, top 2 of 4 SwiGLU experts of 88"),
    Preset("llama-mini-jetmoe", ("lm",), SMALL_VOCAB,
           lambda task, vocab: jetmoe_model(vocab, d_model=128, layers=3, max_positions=512, top_k=2, num_experts=8,
                                            head_dim=32, kv_heads=2),
           "JetMoE-style d 128, 3 layers, MoA 2K8E32D with 2 K/V heads, top 2 of 8 SwiGLU experts of 176"),
    Preset("llama3-tiny-gqa", ("lm",), 1000, _llama3(LLAMA3_GQA, 64, 2, 256),
           "Llama-3-style d 64, SwiGLU 176, 2 layers, MHA 8 heads of 8 on 2 K/V heads"),
    Preset("llama3-tiny-gated", ("lm",), 1000, _llama3(LLAMA3_GATED, 64, 2, 256),
           "Llama-3-style d 64, 2 layers, GQA 8 on 2 K/V heads with QK-norm and an elementwise output gate"),
    Preset("llama3-tiny-gqe", ("lm",), 1000, _llama3(LLAMA3_GQE, 64, 2, 256),
           "Llama-3-style d 64, 2 layers, GQE (the paper's, kind 'gqe'): 8 query-head experts of 8 on 2 K/V heads, "
           "top 2 of 4 per group, weighted slot + shared head"),
    Preset("llama3-tiny-moh-per-group", ("lm",), 1000, _llama3(LLAMA3_MOH_PER_GROUP, 64, 2, 256),
           "Llama-3-style d 64, 2 layers, MoH routed per K/V group: 8 heads on 2 K/V heads, per group 1 shared + "
           "top 2 of 3"),
    Preset("llama3-mini-gqa", ("lm",), SMALL_VOCAB, _llama3(LLAMA3_GQA, 128, 3, 512),
           "Llama-3-style d 128, SwiGLU 352, 3 layers, MHA 8 heads of 16 on 2 K/V heads"),
    Preset("llama3-mini-gated", ("lm",), SMALL_VOCAB, _llama3(LLAMA3_GATED, 128, 3, 512),
           "Llama-3-style d 128, 3 layers, GQA 8 on 2 K/V heads with QK-norm and an elementwise output gate"),
    Preset("llama3-mini-gqe", ("lm",), SMALL_VOCAB, _llama3(LLAMA3_GQE, 128, 3, 512),
           "Llama-3-style d 128, 3 layers, GQE (the paper's, kind 'gqe'): 8 query-head experts of 16 on 2 K/V heads, "
           "top 2 of 4 per group, weighted slot + shared head"),
    Preset("llama3-mini-moh-per-group", ("lm",), SMALL_VOCAB, _llama3(LLAMA3_MOH_PER_GROUP, 128, 3, 512),
           "Llama-3-style d 128, 3 layers, MoH routed per K/V group: 8 heads on 2 K/V heads, per group 1 shared + "
           "top 2 of 3"),
]
PRESETS: dict[str, Preset] = {p.name: p for p in _PRESETS}


def list_presets() -> list[str]:
    return list(PRESETS)


def parse_moa_name(name: str) -> tuple[int, int, int]:
    """``"8K8E128D"`` -> ``(top_k=8, num_experts=8, head_dim=128)``; ``ValueError`` if malformed or K > E."""
    m = MOA_PATTERN.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not of the form {MOA_PATTERN_TEXT}")
    k, e, d = (int(g) for g in m.groups())
    for letter, value in (("K", k), ("E", e), ("D", d)):
        if value <= 0:
            raise ValueError(f"{letter}={value} must be positive in {name!r}")
    if k > e:
        raise ValueError(f"top_k K={k} exceeds num_experts E={e} in {name!r}")
    return k, e, d


#: What a {K}K{E}E{D}D string builds per task: the base-size Transformer, or RoBERTa medium (attention dropout 0.1).
MOA_STRING_MODELS: dict[str, Callable[[int, int, int, int], ModelConfig]] = {
    "translation": lambda vocab, k, e, d: transformer_base(vocab, moa(k, e, d)),
    "mlm": lambda vocab, k, e, d: roberta_medium(vocab, moa(k, e, d, dropout=0.1)),
}


def _valid_forms() -> str:
    return (f"valid forms: a preset name ({', '.join(PRESETS)}), a MoA string {MOA_PATTERN_TEXT}, "
            f"a path to a JSON model config, or the config itself as JSON (starting with '{{')")


def _inline_config(text: str, task: str | None) -> dict:
    """The dict of a model config given as a JSON string (its ``task`` the one asked for where it names none); a
    one-line ``ValueError`` for a string that is not a JSON object."""
    import json

    try:
        data = json.loads(text)
    except ValueError as err:
        raise ValueError(f"the inline JSON model config is not valid JSON ({err}): give a JSON object, "
                         f"or a path to a JSON file") from None
    if not isinstance(data, dict):
        raise ValueError(f"the inline JSON model config must be a JSON object, got {type(data).__name__}")
    return data if task is None or "task" in data else {**data, "task": task}


def _is_file(name: str) -> bool:
    """Whether ``name`` is an existing file (False for a name the system cannot take, such as a long string)."""
    try:
        return Path(name).is_file()
    except OSError:
        return False


def get_config(name_or_path: str | Path, task: str | None = None, vocab_size: int | None = None) -> ModelConfig:
    """A :class:`ModelConfig` from a preset name, a ``{K}K{E}E{D}D`` string, a JSON file or a JSON string (a model
    config given inline: a string starting with ``{``).

    ``task`` defaults to the preset's (``translation`` for the CPU presets and MoA strings); ``vocab_size``
    to 32000 for translation, 50265 for the masked LM, and 8000 / 1000 for the small / tiny presets. For a
    JSON file, ``task`` must match the file's and ``vocab_size`` overrides it.
    """
    if task is not None and task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size <= 0):
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    name = str(name_or_path)
    if name in PRESETS:
        preset = PRESETS[name]
        task = task or preset.tasks[0]
        if task not in preset.tasks:
            raise ValueError(f"preset {name!r} is for task {' / '.join(preset.tasks)}, not {task!r}")
        return preset.build(task, vocab_size or preset.default_vocab or DEFAULT_VOCAB[task])
    if MOA_PATTERN.match(name):
        k, e, d = parse_moa_name(name)
        task = task or "translation"
        if task in MOA_STRING_MODELS:
            return MOA_STRING_MODELS[task](vocab_size or DEFAULT_VOCAB[task], k, e, d)
        raise ValueError(f"{MOA_PATTERN_TEXT} strings name translation or mlm models, not task {task!r}; "
                         f"for a causal LM use tiny-moa / small-moa / llama-tiny-moa / llama-mini-moa or a JSON config")
    if name.lstrip().startswith("{"):  # a model config given inline, as JSON
        config = ModelConfig.from_dict(_inline_config(name, task), "the inline JSON model config")
        if task is not None and task != config.task:
            raise ValueError(f"the inline JSON model config is a {config.task!r} config, but task={task!r} was asked for")
        return config if vocab_size is None else config.replace(vocab_size=vocab_size)
    if name.endswith(".json") or _is_file(name):
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"config file {path} not found; {_valid_forms()}")
        config = ModelConfig.load_json(path)
        if task is not None and task != config.task:
            raise ValueError(f"{path} is a {config.task!r} config, but task={task!r} was asked for")
        return config if vocab_size is None else config.replace(vocab_size=vocab_size)
    raise ValueError(f"unknown model {name!r}; {_valid_forms()}")
