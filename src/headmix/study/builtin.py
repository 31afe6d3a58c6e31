"""The built-in studies, on the embedded corpora (CPU-sized; ``docs/study.md`` reports their results).

- ``lm-en``: causal LM on the English documents; baseline ``mini-mha`` (d_model 128, 3 layers, MHA 4 heads
  of 32, blocks of 128 tokens). Rows at the baseline's attention MACs: MoA with ``k = 4`` of ``E`` in
  {4, 8, 16, 32} (E = 4 routes nothing: every expert is used), MoH, Talking-Heads and a decoupled key size
  (4 heads with query/key size 48 and a value size solved to the same MACs, 17: Bhojanapalli et al.'s
  remedy for the low-rank bottleneck, keys larger than values).
- ``translation-en-de``: the English-German pairs; baseline ``mini-mha`` (3+3 layers); MHA against MoA at
  ``k = 4`` of 4, 8 and 32 experts, scored with validation NLL and test BLEU.
- ``lm-en-llama``: ``lm-en``'s data and training on the Llama-style decoder (``llama-mini-mha``: RMSNorm,
  SwiGLU, rotary positions, no biases); MHA against MoA (``k = 4`` of 8), SwitchHead (2 heads, top 2 of 4
  value and output experts each) and MoH. Every row keeps the baseline's rotary positions and bias-free
  projections (:data:`headmix.study.matching.INHERITED`).
- ``lm-en-contenders``: ``lm-en``'s data and training on the Llama-3-style decoder with grouped-query attention
  (``llama3-mini-gqa``: 8 query heads of 16 on 2 K/V heads); this year's contenders at its attention MACs:
  headwise-gated GQA (Gated Attention), GQE as its paper defines it (``kind="gqe"``, arXiv 2606.20945: 2
  query-head experts per K/V head, top 1, with the weighted-sum slot and the shared head: the paper's main
  setting per group), MoA with 2 K/V heads (top 4 of 8), MoSA (2 dense heads and sparse heads of 16 keeping
  1/8 of the tokens, their number solved) and SwitchHead; and the controls: GQE and MoA kv2 with random routing
  (``router="random"``), GQE's static twin (grouped-query attention with 4 query heads on the 2 K/V heads: the
  3 query heads a GQE token computes, its 2 slots and its shared head, rounded up to whole K/V groups; no
  router), GQE without its weighted slot (the paper's Table 2 "hard concat only", whose router gets no task
  gradient: asked for as that ablation) and MoSA evaluated with the causal threshold rule as well as top-k.
  Until 2026-11-27 the GQE rows were MoH routed per K/V group with 1 shared + top 1 of 3, whose router got no
  gradient from the task loss (issue 42); their records were removed when the paper's GQE replaced them.
- ``lm-en-contenders-long``: the baseline and the two best rows of ``lm-en-contenders`` (Gated, GQE) once more
  with four times the training tokens (1600 steps, three seeds), to show the trend with training length. Its
  GQE row is the paper's GQE since 2026-11-27 (run on 2026-11-28; the MoH-per-group row it replaced had a
  router without a task gradient).

- ``lm-en-upcycle``: from a trained dense model to head routing (issue 44). The parent is ``lm-en-contenders``'
  baseline (``llama3-mini-gqa``, 8 query heads on 2 K/V heads) trained once for 1600 steps with the contenders'
  training (seed 1); every row continues it for 400 steps on the same batches (the parent's tokenizer and split:
  validation stays unseen) with a fresh AdamW and the same short schedule (:data:`UPCYCLE_TRAINING`: peak lr
  1e-3 after 20 warm-up steps, linear to 0). Rows keep the parent's shape (``matching = "none"``): dense
  continued (the baseline); MoH-LLaMA3's parameter-free query-norm rule at 75% of the heads active (4 shared +
  top 2 of 4) and at 50% (2 shared + top 2 of 6); MoH's learned router (zero-initialised) at 75% and 50%; MoH
  routed per K/V group at 50% (top 2 of 4 per group, learned) and its random-routing twin; static pruning to
  75% and 50% (3 and 2 query heads kept per K/V group, ranked by the mean norm of each head's contribution on 8
  calibration batches). Routed rows run sparse MoH (the unselected heads' attention and output projection
  skipped). One parent: the intervals hold the continuations' seeds, not parent-to-parent variance.

A row's free fields (``solve``) are sized to the baseline's attention MACs within 2%
(:mod:`headmix.study.matching`), preferring the baseline's head size of 32.

Studies that want a GPU (``headmix study --list`` says how long a row takes on one H100):

- ``lm-en-gpu``: the study measured on one H100 on 2026-11-23 (``docs/study.md``): a Llama-style decoder,
  d_model 384, 6 layers (MHA 6 heads of 64), vocabulary 16000, blocks of 512 tokens, 700 steps of 16384 tokens
  (11.5M tokens per run), lr 1.5e-3, bf16 on CUDA; rows MHA, MoA with ``k = 6`` of 12 and of 48 experts, MoH
  (6 heads, 2 shared, top 2) and SwitchHead (3 heads, top 2 of 4 experts); 3 seeds. Its corpus was
  ``../shared/data/en-docs.jsonl.gz`` (give it with ``--data``); by default the embedded English documents.
- ``lm-en-gpu-large``: the Llama-style decoder of d_model 768, 12 layers (MHA 12 heads of 64), vocabulary
  32000, blocks of 1024 tokens, 1536 steps of 32768 tokens (50.3M tokens per run); rows MHA, MoA (``k = 12``
  of 48), MoH (12 heads, 4 shared, top 4), SwitchHead (6 heads, top 2 of 4). Its corpus is the larger Debian
  documentation corpus (``DEBIAN_DOCS``, built by ``headmix data ...``; ``--data`` gives another file).
- ``lm-en-gpu-contenders``: ``lm-en-contenders``' rows at GPU scale, in runs that fit a short loan of one H100: a
  Llama-3-style decoder of d_model 512, 8 layers, GQA 8 query heads of 64 on 2 K/V heads (rotary base 500000),
  blocks of 1024 tokens, 400 steps of 16 x 1024 tokens (6.6M tokens per run), lr 1.5e-3 (as ``lm-en-gpu``, not
  tuned), bf16 on CUDA, 3 seeds; rows GQA, Gated, GQE (the paper's, as in ``lm-en-contenders``), GQE with a
  random router (``router="random"``: the control of GQE's learned one), its static control and its
  hard-slots-only ablation, MoA with 2 K/V heads (top 4 of 8) and MoSA (2 dense heads of 64 and sparse heads
  of 64 keeping 1/8 of the tokens, their number solved). Rows are matched on the ``causal`` MAC count (what a
  causal flash kernel computes on the GPU; the report shows the ``full`` ratio beside it). Its data is the token
  pack committed in ``studies/lm-en-gpu-contenders/pack/`` (:data:`GPU_CONTENDERS_PACK`: ``en-docs.jsonl.gz``
  split, tokenised with its 16000-token BPE and checksummed, 18.9 MB), so the GPU machine reads no corpus and
  trains no tokenizer. Sized from the one H100 throughput headmix has measured for a model of this family:
  ``lm-en-gpu``'s MHA, 326k tokens/s on 2026-11-23 (``../shared/gpu-2026-11-23/study/``), scaled by MACs per
  token to this baseline, and the slowest measured routed row's ratio (0.44); how long a run really takes on an
  H100 is still to be measured (``headmix study --list`` prints the estimate).
"""

