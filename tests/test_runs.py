"""The run folder (headmix.runs): lock, configuration check, atomic writes, checkpoints with checksums and
fall-back, the keep/average rule for signal checkpoints, metrics truncation, final files and load_run.
Tiny modules only: nothing is trained here."""

from __future__ import annotations

import ast
import builtins
import errno
import io
import json
import multiprocessing
import os
import shutil
import signal
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from headmix.data import read_tsv_pairs, train_tokenizer, write_tsv_pairs
from headmix.models import build_model, get_config
from headmix.runs import (
    Run,
    RunError,
    RunLockedError,
    RunMismatchError,
    atomic_directory,
    atomic_output,
    atomic_write,
    average_checkpoints,
    load_run,
)
from headmix.runs import checkpoints as ckpt
from headmix.storage import files

SRC = Path(__file__).resolve().parents[1] / "src"
IDENTITY = ("task", "preset", "data", "tokenizer", "vocab_size", "max_len", "seed", "valid_size", "test_size",
            "src_lang", "tgt_lang")


@pytest.fixture
def data_file(tmp_path) -> Path:
    path = tmp_path / "inputs" / "pairs.tsv"
    path.parent.mkdir()
    path.write_text("a b\tc d\ne f\tg h\n")
    return path


@pytest.fixture
def config(data_file, tmp_path) -> dict:
    tok_dir = tmp_path / "inputs" / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text("{}")
    return {"task": "translation", "preset": "tiny-moa", "data": [str(data_file)], "tokenizer": str(tok_dir),
            "vocab_size": 300, "max_len": 32, "seed": 1, "valid_size": 0.05, "test_size": 0.05, "src_lang": "en",
            "tgt_lang": "de", "max_steps": 10, "log_every": 2, "progress": False, "betas": (0.9, 0.98)}


@pytest.fixture
def run(tmp_path, config):
    with Run.create_or_resume(tmp_path / "run", config, identity=IDENTITY) as r:
        yield r


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob("*") if p.name.startswith(files.TMP_PREFIX)]


# ------------------------------------------------------------------------------------------------ lock

def _hold_lock(path: str, ready, release) -> None:
    run = Run(path)
    run.lock()
    ready.set()
    release.wait(60)


def _start_holder(run: Run):
    """Another process that takes ``run``'s lock and holds it until ``release`` is set."""
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    run.unlock()
    child = ctx.Process(target=_hold_lock, args=(str(run.path), ready, release))
    child.start()
    assert ready.wait(30)
    return child, release


def test_a_second_process_gets_a_lock_error_naming_the_holder(run, config):
    child, release = _start_holder(run)
    try:
        before = snapshot(run.path)
        with pytest.raises(RunLockedError, match=rf"in use by process {child.pid} on host "
                                                 rf"{socket.gethostname()} \(since 20"):
            Run.create_or_resume(run.path, config, identity=IDENTITY)
        assert snapshot(run.path) == before
    finally:
        release.set()
        child.join(30)
    with Run.create_or_resume(run.path, config, identity=IDENTITY) as again:  # released when the holder exits
        assert again.locked


def test_a_lock_left_by_a_killed_process_is_free(run, config):
    child, _ = _start_holder(run)
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    assert str(child.pid) in run.lock_path.read_text()  # the stale record is still there
    with Run.create_or_resume(run.path, config, identity=IDENTITY) as again:
        assert json.loads(again.lock_path.read_text())["pid"] == os.getpid()


def test_lock_is_exclusive_within_a_process_and_released_on_exit(tmp_path, config):
    with Run.create_or_resume(tmp_path / "r", config, identity=IDENTITY) as first:
        with pytest.raises(RunLockedError, match=f"process {os.getpid()}"):
            Run.create_or_resume(tmp_path / "r", config, identity=IDENTITY)
    assert not first.locked
    Run.create_or_resume(tmp_path / "r", config, identity=IDENTITY).unlock()


# ------------------------------------------------------------------------------------------------ configuration

def test_new_run_stores_config_with_absolute_paths_and_checksums(run, config, data_file):
    stored = json.loads(run.config_path.read_text())
    assert stored["data"] == [str(data_file.resolve())]
    assert stored["content_sha256"]["data"] == [ckpt.sha256_file(data_file)]
    assert stored["betas"] == [0.9, 0.98] and stored["max_steps"] == 10
    assert run.read_config() == {**json.loads(json.dumps(config)), "data": [str(data_file.resolve())],
                                 "tokenizer": str(Path(config["tokenizer"]).resolve())}
    assert oct(run.config_path.stat().st_mode & 0o777) == "0o644"


