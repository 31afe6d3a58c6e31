"""Many workers, one study; a study in commands of a time budget. Two ``headmix study`` processes on one tiny
CPU study train every run exactly once and write the report a single worker writes; a study stopped by its time
budget (on a simulated clock) continues in the next command and ends as an uncut one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from headmix.data import load_embedded_documents, write_jsonl_documents

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("workers")
    docs = folder / "docs.jsonl"
    write_jsonl_documents(load_embedded_documents(sources="kjv-bible")[:60], docs)
    spec = dict(name="tiny", task="lm", baseline="tiny-mha", data=[str(docs)], seeds=[1, 2], max_steps=4,
                timing_rounds=6, timing_steps=1, timing_warmup=1,
                rows=[{"name": "MHA"}, {"name": "MoA", "attention": {"kind": "moa", "num_experts": 4, "top_k": 2},
                                         "solve": ["head_dim"], "prefer": {"head_dim": 16}}],
                training={"max_len": 32, "max_tokens": 600, "vocab_size": 300, "warmup_steps": 2, "eval_every": 2,
                          "log_every": 2, "save_every": 2, "average_last": 1, "keep_checkpoints": 2,
                          "valid_size": 0.05, "test_size": 0.05})
    path = folder / "tiny.json"
    path.write_text(json.dumps(spec))
    return path


def _study(spec_file: Path, out: Path, *extra: str) -> list[str]:
    return ["study", str(spec_file), "--out", str(out), "--device", "cpu", "--no-progress", *extra]


@pytest.fixture(scope="module")
def single_worker(spec_file, tmp_path_factory) -> Path:
    """The tiny study run by one worker, uncut: the reference."""
    from headmix.cli.main import main

    out = tmp_path_factory.mktemp("single") / "study"
    assert main(_study(spec_file, out)) == 0
    return out


def _comparable(out: Path) -> dict:
    """results.json without what depends on timing (tokens/s, wall-clock, the measured step-time ratios)."""
    table = json.loads((out / "results.json").read_text())
    for key in ("curve_times", "machine", "machines_differ"):
        table.pop(key)
    for row in table["rows"]:
        for key in ("equal_time", "equal_time_interleaved", "machines"):
            row.pop(key)
        for key in ("train_seconds", "tokens_per_second"):
            row["metrics"].pop(key)
    return table


@pytest.mark.slow  # two processes, each importing torch: about 40 s on the loaded 2-core machine
def test_two_workers_run_every_run_once_and_write_one_report(spec_file, single_worker, tmp_path):
    out = tmp_path / "study"
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    code = "import sys; from headmix.cli.main import main; raise SystemExit(main(sys.argv[1:]))"
    workers = [subprocess.Popen([sys.executable, "-c", code, *_study(spec_file, out)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    logs = []
    for w in workers:
        stdout, stderr = w.communicate(timeout=300)
        assert w.returncode == 0, stderr[-2000:]
        logs.append(stderr)
    text = "\n".join(logs)
    trained = sorted(line.split("training ", 1)[1] for line in text.splitlines() if "] study tiny: training " in line)
    assert trained == ["'MHA' seed 1", "'MHA' seed 2", "'MoA' seed 1", "'MoA' seed 2"]  # each run exactly once
    assert text.count("timing 'MoA' against 'MHA'") == 1
    assert text.count("the complete report is written") == 1
    record = json.loads((out / "timing" / "MoA.json").read_text())
    assert len(record["rounds"]) == 6 and record["machine"]["device_type"] == "cpu"
    assert set(record["software"]) == {"headmix", "torch", "python"}
    assert record["study_workers_excluded"] is True  # timed holding the study's machine lock alone
    assert _comparable(out) == _comparable(single_worker)
    # a worker started on the finished study trains nothing and leaves the complete report as it is
    from headmix.cli.main import main

    before = {p.name: p.read_bytes() for p in out.glob("results.*")}
    stamp = (out / "results.json").stat().st_mtime_ns
    assert main(_study(spec_file, out)) == 0
    assert (out / "results.json").stat().st_mtime_ns == stamp
    assert {p.name: p.read_bytes() for p in out.glob("results.*")} == before


def test_a_run_held_by_another_worker_is_skipped(spec_file, tmp_path):
    from headmix.runs.lock import RunLock
    from headmix.study import get_study, run_study
    from headmix.study.runner import CLAIMS_DIR

    spec = get_study(str(spec_file))
    spec.seeds = [1]
    out = tmp_path / "study"
    (out / CLAIMS_DIR).mkdir(parents=True)
    held = RunLock(out / CLAIMS_DIR, "run-MoA-seed-1.lock")  # another worker's claim (a lock of this process)
    held.acquire()
    try:
        messages = []
        results = run_study(spec, out, log=messages.append)
    finally:
        held.release()
    assert [(r.row, r.seed) for r in results] == [("MHA", 1)]
    assert any("'MoA' seed 1 is taken by another worker" in m for m in messages)
    assert not (out / "runs" / "MoA" / "seed-1").exists()
    # the next worker trains the run left over, and only it; the complete report is then written once
    from headmix.study import plan
    from headmix.study.report import update_report

    messages.clear()
    reports = []
    results = run_study(spec, out, log=messages.append,
                        on_result=lambda r: reports.append(update_report(spec, plan(spec), out, log=messages.append)))
    assert [m for m in messages if "training" in m] == ["study tiny: training 'MoA' seed 1"]
    assert len(results) == 2 and sum(m.endswith("the complete report is written (" + str(out / "results.md") + ")")
                                     for m in messages) == 1
    assert reports[-1] is None and json.loads((out / "results.json").read_text())["complete"] is True
    assert update_report(spec, plan(spec), out, log=messages.append) is None
    # a row timed again (the same runs) changes the equal-time table: the complete report is written anew
    from headmix.study.timing import read_timing, write_timing

    record = read_timing(out, "MoA")
    assert record is not None
    write_timing(out, "MoA", {**record, "measured_at": "2030-01-01T00:00:00Z"})
    assert update_report(spec, plan(spec), out, log=messages.append) is not None
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert rows[1]["equal_time_interleaved"]["timing"]["measured_at"] == "2030-01-01T00:00:00Z"
    assert update_report(spec, plan(spec), out, log=messages.append) is None


def test_time_budget_stops_between_steps_and_reserves_time():
    now = [0.0]
    check = __import__("headmix.study.runner", fromlist=["with_time_budget"]).with_time_budget(
        None, 100.0, 30.0, clock=lambda: now[0])
    now[0] = 69.9
    assert check() is None
    now[0] = 70.0
    assert check() == "time budget"
    signals = __import__("headmix.study.runner", fromlist=["with_time_budget"]).with_time_budget(
        lambda: "signal 15", None, 60.0)
    assert signals() == "signal 15"
    from headmix.study.runner import with_time_budget

    for budget, reserve, name in ((0.0, 0.0, "time_budget"), (60.0, 60.0, "time_reserve"), (None, -1, "time_reserve")):
        with pytest.raises(ValueError, match=name):
            with_time_budget(None, budget, reserve)


def test_a_study_in_commands_of_a_time_budget_ends_as_an_uncut_one(spec_file, single_worker, tmp_path, monkeypatch):
    """Each command's clock advances one simulated second per poll (every training step, before every run and
    timing): with a budget of 12 and a reserve of 2 a command stops after 10 polls, saves its run's checkpoint
    and exits with 75; the same command continues. The last one finishes the study as one uncut worker did."""
    from headmix.cli.main import main
    from headmix.study import runner

    ticks = [0.0]

    def monotonic():
        ticks[0] += 1.0
        return ticks[0]

    monkeypatch.setattr(runner, "time", SimpleNamespace(monotonic=monotonic))
    out = tmp_path / "study"
    codes, interrupted = [], set()
    for _ in range(10):
        codes.append(main(_study(spec_file, out, "--time-budget", "12", "--time-reserve", "2")))
        interrupted |= {str(c.relative_to(out)) for c in out.glob("runs/*/seed-*/checkpoints/step_*")
                        if json.loads((c / "state.json").read_text())["reason"] == "time budget"}
        if codes[-1] == 0:
            break
    assert codes[-1] == 0 and len(codes) >= 3 and set(codes[:-1]) == {75}
    assert interrupted  # a run was cut by the budget (its checkpoint) and resumed by the next command
    assert _comparable(out) == _comparable(single_worker)


def test_no_two_workers_time_at_once_and_none_trains_while_one_times(tmp_path):
    """The study's machine lock (threads stand for workers: each takes its own ``flock``): trainers share it,
    a timer waits for them and holds it alone, a second timer waits for the first, and a trainer that arrives
    while a timer waits does not overtake it."""
    import threading
    import time

    from headmix.study.runner import machine_turn

    events: list[tuple[str, str]] = []
    noted = threading.Condition()
    release = threading.Event()

    def note(name: str, what: str) -> None:
        with noted:
            events.append((name, what))
            noted.notify_all()

    def until(name: str, what: str) -> None:
        with noted:
            assert noted.wait_for(lambda: (name, what) in events, timeout=30), (name, what, events)

    def worker(name: str, exclusive: bool) -> None:
        with machine_turn(tmp_path, exclusive=exclusive, poll=0.01, waiting=lambda: note(name, "waits")) as turn:
            assert turn
            note(name, "in")
            if name in ("train-1", "train-2"):
                release.wait(30)
            else:
                time.sleep(0.05)
            note(name, "out")

    threads = {}
    for name, exclusive in (("train-1", False), ("train-2", False), ("time-1", True), ("time-2", True),
                            ("train-3", False)):
        threads[name] = threading.Thread(target=worker, args=(name, exclusive))
        threads[name].start()
        until(name, "in" if name == "train-2" or name == "train-1" else "waits")
    assert ("train-1", "out") not in events  # two trainers share the machine
    release.set()
    for thread in threads.values():
        thread.join(30)
    assert all((name, "out") in events for name in threads), events
    order = [f"{n} {w}" for n, w in events if w != "waits"]
    for timer in ("time-1", "time-2"):  # nothing else in the machine while a timer is in
        inside = order[order.index(f"{timer} in") + 1:order.index(f"{timer} out")]
        assert inside == [], (timer, order)
    assert order.index("time-1 in") < order.index("train-3 in")  # the waiting timer is not overtaken

    # a worker stopped while it waits for its turn gets no turn (in a thread: a wait that ignored the stop would
    # never end)
    turns = []

    def stopped_timer() -> None:
        with machine_turn(tmp_path, exclusive=True, stop=lambda: "signal 15", poll=0.01) as turn:
            turns.append(turn)

    with machine_turn(tmp_path, exclusive=False):
        waiter = threading.Thread(target=stopped_timer, daemon=True)
        waiter.start()
        waiter.join(10)
    assert turns == [False]


def test_a_row_is_timed_with_the_study_to_itself_and_the_report_says_so(spec_file, tmp_path):
    """A worker that finds another training waits before timing (stopped while it waits, it times nothing);
    the timing record says the study's other workers were excluded and gives the load average; the report
    states each row's conditions, and a record written before the lock (no such field) still loads and is
    marked as taken under unknown load."""
    from headmix.study import get_study, run_study
    from headmix.study.report import interleaved_markdown, timing_conditions
    from headmix.study.runner import machine_turn
    from headmix.study.timing import read_timing, timing_path

    spec = get_study(str(spec_file))
    spec.seeds = [1]
    out = tmp_path / "study"
    out.mkdir()
    messages: list[str] = []
    polls = []

    def stop_after_three():
        polls.append(1)
        return "signal 15" if len(polls) > 3 else None

    with machine_turn(out, exclusive=False):  # another worker training
        run_study(spec, out, log=messages.append, stop=stop_after_three)
    assert any("waiting for the other workers of the study to finish training or timing before timing 'MoA'" in m
               for m in messages)
    assert not timing_path(out, "MoA").exists() and not (out / "runs").exists()

    # alone: timed (and stopped before training, once the record is there)
    run_study(spec, out, log=messages.append, stop=lambda: "done" if timing_path(out, "MoA").exists() else None)
    record = read_timing(out, "MoA")
    assert record["study_workers_excluded"] is True
    assert len(record["load_average"]) == 2 and all(isinstance(v, float) for v in record["load_average"])
    from headmix.process import freed_memory_kept

    # whether this process keeps freed memory (an earlier test in it may have run the headmix command)
    assert record["freed_memory"] == ("kept" if freed_memory_kept() else "returned")
    freed = {"kept": "kept (headmix.keep_freed_memory)",
             "returned": "returned to the system (glibc's default)"}[record["freed_memory"]]
    from headmix.provenance import source_commit

    assert record["software"]["commit"] == source_commit()  # which code was timed
    assert timing_conditions(record) == (f"no other worker of the study training or timing, load average "
                                         f"{record['load_average'][0]:.2f} before and "
                                         f"{record['load_average'][1]:.2f} after, freed memory {freed}, code at "
                                         f"{source_commit()}")
    old = {k: v for k, v in record.items() if k not in ("study_workers_excluded", "load_average", "freed_memory")}
    old["software"] = {k: v for k, v in record["software"].items() if k != "commit"}
    timing_path(out, "MoA").write_text(json.dumps(old))
    assert read_timing(out, "MoA") == old
    assert timing_conditions(old) == ("other workers of the study not excluded (not recorded: one may have been "
                                      "training or timing)")
    row = {"ratio": 1.1, "low": 1.0, "high": 1.2, "row_step": {}, "baseline_step": {}, "summary": None,
           "vs_baseline": None, "delta_at_interval_ends": None}
    lines = interleaved_markdown({"baseline": "MHA", "rows": [
        {"name": "MHA", "equal_time_interleaved": {**row, "ratio": 1.0}},
        {"name": "MoA", "equal_time_interleaved": {**row, "timing": record}},
        {"name": "Old", "equal_time_interleaved": {**row, "timing": old}}]})
    assert lines[-1].startswith("Step times measured (interleaved in one process")
    assert f"compile False, {record['measured_at']}, no other worker of the study training or timing, " \
           f"load average" in lines[-1]
    assert lines[-1].endswith(f"{record['measured_at']}, other workers of the study not excluded (not recorded: one "
                              f"may have been training or timing).")


def test_the_study_command_keeps_freed_memory_and_its_timings_say_so(monkeypatch):
    """``headmix study`` trains and times models: like ``train``, it keeps freed memory
    (:func:`headmix.keep_freed_memory`; without it a CPU step page-faults its activations back in: half of a study
    run's CPU time was system time); a timing made so says it in the report's conditions."""
    import headmix.cli.main as cli
    from headmix.study.report import timing_conditions

    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append(1) or True)
    assert cli.main(["study", "--list"]) == 0 and calls == [1]
    assert cli.main(["macs", "--help"]) == 0 and calls == [1]  # a command that trains nothing leaves it
    kept = {"study_workers_excluded": True, "load_average": [0.5, 0.75], "freed_memory": "kept"}
    assert timing_conditions(kept) == ("no other worker of the study training or timing, load average 0.50 before "
                                       "and 0.75 after, freed memory kept (headmix.keep_freed_memory)")


def test_freed_memory_kept_says_whether_the_setting_was_made():
    import subprocess
    import sys

    code = ("import headmix; from headmix.process import freed_memory_kept; before = freed_memory_kept(); "
            "made = headmix.keep_freed_memory(); print(before, made, freed_memory_kept())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True", "True"]  # glibc on Linux, as on the machines the suite runs on
