"""The ``headmix`` command: flags generated from TrainConfig, and one-line errors with exit code 2 for a
bad command line and 1 for a failed run, never a traceback for an expected failure."""

from __future__ import annotations

import dataclasses
import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from headmix.cli.main import build_parser, dataclass_from_args, main
from headmix.training import TrainConfig

SRC = Path(__file__).resolve().parents[1] / "src"


def tiny(out: Path, data: Path, *extra: str, task: str = "translation") -> list[str]:
    return ["train", task, "--preset", "tiny-mha", "--out", str(out), "--data", str(data), "--vocab-size", "300",
            "--max-steps", "2", "--max-tokens", "600", "--max-len", "32", "--warmup-steps", "1", "--log-every", "1",
            "--save-every", "2", "--eval-every", "100", "--average-last", "1", "--valid-size", "0.05",
            "--test-size", "0.05", "--no-progress", *extra]


def one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("[headmix]")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------------------------- generated flags
def parse_train(*argv: str):
    return build_parser().parse_args(["train", *argv])


def test_every_train_config_field_is_a_flag_with_its_default_and_help():
    args = parse_train("translation", "--out", "R")
    assert dataclass_from_args(TrainConfig, args) == TrainConfig(task="translation", out="R")
    help_text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata["help"] and " ".join(f.metadata["help"].split())[:30] in " ".join(help_text.split()), f.name
        if f.metadata.get("cli") != "positional" and f.type != "bool":
            assert "--" + f.name.replace("_", "-") in help_text, f.name
    assert "--no-progress" in help_text and "--strict" in help_text


def test_flags_reach_the_config():
    cfg = dataclass_from_args(TrainConfig, parse_train(
        "lm", "--out", "R", "--lr", "0.01", "--betas", "0.8", "0.9", "--data", "a.jsonl", "--strict", "--no-progress",
        "--schedule", "constant", "--max-time", "5"))
    assert (cfg.task, cfg.lr, cfg.betas, cfg.data, cfg.strict, cfg.progress, cfg.schedule, cfg.max_time) == \
        ("lm", 0.01, (0.8, 0.9), ["a.jsonl"], True, False, "constant", 5.0)


def test_learning_rate_default_is_the_tasks():
    assert TrainConfig(task="translation").resolved_lr == 7e-4
    assert TrainConfig(task="lm").resolved_lr == 5e-4 and TrainConfig(task="mlm").resolved_lr == 5e-4
    assert TrainConfig(task="lm", lr=1e-3).resolved_lr == 1e-3
    assert TrainConfig(task="translation").resolved_schedule == "inverse_sqrt"
    assert TrainConfig(task="mlm").resolved_schedule == "linear"


# ---------------------------------------------------------------------------------------- bad usage
@pytest.mark.parametrize("argv, needles", [
    (["--lr", "0"], ["error: --lr must be a number > 0, got 0.0"]),
    (["--seed", "-1"], ["error: --seed must be a non-negative integer, got -1"]),
    (["--max-time", "0"], ["error: --max-time must be a number > 0, got 0.0"]),
    (["--device", "gpu"], ["error: --device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu'"]),
    (["--max-steps", "0"], ["error: --max-steps must be a positive integer"]),
    (["--valid-size", "1.5"], ["error: --valid-size must be a fraction in [0, 1), got 1.5"]),
    (["--schedule", "cosine"], ["--schedule", "invalid choice"]),
    (["--vocab-size", "many"], ["--vocab-size", "invalid int value"]),
])
def test_bad_train_option_is_one_line_and_exit_2(tmp_path, pairs_file, capsys, argv, needles):
    out = tmp_path / "r"
    assert main(tiny(out, pairs_file, *argv)) == 2
    one_line_error(capsys, *needles)
    assert not out.exists()  # nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_device_cuda_without_a_gpu(tmp_path, pairs_file, capsys):
    assert main(tiny(tmp_path / "r", pairs_file, "--device", "cuda")) == 2
    one_line_error(capsys, "no CUDA device is available")


def test_out_naming_a_file(tmp_path, pairs_file, capsys):
    out = tmp_path / "file"
    out.write_text("mine")
    assert main(tiny(out, pairs_file)) == 2
    one_line_error(capsys, "is a file, expected a run folder")
    assert out.read_text() == "mine"


def test_missing_data_file(tmp_path, capsys):
    assert main(tiny(tmp_path / "r", tmp_path / "missing.tsv")) == 2
    one_line_error(capsys, "data file not found", "missing.tsv")