def test_relative_data_paths_are_stored_resolved(tmp_path, config, data_file, monkeypatch):
    monkeypatch.chdir(data_file.parent)
    with Run.create_or_resume(tmp_path / "r", {**config, "data": [data_file.name]}, identity=IDENTITY) as r:
        assert r.read_config()["data"] == [str(data_file)]
    monkeypatch.chdir(tmp_path)  # the same file named from elsewhere is the same run
    Run.create_or_resume(tmp_path / "r", {**config, "data": [str(Path("inputs") / data_file.name)]},
                         identity=IDENTITY).unlock()


def test_init_from_distill_from_and_init_options_compare_what_they_name(tmp_path, config, monkeypatch):
    """``--init-from`` and ``--distill-from`` are stored as absolute paths: the same folder named relatively from
    another directory, or absolutely, resumes the run; ``--init-options`` compares the JSON it parses to (spacing,
    key order). Another folder or other options are refused."""
    (tmp_path / "parent").mkdir()
    (tmp_path / "teacher").mkdir()
    identity = (*IDENTITY, "init_from", "distill_from", "init_options")
    config = {**config, "init_from": "parent", "distill_from": "teacher", "init_options": '{"a": 1, "b": [2, 3]}'}
    monkeypatch.chdir(tmp_path)
    with Run.create_or_resume(tmp_path / "r", config, identity=identity) as r:
        stored = r.read_config()
    assert (stored["init_from"], stored["distill_from"]) == (str(tmp_path / "parent"), str(tmp_path / "teacher"))
    monkeypatch.chdir(tmp_path / "inputs")
    same = {**config, "init_from": str(tmp_path / "parent"), "distill_from": "../teacher",
            "init_options": '{"b":[2,3],  "a":1}'}
    Run.create_or_resume(tmp_path / "r", same, identity=identity).unlock()
    for field, other in (("init_from", "../teacher"), ("distill_from", "../parent"), ("init_options", '{"a": 2}')):
        with pytest.raises(RunMismatchError, match=f"was created with {field}="):
            Run.create_or_resume(tmp_path / "r", {**same, field: other}, identity=identity)


CHANGES = {"task": "mlm", "preset": "tiny-mha", "vocab_size": 400, "max_len": 64, "seed": 2, "valid_size": 0.1,
           "test_size": 0.1, "src_lang": "fr", "tgt_lang": "en"}


@pytest.mark.parametrize("field", IDENTITY)
def test_a_changed_identity_field_is_refused_and_nothing_is_written(run, config, field, tmp_path):
    run.unlock()
    run.lock_path.write_text("an earlier holder\n")  # so that even a rewrite of the lock record is seen
    before = snapshot(run.path)
    changed = dict(config)
    if field == "data":
        other = tmp_path / "inputs" / "other.tsv"
        other.write_text("a b\tc d\ne f\tg h\n")  # same content, other path
        changed["data"], shown = [str(other)], "other.tsv"
    elif field == "tokenizer":
        changed["tokenizer"], shown = str(tmp_path / "inputs"), "inputs'"
    else:
        changed[field] = shown = CHANGES[field]
    with pytest.raises(RunMismatchError, match=rf"was created with {field}=.*; this command has {field}=.*{shown}"):
        Run.create_or_resume(run.path, changed, identity=IDENTITY)
    assert snapshot(run.path) == before


def test_changed_data_content_is_refused(run, config, data_file):
    run.unlock()
    run.lock_path.write_text("an earlier holder\n")
    before = snapshot(run.path)
    data_file.write_text("x y\tz w\n")
    with pytest.raises(RunMismatchError, match=r"created with data .*pairs.tsv of sha256 \w{12}; its content has changed"):
        Run.create_or_resume(run.path, config, identity=IDENTITY)
    assert snapshot(run.path) == before


def test_changed_tokenizer_folder_content_is_refused(run, config):
    run.unlock()
    (Path(config["tokenizer"]) / "tokenizer.json").write_text('{"x": 1}')
    with pytest.raises(RunMismatchError, match="created with tokenizer .*its content has changed"):
        Run.create_or_resume(run.path, config, identity=IDENTITY)