from __future__ import annotations

import dataclasses
import os

from ..models import analytic_macs
from ..models.presets import llama_model, mha
from ..routing.task_gradient import ALLOW_FLAG
from .spec import ParentSpec, RowSpec, StudySpec

_PREFER = {"head_dim": 32}


def _moa(e: int) -> RowSpec:
    return RowSpec(f"MoA E={e}", {"kind": "moa", "num_experts": e, "top_k": 4}, ["head_dim"], _PREFER)


_MOH = RowSpec("MoH", {"kind": "moh", "num_heads": 4, "num_shared_heads": 1, "top_k": 2}, ["head_dim"], _PREFER)
_LM_TRAINING = {"max_len": 128, "max_tokens": 2048, "lr": 2e-3, "warmup_steps": 100, "schedule": "linear",
                "eval_every": 50, "log_every": 25, "save_every": 50, "average_last": 1, "keep_checkpoints": 2,
                "vocab_size": 8000}


def lm_en() -> StudySpec:
    rows = [RowSpec("MHA"), _moa(4), _moa(8), _moa(16), _moa(32), _MOH,
            RowSpec("Talking-Heads", {"kind": "talking_heads", "num_heads": 4}, ["head_dim"], _PREFER),
            RowSpec("MHA key 48", {"kind": "mha", "num_heads": 4, "key_dim": 48}, ["head_dim"], {"head_dim": 16}),
            ]
    return StudySpec(name="lm-en", task="lm", baseline="mini-mha", rows=rows, seeds=[1, 2, 3], max_steps=400,
                     training=dict(_LM_TRAINING))


