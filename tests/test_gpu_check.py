"""``benchmarks/gpu_check.sh quick|full1|full2|compute`` at ``--tiny`` on the CPU (the plumbing of the GPU check: every
step runs, rows come out as they are measured, each part writes its JSON summary beside its logs), the header's
time estimates against the steps' own limits, a step stopped at its limit keeping its rows, and the fold of the
parts found in a folder into docs/performance.md."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from headmix.bench import gpu_check
from headmix.bench.kinds import KINDS

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def test_header_estimates_are_the_sums_of_the_limits_and_fit_a_job():
    header = SCRIPT.read_text()
    for part in gpu_check.PARTS:
        match = re.search(rf"{part} \(at most (\d+) s", header)
        assert match, f"{part}: no estimate in the header"
        assert int(match.group(1)) == gpu_check.budget_s(part) <= gpu_check.PART_LIMITS[part]
    assert gpu_check.PART_LIMITS["quick"] <= 420 and max(gpu_check.PART_LIMITS.values()) <= 480


def run_script(part: str, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", str(SCRIPT), part, "--tiny", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def quick_check(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = run_script("quick", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_quick_runs_tiny_and_names_every_attention_kind(quick_check):
    summary = json.loads((quick_check / "quick.json").read_text())
    assert summary["part"] == "quick" and summary["tiny"] is True and summary["machine"]["torch"]
    assert [s["name"] for s in summary["steps"]] == ["layers", "models", "decode", "gqe"]
    steps = {s["name"]: s for s in summary["steps"]}
    # the paper's GQE against GQA with all its query heads: fwd+bwd and the prefill, each with its ratio
    gqe = {(r["timed"], r["layer"]): r for r in steps["gqe"]["rows"][0]}
    assert set(gqe) == {(what, layer) for what in ("fwd+bwd 1x8", "prefill 1x8")
                        for layer in ("GQA 16 heads", "GQE 16E on 8 K/V, top 1")}
    assert gqe[("prefill 1x8", "GQA 16 heads")]["/ GQA"] == "1.000"
    for step in steps.values():
        assert step["status"] == "ok", step
        assert (quick_check / step["log"]).is_file()
    layers = {r["layer"]: r for r in steps["layers"]["rows"][0]}
    assert layers["torch SDPA MHA"]["x torch SDPA MHA"] == "1.00"
    for kind in KINDS:
        assert kind.name in layers, kind.name
        row = layers[kind.name]
        if kind.needs:  # the Triton rows: left out with why on a CPU without the interpreter
            assert "needs Triton" in row["wall ms"], row
        else:
            assert float(row["wall ms"]) > 0 and int(row["kernels per step"]) > 0, row
    assert "HF JetMoeAttention (sdpa, peer of MoA)" in layers
    models = {r["attention"]: r for r in steps["models"]["rows"][0]}
    decode = [{r["attention"]: r for r in table} for table in steps["decode"]["rows"]]
    for kind in KINDS:
        if kind.needs:
            continue
        assert float(models[kind.name]["ms / step"]) > 0, kind.name
        assert [table[kind.name]["batch"] for table in decode] == ["1", "2"], kind.name
        assert float(decode[0][kind.name]["tokens/s"]) > 0
    assert models["MHA"]["x MHA"] == "1.00" and decode[1]["MHA"]["x MHA"] == "1.00"


def test_a_step_stopped_at_its_limit_keeps_the_rows_it_printed(tmp_path):
    script = "import time\nprint('| a | b |', flush=True)\nprint('|---|---|', flush=True)\n" \
             "print('| 1 | 2 |', flush=True)\ntime.sleep(60)\n"
    log = tmp_path / "step.log"
    status, text = gpu_check._run_streaming([sys.executable, "-c", script], dict(os.environ), log, limit_s=3)
    assert status == "timed out after 3 s"
    assert log.read_text() == text == "| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert gpu_check.table_records(gpu_check.markdown_tables(text)[0]) == [{"a": "1", "b": "2"}]


def test_a_warning_between_rows_does_not_split_a_table_and_a_new_header_starts_one():
    """A step's stderr is interleaved with its tables (seen on an H200: the profiler's warning after a header)."""
    text = ("| a | b |\n|---|---|\n/x/profiler.py:224: UserWarning: Profiler clears events\n  _warn_once(\n"
            "| 1 | 2 |\n| - | - |\n| c |\n|---|\n| 5 |\n\n| d |\n|:--:|\n| 6 |\n")
    tables = gpu_check.markdown_tables(text)
    assert [gpu_check.table_records(t) for t in tables] == [[{"a": "1", "b": "2"}, {"a": "-", "b": "-"}],
                                                          [{"c": "5"}], [{"d": "6"}]]


def test_fold_reads_each_steps_tables_again_from_its_log(tmp_path):
    summary = {"part": "quick", "tiny": False, "machine": {"device": "GPU"}, "commit": "abc", "started": "now",
               "budget_s": 1, "seconds": 1, "steps": [{"name": "layers", "status": "ok", "seconds": 1, "limit_s": 1,
                                                         "log": "quick-layers.log", "tables": [["| stale |"]]}]}
    (tmp_path / "quick.json").write_text(json.dumps(summary))
    (tmp_path / "quick-layers.log").write_text("| a |\n|---|\nUserWarning: noise\n| 1 |\n")
    doc = tmp_path / "performance.md"
    doc.write_text("# page\n")
    gpu_check.fold(tmp_path, doc)
    assert "| a |\n|---|\n| 1 |" in doc.read_text() and "stale" not in doc.read_text()


def test_fold_writes_each_part_once_keeps_the_others_and_refuses_tiny_runs(quick_check, tmp_path):
    doc = tmp_path / "performance.md"
    shutil.copy(ROOT / "docs" / "performance.md", doc)
    before = doc.read_text()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-m", "headmix.bench.gpu_check", "fold", str(quick_check), "--doc", str(doc)],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 2 and "is a --tiny run" in proc.stderr and doc.read_text() == before
    for _ in range(2):  # a second fold replaces the first
        section = gpu_check.fold(quick_check, doc, allow_tiny=True)
    text = doc.read_text()
    begin, end = gpu_check.markers("quick")
    assert text.count(begin) == 1 and text.count(end) == 1 and section in text
    commit = json.loads((quick_check / "quick.json").read_text())["commit"]
    assert "`gpu_check.sh quick` on cpu" in section and f"at commit {commit}" in section
    assert "| MoA dense | 8K32E8D |" in section
    # another part folded later (another machine loan) goes beside it and leaves quick's section as it was
    other = tmp_path / "other"
    other.mkdir()
    summary = json.loads((quick_check / "quick.json").read_text())
    summary.update(part="full1", steps=summary["steps"][:1])
    (other / "full1.json").write_text(json.dumps(summary))
    gpu_check.fold(other, doc, allow_tiny=True)
    after = doc.read_text()
    assert section in after and gpu_check.markers("full1")[0] in after and after.count(gpu_check.BEGIN) <= 1
    with pytest.raises(ValueError, match="none in"):
        gpu_check.fold(tmp_path / "empty", doc, allow_tiny=True)


#: The full parts and the compute part at --tiny: 8 subprocesses, each importing torch (minutes on the shared 2-core machine).
@pytest.mark.slow
@pytest.mark.parametrize("part", ["full1", "full2", "compute"])
def test_full_parts_run_tiny(part, tmp_path):
    proc = run_script(part, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / f"{part}.json").read_text())
    assert [s["name"] for s in summary["steps"]] == [s.name for s in gpu_check.STEPS[part]]
    assert all(s["status"] == "ok" for s in summary["steps"]), summary["steps"]