def test_other_fields_may_change_on_resume_and_are_stored(run, config):
    run.unlock()
    with Run.create_or_resume(run.path, {**config, "max_steps": 20, "progress": True}, identity=IDENTITY) as again:
        stored = again.read_config()
    assert stored["max_steps"] == 20 and stored["progress"] is True and stored["preset"] == "tiny-moa"
    assert not leftovers(run.path)


def test_out_naming_a_file_is_refused(tmp_path, config):
    path = tmp_path / "not_a_folder"
    path.write_text("mine")
    with pytest.raises(RunError, match=f"--out {path} is a file, expected a run folder"):
        Run.create_or_resume(path, config, identity=IDENTITY)
    assert path.read_text() == "mine"


def test_a_non_empty_folder_that_is_not_a_run_is_refused(tmp_path, config):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(RunError, match=r"is not empty \(config.json\) and holds no train_config.json"):
        Run.create_or_resume(folder, config, identity=IDENTITY)
    assert snapshot(folder) == {"config.json": b"{}"}
    assert not (folder / ".lock").exists()


def test_identity_must_name_config_fields(tmp_path, config):
    with pytest.raises(ValueError, match=r"identity names fields that are not in config: \['dataset'\]"):
        Run.create_or_resume(tmp_path / "r", config, identity=("task", "dataset"))
    assert not (tmp_path / "r").exists()


def test_a_damaged_stored_config_is_an_error_not_an_overwrite(run, config):
    run.unlock()
    run.config_path.write_text('{"task": ')
    with pytest.raises(RunError, match="train_config.json is damaged"):
        Run.create_or_resume(run.path, config, identity=IDENTITY)
    assert run.config_path.read_text() == '{"task": '


def test_stale_temporaries_are_removed_under_the_lock(run, config):
    (run.checkpoints_dir / ".tmp-step_00000002-1-ab").mkdir(parents=True)
    (run.path / ".tmp-summary.json-1-cd").write_text("half")
    run.unlock()
    with Run.create_or_resume(run.path, config, identity=IDENTITY):
        assert not leftovers(run.path)


def test_writes_need_the_lock(run):
    reader = Run(run.path)
    with pytest.raises(RunError, match="without holding its lock"):
        reader.write_summary({"steps": 1})
    with pytest.raises(RunError, match="without holding its lock"):
        reader.save_checkpoint(1, nn.Linear(2, 2), {}, {}, keep=2, reason="periodic")


# ------------------------------------------------------------------------------------------------ atomic writes

def test_atomic_write_replaces_and_sets_the_mode(tmp_path):
    path = tmp_path / "a" / "f.txt"
    old = os.umask(0o077)
    try:
        atomic_write(path, "one")
        atomic_write(path, b"two", mode=0o640)
    finally:
        os.umask(old)
    assert path.read_bytes() == b"two" and oct(path.stat().st_mode & 0o777) == "0o640"
    assert not leftovers(tmp_path)


def test_atomic_write_failure_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "f.txt"
    path.write_text("old")

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "write", full)
    with pytest.raises(RunError) as err:
        atomic_write(path, "new" * 1000)
    monkeypatch.undo()
    assert str(err.value) == f"no space left on device while writing {path} (No space left on device)"
    assert path.read_text() == "old" and not leftovers(tmp_path)


def test_atomic_write_other_os_errors_are_one_line(tmp_path, monkeypatch):
    path = tmp_path / "f.txt"

    def denied(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(files.os, "replace", denied)
    with pytest.raises(RunError, match=rf"^could not write {path}: Permission denied$"):
        atomic_write(path, "x")
    monkeypatch.undo()
    assert not path.exists() and not leftovers(tmp_path)


def free_space(monkeypatch, blocks: int) -> None:
    """Make the file system look as if ``blocks`` blocks of 4 KiB were free."""
    monkeypatch.setattr(files.os, "statvfs", lambda p: type("S", (), {"f_bavail": blocks, "f_frsize": 4096})())


@pytest.mark.parametrize("raised,blocks", [
    (OSError(errno.ENOSPC, "No space left on device"), 10_000),
    (RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space\" })"), 10_000),
    (RuntimeError("basic_ios::clear: iostream error"), 0),  # torch.save on a full disk
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 896 vs 790"), 1),  # seen on a full tmpfs
    (RuntimeError("something else"), 0),  # no errno, but the disk is full
])
def test_atomic_output_disk_full_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, raised, blocks):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"old")
    free_space(monkeypatch, blocks)
    with pytest.raises(RunError, match=rf"^no space left on device while writing {path} \(") as err:
        with atomic_output(path) as tmp:
            tmp.write_bytes(b"half")
            raise raised
    assert "\n" not in str(err.value)
    assert path.read_bytes() == b"old" and not leftovers(tmp_path)