def lm_en_llama() -> StudySpec:
    rows = [RowSpec("MHA"), _moa(8),
            RowSpec("SwitchHead", {"kind": "switchhead", "num_heads": 2, "num_experts": 4, "top_k": 2}, ["head_dim"],
                    _PREFER),
            _MOH]
    return StudySpec(name="lm-en-llama", task="lm", baseline="llama-mini-mha", rows=rows, seeds=[1, 2, 3],
                     max_steps=400, training=dict(_LM_TRAINING))


#: ``lm-en-contenders``: this year's contenders against grouped-query attention (8 query heads of 16 on 2 K/V heads,
#: Llama 3's 4 query heads per K/V head), each sized to its attention MACs (head size 16 preferred).
_CONTENDERS_PREFER = {"head_dim": 16}
_GQA = {"num_heads": 8, "kv_heads": 2}
#: The paper's GQE (arXiv 2606.20945) at the paper's main setting per K/V group (2 query-head experts per K/V head,
#: top 1: half of the routed experts active), on the baseline's 2 K/V heads: 2 hard slots + the weighted slot +
#: the shared head; its head size solved to the baseline's MACs.
_GQE = {"kind": "gqe", "num_experts": 4, "kv_heads": 2, "top_k": 1}
#: ``lm-en-contenders`` and ``-long`` ran GQE before the authors' code was read: the shared head over K/V head 0
#: (``shared_head_kv="head0"``), kept so that their committed records stay these studies (a stored study refuses a
#: changed row): rows with the authors' mean (the default) are new runs of these rows.
_GQE_AS_RUN = {**_GQE, "shared_head_kv": "head0"}
#: The paper's Table 2 ablation "hard concat only": GQE without the weighted-sum slot, whose router then gets no
#: gradient from the task loss (only the load-balancing loss moves it): asked for by name as that ablation.
_GQE_HARD_ONLY = {"weighted_slot": False, ALLOW_FLAG: True}


def _contender_rows() -> list[RowSpec]:
    return [RowSpec("GQA"),
            RowSpec("Gated", {"kind": "mha", **_GQA, "output_gate": "headwise"}, ["head_dim"], _CONTENDERS_PREFER),
            RowSpec("GQE", dict(_GQE_AS_RUN), ["head_dim"], _CONTENDERS_PREFER),
            RowSpec("MoA kv2", {"kind": "moa", "num_experts": 8, "top_k": 4, "kv_heads": 2}, ["head_dim"],
                    _CONTENDERS_PREFER),
            RowSpec("MoSA", {"kind": "mosa", "num_dense_heads": 2, "head_dim": 16, "sparsity": 8},
                    ["num_sparse_heads"]),
            RowSpec("SwitchHead", {"kind": "switchhead", "num_heads": 2, "num_experts": 4, "top_k": 2}, ["head_dim"],
                    {"head_dim": 32})]


