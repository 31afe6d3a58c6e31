"""A study or run folder from elsewhere is safe to open: the token cache is a numpy archive read without pickle,
a checkpoint's training state is read with ``torch.load(weights_only=True)``; crafted files whose unpickling
would write a marker file are refused in one line, and the marker never appears."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from headmix.data import load_embedded_documents, write_jsonl_documents


class WritesMarker:
    """Unpickling this object creates ``path`` (what a hostile file could do instead: run any code)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    from headmix.training import TrainConfig
    from headmix.training.setup import prepare_shared_data

    folder = tmp_path_factory.mktemp("safe")
    docs = folder / "docs.jsonl"
    write_jsonl_documents(load_embedded_documents(sources="kjv-bible")[:30], docs)
    cfg = TrainConfig(task="lm", out=str(folder / "shared"), data=[str(docs)], vocab_size=300, split_seed=1,
                      valid_size=0.1, test_size=0.1, max_len=32)
    tokenizer = prepare_shared_data(cfg, lambda m: None)
    return cfg, tokenizer


def _cache_setup(shared, folder: Path):
    from headmix.data import Tokenizer
    from headmix.training import TrainConfig

    cfg, tokenizer = shared
    run_cfg = TrainConfig(**{**cfg.to_dict(), "out": str(folder / "run"), "shared_data": str(tokenizer.parent),
                             "tokenizer": str(tokenizer)})
    task = run_cfg.task_spec
    items = task.read_items(task.split_path(tokenizer.parent / "data", "valid"))
    return run_cfg, items, Tokenizer.load(tokenizer), tokenizer / "tokenizer.json"


def _blocks(dataset) -> list:
    return [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in dataset[i].items()}
            for i in range(len(dataset))]


def test_the_token_cache_is_a_numpy_archive_and_reads_back_the_same(shared, tmp_path):
    from headmix.training.setup import cached_dataset

    cfg, items, tok, tok_file = _cache_setup(shared, tmp_path)
    first = cached_dataset(cfg, "valid", items, tok, tok_file, "bos")
    [path] = list(Path(cfg.shared_data, "tokenized").glob("valid-*"))
    assert path.suffix == ".npz"
    with np.load(path, allow_pickle=False) as archive:  # plain arrays only
        assert all(archive[name].dtype != object for name in archive.files)
    again = cached_dataset(cfg, "valid", items, tok, tok_file, "bos")
    assert type(again) is type(first) and _blocks(again) == _blocks(first) and len(again) > 1


def test_translation_datasets_round_trip_through_the_archive(tmp_path):
    from headmix.data.batching import TranslationDataset
    from headmix.training.setup import load_dataset, save_dataset

    dataset = TranslationDataset([[5, 6, 7], [8]], [[9], [10, 11]], eos_id=2, max_len=8)
    assert save_dataset(dataset, tmp_path / "t.npz")
    back = load_dataset(tmp_path / "t.npz")
    assert [(e.src.tolist() if hasattr(e.src, "tolist") else e.src) for e in back] == \
        [(e.src.tolist() if hasattr(e.src, "tolist") else e.src) for e in dataset]
    assert back.max_len == 8 and back.src_eos is True and back.kept_indices.tolist() == [0, 1]


def test_a_crafted_token_cache_cannot_run_code(shared, tmp_path):
    from headmix.training.setup import cached_dataset

    cfg, items, tok, tok_file = _cache_setup(shared, tmp_path)
    cached_dataset(cfg, "valid", items, tok, tok_file, "bos")
    [path] = list(Path(cfg.shared_data, "tokenized").glob("valid-*.npz"))
    marker = tmp_path / "marker"
    evil = np.empty(1, dtype=object)
    evil[0] = WritesMarker(marker)
    with open(path, "wb") as f:
        np.savez(f, stream=evil, __meta__=np.frombuffer(b'{"class": "x:y", "fields": {}}', dtype=np.uint8))
    with pytest.raises(ValueError, match=r"^token cache .* is not a headmix token cache .*remove it") as err:
        cached_dataset(cfg, "valid", items, tok, tok_file, "bos")
    assert "\n" not in str(err.value)
    assert not marker.exists()
    # a pickle cache of an older version (the old name) is never opened: the ids are tokenised again
    path.unlink()
    old = path.with_name(path.name.replace(".npz", ".pkl"))
    old.write_bytes(pickle.dumps(WritesMarker(marker)))
    assert len(cached_dataset(cfg, "valid", items, tok, tok_file, "bos")) > 1
    assert not marker.exists() and path.is_file()