def test_a_torch_write_failure_with_space_left_is_one_line(tmp_path, monkeypatch):
    free_space(monkeypatch, 1 << 20)
    with pytest.raises(RunError, match=rf"^could not write {tmp_path / 'x.pt'}: RuntimeError: \[enforce fail"):
        with atomic_output(tmp_path / "x.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 896 vs 790")
    with pytest.raises(RuntimeError, match="^a bug$"):  # other runtime errors are bugs, not write failures
        with atomic_output(tmp_path / "x.pt"):
            raise RuntimeError("a bug")
    assert not leftovers(tmp_path)


def test_atomic_output_passes_other_errors_through(tmp_path):
    path = tmp_path / "x.bin"
    with pytest.raises(ValueError, match="a bug"):
        with atomic_output(path) as tmp:
            tmp.write_bytes(b"half")
            raise ValueError("a bug")
    assert not path.exists() and not leftovers(tmp_path)
    old = os.umask(0o077)
    try:
        with atomic_output(path, mode=0o644) as tmp:
            torch.save({"a": 1}, tmp)
    finally:
        os.umask(old)
    assert torch.load(path) == {"a": 1} and oct(path.stat().st_mode & 0o777) == "0o644"


def test_atomic_output_keeps_the_suffix_for_writers_that_read_it(tmp_path):
    path = tmp_path / "train.tsv.gz"
    with atomic_output(path) as tmp:
        write_tsv_pairs([("ein Haus", "a house")], tmp)
    assert path.read_bytes()[:2] == b"\x1f\x8b"  # gzip, chosen by write_tsv_pairs from the name
    assert [(p.src, p.tgt) for p in read_tsv_pairs(path)] == [("ein Haus", "a house")]


@pytest.mark.parametrize("exchange", [True, False])
def test_atomic_directory_replaces_whole_or_not_at_all(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    folder = tmp_path / "tokenizer"
    with atomic_directory(folder) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(KeyError):
        with atomic_directory(folder) as tmp:
            (tmp / "a").write_text("2")
            raise KeyError("writer failed")
    assert snapshot(folder) == {"a": b"1"} and not leftovers(tmp_path)
    with atomic_directory(folder) as tmp:
        (tmp / "b").write_text("3")
    assert snapshot(folder) == {"b": b"3"} and not leftovers(tmp_path)


def test_tokenizer_is_saved_atomically_in_its_usual_format(run, monkeypatch):
    tok = train_tokenizer(["ein kleiner Test", "a small test"] * 5, vocab_size=270)
    run.save_tokenizer(tok)
    assert (run.tokenizer_dir / "tokenizer.json").read_text() == tok.hf.to_str(pretty=True)
    assert run.load_tokenizer().encode("a small test") == tok.encode("a small test")
    before = snapshot(run.tokenizer_dir)
    def half_then_full(self, path, pretty=True):
        Path(path).write_text('{"half": ')
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(tok.hf), "save", half_then_full)
    other = train_tokenizer(["something else entirely"] * 5, vocab_size=270)
    with pytest.raises(RunError, match="no space left on device while writing .*tokenizer"):
        run.save_tokenizer(other)
    assert snapshot(run.tokenizer_dir) == before and not leftovers(run.path)


# ------------------------------------------------------------------------------------------------ checkpoints

class Tied(nn.Module):
    """A tiny module with a tied weight and a buffer, like the models' shared embeddings."""

    def __init__(self, value: float = 0.0):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.out = nn.Linear(3, 5)
        self.out.weight = self.emb.weight
        self.register_buffer("count", torch.zeros(2))
        with torch.no_grad():
            for t in self.state_dict().values():
                t.fill_(value)


def save(run: Run, step: int, reason: str = "periodic", keep: int | None = 3) -> Path:
    return run.save_checkpoint(step, Tied(step), {"step": step, "rng": torch.arange(step)}, {"tokens": 10 * step},
                               keep=keep, reason=reason)


def steps(paths: list[Path]) -> list[int]:
    return [ckpt.checkpoint_step(p) for p in paths]


