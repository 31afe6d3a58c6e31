"""One benchmark tree: every benchmark is a ``headmix bench NAME`` command (a module of :mod:`headmix.bench` with
``add_arguments`` and ``run``), its ``--help`` works, it runs at tiny sizes, a bad option is a one-line error naming
the option, and ``benchmarks/`` holds only the shell scripts that time whole commands or run the GPU check."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest
import torch

import headmix.bench
from headmix.cli.bench import _modules
from headmix.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
#: Modules of headmix.bench that are not commands: shared code, and the GPU check that runs the commands
#: (``benchmarks/gpu_check.sh``).
NOT_COMMANDS = {"timing", "kinds", "gpu_check"}


@pytest.mark.parametrize("name", sorted(_modules()))
def test_every_bench_command_has_help(name, capsys):
    assert main(["bench", name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: headmix bench {name} ") and "options:" in out


def test_bench_help_lists_every_command(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"    {name} " in out for name in _modules())


def test_every_bench_module_is_a_command_and_benchmarks_holds_only_the_scripts():
    """A benchmark module that is no ``headmix bench`` command, or a Python file in ``benchmarks/``, fails here:
    no second tree grows back."""
    registered = {module.__name__.rsplit(".", 1)[1] for module, _ in _modules().values()}
    modules = {info.name for info in pkgutil.iter_modules(headmix.bench.__path__)}
    assert modules - NOT_COMMANDS == registered
    for name in registered:
        module = importlib.import_module(f"headmix.bench.{name}")
        assert callable(module.add_arguments) and callable(module.run), name
    assert sorted(p.name for p in (ROOT / "benchmarks").iterdir()) == ["generate_and_init_from.sh", "gpu_check.sh"]


def _project_texts():
    for pattern in ("README.md", "Makefile", "docs/*.md", "examples/*", "src/headmix/**/*.py", "tests/*.py",
                    "benchmarks/*"):
        for path in sorted(ROOT.glob(pattern)):
            if path.is_file():
                yield path, path.read_text()


def test_the_docs_and_code_name_only_commands_and_scripts_that_exist():
    """Every ``headmix bench NAME`` the docs, examples and code name is a command; every file they name in ``benchmarks/`` exists."""
    import re

    for path, text in _project_texts():
        for name in re.findall(r"headmix bench ([a-z][a-z-]*)", text):
            assert name in _modules() or name in ("command", "commands"), f"{path.relative_to(ROOT)}: headmix bench {name}"
        for name in re.findall(r"benchmarks/([\w.-]+)", text):
            assert (ROOT / "benchmarks" / name).is_file(), f"{path.relative_to(ROOT)}: benchmarks/{name}"


@pytest.fixture
def one_thread_after():
    """``headmix bench gemm-shapes`` runs on one torch thread (for its CPU-time clock): restore the count."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _table_rows(out: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")]
                                              for line in out.splitlines() if line.startswith("| "))}


def test_bench_grouped_tiny(capsys):
    assert main(["bench", "grouped", "--tokens", "16", "--d-model", "16", "--d-head", "4", "--top-k", "2",
                 "--experts", "2", "4", "--impls", "dense", "sorted", "--repeats", "1", "--no-cuda"]) == 0
    out = capsys.readouterr().out
    assert "## CPU float32" in out and "N=16 tokens, d_model=16, d_head=4, k=2" in out
    rows = [line.split() for line in out.splitlines() if line[:4].strip() in ("2", "4")]
    assert [(r[0], r[1]) for r in rows] == [("2", "2x"), ("2", "dense"), ("2", "sorted"),
                                            ("4", "2x"), ("4", "dense"), ("4", "sorted")]
    assert rows[0][4] == "1.00" and rows[0][6] == "1.00"  # the baseline's ratios (its name is two words)