def test_a_crafted_checkpoint_cannot_run_code(tmp_path):
    from headmix.models import build_model, get_config
    from headmix.runs import Run, RunError
    from headmix.runs.checkpoints import INFO_FILE, STATE_FILE, rng_state, sha256_file

    model = build_model(get_config("tiny-mha", task="lm", vocab_size=50))
    config = {"task": "lm", "seed": 1}
    with Run.create_or_resume(tmp_path / "run", config, identity=["task", "seed"]) as run:
        path = run.save_checkpoint(3, model, {"rng": rng_state(), "sampler": {"epoch": 0}}, {"tokens": 1},
                                   keep=2, reason="periodic")
        state, info = run.latest_intact_checkpoint(model)[1:]
        assert info["step"] == 3 and state["sampler"] == {"epoch": 0}
        # a crafted training state, with checksums recomputed (as someone sending the folder could)
        marker = tmp_path / "marker"
        torch.save({"rng": WritesMarker(marker)}, path / STATE_FILE)
        record = json.loads((path / INFO_FILE).read_text())
        record["sha256"][STATE_FILE] = sha256_file(path / STATE_FILE)
        (path / INFO_FILE).write_text(json.dumps(record))
        with pytest.raises(RunError, match=r"training_state.pt holds more than tensors and plain values") as err:
            run.latest_intact_checkpoint(model)
    assert "\n" not in str(err.value)
    assert not marker.exists()


def test_the_rng_state_round_trips_as_data(tmp_path):
    import random

    from headmix.runs.checkpoints import rng_state, set_rng_state

    np.random.seed(5)
    np.random.standard_normal()  # a cached gaussian in the state
    state = rng_state()
    torch.save(state, tmp_path / "s.pt")
    expected = (np.random.standard_normal(3).tolist(), random.random(), torch.rand(2).tolist())
    set_rng_state(torch.load(tmp_path / "s.pt", weights_only=True))
    assert (np.random.standard_normal(3).tolist(), random.random(), torch.rand(2).tolist()) == expected


def test_a_study_folder_of_an_older_version_is_converted_or_refused(tmp_path):
    """The committed lm-en-llama study was planned before the attention fields ``dropout_on``/``moh_impl`` and the
    spec's ``moh_count`` existed: its study.json as that version wrote it (without them) is read with their
    defaults (and rewritten with them); a real change of the study is still refused."""
    from headmix.study import get_study, plan
    from headmix.study.runner import _write_plan, check_plan

    root = Path(__file__).resolve().parents[1] / "studies" / "lm-en-llama"
    old = json.loads((root / "study.json").read_text())
    for row in old["rows"]:
        for field in ("moh_impl", "dropout_on"):
            row["attention"].pop(field, None)
    for field in ("moh_count", "timing_rounds", "timing_steps", "timing_warmup"):
        old["spec"].pop(field, None)
    (tmp_path / "study.json").write_text(json.dumps(old))
    spec = get_study("lm-en-llama")
    planned = plan(spec)
    check_plan(spec, planned, tmp_path)
    _write_plan(spec, planned, tmp_path)
    assert json.loads((tmp_path / "study.json").read_text())["rows"][0]["attention"]["moh_impl"] is None
    spec.max_steps = 500
    with pytest.raises(ValueError, match="holds another study"):
        check_plan(spec, planned, tmp_path)
