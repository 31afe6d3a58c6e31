"""Training runs end to end on a small slice of the embedded corpus: resume, checkpoints, faults, DDP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from headmix.models import load_pretrained
from headmix.data import load_embedded_documents, load_embedded_translation, write_jsonl_documents, write_tsv_pairs
from headmix.training import (
    TrainConfig,
    TrainingError,
    average_checkpoints,
    corpus_scores,
    evaluate_translation,
    list_checkpoints,
    lr_multiplier,
    save_checkpoint,
    train,
)
from headmix.training import checkpoint as ckpt
from headmix.routing import load_summary
from headmix.training.metrics import read_metrics

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "pairs.tsv"
    write_tsv_pairs(load_embedded_translation()[:600], path)
    return path


@pytest.fixture(scope="module")
def docs_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    docs = [d for d in load_embedded_documents(sources="kjv-bible")[:60]]
    write_jsonl_documents(docs, path)
    return path


def small_config(out: Path, data: Path, **kw) -> TrainConfig:
    base = dict(task="translation", preset="tiny-moa", out=str(out), data=[str(data)], vocab_size=300, max_steps=6,
                max_tokens=600, max_len=32, warmup_steps=2, log_every=2, eval_every=3, save_every=3, keep_checkpoints=3,
                average_last=2, valid_size=0.05, test_size=0.05, progress=False, dropout=0.1)
    base.update(kw)
    return TrainConfig(**base)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_translation_run_writes_everything_and_resume_continues_the_same_run(tmp_path, pairs_file):
    straight = small_config(tmp_path / "straight", pairs_file)
    summary = train(straight)
    run = Path(straight.out)
    for name in ("train_config.json", "config.json", "model.safetensors", "summary.json", "metrics.jsonl",
                 "tokenizer/tokenizer.json", "data/train.tsv", "data/valid.tsv", "data/test.tsv"):
        assert (run / name).is_file(), name
    assert summary["steps"] == 6 and summary["averaged_checkpoints"] == 2
    records = read_metrics(run)
    train_rec = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train_rec] == [2, 4, 6]
    assert all(r["tokens_per_sec"] > 0 and "load_max_share" in r for r in train_rec)
    assert any(r["split"] == "valid" for r in records)

    # The same run cut in two: 3 steps, then resumed to 6, ends with identical weights (dropout on).
    resumed = small_config(tmp_path / "resumed", pairs_file, max_steps=3)
    train(resumed)
    resumed.max_steps = 6
    train(resumed)
    a = weights(run / "checkpoints" / "step_00000006")
    b = weights(Path(resumed.out) / "checkpoints" / "step_00000006")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)

    # The final model is the average of the last two checkpoints.
    avg = average_checkpoints(list_checkpoints(run)[-2:])
    final = load_pretrained(run).state_dict()
    for k in avg:
        torch.testing.assert_close(final[k], avg[k])
    assert any(not torch.equal(final[k], a[k]) for k in a)  # averaging changed the last step's weights

    scores = evaluate_translation(run, split="test", beam_size=2, limit=5)
    assert scores["sentences"] == 5 and 0.0 <= scores["bleu"] <= 100.0 and len(scores["examples"]) == 3


@pytest.mark.parametrize("task", ["mlm", "lm"])
def test_language_model_runs(tmp_path, docs_file, task):
    cfg = small_config(tmp_path / task, docs_file, task=task, max_steps=12, max_tokens=512, max_len=32, lr=3e-3,
                       valid_size=0.1, test_size=0.1, eval_every=6, save_every=6)
    summary = train(cfg)
    assert summary["steps"] == 12
    assert 1.0 < summary["valid"]["ppl"] < 300  # vocabulary 300: it has learned more than the uniform guess


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, pairs_file, monkeypatch):
    cfg = small_config(tmp_path / "nan", pairs_file, max_steps=6, save_every=2)
    from headmix.training.distributed import Parallel

    real = Parallel.clip_grad_norm
    calls = {"n": 0}

    def poisoned(self, max_norm):
        calls["n"] += 1
        if calls["n"] == 4:
            return torch.tensor(float("nan"))
        return real(self, max_norm)

    monkeypatch.setattr(Parallel, "clip_grad_norm", poisoned)
    with pytest.raises(TrainingError, match="non-finite .* at step 4.*step_00000002"):
        train(cfg)
    assert [p.name for p in list_checkpoints(cfg.out)] == ["step_00000002"]


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    model = torch.nn.Linear(3, 2)
    save_checkpoint(tmp_path, 1, model, {"x": 1}, {"tokens": 0})

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 2, model, {"x": 2}, {"tokens": 0})
    # the interrupted step is invisible, the previous one intact, the leftovers cleaned on the next save
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    monkeypatch.undo()
    save_checkpoint(tmp_path, 3, model, {"x": 3}, {"tokens": 0}, keep=1)
    root = ckpt.checkpoint_root(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003"]


def test_sigterm_writes_a_checkpoint_and_resume_finishes(tmp_path, pairs_file):
    out = tmp_path / "sig"
    cmd = [sys.executable, "-m", "headmix.cli.main", "train", "translation", "--preset", "tiny-moa", "--out", str(out),
           "--data", str(pairs_file), "--vocab-size", "300", "--max-steps", "100000", "--max-tokens", "600",
           "--max-len", "32", "--save-every", "100000", "--eval-every", "100000", "--no-progress",
           "--valid-size", "0.05", "--test-size", "0.05"]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").is_file() and time.time() < deadline:  # wait until it trains
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    saved = list_checkpoints(out)
    assert len(saved) == 1 and "signal" in json.loads((saved[0] / "state.json").read_text())["reason"]
    step = json.loads((saved[0] / "state.json").read_text())["step"]
    cfg = small_config(out, pairs_file, max_steps=step + 2, save_every=100000, eval_every=100000)
    assert train(cfg)["steps"] == step + 2


def test_bad_input_fails_before_training(tmp_path, pairs_file):
    with pytest.raises(FileNotFoundError, match="missing.tsv"):
        train(small_config(tmp_path / "a", tmp_path / "missing.tsv"))
    empty = tmp_path / "empty.tsv"
    empty.write_text("only one column\n")
    with pytest.raises(ValueError, match="empty|no valid"):
        train(small_config(tmp_path / "b", empty))
    with pytest.raises(ValueError, match="task must be one of"):
        small_config(tmp_path / "c", pairs_file, task="speech").validate()
    with pytest.raises(ValueError, match="max_steps must be a positive integer"):
        small_config(tmp_path / "c", pairs_file, max_steps=0).validate()


def test_schedules():
    assert lr_multiplier(0, schedule="inverse_sqrt", warmup_steps=4, max_steps=100) == pytest.approx(0.25)
    assert lr_multiplier(3, schedule="inverse_sqrt", warmup_steps=4, max_steps=100) == pytest.approx(1.0)
    assert lr_multiplier(15, schedule="inverse_sqrt", warmup_steps=4, max_steps=100) == pytest.approx(0.5)
    assert lr_multiplier(99, schedule="linear", warmup_steps=4, max_steps=100) == pytest.approx(0.0)
    assert lr_multiplier(51, schedule="linear", warmup_steps=4, max_steps=100) == pytest.approx(48 / 96)
    with pytest.raises(ValueError, match="schedule must be one of"):
        lr_multiplier(1, schedule="cosine", warmup_steps=1, max_steps=2)


def test_corpus_scores_and_load_summary():
    perfect = corpus_scores(["Das ist ein Test."], ["Das ist ein Test."])
    assert perfect["bleu"] == pytest.approx(100.0) and perfect["chrf"] == pytest.approx(100.0)
    split = corpus_scores(["Hilfe-Datei öffnen"], ["Hilfe-Datei öffnen"], compound_split=True)
    assert split["bleu"] == pytest.approx(100.0)
    assert corpus_scores(["a b c d"], ["w x y z"])["bleu"] == pytest.approx(0.0)
    s = load_summary(torch.tensor([10, 10, 10, 10]))
    assert s["max_share"] == s["min_share"] == 0.25 and s["cv"] == 0 and s["norm_entropy"] == pytest.approx(1.0)
    s = load_summary(torch.tensor([30, 10, 0, 0]))
    assert s["max_share"] == 0.75 and s["min_share"] == 0.0


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_two_processes_match_one_process_exactly(tmp_path, kind):
    """Two gloo processes, each with its own batch, take the same optimizer step as one process on the
    mean of both losses (MoA layers, auxiliary losses included), with DDP and with FSDP2."""
    script = Path(__file__).parent / "ddp_agreement.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(tmp_path), kind]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / f"{kind}_result.json").read_text())
    assert result["max_abs_diff"] < 1e-6 and result["changed"] > 0


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_torchrun_training_end_to_end(tmp_path, pairs_file, kind):
    """The training command under torchrun with 2 CPU processes: the same splits as one process, and a
    validation loss close to the one-process run."""
    one = small_config(tmp_path / "one", pairs_file, max_steps=3, save_every=3, eval_every=100, dropout=0.0,
                       preset="tiny-mha")
    train(one)
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "headmix.cli.main", "train", "translation", "--preset", "tiny-mha", "--out", str(two),
           "--data", str(pairs_file), "--vocab-size", "300", "--max-steps", "3", "--max-tokens", "600",
           "--max-len", "32", "--warmup-steps", "2", "--save-every", "3", "--eval-every", "100",
           "--dropout", "0", "--no-progress", "--log-every", "1", "--valid-size", "0.05", "--test-size", "0.05",
           "--distributed", kind]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    l1 = json.loads((tmp_path / "one" / "summary.json").read_text())["valid"]["loss"]
    assert abs(l1 - summary["valid"]["loss"]) < 0.5, (l1, summary["valid"]["loss"])
    for split in ("train", "valid", "test"):
        assert (tmp_path / "one" / "data" / f"{split}.tsv").read_bytes() == (two / "data" / f"{split}.tsv").read_bytes()