def _control_rows() -> list[RowSpec]:
    """``lm-en-contenders``' controls: GQE and MoA kv2 with random routing, GQE's static twin (grouped-query
    attention with GQE's active query heads per K/V head: 1 shared + top 1 = 2 of each group's 4, i.e. 4 query
    heads on 2 K/V heads, no router; its head size solved to the same MACs) and MoSA evaluated with causal
    selection too (the MoSA row's model again, same seeds: the finished MoSA runs kept no weights)."""
    rows = {row.name: row for row in _contender_rows()}
    gqe, moa, mosa = rows["GQE"], rows["MoA kv2"], rows["MoSA"]
    return [RowSpec("GQE random", {**gqe.attention, "router": "random"}, gqe.solve, gqe.prefer, control_of="GQE"),
            RowSpec("MoA kv2 random", {**moa.attention, "router": "random"}, moa.solve, moa.prefer,
                    control_of="MoA kv2"),
            RowSpec("GQE static", {"kind": "mha", "num_heads": 4, "kv_heads": 2}, ["head_dim"], _CONTENDERS_PREFER,
                    control_of=["GQE", "GQE mean"]),
            RowSpec("MoSA causal", dict(mosa.attention), mosa.solve, mosa.prefer, causal_eval=True),
            RowSpec("GQE hard-only", {**gqe.attention, **_GQE_HARD_ONLY}, gqe.solve, gqe.prefer)]


def _with_the_authors_shared_head(row: RowSpec) -> RowSpec:
    """A GQE row of ``lm-en-contenders`` (run with the shared head over K/V head 0) as its authors' code runs it:
    the same model with the shared head over the mean of the K/V heads (the same head size: the K/V source costs
    no MACs), named with "mean" after "GQE"; its control, if any, is the same row's."""
    def mean(name: str) -> str:
        return name.replace("GQE", "GQE mean", 1)

    return dataclasses.replace(row, name=mean(row.name), attention={**row.attention, "shared_head_kv": "mean"},
                               control_of=mean(row.control_of) if row.control_of else None)


def _all_contender_rows() -> list[RowSpec]:
    """``lm-en-contenders``' rows: the contenders, their controls, and ``GQE``, ``GQE random`` and ``GQE hard-only``
    again with the authors' shared head (added after those ran with K/V head 0; ``GQE static`` controls both GQE
    rows)."""
    rows = _contender_rows() + _control_rows()
    return rows + [_with_the_authors_shared_head(r) for r in rows if r.name in ("GQE", "GQE random", "GQE hard-only")]


def lm_en_contenders() -> StudySpec:
    return StudySpec(name="lm-en-contenders", task="lm", baseline="llama3-mini-gqa", rows=_all_contender_rows(),
                     seeds=[1, 2, 3], max_steps=400, training=dict(_LM_TRAINING))


#: the rows of ``lm-en-contenders-long``: the baseline and the two rows best at equal MACs after 400 steps
#: (chosen after its seeds 1 and 2, still the two best with all three: docs/study.md), and GQE's controls as in
#: ``lm-en-contenders`` (its random router, its static twin, the paper's hard-slots-only ablation).
LONG_CONTENDERS = ("GQA", "Gated", "GQE", "GQE random", "GQE static", "GQE hard-only", "GQE mean", "GQE mean random",
                   "GQE mean hard-only")


def lm_en_contenders_long() -> StudySpec:
    rows = [row for row in _all_contender_rows() if row.name in LONG_CONTENDERS]
    return StudySpec(name="lm-en-contenders-long", task="lm", baseline="llama3-mini-gqa", rows=rows, seeds=[1, 2, 3],
                     max_steps=1600, training=dict(_LM_TRAINING))


