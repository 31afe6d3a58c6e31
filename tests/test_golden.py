"""Fixed-seed golden loss curves of tiny runs (the torchtitan habit): any change to the numerics of the
data pipeline, the models or the training loop shows up here.

The curves in ``tests/golden/*.json`` were recorded with the code before the training layer was
redesigned (issue 10) and are compared EXACTLY (the losses are Python floats written by ``json``, which
round-trips a float64 bit for bit). One thread (``torch.set_num_threads(1)``), dropout on, the CPU.
Regenerate (only when a change of the numerics is intended, and say so in the commit):

    PYTHONPATH=src python tests/test_golden.py
"""

from __future__ import annotations

import json
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


@pytest.mark.parametrize("name", list(RUNS))
def test_golden_loss_curve(tmp_path, name):
    expected = json.loads((GOLDEN / f"{name}.json").read_text())
    got = golden_run(name, tmp_path)
    assert len(got["train_loss"]) == 30
    assert got == expected


if __name__ == "__main__":
    names = sys.argv[1:] or list(RUNS)
    GOLDEN.mkdir(exist_ok=True)
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            result = golden_run(name, Path(tmp))
        (GOLDEN / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(name, result["train_loss"][0], result["train_loss"][-1], result["final_valid_loss"])
