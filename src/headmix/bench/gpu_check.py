"""The GPU check: ``quick`` (one 10-minute job, at most 7 minutes by its steps' limits) and ``full1`` / ``full2``
(the rest, at most 8 minutes each), run by ``benchmarks/gpu_check.sh``, and the fold of whatever parts finished
into ``docs/performance.md``.

* ``quick``: eager, bf16 on CUDA, every number against a baseline measured in the same process:
  the layer table (:mod:`headmix.bench.gpu_layers`: every attention kind of :mod:`headmix.bench.kinds` and HF
  ``JetMoeAttention``, one fwd+bwd at 16 x 2048, d_model 512, causal, against torch SDPA multi-head attention:
  wall ms, ratio, GPU-busy ms, kernels per step, peak memory), a Llama-style training step per attention kind
  against MHA, greedy decoding tokens/s at batch 1 and 8 (:mod:`headmix.bench.quick`), and the paper's GQE on
  the slot path against GQA with all its query heads, fwd+bwd at T 4096 and 8192 and prefill at T 8192, eager
  and compiled, with GPU-busy ms, kernels and a host-sync check (:mod:`headmix.bench.gqe`). Triton runs its
  default configuration (no autotuning).
* ``full1``: the ``gpu``-marked tests, the grouped-projection table with Triton autotuning, the grouped-query
  curve (``headmix bench gqa``);
* ``compute``: the time-beside-compute table (:mod:`headmix.bench.compute`) in bf16 at d_model 2048, T 4096:
  every routed kind's GPU-busy time and kernels over its dense baseline's beside its minimal MAC ratio, eager
  (with profiles of the rows furthest off) and compiled;
* ``full2``: compiled model steps (``headmix bench models --compile``), decoding with the static cache and
  CUDA graphs (``headmix bench decode``), the MoA / MoH curves (``headmix bench attention --moh-curve``).

Every step runs under its own time limit (:data:`STEPS`, seconds); a part's limits add up to at most its
:data:`PART_LIMITS` entry, which the script's header states. A step's output is written to
``OUT/<part>-<step>.log`` line by line as it comes (rows are printed as they are measured, so a step stopped at
its limit keeps what it measured), and ``OUT/<part>.json`` is rewritten after every step: machine, commit, per
step its status, seconds, limit, the markdown tables it printed and their rows as records. ``fold OUT`` writes
every part found there into ``docs/performance.md`` between :data:`BEGIN` and :data:`END` (a check run with
``--tiny`` on a CPU is refused: its numbers say nothing about a GPU).

    python -m headmix.bench.gpu_check quick [--tiny] [--out runs/gpu_check]
    python -m headmix.bench.gpu_check fold runs/gpu_check [--doc docs/performance.md]
    python -m headmix.bench.gpu_check budget quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..storage.files import atomic_write, atomic_write_json
from ..provenance import source_commit

PARTS = ("quick", "full1", "full2", "compute")
#: The most seconds each part's steps may take: quick fits one 10-minute job with the machine's start and the
#: copies; each full part fits one job too.
PART_LIMITS = {"quick": 420, "full1": 480, "full2": 480, "compute": 480}
BEGIN, END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"

CLI = ["-m", "headmix.cli.main"]
NO_AUTOTUNE = (("HEADMIX_TRITON_AUTOTUNE", "0"),)


@dataclass(frozen=True)
class Step:
    """One command of a part: ``full`` on a GPU, ``tiny`` on the CPU (the suite's check of the plumbing)."""

    name: str
    limit_s: int
    full: list[str]
    tiny: list[str]
    env: tuple[tuple[str, str], ...] = ()


STEPS: dict[str, list[Step]] = {
    "quick": [
        Step("layers", 100, ["-m", "headmix.bench.gpu_layers", "--skip-grouped"],
             ["-m", "headmix.bench.gpu_layers", "--skip-grouped", "--tiny", "--device", "cpu", "--no-triton"],
             env=NO_AUTOTUNE),
        Step("models", 80, ["-m", "headmix.bench.quick", "models", "--device", "cuda"],
             ["-m", "headmix.bench.quick", "models", "--tiny", "--device", "cpu"], env=NO_AUTOTUNE),
        # 32 new tokens, 3 repeats: eager decoding at batch 1 is launch-bound (138 tokens/s for MHA on an H200,
        # 2026-11-28), and 64 tokens x 5 repeats measured only 10 of its 28 rows in 90 s there
        Step("decode", 160, ["-m", "headmix.bench.quick", "decode", "--device", "cuda", "--steps", "32",
                             "--repeats", "3"],
             ["-m", "headmix.bench.quick", "decode", "--tiny", "--device", "cpu"], env=NO_AUTOTUNE),
        # the paper's GQE on the slot path against GQA with all 16 query heads, bf16: fwd+bwd at T 4096 and 8192
        # and the prefill at T 8192 (the paper's 1.7-1.8x faster prefill is the anchor), eager and compiled,
        # GPU-busy ms and kernels; a compiled step under set_sync_debug_mode("error") (35 s at T 4096 alone on
        # an H200)
        Step("gqe", 80, [*CLI, "bench", "gqe", "--device", "cuda", "--seqs", "4096", "8192", "--prefill-seq", "8192",
                         "--repeats", "5"],
             [*CLI, "bench", "gqe", "--device", "cpu", "--embed-dim", "32", "--seqs", "8", "--prefill-seq", "8",
              "--repeats", "1", "--warmup", "0", "--modes", "eager"]),
    ],
    "full1": [
        # one kernel configuration: autotuning every test's sizes would take minutes
        Step("tests", 240, ["-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q", "tests/test_gpu.py",
                            "tests/test_kernels_grouped_mm.py"],
             ["-m", "pytest", "-p", "no:cacheprovider", "-q", "tests/test_kernels_grouped_mm.py", "-k",
              "known_values"], env=NO_AUTOTUNE),
        # the first run autotunes the Triton kernels (Triton keeps the choices in its cache)
        Step("grouped", 150, ["-m", "headmix.bench.gpu_layers", "--skip-layers"],
             ["-m", "headmix.bench.gpu_layers", "--skip-layers", "--tiny", "--device", "cpu", "--no-triton"]),
        # the GQE curve: grouped MHA against SDPA enable_gqa, GQE (half of each group's routed heads) against
        # grouped MHA (fwd+bwd and prefill), the gates and QK-norm
        Step("gqa", 60, [*CLI, "bench", "gqa", "--device", "cuda", "--batch", "8", "--seq", "2048",
                         "--prefill-seq", "8192", "--repeats", "5"],
             [*CLI, "bench", "gqa", "--device", "cpu", "--embed-dim", "32", "--heads", "4", "--kv-heads", "2",
              "--batch", "1", "--seq", "8", "--prefill-seq", "8", "--repeats", "1", "--warmup", "0"]),
    ],
    "full2": [
        Step("models_compiled", 180, [*CLI, "bench", "models", "--presets", "llama-mini-mha", "llama-mini-moa",
                                      "llama-mini-moh", "llama-mini-switchhead", "--device", "cuda", "--compile",
                                      "--lm-batch", "16", "--lm-len", "512", "--repeats", "10"],
             [*CLI, "bench", "models", "--presets", "llama-tiny-mha", "llama-tiny-moa", "--device", "cpu",
              "--lm-batch", "1", "--lm-len", "8", "--repeats", "1", "--warmup", "0"]),
        Step("decode_graphs", 120, [*CLI, "bench", "decode", "--presets", "llama-mini-mha", "llama-mini-moa",
                                    "llama-mini-moh", "llama-mini-switchhead", "--device", "cuda", "--batches", "1",
                                    "8", "--prompt", "128", "--steps", "64", "--repeats", "5"],
             [*CLI, "bench", "decode", "--presets", "tiny-mha", "--device", "cpu", "--batches", "1", "--prompt",
              "4", "--steps", "2", "--repeats", "1", "--modes", "eager"]),
        Step("attention_moh", 150, [*CLI, "bench", "attention", "--device", "cuda", "--batch-tokens", "32768",
                                    "--repeats", "5", "--moh-curve", "--moh-seq", "2048", "--moh-batch", "16"],
             [*CLI, "bench", "attention", "--device", "cpu", "--seq", "8", "--experts", "4", "--batch", "1",
              "--embed-dim", "32", "--top-k", "2", "--head-dim", "16", "--switchhead", "--repeats", "1", "--warmup",
              "0", "--no-decode"]),
    ],
    # time beside compute (headmix bench compute --size gpu): each routed kind against its dense baseline, bf16,
    # d_model 2048, T 4096, GPU-busy time and kernels beside the minimal MAC ratio; eager first (with the profiles of
    # the three rows furthest above their MAC ratio), then compiled (rows printed as measured: a step stopped at its
    # limit keeps them)
    "compute": [
        Step("compute_eager", 180, ["-m", "headmix.bench.compute", "--size", "gpu", "--modes", "eager"],
             ["-m", "headmix.bench.compute", "--tiny", "--device", "cpu"], env=NO_AUTOTUNE),
        Step("compute_compiled", 300, ["-m", "headmix.bench.compute", "--size", "gpu", "--modes", "compiled"],
             ["-m", "headmix.bench.compute", "--tiny", "--device", "cpu", "--rows", "GQE", "--no-profile"],
             env=NO_AUTOTUNE),
    ],
}


def budget_s(part: str) -> int:
    """The sum of a part's time limits (at most its :data:`PART_LIMITS` entry)."""
    return sum(step.limit_s for step in STEPS[part])


def _machine() -> dict:
    import torch

    from ..provenance import cpu_model

    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    else:
        info["device"] = "cpu: " + cpu_model()  # the name run summaries record
    return info


#: a markdown table's header separator (``|---|:--:|``)
SEPARATOR = re.compile(r"^\|(\s*:?-{3,}:?\s*\|)+$")


def markdown_tables(text: str) -> list[list[str]]:
    """The markdown tables (lines starting with ``|``) of a step's output. A step's stderr is interleaved with
    its stdout, so a line of other text (a library's warning printed between two rows) does not end a table; a
    blank line, a heading or a new header (a row followed by a ``|---|`` line) does."""
    tables, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            if SEPARATOR.match(line.strip()) and len(current) > 2:
                tables.append(current[:-1])  # the row before this separator is the next table's header
                current = current[-1:]
            current.append(line.rstrip())
        elif current and (not line.strip() or line.startswith("#")):
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    return tables


def table_records(table: list[str]) -> list[dict]:
    """A markdown table's rows as records keyed by its header's cells."""
    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split("|")]

    if len(table) < 2:
        return []
    header = cells(table[0])
    return [dict(zip(header, cells(line))) for line in table[2:]]


