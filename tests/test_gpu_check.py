"""``benchmarks/gpu_check.sh part1|part2`` at ``--tiny`` on the CPU (the plumbing of the two-part GPU check: every
step runs, each part writes its JSON summary beside its logs), the header's time estimates against the steps'
own limits, and the fold of a finished check into docs/performance.md."""

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

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def test_header_estimates_are_the_sums_of_the_limits_and_fit_a_job():
    header = SCRIPT.read_text()
    for part in gpu_check.PARTS:
        match = re.search(rf"{part} \(at most (\d+) s", header)
        assert match, f"{part}: no estimate in the header"
        assert int(match.group(1)) == gpu_check.budget_s(part) <= gpu_check.PART_LIMIT_S


#: Both parts at --tiny: 11 subprocesses, each importing torch (about a minute of CPU; 8 minutes on the shared
#: 2-core machine at load 17).
TINY_RUN = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_check(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, PYTHON=sys.executable)
    for part in gpu_check.PARTS:
        proc = subprocess.run(["bash", str(SCRIPT), part, "--tiny", "--out", str(out)], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@TINY_RUN
def test_both_parts_run_tiny_and_write_their_summaries(tiny_check):
    for part in gpu_check.PARTS:
        summary = json.loads((tiny_check / f"{part}.json").read_text())
        assert summary["part"] == part and summary["tiny"] is True
        assert [s["name"] for s in summary["steps"]] == [s.name for s in gpu_check.STEPS[part]]
        for step in summary["steps"]:
            assert step["status"] == "ok", step
            assert (tiny_check / step["log"]).is_file()
        assert summary["machine"]["torch"] and summary["budget_s"] == gpu_check.budget_s(part)
    layers = json.loads((tiny_check / "part1.json").read_text())["steps"][1]
    assert any("grouped grouped_mm" in line for table in layers["tables"] for line in table)


@TINY_RUN
def test_fold_writes_the_summaries_once_and_refuses_tiny_runs(tiny_check, tmp_path):
    doc = tmp_path / "performance.md"
    shutil.copy(ROOT / "docs" / "performance.md", doc)
    before = doc.read_text()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-m", "headmix.bench.gpu_check", "fold", str(tiny_check), "--doc", str(doc)],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 2 and "is a --tiny run" in proc.stderr and doc.read_text() == before
    for _ in range(2):  # a second fold replaces the first
        section = gpu_check.fold(tiny_check, doc, allow_tiny=True)
    text = doc.read_text()
    assert text.count(gpu_check.BEGIN) == 1 and section in text and text.startswith(before.rstrip("\n"))
    commit = json.loads((tiny_check / "part1.json").read_text())["commit"]
    assert f"`gpu_check.sh part1` on cpu" in section and f"at commit {commit}" in section
    with pytest.raises(ValueError, match="out must hold a finished check's part2.json"):
        (tiny_check / "part2.json").rename(tmp_path / "moved.json")
        try:
            gpu_check.fold(tiny_check, doc, allow_tiny=True)
        finally:
            (tmp_path / "moved.json").rename(tiny_check / "part2.json")
