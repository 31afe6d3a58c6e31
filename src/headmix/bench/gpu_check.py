"""The GPU check in two parts, each within a 10-minute job (``benchmarks/gpu_check.sh part1|part2``), and the
fold of a finished check's summaries into ``docs/performance.md``.

* ``part1``: the ``gpu``-marked correctness tests (the Triton kernels and ``grouped_mm`` on CUDA against the
  float64 reference, no host sync, flash attention, Inductor) and the layer table
  (``benchmarks/gpu_layers.py``: one fwd+bwd per layer against torch MHA, and the grouped projections for
  ``dense``, ``grouped_mm`` and ``triton``);
* ``part2``: model steps (``headmix bench models``, eager and compiled), decoding (``headmix bench decode``)
  and the MoA / MoH curves (``headmix bench attention --moh-curve``).

Every step runs under its own time limit (:data:`STEPS`, seconds); a part's limits add up to at most
:data:`PART_LIMIT_S` (9 minutes), which the script's header states. Each step's output goes to
``OUT/<part>-<step>.log``, and ``OUT/<part>.json`` sums the part up: machine, commit, per step its status,
seconds, limit and the markdown tables it printed. ``fold OUT`` writes both parts' summaries into
``docs/performance.md`` between :data:`BEGIN` and :data:`END` (a check run with ``--tiny`` on a CPU is
refused: its numbers say nothing about a GPU).

    python -m headmix.bench.gpu_check part1 [--tiny] [--out runs/gpu_check]
    python -m headmix.bench.gpu_check fold runs/gpu_check [--doc docs/performance.md]
    python -m headmix.bench.gpu_check budget part1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..storage.files import atomic_write, atomic_write_json

PARTS = ("part1", "part2")
#: A part's steps must fit this many seconds (one 10-minute job, with a minute for start and copies).
PART_LIMIT_S = 540
BEGIN, END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"

CLI = ["-m", "headmix.cli.main"]


@dataclass(frozen=True)
class Step:
    """One command of a part: ``full`` on a GPU, ``tiny`` on the CPU (the suite's check of the plumbing)."""

    name: str
    limit_s: int
    full: list[str]
    tiny: list[str]
    env: tuple[tuple[str, str], ...] = ()


STEPS: dict[str, list[Step]] = {
    "part1": [
        # one kernel configuration: autotuning every test's sizes would take minutes
        Step("tests", 240, ["-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q", "tests/test_gpu.py",
                            "tests/test_kernels_grouped_mm.py"],
             ["-m", "pytest", "-p", "no:cacheprovider", "-q", "tests/test_kernels_grouped_mm.py", "-k",
              "known_values"], env=(("HEADMIX_TRITON_AUTOTUNE", "0"),)),
        # the first run autotunes the Triton kernels (Triton keeps the choices in its cache)
        Step("layers", 270, ["benchmarks/gpu_layers.py"],
             ["benchmarks/gpu_layers.py", "--tiny", "--device", "cpu", "--no-triton"]),
    ],
    "part2": [
        Step("models", 180, [*CLI, "bench", "models", "--presets", "llama-mini-mha", "llama-mini-moa",
                             "llama-mini-moh", "llama-mini-switchhead", "--device", "cuda", "--compile",
                             "--lm-batch", "8", "--lm-len", "1024", "--repeats", "10"],
             [*CLI, "bench", "models", "--presets", "tiny-mha", "tiny-moa", "--device", "cpu", "--lm-batch", "1",
              "--lm-len", "8", "--repeats", "1", "--warmup", "0"]),
        Step("decode", 120, [*CLI, "bench", "decode", "--presets", "llama-mini-mha", "llama-mini-moa",
                             "llama-mini-moh", "llama-mini-switchhead", "--device", "cuda", "--batches", "1", "8",
                             "--prompt", "128", "--steps", "64", "--repeats", "5"],
             [*CLI, "bench", "decode", "--presets", "tiny-mha", "--device", "cpu", "--batches", "1", "--prompt",
              "4", "--steps", "2", "--repeats", "1", "--modes", "eager"]),
        Step("attention_moh", 150, [*CLI, "bench", "attention", "--device", "cuda", "--batch-tokens", "32768",
                                    "--repeats", "5", "--moh-curve", "--moh-seq", "2048", "--moh-batch", "16"],
             [*CLI, "bench", "attention", "--device", "cpu", "--seq", "8", "--experts", "4", "--batch", "1",
              "--embed-dim", "32", "--top-k", "2", "--head-dim", "16", "--switchhead", "--repeats", "1", "--warmup",
              "0", "--no-decode"]),
        # the GQE curve: grouped MHA against SDPA enable_gqa, GQE (half of each group's routed heads) against
        # grouped MHA (fwd+bwd and prefill), the gates and QK-norm
        Step("gqa", 60, [*CLI, "bench", "gqa", "--device", "cuda", "--dtype", "bfloat16", "--batch", "8", "--seq",
                         "2048", "--prefill-seq", "8192", "--repeats", "5"],
             [*CLI, "bench", "gqa", "--device", "cpu", "--embed-dim", "32", "--heads", "4", "--kv-heads", "2",
              "--batch", "1", "--seq", "8", "--prefill-seq", "8", "--repeats", "1", "--warmup", "0"]),
    ],
}


def budget_s(part: str) -> int:
    """The sum of a part's time limits."""
    return sum(step.limit_s for step in STEPS[part])


def _machine() -> dict:
    import torch

    from ..training.machine import cpu_model

    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    else:
        info["device"] = "cpu: " + cpu_model()  # the name run summaries record
    return info


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def markdown_tables(text: str) -> list[list[str]]:
    """The markdown tables (runs of lines starting with ``|``) of a step's output."""
    tables, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(line.rstrip())
        elif current:
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    return tables


def run_part(part: str, out: Path, tiny: bool = False, python: str = sys.executable) -> dict:
    """Run a part's steps, each under its limit, and write ``out/<part>.json``; returns that summary."""
    import torch

    if not tiny and not torch.cuda.is_available():
        raise SystemExit("gpu-check: needs a CUDA build of PyTorch that sees a GPU (or --tiny on the CPU)")
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    src = str(Path.cwd() / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    summary = {"part": part, "tiny": tiny, "machine": _machine(), "commit": _commit(),
               "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "budget_s": budget_s(part), "steps": []}
    for step in STEPS[part]:
        log = out / f"{part}-{step.name}.log"
        start = time.perf_counter()
        try:
            proc = subprocess.run([python, *(step.tiny if tiny else step.full)], env=dict(env, **dict(step.env)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=step.limit_s)
            text, status = proc.stdout, "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired as e:
            text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            status = f"timed out after {step.limit_s} s"
        seconds = round(time.perf_counter() - start, 1)
        atomic_write(log, text)
        print(f"[gpu-check] {part} {step.name}: {status} in {seconds} s (limit {step.limit_s} s), log {log}",
              flush=True)
        summary["steps"].append({"name": step.name, "status": status, "seconds": seconds, "limit_s": step.limit_s,
                                 "log": log.name, "tables": markdown_tables(text)})
    summary["seconds"] = round(sum(s["seconds"] for s in summary["steps"]), 1)
    atomic_write_json(out / f"{part}.json", summary)
    return summary


def fold(out: Path, doc: Path, allow_tiny: bool = False) -> str:
    """Write the summaries ``out/part1.json`` and ``out/part2.json`` into ``doc`` between :data:`BEGIN` and
    :data:`END` (appended as a section when the markers are missing); returns the section."""
    summaries = []
    for part in PARTS:
        path = out / f"{part}.json"
        if not path.is_file():
            raise ValueError(f"out must hold a finished check's {path.name}, missing in {out}")
        summary = json.loads(path.read_text())
        if summary.get("tiny") and not allow_tiny:
            raise ValueError(f"{path} is a --tiny run on {summary['machine'].get('device')}: not folded into {doc}")
        summaries.append(summary)
    lines = [BEGIN, ""]
    for s in summaries:
        m = s["machine"]
        lines += [f"#### `gpu_check.sh {s['part']}` on {m.get('device')} at commit {s.get('commit')} "
                  f"({s['started']}; torch {m.get('torch')}, triton {m.get('triton')})", "",
                  f"{s['seconds']} s of a {s['budget_s']} s budget.", "",
                  "| step | status | seconds | limit s |", "|---|---|---|---|"]
        lines += [f"| {st['name']} | {st['status']} | {st['seconds']} | {st['limit_s']} |" for st in s["steps"]]
        for st in s["steps"]:
            for table in st["tables"]:
                lines += ["", f"{st['name']} ({st['log']}):", "", *table]
        lines.append("")
    lines.append(END)
    section = "\n".join(lines)
    text = doc.read_text()
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## GPU check results\n\n" + section + "\n"
    atomic_write(doc, text)
    return section


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for part in PARTS:
        q = sub.add_parser(part, help=f"run {part}")
        q.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (checks the plumbing)")
        q.add_argument("--out", default="runs/gpu_check")
    q = sub.add_parser("fold", help="fold a finished check's summaries into docs/performance.md")
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