def _run_streaming(cmd: list[str], env: dict, log: Path, limit_s: int) -> tuple[str, str]:
    """Run ``cmd``, writing its output to ``log`` (and this process's stdout) line by line as it comes; stop it
    (its whole process group) at ``limit_s`` seconds. Returns (status, output)."""
    lines: list[str] = []
    with open(log, "w", encoding="utf-8") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

        def pump() -> None:
            for line in proc.stdout:
                lines.append(line)
                sink.write(line)
                sink.flush()
                print(line, end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=limit_s)
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"timed out after {limit_s} s"
        reader.join(timeout=10)
    return status, "".join(lines)


def run_part(part: str, out: Path, tiny: bool = False, python: str = sys.executable) -> dict:
    """Run a part's steps, each under its limit, rewriting ``out/<part>.json`` after each; returns that summary."""
    import torch

    if not tiny and not torch.cuda.is_available():
        raise SystemExit("gpu-check: needs a CUDA build of PyTorch that sees a GPU (or --tiny on the CPU)")
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    src = str(Path.cwd() / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    summary = {"part": part, "tiny": tiny, "machine": _machine(), "commit": source_commit(),
               "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "budget_s": budget_s(part), "steps": []}
    for step in STEPS[part]:
        log = out / f"{part}-{step.name}.log"
        print(f"[gpu-check] {part} {step.name} (limit {step.limit_s} s)", flush=True)
        start = time.perf_counter()
        status, text = _run_streaming([python, *(step.tiny if tiny else step.full)], dict(env, **dict(step.env)),
                                      log, step.limit_s)
        seconds = round(time.perf_counter() - start, 1)
        print(f"[gpu-check] {part} {step.name}: {status} in {seconds} s (limit {step.limit_s} s), log {log}",
              flush=True)
        tables = markdown_tables(text)
        summary["steps"].append({"name": step.name, "status": status, "seconds": seconds, "limit_s": step.limit_s,
                                 "log": log.name, "tables": tables, "rows": [table_records(t) for t in tables]})
        summary["seconds"] = round(sum(s["seconds"] for s in summary["steps"]), 1)
        atomic_write_json(out / f"{part}.json", summary)
    return summary


def markers(part: str) -> tuple[str, str]:
    """The comments that enclose ``part``'s section in the document."""
    return f"<!-- gpu-check {part}:begin -->", f"<!-- gpu-check {part}:end -->"


def part_section(summary: dict) -> str:
    """One part's summary as markdown: machine, software, commit, per step its status and tables."""
    m = summary["machine"]
    begin, end = markers(summary["part"])
    lines = [begin, "", f"#### `gpu_check.sh {summary['part']}` on {m.get('device')} at commit {summary.get('commit')} "
             f"({summary['started']}; python {m.get('python')}, torch {m.get('torch')}, triton {m.get('triton')}, "
             f"transformers {m.get('transformers')})", "",
             f"{summary['seconds']} s of a {summary['budget_s']} s budget.", "",
             "| step | status | seconds | limit s |", "|---|---|---|---|"]
    lines += [f"| {st['name']} | {st['status']} | {st['seconds']} | {st['limit_s']} |" for st in summary["steps"]]
    for st in summary["steps"]:
        for table in st["tables"]:
            lines += ["", f"{st['name']} ({st['log']}):", "", *table]
    return "\n".join(lines + ["", end])


def fold(out: Path, doc: Path, allow_tiny: bool = False) -> str:
    """Write every part summary found in ``out`` (``<part>.json``, finished or stopped part-way) into ``doc``,
    each between its :func:`markers` (replacing that part's earlier section; appended under "GPU check
    results" when absent), leaving the other parts' sections as they are. Returns what was written."""
    summaries = []
    for part in PARTS:
        path = out / f"{part}.json"
        if not path.is_file():
            continue
        try:
            summary = json.loads(path.read_text())
        except ValueError:
            raise ValueError(f"{path} is not a GPU check summary (not JSON)") from None
        if summary.get("tiny") and not allow_tiny:
            raise ValueError(f"{path} is a --tiny run on {summary['machine'].get('device')}: not folded into {doc}")
        for step in summary["steps"]:  # each step's log is its raw record: its tables are read again from it
            log = out / step["log"]
            if log.is_file():
                step["tables"] = markdown_tables(log.read_text(encoding="utf-8"))
        summaries.append(summary)
    if not summaries:
        raise ValueError(f"out must hold a part's summary ({', '.join(p + '.json' for p in PARTS)}), none in {out}")
    text = doc.read_text()
    sections = []
    for summary in summaries:
        section = part_section(summary)
        begin, end = markers(summary["part"])
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            text = head + section + rest.split(end, 1)[1]
        else:
            if BEGIN not in text:
                text = text.rstrip("\n") + "\n\n## GPU check results\n\n" + BEGIN + "\n" + END + "\n"
            head, rest = text.split(END, 1)
            text = head + section + "\n\n" + END + rest
        sections.append(section)
    atomic_write(doc, text)
    return "\n\n".join(sections)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for part in PARTS:
        q = sub.add_parser(part, help=f"run {part}")
        q.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (checks the plumbing)")
        q.add_argument("--out", default="runs/gpu_check", help="folder for the logs and the JSON summary")
    q = sub.add_parser("fold", help="fold the parts' summaries found in OUT into docs/performance.md")
    q.add_argument("out")
    q.add_argument("--doc", default="docs/performance.md")
    q.add_argument("--allow-tiny", action="store_true", help="fold --tiny summaries too (tests)")
    q = sub.add_parser("budget", help="print a part's time budget in seconds")
    q.add_argument("part", choices=PARTS)
    args = p.parse_args(argv)
    if args.command == "budget":
        print(budget_s(args.part))
        return 0
    if args.command == "fold":
        try:
            fold(Path(args.out), Path(args.doc), args.allow_tiny)
        except ValueError as e:
            print(f"gpu-check fold: {e}", file=sys.stderr)
            return 2
        print(f"folded {args.out} into {args.doc}")
        return 0
    summary = run_part(args.command, Path(args.out), args.tiny)
    return 0 if all(s["status"] == "ok" for s in summary["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