def test_bench_grouped_sweep_tiny(capsys):
    assert main(["bench", "grouped", "--sweep", "--d-model", "16", "--d-head", "4", "--sweep-tokens", "2",
                 "--sweep-k", "2", "--sweep-experts-per-k", "1", "2", "--sweep-impls", "dense", "sorted",
                 "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.lstrip().startswith("2   2")]
    assert len(rows) == 2 and all(row.count("*") == 2 for row in rows)  # best of fwd and of fwd+bwd marked


def test_bench_grouped_cpu_tiny_checks_each_kernel_and_gives_the_threads_back(capsys):
    """Every implementation (the padded-bmm prototype included) is checked against ``impl="reference"`` before it is
    timed; each row's ratios are against the dense GEMM and ``sorted`` of the same rounds; the threads are restored."""
    import torch

    threads = torch.get_num_threads()
    assert main(["bench", "grouped-cpu", "--sizes", "tiny", "--threads", "1", "--rounds", "2", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert torch.get_num_threads() == threads
    assert "tiny: 64 tokens, d_model 32, top 2 of 4 experts, heads of 8, 1 thread(s)" in out
    for name in ("dense GEMM (baseline)", "sorted", "grouped_cpp", "bmm padded"):
        assert f"| {name} |" in out, name
    assert "| dense GEMM (baseline) | " in out and "| 1.00 [1.00-1.00] |" in out


def test_bench_gemm_shapes_tiny(capsys, one_thread_after):
    assert main(["bench", "gemm-shapes", "--tokens", "16", "--d-model", "16", "--head-dim", "4", "--top-k", "2",
                 "--experts", "4", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "(8 rows per expert); one thread, CPU time" in out
    assert list(_table_rows(out)) == ["product", "map fwd", "map dgrad", "map wgrad", "reduce fwd", "reduce u",
                                      "reduce wgrad", "all six"]


def test_bench_moh_projections_tiny(capsys):
    assert main(["bench", "moh-projections", "--tokens", "16", "--embed-dim", "16", "--heads", "4", "--shared",
                 "1", "--top-k", "2", "--repeats", "1"]) == 0
    rows = _table_rows(capsys.readouterr().out)
    assert rows["dense (as MoH computes)"][1] == "1.00" and "grouped (2 of 3 routed)" in rows


def test_bench_kv_cache_tiny(capsys):
    pytest.importorskip("transformers")
    assert main(["bench", "kv-cache", "--embed-dim", "32", "--head-dim", "8", "--top-k", "2", "--experts", "4",
                 "--kv-heads", "1", "2", "--tokens", "4", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    bytes_per_token = {line[:44].strip(): float(line.split()[-2]) for line in out.splitlines()[2:]}
    # float32: K and V, G heads of 8 -> 2 * 4 * 8 G bytes; MHA holds k G heads
    assert bytes_per_token["MoA 2K4E8D, kv_heads=1"] == bytes_per_token["GQA (HF LlamaAttention), 2 heads"] == 64
    assert bytes_per_token["MHA, 4 heads"] == 256 and bytes_per_token["MoA 2K4E8D, kv_heads=2"] == 128


def test_bench_gqe_tiny_times_each_mode_and_length_against_gqa(capsys):
    assert main(["bench", "gqe", "--embed-dim", "32", "--seqs", "8", "12", "--prefill-seq", "16", "--modes", "eager",
                 "--repeats", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "d_model 32, heads of 2" in out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| eager")]
    assert [(r[1], r[2]) for r in rows] == [(what, layer) for what in ("fwd+bwd 1x8", "fwd+bwd 1x12", "prefill 1x16")
                                            for layer in ("GQA 16 heads", "GQE 16E on 8 K/V, top 1")]
    assert [r[4] for r in rows[::2]] == ["1.000"] * 3 and all(float(r[3]) > 0 for r in rows)


def test_bench_quick_tiny(capsys):
    """``headmix bench quick`` is ``python -m headmix.bench.quick`` (which the GPU check runs; tests/test_gpu_check.py)."""
    assert main(["bench", "quick", "decode", "--tiny", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "re-timed after the other rows" in out and "| 2 | MHA" in out


@pytest.mark.parametrize("argv, message", [
    (["grouped", "--tokens", "0"], "--tokens must be >= 1, got 0"),
    (["grouped", "--experts", "1", "4"], "--experts must be >= --top-k (8), got [1, 4]"),
    (["grouped", "--impls", "fast"], "--impls: invalid choice: 'fast'"),
    (["gemm-shapes", "--tokens", "1", "--top-k", "1"], "--tokens x --top-k must be >= --experts"),
    (["moh-projections", "--shared", "8"], "--shared must be >= 0 and below --heads (8), got 8"),
    (["moh-projections", "--top-k", "7"], "--top-k must be at most the routed heads"),
    (["moh-projections", "--heads", "3", "--shared", "0"], "--heads must divide --embed-dim (512), got 3"),
    (["kv-cache", "--kv-heads", "0", "1"], "--kv-heads must be >= 1, got [0, 1]"),
    (["kv-cache", "--top-k", "20"], "--top-k must be at most --experts (16), got 20"),
    (["layers", "--batch", "0"], "--batch must be >= 1, got 0"),
    (["quick", "decode", "--batches", "0"], "--batches must be >= 1, got [0]"),
    (["quick", "models", "--device", "gpu"], "device"),
    (["hopper-aot", "--jobs", "0"], "--jobs must be >= 1, got 0"),
    (["gqe", "--seqs", "0"], "--seqs must be >= 1, got [0]"),
    (["gqe", "--embed-dim", "40"], "--embed-dim must be a multiple of 16 (16 heads), got 40"),
])
def test_bench_bad_options_are_one_line_errors(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.strip().splitlines()[-1].startswith(("headmix bench: error: ", "headmix bench"))
    if not message.endswith("invalid choice: 'fast'"):
        assert len(err.strip().splitlines()) == 1, err


def test_standalone_modules_take_the_same_options(capsys):
    """``python -m headmix.bench.gpu_layers`` / ``quick`` / ``compute`` (the GPU check's steps): a bad option is a usage error."""
    from headmix.bench import compute, gpu_layers, quick

    for module, argv in ((gpu_layers, ["--device", "cpu", "--time", "0"]), (quick, ["models", "--layers", "0"]),
                         (compute, ["--device", "cpu", "--repeats", "0"])):
        with pytest.raises(SystemExit) as stop:
            module.main(argv)
        assert stop.value.code == 2
        assert f"error: --{argv[-2].lstrip('-')} must be >= 1, got 0" in capsys.readouterr().err
