"""Training runs end to end on a small slice of the embedded corpus: resume, checkpoints, faults, DDP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import math

import pytest
import sacrebleu
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from headmix.data import Tokenizer, load_embedded_documents, write_jsonl_documents
from headmix.evaluation import corpus_scores
from headmix.tasks import evaluate_run
from headmix.models import build_model, load_pretrained
from headmix.routing import load_summary
from headmix.runs import average_checkpoints
from headmix.training import TrainConfig, TrainingError, lr_multiplier, train
from headmix.training.demo import expert_load_figure, loss_curves_figure
from headmix.training.metrics import read_metrics
from headmix.training.setup import model_config

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def docs_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    docs = [d for d in load_embedded_documents(sources="kjv-bible")[:60]]
    write_jsonl_documents(docs, path)
    return path


def small_config(out: Path, data: Path, **kw) -> TrainConfig:
    base = dict(task="translation", preset="tiny-moa", out=str(out), data=[str(data)], vocab_size=300, max_steps=6,
                max_tokens=600, max_len=32, warmup_steps=2, log_every=2, eval_every=3, save_every=3, keep_checkpoints=3,
                average_last=2, average_window=1.0, valid_size=0.05, test_size=0.05, progress=False, dropout=0.1)
    base.update(kw)
    return TrainConfig(**base)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def checkpoint_dirs(run: Path) -> list[Path]:
    return sorted((run / "checkpoints").glob("step_*"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def without_clock(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("time", "tokens_per_sec")} for r in records]


def test_translation_run_writes_everything_and_resume_continues_the_same_run(tmp_path, pairs_file):
    straight = small_config(tmp_path / "straight", pairs_file)
    summary = train(straight)
    run = Path(straight.out)
    for name in ("train_config.json", "config.json", "model.safetensors", "summary.json", "metrics.jsonl",
                 "tokenizer/tokenizer.json", "data/train.tsv", "data/valid.tsv", "data/test.tsv"):
        assert (run / name).is_file(), name
    assert summary["steps"] == 6 and summary["final_weights"]["averaged_steps"] == [3, 6]
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
    assert_same_weights(a, weights(Path(resumed.out) / "checkpoints" / "step_00000006"))

    # The average is the mean of the last two checkpoints' files (3 and 6), computed here in float64; the final
    # model is that average or the step-6 weights, whichever the summary names (the lower validation loss).
    last = checkpoint_dirs(run)[-2:]
    assert [p.name for p in last] == ["step_00000003", "step_00000006"]
    files = [weights(p) for p in last]
    averaged = average_checkpoints(last)
    for k in files[0]:
        mean = ((files[0][k].double() + files[1][k].double()) / 2).to(files[0][k].dtype)
        torch.testing.assert_close(averaged[k], mean, rtol=0, atol=0, msg=k)
    assert any(not torch.equal(averaged[k], a[k]) for k in a)  # averaging changed the last step's weights
    chosen = summary["final_weights"]
    final = load_pretrained(run).state_dict()
    expected = averaged if chosen["final"] == "averaged" else a
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    losses = {"averaged": chosen["valid_loss_averaged"], "last": chosen["valid_loss_last"]}
    assert losses[chosen["final"]] == min(losses.values()) == summary["valid"]["loss"]


def test_the_averaging_window_is_the_last_tenth_of_the_steps_by_default():
    from headmix.runs.checkpoints import averaging_window_start

    assert TrainConfig.__dataclass_fields__["average_window"].default == 0.1
    # the run: 40 steps saved every 20 would have averaged steps 20 and 40; the window starts at 36
    assert averaging_window_start(40, 0.1) == 36 and averaging_window_start(30, 0.1) == 27
    assert averaging_window_start(100_000, 0.1) == 90_000 and averaging_window_start(6, 0.1) == 6
    assert averaging_window_start(40, 1) == 0 and averaging_window_start(40, 0.5) == 20
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="window must be a fraction in \\(0, 1\\]"):
            averaging_window_start(40, bad)
    with pytest.raises(ValueError, match="average_window must be a fraction in \\(0, 1\\]"):
        TrainConfig(task="lm", out="x", average_window=0)


def _checkpoint(folder: Path, step: int, value: float) -> Path:
    from safetensors.torch import save_file

    path = folder / f"step_{step:08d}"
    path.mkdir(parents=True)
    save_file({"weight": torch.full((2, 2), value)}, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("averaged_loss,final", [(0.5, "averaged"), (2.0, "last"), (1.0, "last")])
def test_the_final_weights_are_the_average_only_where_it_scores_better_on_validation(tmp_path, averaged_loss, final):
    """Scored on validation (here a made-up loss of the weights' value): the average of the window's checkpoints
    when it is better than the last weights, else the last weights, restored exactly (a tie keeps the last);
    both losses and the choice are in the record."""
    from headmix.training.trainer import choose_final_weights

    model = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.fill_(3.0)  # the last weights; the checkpoints average to 2.0
    paths = [_checkpoint(tmp_path, 36, 1.0), _checkpoint(tmp_path, 40, 3.0)]
    losses = {3.0: 1.0, 2.0: averaged_loss}

    def validate():
        return {"loss": losses[float(model.weight[0, 0])]}

    valid, record = choose_final_weights(model, paths, validate)
    assert record["final"] == final and record["averaged_steps"] == [36, 40]
    assert (record["valid_loss_last"], record["valid_loss_averaged"]) == (1.0, averaged_loss)
    assert valid["loss"] == min(1.0, averaged_loss)
    assert torch.equal(model.weight, torch.full((2, 2), 2.0 if final == "averaged" else 3.0))
    assert "the average of the checkpoints at steps 36, 40" in record["text"]
    assert record["text"].startswith("final model: the average" if final == "averaged" else
                                     "final model: the last weights")
    with torch.no_grad():
        model.weight.fill_(3.0)
    alone, record = choose_final_weights(model, paths[1:], validate)
    assert record["final"] == "last" and record["valid_loss_averaged"] is None and alone["loss"] == 1.0
    assert record["text"].endswith("no average: 1 checkpoint in the averaging window")


def test_a_short_run_averages_only_the_checkpoints_of_its_last_tenth_and_says_which_model_is_final(tmp_path,
                                                                                                     pairs_file):
    """20 steps saved every 2 with --average-last 10: the ten newest checkpoints go back to step 2, but the
    default window (the last tenth) takes steps 18 and 20 only; the summary holds both validation losses and
    names the final model, and the final validation record agrees."""
    cfg = small_config(tmp_path / "short", pairs_file, max_steps=20, save_every=2, keep_checkpoints=10,
                       average_last=10, average_window=0.1, eval_every=100, log_every=10)
    summary = train(cfg)
    chosen = summary["final_weights"]
    assert chosen["averaged_steps"] == [18, 20] and chosen["window_from_step"] == 18
    assert len(checkpoint_dirs(Path(cfg.out))) == 10  # the older checkpoints are there, and left out
    assert chosen["final"] in ("averaged", "last")
    losses = {"averaged": chosen["valid_loss_averaged"], "last": chosen["valid_loss_last"]}
    assert all(isinstance(v, float) for v in losses.values())
    assert summary["valid"]["loss"] == losses[chosen["final"]] == min(losses.values())
    assert summary["averaged_checkpoints"] == (2 if chosen["final"] == "averaged" else 1)
    final_record = [r for r in read_metrics(cfg.out) if r["split"] == "valid"][-1]
    assert final_record["averaged"] == summary["averaged_checkpoints"]
    assert json.loads((Path(cfg.out) / "summary.json").read_text())["final_weights"] == chosen


def test_loop_applies_the_schedule(tmp_path, pairs_file):
    """The learning rate of every step's record is the peak rate times lr_multiplier(step)."""
    cfg = small_config(tmp_path / "lr", pairs_file, max_steps=6, warmup_steps=3, log_every=1, lr=1e-3)
    train(cfg)
    records = [r for r in read_metrics(cfg.out) if r["split"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for r in records:
        expected = 1e-3 * lr_multiplier(r["step"], schedule="inverse_sqrt", warmup_steps=3, max_steps=6)
        assert r["lr"] == pytest.approx(expected, rel=1e-12), r


def test_one_step_of_the_loop_equals_one_step_by_hand(tmp_path, pairs_file):
    """Step 1 of the loop (dropout off) is: the first training batch, the label-smoothed cross-entropy (0.1)
    plus the MoA auxiliary losses, AdamW at lr * lr_multiplier(0)."""
    cfg = small_config(tmp_path / "one", pairs_file, max_steps=1, save_every=1, log_every=1, dropout=0.0,
                       warmup_steps=4, lr=1e-3)
    train(cfg)
    run = Path(cfg.out)
    task = cfg.task_spec
    tok = Tokenizer.load(run / "tokenizer")
    parts = {s: task.read_items(run / "data" / f"{s}.tsv") for s in ("train",)}
    torch.manual_seed(cfg.seed)
    mcfg = model_config(cfg, tok)
    model = build_model(mcfg)
    assert mcfg.label_smoothing == 0.1
    loader = task.loader(task.dataset(parts["train"], tok, cfg.max_len), tok, max_tokens=cfg.max_tokens, train=True,
                         seed=cfg.seed)
    batch = next(iter(loader))
    out = model(**task.model_inputs(batch, "cpu"))
    target = batch["tgt_out"]
    smoothed = F.cross_entropy(out.logits.flatten(0, 1), target.flatten(), ignore_index=tok.pad_id,
                               label_smoothing=0.1)
    assert out.aux_loss > 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * 0.25, betas=cfg.betas, eps=cfg.eps, weight_decay=0.0)
    (smoothed + out.aux_loss).backward()
    smoothed = smoothed.detach()
    opt.step()
    record = [r for r in read_metrics(run) if r["split"] == "train"][0]
    assert record["loss"] == pytest.approx(smoothed.item(), rel=1e-6)
    by_hand = {k: v.detach() for k, v in model.state_dict().items()}
    looped = weights(run / "checkpoints" / "step_00000001")
    for k, w in looped.items():
        torch.testing.assert_close(w, by_hand[k], rtol=1e-5, atol=1e-7, msg=k)


@pytest.mark.parametrize("task", ["mlm", "lm"])
def test_language_model_runs(tmp_path, docs_file, task):
    cfg = small_config(tmp_path / task, docs_file, task=task, max_steps=12, max_tokens=512, max_len=32, lr=3e-3,
                       valid_size=0.1, test_size=0.1, eval_every=6, save_every=6)
    summary = train(cfg)
    assert summary["steps"] == 12 and summary["task"] == task
    valid = summary["valid"]
    assert valid["ppl"] == pytest.approx(math.exp(valid["nll"]))
    # `headmix evaluate` on the valid split scores the same tokens as the final validation (the numbers
    # themselves are pinned by tests/test_golden.py).
    result = evaluate_run(cfg.out, split="valid", max_tokens=512)
    assert result["tokens"] == valid["tokens"]
    if task == "lm":  # no masking: the same loss whatever the batching
        assert result["nll"] == pytest.approx(valid["nll"], rel=1e-5)


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
    assert [p.name for p in checkpoint_dirs(Path(cfg.out))] == ["step_00000002"]


def stop_before_step(n: int, reason: str = "signal 15"):
    """A ``stop`` callable asking to stop before step ``n`` (it is polled once before every step)."""
    polls = {"n": 0}

    def stop():
        polls["n"] += 1
        return reason if polls["n"] == n else None
    return stop


def test_stop_checkpoint_stays_out_of_the_average(tmp_path, pairs_file):
    """Stopped (as by SIGTERM) before step 6, then resumed: the final model is the uncut run's, bit for bit.
    The stop wrote a checkpoint at step 5, which must neither join the average of the last two (4 and 6)
    nor push checkpoint 4 out of the two kept; the metrics hold each step once."""
    options = dict(max_steps=6, save_every=2, keep_checkpoints=2, average_last=2, log_every=1)
    uncut = small_config(tmp_path / "uncut", pairs_file, **options)
    train(uncut)
    cut = small_config(tmp_path / "cut", pairs_file, **options)
    assert train(cut, stop=stop_before_step(6)) == {"stopped_by": "signal 15", "steps": 5}
    assert not (Path(cut.out) / "model.safetensors").exists()
    summary = train(cut)
    assert summary["steps"] == 6 and summary["final_weights"]["averaged_steps"] == [4, 6]
    assert_same_weights(weights(Path(cut.out)), weights(Path(uncut.out)))
    assert without_clock(read_metrics(cut.out)) == without_clock(read_metrics(uncut.out))


def test_crash_then_resume_replays_steps_and_logs_each_once(tmp_path, pairs_file):
    """A crash after step 4 (checkpoint at 3): the resumed run replays step 4 from the checkpoint, drops the
    records of steps after it, and ends with the uncut run's weights and records."""
    options = dict(max_steps=6, save_every=3, log_every=1, eval_every=2)
    uncut = small_config(tmp_path / "uncut", pairs_file, **options)
    train(uncut)
    crashed = small_config(tmp_path / "crashed", pairs_file, **options)

    def crash():
        crash.polls = getattr(crash, "polls", 0) + 1
        if crash.polls == 5:
            raise KeyboardInterrupt  # what kill -9 leaves: records of step 4, the checkpoint of step 3
    with pytest.raises(KeyboardInterrupt):
        train(crashed, stop=crash)
    assert max(r["step"] for r in read_metrics(crashed.out)) == 4
    train(crashed)
    assert_same_weights(weights(Path(crashed.out)), weights(Path(uncut.out)))
    assert without_clock(read_metrics(crashed.out)) == without_clock(read_metrics(uncut.out))


def test_sigterm_writes_a_checkpoint_and_resume_finishes(tmp_path, pairs_file):
    out = tmp_path / "sig"
    cmd = [sys.executable, "-m", "headmix.cli.main", "train", "translation", "--preset", "tiny-moa", "--out", str(out),
           "--data", str(pairs_file), "--vocab-size", "300", "--max-steps", "100000", "--max-tokens", "600",
           "--max-len", "32", "--save-every", "100000", "--eval-every", "100000", "--no-progress",
           "--valid-size", "0.05", "--test-size", "0.05", "--log-every", "1"]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").is_file() and time.time() < deadline:  # wait until it trains
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by signal 15; run the same command to resume" in err and "Traceback" not in err
    saved = checkpoint_dirs(out)
    assert len(saved) == 1 and json.loads((saved[0] / "state.json").read_text())["reason"] == "signal 15"
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
    # By hand: every n-gram precision 1 (5/5, 4/4, 3/3, 2/2), brevity penalty exp(1 - 6/5).
    assert corpus_scores(["a b c d e"], ["a b c d e f"])["bleu"] == pytest.approx(100 * math.exp(-0.2), rel=1e-9)
    s = load_summary(torch.tensor([10, 10, 10, 10]))
    assert s["max_share"] == s["min_share"] == 0.25 and s["cv"] == 0 and s["norm_entropy"] == pytest.approx(1.0)
    s = load_summary(torch.tensor([30, 10, 0, 0]))
    assert s["max_share"] == 0.75 and s["min_share"] == 0.0


def test_evaluate_scores_its_own_translations_with_sacrebleu(tmp_path, pairs_file):
    cfg = small_config(tmp_path / "ev", pairs_file, max_steps=2, save_every=2, average_last=1)
    train(cfg)
    hyps_file = tmp_path / "hyps.txt"
    scores = evaluate_run(cfg.out, split="test", beam_size=2, limit=5, output=str(hyps_file))
    hyps = hyps_file.read_text().splitlines()
    refs = [line.split("\t")[1] for line in (Path(cfg.out) / "data" / "test.tsv").read_text().splitlines()[:5]]
    assert scores["sentences"] == 5 == len(hyps) and len(scores["examples"]) == 3
    assert scores["bleu"] == sacrebleu.corpus_bleu(hyps, [refs]).score
    assert scores["chrf"] == sacrebleu.corpus_chrf(hyps, [refs]).score
    assert [e["hyp"] for e in scores["examples"]] == hyps[:3]


def test_demo_figures_show_the_data():
    metrics = {"moa": [{"split": "train", "step": 10, "time": 1.5, "loss": 5.0},
                       {"split": "valid", "step": 10, "loss": 9.0},
                       {"split": "train", "step": 20, "time": 3.0, "loss": 4.0}],
               "mha": [{"split": "train", "step": 10, "time": 1.0, "loss": 5.5}]}
    fig = loss_curves_figure(metrics)
    by_steps, by_time = fig.axes[0], fig.axes[1]
    assert [(list(l.get_xdata()), list(l.get_ydata()), l.get_label()) for l in by_steps.lines] == \
        [([10, 20], [5.0, 4.0], "MoA"), ([10], [5.5], "MHA")]
    assert [list(l.get_xdata()) for l in by_time.lines] == [[1.5, 3.0], [1.0]]
    fig = expert_load_figure({"enc0": [0.5, 0.25, 0.25, 0.0], "dec0": [0.25] * 4})
    ax = fig.axes[0]
    assert ax.get_title() == "enc0" and [p.get_height() for p in ax.patches] == [50.0, 25.0, 25.0, 0.0]
    assert list(ax.lines[0].get_ydata()) == [25.0, 25.0]  # the uniform share
    assert [a.get_title() for a in fig.axes[:2]] == ["enc0", "dec0"]


@pytest.mark.parametrize("kind,loss", [("ddp", ""), ("fsdp", ""), ("ddp", "distill"), ("fsdp", "distill")])
def test_two_processes_match_one_process_exactly(tmp_path, kind, loss):
    """Two gloo processes, each with its own batch, take the same optimizer step as one process on the
    mean of both losses (MoA layers, auxiliary losses included), with DDP and with FSDP2; also with the loss
    distilled from a frozen parent (hashed by rank 0 alone; under FSDP sharded like the student), whose logged KL
    is the mean over the ranks."""
    script = Path(__file__).parent / "ddp_agreement.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(tmp_path), kind, *([loss] if loss else [])]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / f"{kind}{'_distill' if loss else ''}_result.json").read_text())
    assert result["max_abs_diff"] < 1e-6 and result["changed"] > 0
    if loss:  # the parent hashed by rank 0 alone, sharded like the student under FSDP; the logged KL the ranks' mean
        assert result["hashed_per_rank"] == [1, 0] and result["same_identity"]
        assert result["parent_sharded"] == (kind == "fsdp")
        assert result["logged_kl"] == pytest.approx(result["reference_kl"], rel=1e-5) and result["reference_kl"] > 0


@pytest.mark.parametrize("kind,distill", [("ddp", False), ("fsdp", False), ("fsdp", True)])
def test_torchrun_training_end_to_end(tmp_path, pairs_file, kind, distill):
    """The training command under torchrun with 2 CPU processes: the same splits as one process, and a
    validation loss close to the one-process run; also distilled from that run (a translation parent, with its
    tokenizer), the parent on every rank."""
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
    if distill:
        cmd += ["--distill-from", str(tmp_path / "one"), "--tokenizer", str(tmp_path / "one" / "tokenizer")]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    if distill:
        assert summary["distill_from"]["path"] == str((tmp_path / "one").resolve())
        assert all(r["distill_kl"] >= 0 for r in read_metrics(two) if r["split"] == "train")
    l1 = json.loads((tmp_path / "one" / "summary.json").read_text())["valid"]["loss"]
    assert abs(l1 - summary["valid"]["loss"]) < 0.5, (l1, summary["valid"]["loss"])
    for split in ("train", "valid", "test"):
        assert (tmp_path / "one" / "data" / f"{split}.tsv").read_bytes() == (two / "data" / f"{split}.tsv").read_bytes()


def test_metrics_log_on_a_full_disk_is_a_one_line_run_error(tmp_path, monkeypatch):
    import builtins
    import errno

    from headmix.runs import RunError
    from headmix.training.metrics import MetricsLog

    log = MetricsLog(tmp_path, tensorboard=False)
    log.write({"step": 1, "loss": 1.0})
    real_open = builtins.open

    def full(path, *args, **kwargs):
        if str(path).endswith("metrics.jsonl"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full)
    with pytest.raises(RunError, match=r"no space left on device while writing .*metrics.jsonl"):
        log.write({"step": 2, "loss": 0.5})
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def _demo_report(moa_bleu: float, moa_ppl: float, p: float, distinguishable: bool, **moa) -> dict:
    side = {"model": "MoA 4K16E48D", "bleu": moa_bleu, "chrf": 20.0, "valid_ppl": moa_ppl, "attention_macs": 1,
            "macs": 2, "parameters": 3, "steps": 450, "train_seconds": 60.0, **moa}
    return {"moa": side, "mha": dict(side, model="MHA 4 heads of 32", bleu=1.14, valid_ppl=123.54),
            "setup": {"steps": 450, "cpu_count": 2}, "study": "docs/study.md",
            "comparison": {"system_interval": [1.5, 2.5], "bleu_difference": moa_bleu - 1.14, "p_value": p,
                           "distinguishable": distinguishable, "sentences": 400}}


def test_demo_verdict_states_bleu_and_perplexity_and_what_one_seed_concludes():
    """BLEU (with its paired bootstrap) and validation perplexity in one sentence, then one sentence on what can
    and cannot be concluded: BLEU better but perplexity worse, both better, BLEU not significant."""
    from headmix.training.demo import format_comparison

    measured = ("BLEU: MoA 2.22, MHA 1.14, difference +1.08 (paired bootstrap p = 0.001 over 400 sentences; MoA's "
                "95% interval [1.50, 2.50]); validation perplexity (lower is better): MoA 129.68, MHA 123.54.")
    later = "the comparison over seeds, with intervals, is in docs/study.md (headmix study --list)."
    mixed = format_comparison(_demo_report(2.22, 129.68, 0.001, True)).splitlines()
    assert mixed[-2:] == [measured, "This MoA model is ahead on BLEU (a real difference on these sentences) but not "
                          "on validation perplexity, so this run does not rank the two attentions, and one seed and 450 "
                          "steps could not; " + later]
    both = format_comparison(_demo_report(2.22, 110.0, 0.001, True)).splitlines()
    assert both[-2] == measured.replace("MoA 129.68", "MoA 110.00")
    assert both[-1] == ("Both favour this MoA model, a real difference between these two trained models on these "
                        "sentences, but one seed and 450 steps cannot say whether the attention or the training noise "
                        "of the seed made it; " + later)
    worse = format_comparison(_demo_report(0.5, 130.0, 0.002, True)).splitlines()
    assert worse[-1].startswith("Both favour this MHA model, a real difference")
    neither = format_comparison(_demo_report(1.0, 129.68, 0.4, False)).splitlines()
    assert neither[-2].startswith("BLEU: MoA 1.00, MHA 1.14, difference -0.14 (paired bootstrap p = 0.400 over 400")
    assert neither[-1] == ("BLEU cannot tell the two apart at this budget and one seed's perplexity gap ranks "
                           "nothing: this run shows that both models learn, not which attention is better; " + later)
    assert not any("beats" in line or "under load" in line for line in mixed + both + neither)


def test_demo_train_seconds_get_a_caveat_under_load():
    """The load average at the start and end of each model's training is printed; above the machine's CPUs the
    train seconds are said not to compare the models' speed."""
    from headmix.training.demo import format_comparison

    calm = _demo_report(2.22, 129.68, 0.001, True, load_average=[0.8, 1.9])
    text = format_comparison(calm)
    assert "load average (start, end) 0.80, 1.90 0.80, 1.90" in " ".join(text.split()) and "under load" not in text
    loaded = _demo_report(2.22, 129.68, 0.001, True, load_average=[3.1, 4.2])
    assert ("Train seconds measured under load (load average up to 4.20 on 2 CPUs: other processes competed with "
            "the training), so they do not compare the two models' speed; `headmix bench models` times them side by side.") in \
        format_comparison(loaded).splitlines()
    loaded["mha"]["load_average"] = [None, None]  # not available on this system: no caveat from it
    loaded["moa"]["load_average"] = [None, 1.0]
    assert "under load" not in format_comparison(loaded)


@pytest.mark.slow
def test_compile_gives_the_eager_losses_and_leaves_compiling_steps_out_of_tokens_per_sec(tmp_path, pairs_file,
                                                                                        monkeypatch):
    """``compile=True``: the same losses as eager (no dropout), a ``compile`` metrics record for each step that
    (re)compiled, whose time and tokens are left out of tokens/s, and the compile time in the summary. The
    aot_eager backend traces what inductor would compile, without its slow CPU code generation."""
    import headmix.training.trainer as trainer

    compiled_modules = []

    def compile_with_aot_eager(model):
        compiled_modules.append(model)
        return torch.compile(model, backend="aot_eager")

    monkeypatch.setattr(trainer, "compile_model", compile_with_aot_eager)
    options = dict(max_steps=5, log_every=1, eval_every=100, save_every=5, average_last=1, dropout=0.0)
    eager = train(small_config(tmp_path / "eager", pairs_file, **options))
    torch._dynamo.reset()
    compiled = train(small_config(tmp_path / "compiled", pairs_file, compile=True, **options))
    torch._dynamo.reset()
    assert len(compiled_modules) == 1
    eager_records, records = read_metrics(tmp_path / "eager"), read_metrics(tmp_path / "compiled")
    losses = lambda recs: [r["loss"] for r in recs if r["split"] == "train"]
    assert len(losses(records)) == 5
    assert losses(records) == pytest.approx(losses(eager_records), rel=1e-4)
    compiling = {r["step"] for r in records if r["split"] == "compile"}
    assert 1 in compiling and len(compiling) == compiled["compile_steps"] < 5
    assert compiled["compile_seconds"] == pytest.approx(sum(r["compile_seconds"] for r in records
                                                            if r["split"] == "compile"))
    for r in records:
        if r["split"] == "train":
            assert (r["tokens_per_sec"] is None) == (r["step"] in compiling)
    assert "compile_seconds" not in eager


def test_training_window_leaves_compiling_steps_out_of_tokens_per_sec(monkeypatch):
    import headmix.training.metrics as metrics

    now = [100.0]
    monkeypatch.setattr(metrics.time, "time", lambda: now[0])
    window = metrics.TrainingWindow()
    now[0] += 30.0  # a compiling step: 30 s, 1000 tokens
    window.add_step(2.0, 1000, timed=False)
    window.exclude_time(30.0)
    assert window.record(world_size=1)["tokens_per_sec"] is None  # only compiling steps so far
    now[0] += 2.0  # two ordinary steps: 2 s, 400 tokens
    window.add_step(1.0, 200)
    window.add_step(1.0, 200)
    record = window.record(world_size=2)
    assert record["tokens_per_sec"] == pytest.approx(400 * 2 / 2.0)
    assert record["loss"] == pytest.approx(4.0 / 3)


def test_validation_runs_without_autograd():
    """Validation builds no autograd graph (memory and time): the model's forward sees grad mode off."""
    from types import SimpleNamespace

    from headmix.evaluation.loss import validation_loss

    seen = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, x):
            seen.append(torch.is_grad_enabled())
            loss = self.w * x.mean()
            return SimpleNamespace(loss=loss, lm_loss=loss, nll_loss=loss, num_tokens=torch.tensor(x.numel()), routing=[])

    task = SimpleNamespace(model_inputs=lambda batch, device: {"x": batch})
    result = validation_loss(Model(), [torch.full((3,), 2.0)], task, "cpu")
    assert seen == [False]
    assert result["loss"] == pytest.approx(2.0)


def test_a_run_sharing_a_folder_prepared_before_the_sequence_convention_trains_eos_first(tmp_path):
    """A study's runs share a folder (``shared_data``) that stores their sequence convention when it is prepared;
    one prepared before the option stored none, its runs trained eos-first, and a run added to it later (another
    seed, another row) trains as they did, not with the tokenizer's ``bos``. A run that trained keeps its own."""
    import json

    from headmix.training.sequence_start import run_sequence_start

    shared = tmp_path / "shared"
    shared.mkdir()
    cfg = TrainConfig(task="lm", out=str(tmp_path / "run"), shared_data=str(shared), data=["docs.jsonl"],
                      tokenizer=str(shared / "tokenizer"))
    (shared / "train_config.json").write_text(json.dumps({"task": "lm"}))
    assert run_sequence_start(cfg) == "eos"
    (shared / "train_config.json").write_text(json.dumps({"task": "lm", "sequence_start": "bos"}))
    assert run_sequence_start(cfg) == "bos"
    assert run_sequence_start(TrainConfig(task="translation", out=str(tmp_path / "mt"))) is None