#: ``lm-en-upcycle``'s continuation, the same for every row: a fresh optimizer, a short warm-up to half the
#: parent's peak learning rate, linear decay to 0 over the 400 steps; no checkpoint averaging.
UPCYCLE_TRAINING = {**_LM_TRAINING, "lr": 1e-3, "warmup_steps": 20}
#: MoH rows of ``lm-en-upcycle`` skip the unselected heads' work (sparse MoH), so their MACs are what they compute.
_SPARSE = {"attention": "moh", "moh_impl": "sparse"}


#: ``lm-en-upcycle``'s distillation from the parent (``headmix train --distill-from``): the loss
#: ``(1 - weight) task + weight T^2 KL(parent || row)`` at the defaults, weight 0.5 and temperature 1.
UPCYCLE_DISTILL: dict = {}
#: The suffix of a row continued with distillation from the parent.
DISTILLED = " distilled"


def upcycle_rows() -> list[RowSpec]:
    """``lm-en-upcycle``'s rows: how each converts the parent (:mod:`headmix.interop.upcycle`), each continued
    with the LM loss alone and again with distillation from the parent (``NAME distilled``). Every router row is
    paired with the pruned row of the same active heads (its static control: 3 or 2 of each K/V group's 4 heads,
    no router), and the random router per group with the learned one; a distilled row's controls are distilled."""
    def moh(shared: int, top_k: int, **more) -> dict:
        return {**_SPARSE, "num_shared_heads": shared, "top_k": top_k, **more}

    plain = [RowSpec("dense continued"),
             RowSpec("query-norm 75%", init_options=moh(4, 2, router="query_norm")),
             RowSpec("query-norm 50%", init_options=moh(2, 2, router="query_norm")),
             RowSpec("learned 75%", init_options=moh(4, 2)),
             RowSpec("learned 50%", init_options=moh(2, 2)),
             RowSpec("learned per group 50%", init_options=moh(0, 2, route_per_group=True)),
             RowSpec("per group 50% random", init_options=moh(0, 2, route_per_group=True, router="random"),
                     control_of="learned per group 50%"),
             RowSpec("pruned 75%", init_options={"attention": "mha", "keep_heads": 3},
                     control_of=["learned 75%", "query-norm 75%"]),
             RowSpec("pruned 50%", init_options={"attention": "mha", "keep_heads": 2},
                     control_of=["learned 50%", "query-norm 50%", "learned per group 50%"])]

    def distilled(row: RowSpec) -> RowSpec:
        controls = [c + DISTILLED for c in row.controls] or None
        return dataclasses.replace(row, name=row.name + DISTILLED, distill=dict(UPCYCLE_DISTILL),
                                   control_of=controls[0] if controls and len(controls) == 1 else controls)

    return plain + [distilled(row) for row in plain]


def lm_en_upcycle() -> StudySpec:
    return StudySpec(name="lm-en-upcycle", task="lm", baseline="llama3-mini-gqa", rows=upcycle_rows(),
                     seeds=[1, 2, 3], max_steps=400, training=dict(UPCYCLE_TRAINING), matching="none",
                     parent=ParentSpec(max_steps=1600, seed=1, training={"lr": _LM_TRAINING["lr"],
                                                                         "warmup_steps": _LM_TRAINING["warmup_steps"]}))


def translation_en_de() -> StudySpec:
    rows = [RowSpec("MHA"), _moa(4), _moa(8), _moa(32)]
    return StudySpec(name="translation-en-de", task="translation", baseline="mini-mha", rows=rows, seeds=[1, 2, 3],
                     max_steps=400, bleu_sentences=300, bleu_beam=1,
                     training={"max_len": 64, "max_tokens": 2000, "lr": 2e-3, "warmup_steps": 100,
                               "eval_every": 50, "log_every": 25, "save_every": 50, "average_last": 1,
                               "keep_checkpoints": 2, "vocab_size": 8000})