def test_checkpoint_records_checksums_and_reason(run):
    path = save(run, 4, reason="signal 15")
    info = json.loads((path / "state.json").read_text())
    assert info["step"] == 4 and info["reason"] == "signal 15" and info["tokens"] == 40
    assert info["sha256"] == {n: ckpt.sha256_file(path / n) for n in ("model.safetensors", "training_state.pt")}
    model = Tied()
    found, state, record = run.latest_intact_checkpoint(model)
    assert found == path and state["step"] == 4 and record["reason"] == "signal 15"
    assert torch.equal(model.emb.weight, torch.full((5, 3), 4.0)) and model.out.weight is model.emb.weight
    assert torch.equal(model.count, torch.full((2,), 4.0))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated model.safetensors": lambda p: _truncate(p / "model.safetensors"),
    "truncated training_state.pt": lambda p: _truncate(p / "training_state.pt"),
    "empty state.json": lambda p: (p / "state.json").write_text(""),
    "invalid state.json": lambda p: (p / "state.json").write_text('{"step": 6, '),
    "checksum mismatch": lambda p: _flip_byte(p / "model.safetensors"),
    "missing training_state.pt": lambda p: (p / "training_state.pt").unlink(),
}
WHY = {"truncated model.safetensors": "model.safetensors does not match its checksum (truncated or altered)",
       "truncated training_state.pt": "training_state.pt does not match its checksum (truncated or altered)",
       "empty state.json": "state.json is empty", "invalid state.json": "state.json is not valid JSON",
       "checksum mismatch": "model.safetensors does not match its checksum (truncated or altered)",
       "missing training_state.pt": "training_state.pt is missing"}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_falls_back_to_the_previous_intact_one(run, damage, capsys):
    for step in (2, 4, 6):
        save(run, step)
    DAMAGE[damage](run.checkpoints_dir / "step_00000006")
    model = Tied(-1.0)
    path, state, info = run.latest_intact_checkpoint(model)
    assert steps([path]) == [4] and state["step"] == 4 and info["tokens"] == 40
    assert torch.equal(model.emb.weight, torch.full((5, 3), 4.0))
    (err,) = capsys.readouterr().err.splitlines()  # one line
    assert err.startswith(f"[headmix] warning: checkpoint {run.checkpoints_dir / 'step_00000006'} is damaged: "
                          f"{WHY[damage]}")
    assert err.endswith("; skipped, falling back to the checkpoint before it")


@pytest.mark.parametrize("damage", ["truncated model.safetensors", "truncated training_state.pt"])
def test_a_damaged_checkpoint_without_checksums_is_found_by_parsing(run, damage):
    for step in (2, 4):
        path = save(run, step)
        info = json.loads((path / "state.json").read_text())
        del info["sha256"]  # as written by an older version
        (path / "state.json").write_text(json.dumps(info))
    DAMAGE[damage](run.checkpoints_dir / "step_00000004")
    model = Tied(-1.0)
    assert steps([run.latest_intact_checkpoint(model)[0]]) == [2]
    assert torch.equal(model.emb.weight, torch.full((5, 3), 2.0))


def test_no_intact_checkpoint_gives_none_and_leaves_the_model(run):
    save(run, 2)
    DAMAGE["checksum mismatch"](run.checkpoints_dir / "step_00000002")
    model = Tied(-1.0)
    assert run.latest_intact_checkpoint(model) is None
    assert torch.equal(model.emb.weight, torch.full((5, 3), -1.0))


def test_a_checkpoint_of_another_model_is_an_error_not_damage(run):
    save(run, 2)
    with pytest.raises(RunError, match=r"holds the weights of another model \(missing \['weight', 'bias'\]; unexpected \['count'"):
        run.latest_intact_checkpoint(nn.Linear(3, 5))


#: The system calls at which the crash test stops a writer, and after each Python ``open`` (the C writers
#: inside torch.save and safetensors write into temporary names, so their own calls need no interception).
CRASH_POINTS = ("write", "fsync", "mkdir", "rename", "replace", "unlink", "rmdir", "chmod", "fchmod", "ftruncate")


def _writer_work(run: Run, tokenizer) -> None:
    """What a resumed trainer writes around one save: metrics truncated, a checkpoint (which prunes a
    signal checkpoint and, with keep=2, the oldest periodic one), a new tokenizer folder, the summary."""
    run.truncate_metrics(6)
    save(run, 6, keep=2)
    run.save_tokenizer(tokenizer)
    run.write_summary({"step": 6})


