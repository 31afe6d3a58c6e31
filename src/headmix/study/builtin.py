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

A row's free fields (``solve``) are sized to the baseline's attention MACs within 2%
(:mod:`headmix.study.matching`), preferring the baseline's head size of 32.
"""

from __future__ import annotations

from .spec import RowSpec, StudySpec

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


def translation_en_de() -> StudySpec:
    rows = [RowSpec("MHA"), _moa(4), _moa(8), _moa(32)]
    return StudySpec(name="translation-en-de", task="translation", baseline="mini-mha", rows=rows, seeds=[1, 2, 3],
                     max_steps=400, bleu_sentences=300, bleu_beam=1,
                     training={"max_len": 64, "max_tokens": 2000, "lr": 2e-3, "warmup_steps": 100,
                               "eval_every": 50, "log_every": 25, "save_every": 50, "average_last": 1,
                               "keep_checkpoints": 2, "vocab_size": 8000})


BUILTIN = {"lm-en": lm_en, "translation-en-de": translation_en_de, "lm-en-llama": lm_en_llama}


def get_study(name: str) -> StudySpec:
    """A built-in study by name, or a spec file (``.toml`` / ``.json``)."""
    if name in BUILTIN:
        spec = BUILTIN[name]()
        spec.validate()
        return spec
    if name.endswith((".toml", ".json")):
        return StudySpec.load(name)
    raise ValueError(f"unknown study {name!r}: a built-in ({', '.join(BUILTIN)}) or a .toml/.json spec file")