#: Measured on one H100 80GB HBM3 on 2026-11-23 (torch 2.11.0+cu130, bf16, ``lm-en-gpu``'s spec, seed 1;
#: ``../shared/gpu-2026-11-23/study/``): MHA's training tokens per second, and each row's relative to it.
H100_LM_EN_GPU_TOKENS_PER_SECOND = 326_000
H100_LM_EN_GPU_RATIOS = {"MHA": 1.0, "MoA E=12": 0.47, "MoA E=48": 0.44, "MoH": 0.63, "SwitchHead": 0.46}
#: Measured on the same H100 (``grouped_and_model_steps.log``, issue 20): whole training steps of the Llama-style
#: d_model 768, 12-layer decoder, batch 8 x 1024, eager, bf16: MHA 12x64 61.65 ms, MoA 12K48E64D 110.02 ms.
H100_LARGE_STEP_MS = {"MHA": 61.65, "MoA": 110.02}
#: Where ``lm-en-gpu-large`` looks for its corpus, relative to the folder the study runs in (built there by
#: ``headmix data build debian-docs --out data/debian-docs``, docs/data.md; ``--data`` gives another).
DEBIAN_DOCS = "data/debian-docs/all.jsonl.gz"

_GPU_TRAINING = {"device": "auto", "bf16": "auto", "schedule": "linear", "average_last": 1, "keep_checkpoints": 1}


def _gpu_row(name: str, kind: str, prefer: int = 64, **fields) -> RowSpec:
    return RowSpec(name, {"kind": kind, **fields}, ["head_dim"], {"head_dim": prefer})


def _minutes(tokens: int, tokens_per_second: float, seeds: int) -> float:
    return tokens * seeds / tokens_per_second / 60


def lm_en_gpu() -> StudySpec:
    baseline = llama_model(mha(6), 16000, d_model=384, layers=6, max_positions=512).to_dict()
    rows = [RowSpec("MHA"), _gpu_row("MoA E=12", "moa", num_experts=12, top_k=6),
            _gpu_row("MoA E=48", "moa", num_experts=48, top_k=6),
            _gpu_row("MoH", "moh", num_heads=6, num_shared_heads=2, top_k=2),
            _gpu_row("SwitchHead", "switchhead", num_heads=3, num_experts=4, top_k=2)]
    steps, batch, seeds = 700, 16384, [1, 2, 3]
    per_row = {name: _minutes(steps * batch, H100_LM_EN_GPU_TOKENS_PER_SECOND * ratio, len(seeds))
               for name, ratio in H100_LM_EN_GPU_RATIOS.items()}
    gpu = (f"a row ({len(seeds)} seeds) trains for about {min(per_row.values()):.0f} (MHA) to "
           f"{max(per_row.values()):.0f} ({max(per_row, key=per_row.get)}) minutes on one H100: derived from the "
           f"measured {H100_LM_EN_GPU_TOKENS_PER_SECOND // 1000}k tokens/s of MHA and the rows' measured ratios "
           f"(2026-11-23, before the GPU speed work), plus data preparation and validation")
    return StudySpec(name="lm-en-gpu", task="lm", baseline=baseline, rows=rows, seeds=seeds, max_steps=steps,
                     training={**_GPU_TRAINING, "max_len": 512, "max_tokens": batch, "vocab_size": 16000,
                               "lr": 1.5e-3, "warmup_steps": 100, "eval_every": 100, "log_every": 50,
                               "save_every": 350},
                     drop_checkpoints=True, gpu=gpu,
                     data_note="the H100 table in docs/study.md was measured on ../shared/data/en-docs.jsonl.gz")


