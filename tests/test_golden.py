"""Fixed-seed golden loss curves of tiny runs (the torchtitan habit): any change to the numerics of the
data pipeline, the models or the training loop shows up here.

The curves in ``tests/golden/*.json`` were recorded with the code before the training layer was
redesigned (issue 10), on an AMD EPYC (Zen 4, AVX512) with torch 2.13.0. One thread
(``torch.set_num_threads(1)``), dropout on, the CPU. ``lm-tiny-moa.json`` was recorded again when a causal LM's
documents became ``bos text eos`` (issue 57, the sequence convention; before, one eos-first stream), on an Intel
Xeon (AVX512) with torch 2.13.0.

How exactly they are compared (:func:`assert_same_curve`): the learning rates bit for bit (Python float
arithmetic, the same on every machine); the losses within a relative ``LOSS_RTOL``, because float32
kernels are not bit-identical across CPU kinds: torch dispatches its vectorised kernels by the CPU's
instruction sets (AVX2, AVX512) and the BLAS picks its matrix-multiply kernels by CPU vendor and model, and
each sums in its own order. Measured on the AMD EPYC above with the kernels an older CPU would get
(``ATEN_CPU_CAPABILITY=avx2``, and ``default`` with ``MKL_ENABLE_INSTRUCTIONS=SSE4_2``): the curves first
differ at step 0 to 12 and by at most 9.5e-7 over the 30 steps (2 float32 ulps of a loss near 5;
relative 2e-7); issue 42 reports an Intel Xeon (AVX512) off by 3.4e-8 on ``final_valid_loss``. ``LOSS_RTOL = 2e-6`` leaves
10 times that drift (about 20 float32 ulps), while one-line changes of the model or the loss move the
curves by 6e-6 relative or more (tried and listed at ``LOSS_RTOL``), so they still fail.

Regenerate (only when a change of the numerics is intended, and say so in the commit):

    PYTHONPATH=src python tests/test_golden.py
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from headmix.data import load_embedded_documents, load_embedded_translation, write_jsonl_documents, write_tsv_pairs
from headmix.training import TrainConfig, train
from headmix.training.metrics import read_metrics

GOLDEN = Path(__file__).parent / "golden"

#: name -> (task, preset, extra options). 30 steps each on a slice of the embedded corpora.
RUNS = {
    "translation-tiny-moa": ("translation", "tiny-moa", {}),
    "translation-tiny-mha": ("translation", "tiny-mha", {}),
    "lm-tiny-moa": ("lm", "tiny-moa", {"lr": 3e-3}),
    "mlm-tiny-moa": ("mlm", "tiny-moa", {"lr": 3e-3}),
}


def _data(task: str, folder: Path) -> Path:
    if task == "translation":
        path = folder / "pairs.tsv"
        write_tsv_pairs(load_embedded_translation()[:600], path)
    else:
        path = folder / "docs.jsonl"
        write_jsonl_documents(load_embedded_documents(sources="kjv-bible")[:60], path)
    return path


def golden_run(name: str, folder: Path) -> dict:
    """Train run ``name`` in ``folder`` and return its per-step training losses and final numbers."""
    task, preset, extra = RUNS[name]
    data = _data(task, folder)
    options = dict(task=task, preset=preset, out=str(folder / "run"), data=[str(data)], vocab_size=300,
                   max_steps=30, max_tokens=600 if task == "translation" else 512, max_len=32, warmup_steps=4,
                   log_every=1, eval_every=15, save_every=15, keep_checkpoints=2, average_last=2,
                   valid_size=0.05 if task == "translation" else 0.1, test_size=0.05 if task == "translation" else 0.1,
                   progress=False, dropout=0.1, lr=7e-4, device="cpu", bf16="off")
    options.update(extra)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = train(TrainConfig(**options))
    finally:
        torch.set_num_threads(threads)
    records = read_metrics(folder / "run")
    return {
        "train_loss": [r["loss"] for r in records if r["split"] == "train"],
        "lr": [r["lr"] for r in records if r["split"] == "train"],
        "valid_loss": [r["loss"] for r in records if r["split"] == "valid"],
        "final_valid_loss": summary["valid"]["loss"],
    }


#: The relative tolerance of every loss of a golden curve (module docstring: float32 kernels differ by CPU
#: kind, at most 2e-7 relative seen over 30 steps). One-line breaks it catches, tried on the AMD EPYC above
#: (largest change of a loss, and the curves that fail): LayerNorm's eps times 10 (3.2e-5 on translation,
#: 5.8e-6 relative, to 1.7e-3 on lm: all four), the attention scale times 1.01 (1e-4 to 1.1e-2: all four), the
#: label smoothing times 1.1 in ``token_loss`` (1.5e-2: the two translation curves, the LMs have none).
LOSS_RTOL = 2e-6


def assert_same_curve(got: dict, expected: dict) -> None:
    """``got`` equals the stored curve: the same keys and lengths, the learning rates exactly, every loss
    within ``LOSS_RTOL`` relative."""
    assert sorted(got) == sorted(expected)
    assert got["lr"] == expected["lr"]
    for key in ("train_loss", "valid_loss", "final_valid_loss"):
        assert got[key] == pytest.approx(expected[key], rel=LOSS_RTOL, abs=0), key


@pytest.mark.parametrize("name", list(RUNS))
def test_golden_loss_curve(tmp_path, name):
    expected = json.loads((GOLDEN / f"{name}.json").read_text())
    got = golden_run(name, tmp_path)
    assert len(got["train_loss"]) == 30
    assert_same_curve(got, expected)


def test_the_comparison_takes_cross_cpu_drift_and_refuses_more():
    """The tolerance itself: the Intel Xeon's final loss passes, a change 10 times the worst drift seen does
    not, nor does a single learning rate off by one ulp."""
    expected = json.loads((GOLDEN / "mlm-tiny-moa.json").read_text())
    # issue 42's Intel Xeon scored 4.392506118194299 where the AMD EPYC stored 4.39250615195445 (before the
    # golden files were rewritten for the averaging window): the same relative drift on today's stored value
    intel_drift = 4.392506118194299 / 4.39250615195445
    intel = {**expected, "final_valid_loss": expected["final_valid_loss"] * intel_drift}
    assert intel["final_valid_loss"] != expected["final_valid_loss"]
    assert_same_curve(intel, expected)
    drifted = {**expected, "train_loss": [x + 9.5e-7 for x in expected["train_loss"]]}
    assert_same_curve(drifted, expected)
    for broken in ({**expected, "train_loss": [x * (1 + 10 * LOSS_RTOL) for x in expected["train_loss"]]},
                   {**expected, "lr": [math.nextafter(x, 1.0) for x in expected["lr"]]}):
        with pytest.raises(AssertionError):
            assert_same_curve(broken, expected)


if __name__ == "__main__":
    names = sys.argv[1:] or list(RUNS)
    GOLDEN.mkdir(exist_ok=True)
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            result = golden_run(name, Path(tmp))
        (GOLDEN / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(name, result["train_loss"][0], result["train_loss"][-1], result["final_valid_loss"])