def _crash_at_call(path: Path, config: dict, tokenizer, n: int) -> int:
    """Run :func:`_writer_work` in a child process that dies (``os._exit``, no clean-up, like kill -9) at
    its ``n``-th intercepted system call; the child's exit status: 17 when it died, 0 when it finished."""
    pid = os.fork()
    if pid == 0:
        try:
            calls = [0]

            def crashing(real):
                def call(*args, **kwargs):
                    calls[0] += 1
                    if calls[0] == n:
                        os._exit(17)
                    return real(*args, **kwargs)
                return call

            def crashing_after(real):  # open(..., "w") truncates: a crash right after it is a crash point too
                def call(*args, **kwargs):
                    result = real(*args, **kwargs)
                    calls[0] += 1
                    if calls[0] == n:
                        os._exit(17)
                    return result
                return call

            for name in CRASH_POINTS:
                setattr(os, name, crashing(getattr(os, name)))
            builtins.open = io.open = crashing_after(io.open)  # pathlib's write_text calls io.open
            with Run.create_or_resume(path, config, identity=IDENTITY, log=lambda message: None) as run:
                _writer_work(run, tokenizer)
            os._exit(0)
        finally:
            os._exit(1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_crash_at_any_system_call_leaves_a_run_that_resumes_to_the_same_files(run, config, tmp_path, monkeypatch):
    """kill -9 at every point of the writes: each leaves only complete files (old or new), and doing the
    work again gives byte for byte the folder of an uncut run."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # a process crash, not a power cut: flushing is not tested
    run.save_tokenizer(train_tokenizer(["x y z"] * 3, vocab_size=262))
    for step in (2, 4):
        save(run, step, keep=2)
    save(run, 5, reason="signal 15", keep=2)
    run.write_summary({"step": 5})
    run.metrics_path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 9)))
    run.unlock()
    base = snapshot(run.path)
    tokenizer = train_tokenizer(["a b c d e f"] * 3, vocab_size=263)
    uncut = tmp_path / "uncut"
    shutil.copytree(run.path, uncut)
    with Run.create_or_resume(uncut, config, identity=IDENTITY) as r:
        _writer_work(r, tokenizer)
    expected = {k: v for k, v in snapshot(uncut).items() if k != ".lock"}
    old_tokenizer = base["tokenizer/tokenizer.json"]
    n, status = 0, 17
    while status == 17:
        n += 1
        cut = tmp_path / f"cut{n}"
        shutil.copytree(run.path, cut)
        status = _crash_at_call(cut, config, tokenizer, n)
        with Run.create_or_resume(cut, config, identity=IDENTITY) as again:
            assert not leftovers(cut), n
            for path in again.checkpoints():
                ckpt.verify_checkpoint(path)
            assert steps(again.checkpoints())[-1] in (5, 6), n
            assert json.loads(again.summary_path.read_text())["step"] in (5, 6), n
            assert (cut / "tokenizer" / "tokenizer.json").read_bytes() in (old_tokenizer,
                                                                          expected["tokenizer/tokenizer.json"]), n
            _writer_work(again, tokenizer)
        assert {k: v for k, v in snapshot(cut).items() if k != ".lock"} == expected, n
        shutil.rmtree(cut)
    assert status == 0 and n > 20  # every call was a crash point once, then the work finished


def test_checkpoint_write_failure_leaves_the_previous_ones(run, monkeypatch):
    save(run, 2)

    def full(obj, f, *a, **k):
        raise RuntimeError("basic_ios::clear: iostream error")

    monkeypatch.setattr(torch, "save", full)
    free_space(monkeypatch, 0)
    with pytest.raises(RunError, match=r"^no space left on device while writing .*step_00000004 \("):
        save(run, 4)
    assert steps(run.checkpoints()) == [2] and not leftovers(run.path)


def test_keep_counts_scheduled_checkpoints_only(run):
    for step in (2, 4, 6, 8):
        save(run, step, keep=3)
    assert steps(run.checkpoints()) == [4, 6, 8]
    save(run, 9, reason="signal 15", keep=3)
    assert steps(run.checkpoints()) == [4, 6, 8, 9]  # the signal checkpoint pushes nothing out
    assert steps(run.checkpoints_to_average(3)) == [4, 6, 8]  # and never joins the average
    save(run, 10, reason="final", keep=3)
    assert steps(run.checkpoints()) == [6, 8, 10]  # and goes once a newer one exists


def test_signal_at_a_scheduled_step_keeps_the_scheduled_checkpoint(run):
    first = save(run, 4)
    before = snapshot(first)
    assert save(run, 4, reason="signal 2") == first
    assert snapshot(first) == before and json.loads((first / "state.json").read_text())["reason"] == "periodic"


def test_a_resume_from_an_older_checkpoint_drops_the_abandoned_newer_ones(run):
    for step in (2, 4, 6):
        save(run, step, keep=None)
    DAMAGE["truncated model.safetensors"](run.checkpoints_dir / "step_00000006")
    save(run, 5, reason="signal 15", keep=None)  # resumed from 4; the damaged 6 belongs to another history
    assert steps(run.checkpoints()) == [2, 4, 5]


def _uncut_and_interrupted(run_a: Run, run_b: Run, keep: int, average: int) -> tuple[list[Path], list[Path]]:
    """Steps 1..12, a checkpoint every 2 steps, final at 12; run_b is interrupted at steps 5, 8 (right after
    a periodic save) and 11, resuming each time from the checkpoint just written."""
    for step in range(2, 13, 2):
        save(run_a, step, reason="final" if step == 12 else "periodic", keep=keep)
    for step in range(1, 13):
        if step % 2 == 0:
            save(run_b, step, reason="final" if step == 12 else "periodic", keep=keep)
        if step in (5, 8, 11):
            save(run_b, step, reason="signal 15", keep=keep)
            assert steps([run_b.latest_intact_checkpoint(Tied())[0]]) == [step]
    return run_a.checkpoints_to_average(average), run_b.checkpoints_to_average(average)


@pytest.mark.parametrize("keep,average", [(2, 2), (3, 3), (5, 3)])
def test_an_interrupted_run_averages_the_same_checkpoints_as_an_uncut_one(tmp_path, config, keep, average):
    with Run.create_or_resume(tmp_path / "a", config, identity=IDENTITY) as a, \
            Run.create_or_resume(tmp_path / "b", config, identity=IDENTITY) as b:
        uncut, interrupted = _uncut_and_interrupted(a, b, keep, average)
        assert steps(uncut) == list(range(14 - 2 * average, 13, 2))
        assert steps(interrupted) == steps(uncut)
        avg_a, avg_b = average_checkpoints(uncut), average_checkpoints(interrupted)
        assert avg_a.keys() == avg_b.keys() and all(torch.equal(avg_a[k], avg_b[k]) for k in avg_a)
        assert steps(b.checkpoints()) == steps(a.checkpoints())


def test_averaging_leaves_out_a_damaged_checkpoint_with_a_warning(run, capsys):
    for step in (2, 4, 6):
        save(run, step)
    DAMAGE["checksum mismatch"](run.checkpoints_dir / "step_00000004")
    assert steps(run.checkpoints_to_average(2)) == [6]
    assert capsys.readouterr().err == (f"[headmix] warning: checkpoint {run.checkpoints_dir / 'step_00000004'} is "
                                       f"damaged: {WHY['checksum mismatch']}; left out of the average\n")
    assert steps(run.checkpoints_to_average(3, up_to_step=4)) == [2]


def test_average_is_the_mean_of_the_weights(run):
    for step in (2, 4, 9):
        save(run, step)
    avg = average_checkpoints(run.checkpoints_to_average(3))
    assert torch.equal(avg["emb.weight"], torch.full((5, 3), 5.0)) and "out.weight" not in avg


# ------------------------------------------------------------------------------------------------ metrics

def test_truncate_metrics_drops_replayed_steps_and_a_torn_line(run):
    lines = [json.dumps({"split": "train", "step": s, "loss": 1.0 / s}) for s in range(2, 11, 2)]
    lines.insert(3, json.dumps({"split": "valid", "step": 6, "loss": 0.5}))
    run.metrics_path.write_text("\n".join(lines) + '\n{"split": "train", "st')
    assert run.truncate_metrics(6) == 3  # steps 8, 10 and the torn line
    records = [json.loads(l) for l in run.metrics_path.read_text().splitlines()]
    assert [(r["split"], r["step"]) for r in records] == [("train", 2), ("train", 4), ("train", 6), ("valid", 6)]
    inode = run.metrics_path.stat().st_ino
    assert run.truncate_metrics(6) == 0 and run.metrics_path.stat().st_ino == inode  # nothing to drop: untouched
    assert not leftovers(run.path)


def test_truncate_metrics_drops_what_was_written_after_the_checkpoint(run):
    """A finished run run again: the final records came after the final checkpoint, at the same step."""
    run.metrics_path.write_text("".join(json.dumps({"split": "train", "step": s}) + "\n" for s in (2, 4, 6)))
    save(run, 6, reason="final")
    assert json.loads((run.checkpoints_dir / "step_00000006" / "state.json").read_text())["metrics_lines"] == 3
    with run.metrics_path.open("a") as f:
        f.write(json.dumps({"split": "valid", "step": 6, "averaged": 2}) + "\n")
    assert run.truncate_metrics(6) == 1
    assert [json.loads(l)["step"] for l in run.metrics_path.read_text().splitlines()] == [2, 4, 6]


# ------------------------------------------------------------------------------------------------ final files, load_run

@pytest.fixture
def finished(run):
    torch.manual_seed(0)
    model = build_model(get_config("tiny-mha", task="lm", vocab_size=270))
    tok = train_tokenizer(["in the beginning was the word"] * 5, vocab_size=270)
    old = os.umask(0o077)
    try:
        run.save_tokenizer(tok)
        run.save_final_model(model)
        run.write_summary({"steps": 3})
    finally:
        os.umask(old)
    return run, model


def test_final_files_are_written_with_mode_0644(finished):
    """Every file of a run, the weights of its checkpoints and its final model included, has mode 0644 (the
    writers that create their own files, safetensors' among them, use 0600)."""
    run, model = finished
    for path in (run.model_path, run.model_config_path, run.summary_path):
        assert oct(path.stat().st_mode & 0o777) == "0o644", path
    assert sorted(p.name for p in run.path.iterdir()) == [".lock", "config.json", "model.safetensors", "summary.json",
                                                          "tokenizer", "train_config.json"]
    old = os.umask(0o022)
    try:
        run.save_checkpoint(3, model, {"step": 3}, {"metrics_lines": 0}, keep=None, reason="periodic")
    finally:
        os.umask(old)
    checkpoint = [p for p in run.checkpoints_dir.rglob("*") if p.is_file()]
    assert "model.safetensors" in {p.name for p in checkpoint}
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in checkpoint} == {p.name: "0o644" for p in checkpoint}
    assert json.loads(run.summary_path.read_text()) == {"steps": 3}


def test_load_run_gives_model_tokenizer_and_config(finished):
    run, model = finished
    loaded = load_run(run.path)
    assert not loaded.model.training and loaded.task == "lm" and loaded.path == run.path
    assert loaded.train_config["preset"] == "tiny-moa" and "content_sha256" not in loaded.train_config
    assert loaded.tokenizer.vocab_size == run.load_tokenizer().vocab_size
    expected = model.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.model.state_dict().items())