def lm_en_gpu_large() -> StudySpec:
    baseline = llama_model(mha(12), 32000, d_model=768, layers=12, max_positions=1024).to_dict()
    rows = [RowSpec("MHA"), _gpu_row("MoA", "moa", num_experts=48, top_k=12),
            _gpu_row("MoH", "moh", num_heads=12, num_shared_heads=4, top_k=4),
            _gpu_row("SwitchHead", "switchhead", prefer=128, num_heads=6, num_experts=4, top_k=2)]
    steps, batch, seeds = 1536, 32768, [1, 2, 3]
    mha_tps = 8 * 1024 / (H100_LARGE_STEP_MS["MHA"] / 1000)
    moa_tps = 8 * 1024 / (H100_LARGE_STEP_MS["MoA"] / 1000)
    gpu = (f"an ESTIMATE, not a measurement: a row ({len(seeds)} seeds, {steps * batch / 1e6:.1f}M tokens per run) "
           f"trains for about {_minutes(steps * batch, mha_tps, len(seeds)):.0f} minutes (MHA) and "
           f"{_minutes(steps * batch, moa_tps, len(seeds)):.0f} (MoA) on one H100, from the eager whole-step times "
           f"of this model measured in issue 20 (2026-11-23: MHA {H100_LARGE_STEP_MS['MHA']} ms, MoA "
           f"{H100_LARGE_STEP_MS['MoA']} ms per 8 x 1024 tokens); MoH and SwitchHead about as long as MoA")
    return StudySpec(name="lm-en-gpu-large", task="lm", baseline=baseline, rows=rows, seeds=seeds, max_steps=steps,
                     data=[os.path.abspath(DEBIAN_DOCS)],
                     training={**_GPU_TRAINING, "max_len": 1024, "max_tokens": batch, "vocab_size": 32000,
                               "lr": 1e-3, "warmup_steps": 200, "eval_every": 128, "log_every": 32,
                               "save_every": 512},
                     drop_checkpoints=True, gpu=gpu,
                     data_note=f"lm-en-gpu-large reads the Debian documentation corpus {DEBIAN_DOCS}, built by "
                               f"`headmix data build debian-docs --out data/debian-docs` (docs/data.md)")


#: ``lm-en-gpu-contenders``' token pack (relative to the folder the study runs in, the repository's root), built by
#: ``headmix data pack --data ../shared/data/en-docs.jsonl.gz --vocab-size 16000 --out studies/lm-en-gpu-contenders/pack``,
#: and its checksum (:func:`headmix.tasks.pack.pack_checksum`: the sha256 of its files' sha256s; a rebuild by the
#: same command has the same).
GPU_CONTENDERS_PACK = "studies/lm-en-gpu-contenders/pack"
GPU_CONTENDERS_PACK_SHA256 = "16a832b3a2403da1c31567b2e3deb14ef85ce4a3b636e3754bd7dcc0c9c99402"
#: The slowest routed row's training speed relative to the dense baseline that headmix has measured on an H100
#: (``H100_LM_EN_GPU_RATIOS``: MoA E=48, 0.44): what ``lm-en-gpu-contenders``' runs are sized by.
SLOWEST_MEASURED_RATIO = min(H100_LM_EN_GPU_RATIOS.values())