def test_subprocess_bad_device_exit_code_and_one_line(tmp_path, pairs_file):
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-m", "headmix.cli.main", *tiny(tmp_path / "r", pairs_file, "--device", "gpu")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("headmix train: error: --device must be")


# ------------------------------------------------------------------------------------- failed runs
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, pairs_file) -> Path:
    out = tmp_path_factory.mktemp("runs") / "run"
    assert main(tiny(out, pairs_file)) == 0
    return out


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file of a run folder but its lock file (which says who held the lock last)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("change, field", [
    (["--preset", "tiny-moa"], "preset"),
    (["--vocab-size", "301"], "vocab_size"),
    (["--seed", "2"], "seed"),
    (["--max-len", "30"], "max_len"),
])
def test_resuming_with_another_identity_is_refused_and_writes_nothing(finished_run, pairs_file, capsys, change, field):
    before = snapshot(finished_run)
    assert main(tiny(finished_run, pairs_file, *change)) == 2
    one_line_error(capsys, field)
    assert snapshot(finished_run) == before


def test_resuming_with_another_task_or_data_is_refused(finished_run, pairs_file, tmp_path, capsys):
    before = snapshot(finished_run)
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "In the beginning.", "id": "a"}\n' * 30)
    assert main(tiny(finished_run, docs, task="mlm")) == 2
    one_line_error(capsys, "task")
    other = tmp_path / "other.tsv"
    other.write_bytes(pairs_file.read_bytes() + b"One more.\tNoch einer.\n")
    assert main(tiny(finished_run, other)) == 2
    one_line_error(capsys, "data")
    assert snapshot(finished_run) == before


def test_nonfinite_loss_is_one_line_and_exit_1(tmp_path, pairs_file, capsys, monkeypatch):
    from headmix.training.distributed import Parallel

    monkeypatch.setattr(Parallel, "clip_grad_norm", lambda self, max_norm: torch.tensor(float("nan")))
    assert main(tiny(tmp_path / "r", pairs_file)) == 1
    one_line_error(capsys, "non-finite loss", "at step 1")


def test_evaluate_limit_must_be_positive(finished_run, capsys):
    for limit in ("0", "-1"):
        assert main(["evaluate", str(finished_run), "--limit", limit]) == 2
        one_line_error(capsys, "--limit", "expected a positive integer")


def test_disk_full_is_one_line_about_space_and_exit_1(tmp_path, pairs_file, capsys, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)  # the checkpoint's training state
    out = tmp_path / "r"
    assert main(tiny(out, pairs_file)) == 1
    one_line_error(capsys, "no space left on device while writing", "checkpoints")
    assert not [p for p in out.rglob("*") if p.name.startswith(".tmp")]
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").iterdir())


def test_a_run_in_use_is_one_line_and_exit_1(finished_run, pairs_file, capsys):
    from headmix.runs import Run

    before = snapshot(finished_run)
    holder = Run(finished_run)
    holder.lock()
    try:
        assert main(tiny(finished_run, pairs_file, "--max-steps", "3")) == 1
    finally:
        holder.unlock()
    one_line_error(capsys, "is in use by process", str(os.getpid()))
    assert snapshot(finished_run) == before


