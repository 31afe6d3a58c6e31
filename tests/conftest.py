"""Shared test set-up."""

from pathlib import Path

import pytest
import torch

from headmix.process import freed_memory_kept, return_freed_memory
from headmix.data import load_embedded_documents, load_embedded_translation, write_jsonl_documents, write_tsv_pairs

# The tests use tiny models, which gain nothing from intra-op threads; on a busy 2-core machine (and
# with one pytest-xdist worker per core) the thread pools' spinning makes them several times slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def pairs_file(tmp_path_factory) -> Path:
    """600 pairs of the embedded En-De corpus as a TSV file: the training and command-line tests' data."""
    path = tmp_path_factory.mktemp("data") / "pairs.tsv"
    write_tsv_pairs(load_embedded_translation()[:600], path)
    return path


@pytest.fixture(scope="session")
def docs_file(tmp_path_factory) -> Path:
    """40 documents of the embedded English corpus (the KJV Bible) as a JSONL file: the language-model tests'
    data (a test module may define its own ``docs_file``)."""
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    write_jsonl_documents(load_embedded_documents(sources="kjv-bible")[:40], path)
    return path


@pytest.fixture(autouse=True)
def freed_memory_returned():
    """A test that runs a training command in-process (``headmix.cli.main.main``) makes its process keep freed memory
    (:func:`headmix.keep_freed_memory`, a process-wide allocator setting): it is undone after the test, so that the
    later tests of this worker run as they would alone."""
    yield
    if freed_memory_kept():
        return_freed_memory()


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: serves models with vLLM (tests/test_vllm.py; `make test-vllm` runs it "
                                       "in its own environment, .venv-vllm)")