def test_load_run_errors_name_the_file(finished, tmp_path):
    run, _ = finished
    with pytest.raises(RunError, match=f"run folder not found: {tmp_path / 'nope'}"):
        load_run(tmp_path / "nope")
    with pytest.raises(RunError, match="is a file, expected a run folder"):
        load_run(run.summary_path)
    (run.tokenizer_dir / "tokenizer.json").write_text("{")
    with pytest.raises(RunError, match=r"tokenizer/tokenizer.json is damaged \(Exception: "):
        load_run(run.path)
    run.model_config_path.write_text("not json")
    with pytest.raises(RunError, match="config.json is damaged"):
        load_run(run.path)
    run.model_path.unlink()
    with pytest.raises(FileNotFoundError, match=r"model.safetensors not found: .* is not a finished headmix run"):
        load_run(run.path)


def test_a_damaged_final_model_names_the_command_that_rebuilds_it(finished):
    run, _ = finished
    _truncate(run.model_path)
    with pytest.raises(RunError, match=r"model.safetensors is damaged \(.*\); the run has no intact checkpoint"):
        load_run(run.path)
    save(run, 4)
    with pytest.raises(RunError, match=rf"model.safetensors is damaged \(.*\); its intact checkpoints \(newest "
                                       rf"step_00000004\) can rebuild it: run the same `headmix train` command "
                                       rf"with --out {run.path} again$"):
        load_run(run.path)


def _imported_modules(module: str) -> set[str]:
    """The headmix modules ``module`` imports, directly or through others (read from the sources, so
    imports inside functions count too)."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = SRC.joinpath(*name.split("."))
        file = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if not file.is_file():
            continue
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                todo += [".".join(parts[:i]) for i in range(1, len(parts) + 1) if parts[0] == "headmix"]
    return seen


def test_the_run_layer_does_not_import_the_trainer():
    reached = _imported_modules("headmix.runs")
    assert {"headmix.runs.load", "headmix.models", "headmix.data.tokenizer"} <= reached  # the walk follows imports
    assert not [m for m in reached if m.startswith("headmix.training")]