def test_translate_and_evaluate_a_finished_run(finished_run, tmp_path, capsys):
    import json

    from headmix.evaluation import translate
    from headmix.runs import load_run

    source = tmp_path / "in.txt"
    source.write_text("Open the file.\nSave the document.\n")
    capsys.readouterr()
    assert main(["translate", str(finished_run), "--input", str(source), "--beam", "2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    run = load_run(finished_run)
    assert printed == translate(run.model, run.tokenizer, ["Open the file.", "Save the document."], beam_size=2)
    assert main(["evaluate", str(finished_run), "--limit", "3", "--beam", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["sentences"] == 3 and result["split"] == "test" and result["beam_size"] == 2
    assert main(["evaluate", str(tmp_path / "nowhere")]) == 2
    one_line_error(capsys, "run folder not found")


# ------------------------------------------------------------------------------------------- devices
def test_pick_device_parses_every_form_and_gives_cuda_an_index(monkeypatch):
    from headmix.training.config import pick_device

    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device(torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu")
    # a machine with two CUDA devices, simulated: "cuda" must come back with an index (set_device needs one)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert pick_device("cuda") == torch.device("cuda", 1)
    assert pick_device("auto") == torch.device("cuda", 1)
    assert pick_device("cuda:0") == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "0")  # under torchrun: this process' device
    assert pick_device("cuda") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"^device 'cuda:2': this machine has 2 CUDA device\(s\)$"):
        pick_device("cuda:2")
    for bad in ("gpu", "cuda:x", "", 3):
        with pytest.raises(ValueError, match=r"^device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got "):
            pick_device(bad)


@pytest.mark.parametrize("argv", [
    ["translate", "RUN", "--device", "gpu"],
    ["evaluate", "RUN", "--device", "cuda:x"],
    ["analyze", "load", "RUN", "--out", "O", "--device", "tpu"],
    ["study", "lm-en", "--out", "O", "--device", "gpu"],
    ["demo", "--out", "O", "--device", "gpu"],
])
def test_bad_device_of_every_command_is_one_line_naming_the_option(capsys, argv):
    assert main(argv) == 2
    one_line_error(capsys, "argument --device: device must be 'auto', 'cpu', 'cuda' or 'cuda:N'")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("argv", [["translate", "RUN", "--device", "cuda"], ["evaluate", "RUN", "--device", "cuda:0"],
                                  ["demo", "--out", "O", "--device", "cuda"]])
def test_cuda_device_without_a_gpu_is_one_line(capsys, argv):
    assert main(argv) == 2
    one_line_error(capsys, "argument --device: device", "no CUDA device is available")


def test_device_reaches_translate_and_evaluate(finished_run, monkeypatch, capsys):
    """``--device`` is parsed once (pick_device) and what it names is where the run is loaded."""
    import headmix.runs as runs

    seen = []
    real_load_run = runs.load_run
    monkeypatch.setattr(runs, "load_run", lambda path, device="cpu": seen.append(device) or real_load_run(path, device))
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO("hello\n"))
    assert main(["translate", str(finished_run), "--device", "auto", "--beam", "1"]) == 0
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert seen == [expected]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "auto"])
def test_train_and_evaluate_on_the_gpu_with_every_device_form(tmp_path, pairs_file, device, capsys):
    out = tmp_path / "r"
    assert main(tiny(out, pairs_file, "--device", device)) == 0
    assert main(["evaluate", str(out), "--device", device, "--limit", "5", "--beam", "1"]) == 0
    assert '"bleu"' in capsys.readouterr().out


# ------------------------------------------------------------------------------------- issue 57: refusals
@pytest.mark.parametrize("argv, nearest", [
    (["train", "lm", "--max-stepz", "3", "--out", "r"], "--max-steps"),
    (["train", "lm", "--distil-from=runs/dense", "--out", "r"], "--distill-from"),
    (["generate", "r", "--prompt", "a", "--max-new-token", "3", "--temprature", "0.5"], "--temperature"),
])
def test_a_misspelt_flag_names_the_nearest_flag_of_its_command(argv, nearest, capsys):
    assert main(argv) == 2
    line = one_line_error(capsys, "unrecognized arguments: ", f"(did you mean {nearest}?)")
    assert line.startswith("headmix: error: ")


def test_a_flag_near_none_gets_no_guess(capsys):
    assert main(["train", "lm", "--zzzzzz", "--out", "r"]) == 2
    assert "did you mean" not in one_line_error(capsys, "unrecognized arguments: --zzzzzz")


def test_preset_takes_a_model_config_as_a_json_string(tmp_path, docs_file, capsys):
    """``--preset`` given the model config itself (the help says so): the run trains that model, however long the
    string (a long one is no file name); a bad JSON string is refused in one line."""
    import json

    from headmix.models import get_config
    from headmix.runs import load_run

    config = get_config("tiny-mha", task="lm", vocab_size=300).to_dict()
    inline = json.dumps(config, indent=1)
    assert len(inline) > 1000
    assert main(tiny(tmp_path / "r", docs_file, task="lm")[:2] + ["--preset", inline]
                + tiny(tmp_path / "r", docs_file, task="lm")[4:]) == 0
    capsys.readouterr()
    assert load_run(tmp_path / "r").model.config == get_config("tiny-mha", task="lm", vocab_size=300)
    assert main(["train", "lm", "--preset", '{"d_model": 64,', "--out", str(tmp_path / "bad"),
                 "--data", str(docs_file)]) == 2
    one_line_error(capsys, "the inline JSON model config is not valid JSON", "give a JSON object")
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["train"].format_help().split())
    assert "or a JSON model config itself (a string starting with '{')" in help_text