def gpu_contenders_spec(*, d_model: int = 512, layers: int = 8, block: int = 1024, batch_blocks: int = 16,
                        steps: int = 400, head_dim: int = 64, vocab_size: int = 16000, seeds: tuple = (1, 2, 3),
                        pack: str = GPU_CONTENDERS_PACK, pack_sha256: str = GPU_CONTENDERS_PACK_SHA256,
                        name: str = "lm-en-gpu-contenders", **training) -> StudySpec:
    """``lm-en-gpu-contenders`` (the module docstring) with its sizes as arguments: the built-in takes the
    defaults; a test runs the same rows on a tiny model and pack."""
    from ..models import AttentionConfig
    from ..models.presets import LLAMA3_ROTARY_BASE

    gqa = {"num_heads": 8, "kv_heads": 2}
    prefer = {"head_dim": head_dim}
    rows = [RowSpec("GQA"),
            RowSpec("Gated", {"kind": "mha", **gqa, "output_gate": "headwise"}, ["head_dim"], prefer),
            RowSpec("GQE", dict(_GQE), ["head_dim"], prefer),
            RowSpec("GQE random", {**_GQE, "router": "random"}, ["head_dim"], prefer, control_of="GQE"),
            RowSpec("GQE static", {"kind": "mha", "num_heads": 4, "kv_heads": 2}, ["head_dim"], prefer,
                    control_of="GQE"),
            RowSpec("GQE hard-only", {**_GQE, **_GQE_HARD_ONLY}, ["head_dim"], prefer),
            RowSpec("MoA kv2", {"kind": "moa", "num_experts": 8, "top_k": 4, "kv_heads": 2}, ["head_dim"], prefer),
            RowSpec("MoSA", {"kind": "mosa", "num_dense_heads": 2, "head_dim": head_dim, "sparsity": 8},
                    ["num_sparse_heads"])]
    attention = AttentionConfig(kind="mha", **gqa, rotary_base=LLAMA3_ROTARY_BASE)
    baseline = llama_model(attention, vocab_size, d_model=d_model, layers=layers, max_positions=block).to_dict()
    return StudySpec(name=name, task="lm", baseline=baseline, rows=rows, seeds=list(seeds), max_steps=steps,
                     pack=pack, pack_sha256=pack_sha256, attention_macs="causal", drop_checkpoints=True,
                     training={**_GPU_TRAINING, "max_len": block, "max_tokens": batch_blocks * block, "lr": 1.5e-3,
                               "warmup_steps": 50, "eval_every": 50, "log_every": 25, "save_every": steps,
                               **training},
                     data_note=f"the pack is committed in {GPU_CONTENDERS_PACK}; rebuild it with `headmix data pack "
                               f"--data ../shared/data/en-docs.jsonl.gz --vocab-size 16000 --out {GPU_CONTENDERS_PACK}`")


def lm_en_gpu_contenders() -> StudySpec:
    spec = gpu_contenders_spec()
    tokens = spec.max_steps * spec.training["max_tokens"]
    ours = analytic_macs(spec.baseline_config(), tgt_len=1024).total / 1024
    measured = analytic_macs(lm_en_gpu().baseline_config(), tgt_len=512).total / 512
    baseline_tps = H100_LM_EN_GPU_TOKENS_PER_SECOND * measured / ours
    fastest, slowest = tokens / baseline_tps, tokens / (baseline_tps * SLOWEST_MEASURED_RATIO)
    spec.gpu = (f"an ESTIMATE, to be measured: a run ({tokens / 1e6:.1f}M tokens) trains for about {fastest:.0f} s "
                f"(GQA) to {slowest:.0f} s (a row at {SLOWEST_MEASURED_RATIO}x its speed) on one H100, from the "
                f"measured {H100_LM_EN_GPU_TOKENS_PER_SECOND // 1000}k tokens/s of lm-en-gpu's MHA scaled by MACs "
                f"per token ({measured / 1e6:.1f}M -> {ours / 1e6:.1f}M: {baseline_tps / 1000:.0f}k tokens/s) and the "
                f"slowest measured routed row's ratio; plus start-up, validation and the timing phase")
    return spec


BUILTIN = {"lm-en": lm_en, "translation-en-de": translation_en_de, "lm-en-llama": lm_en_llama,
           "lm-en-contenders": lm_en_contenders, "lm-en-contenders-long": lm_en_contenders_long,
           "lm-en-upcycle": lm_en_upcycle,
           "lm-en-gpu": lm_en_gpu, "lm-en-gpu-large": lm_en_gpu_large, "lm-en-gpu-contenders": lm_en_gpu_contenders}


def get_study(name: str) -> StudySpec:
    """A built-in study by name, or a spec file (``.toml`` / ``.json``)."""
    if name in BUILTIN:
        spec = BUILTIN[name]()
        spec.validate()
        return spec
    if name.endswith((".toml", ".json")):
        return StudySpec.load(name)
    raise ValueError(f"unknown study {name!r}: a built-in ({', '.join(BUILTIN)}) or a .toml/.json spec file")
