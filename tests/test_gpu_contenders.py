"""``lm-en-gpu-contenders`` and its token pack: the pack built from a few documents is the stream a run would
tokenise, checksummed and refused in one line when damaged; the study runs end to end at a tiny size through the
CLI on the CPU, in slices of ``--max-runs``, continues from its records alone, and never mixes timings of
different devices; the committed pack is the one the built-in names, and the built-in is sized as documented."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from headmix.cli.main import main
from headmix.data import load_embedded_documents, write_jsonl_documents
from headmix.tasks.pack import load_pack, pack_checksum
from headmix.study import builtin, get_study, plan

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory) -> Path:
    """A pack of 60 documents, built by the documented command."""
    folder = tmp_path_factory.mktemp("pack")
    docs = folder / "docs.jsonl"
    write_jsonl_documents(load_embedded_documents(sources="kjv-bible")[:60], docs)
    assert main(["data", "pack", "--data", str(docs), "--vocab-size", "300", "--valid-size", "0.05",
                 "--test-size", "0.05", "--out", str(folder / "pack"), "--quiet"]) == 0
    return folder / "pack"


def test_the_pack_holds_the_stream_a_run_tokenises(tiny_pack):
    from headmix.data import CausalLMBlockDataset, Tokenizer, read_jsonl_documents, split_documents

    pack = load_pack(tiny_pack)
    manifest = pack.manifest
    assert manifest["split_seed"] == 1 and manifest["vocab_size"] == 300 and manifest["dtype"] == "uint16"
    assert manifest["command"].startswith("headmix data pack --data ")
    assert pack.sha256 == pack_checksum(manifest["files"])
    split = split_documents(read_jsonl_documents(tiny_pack.parent / "docs.jsonl"), valid_size=0.05, test_size=0.05,
                            seed=1)
    tok = Tokenizer.load(pack.tokenizer_dir)
    for name, part in (("train", split.train), ("valid", split.valid), ("test", split.test)):
        expected = CausalLMBlockDataset.from_documents(part, tok, 32, sequence_start="eos").stream
        assert np.array_equal(pack.stream(name), expected) and pack.stream(name).dtype == np.int32
        assert manifest["splits"][name] == {"documents": len(part), "tokens": len(expected)}
    # a rebuild elsewhere has the same checksum (what the pack holds, not where it was built)
    assert main(["data", "pack", "--data", str(tiny_pack.parent / "docs.jsonl"), "--vocab-size", "300",
                 "--valid-size", "0.05", "--test-size", "0.05", "--out", str(tiny_pack.parent / "again"),
                 "--quiet"]) == 0
    assert load_pack(tiny_pack.parent / "again").sha256 == pack.sha256


def test_a_run_on_the_pack_trains_on_its_blocks(tiny_pack):
    """A run with ``pack`` reads the pack's streams and tokenizer and cuts them into its blocks: the blocks a run
    on the same corpus, split and tokenizer makes."""
    from headmix.data import CausalLMBlockDataset, Tokenizer, read_jsonl_documents, split_documents
    from headmix.training import TrainConfig
    from headmix.training.setup import cached_dataset, read_pack

    cfg = TrainConfig(task="lm", pack=str(tiny_pack), max_len=32, out="unused")
    parts, tok = read_pack(cfg)
    assert tok.hf.to_str() == Tokenizer.load(tiny_pack / "tokenizer").hf.to_str()
    split = split_documents(read_jsonl_documents(tiny_pack.parent / "docs.jsonl"), valid_size=0.05, test_size=0.05,
                            seed=1)
    for name, part in (("train", split.train), ("valid", split.valid)):
        ours = cached_dataset(cfg, name, parts[name], tok, None)
        theirs = CausalLMBlockDataset.from_documents(part, tok, 32, sequence_start="eos")
        assert len(ours) == len(theirs) > 0
        assert all(np.array_equal(ours[i]["input_ids"], theirs[i]["input_ids"]) and
                   np.array_equal(ours[i]["labels"], theirs[i]["labels"]) for i in range(len(ours)))
    for bad, message in (({"task": "mlm"}, "a token pack is a causal LM's whole data"),
                         ({"data": ["x.jsonl"]}, "no data, tokenizer, shared_data beside it|got task 'lm' and data")):
        with pytest.raises(ValueError, match=message):
            TrainConfig(**{"task": "lm", "pack": str(tiny_pack), "out": "unused", **bad}).check_values()


def test_a_run_on_the_pack_is_eos_first_and_a_parent_trained_otherwise_is_refused(tiny_pack, tmp_path):
    """The pack's stream is eos-first, so a run on it is too (sequence_start "eos"), and continuing a parent
    trained with its documents starting otherwise (bos, a model of today) is refused in one line: its documents
    could not continue as it was trained."""
    from headmix.models import build_model, get_config
    from headmix.training import TrainConfig
    from headmix.training.sequence_start import run_sequence_start

    assert run_sequence_start(TrainConfig(task="lm", pack=str(tiny_pack), out=str(tmp_path / "run"))) == "eos"
    parent = tmp_path / "parent"
    build_model(get_config("tiny-mha", task="lm", vocab_size=300)).save_pretrained(parent)
    cfg = TrainConfig(task="lm", pack=str(tiny_pack), init_from=str(parent), out=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=rf"^init_from {parent} was trained with sequence_start 'bos', but the "
                                         rf"token pack {tiny_pack} holds eos-first documents \('eos'\): continue it "
                                         rf"on --data instead$"):
        run_sequence_start(cfg)


def test_a_damaged_or_different_pack_is_refused_in_one_line(tiny_pack, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_pack, broken)
    raw = bytearray((broken / "train.npy").read_bytes())
    raw[-1] ^= 1
    (broken / "train.npy").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"^token pack .*broken is damaged: train.npy has sha256 .* its manifest "
                                         r"records .*; it was not used"):
        load_pack(broken)
    with pytest.raises(ValueError, match="is not the expected pack"):
        load_pack(tiny_pack, "0" * 64)
    (broken / "train.npy").unlink()
    with pytest.raises(ValueError, match="lacks train.npy"):
        load_pack(broken)
    (broken / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="has no readable manifest.json"):
        load_pack(broken)
    with pytest.raises(FileNotFoundError, match="token pack not found"):
        load_pack(tmp_path / "nowhere")
    # an existing folder is never overwritten
    assert main(["data", "pack", "--data", "x.jsonl", "--vocab-size", "300", "--out", str(tiny_pack)]) == 2
    assert "exists" in capsys.readouterr().err
    assert sorted(p.name for p in tiny_pack.iterdir()) == ["manifest.json", "test.npy", "tokenizer", "train.npy",
                                                           "valid.npy"]


def _tiny_spec(pack: Path):
    """``lm-en-gpu-contenders``' rows, matching and options on a model and pack the CPU trains in seconds."""
    spec = builtin.gpu_contenders_spec(d_model=192, layers=1, block=32, batch_blocks=4, steps=2, head_dim=24,
                                       vocab_size=300, seeds=(1,), pack=str(pack), pack_sha256=load_pack(pack).sha256,
                                       eval_every=1, log_every=1, warmup_steps=1)
    spec.timing_rounds, spec.timing_steps, spec.timing_warmup = 6, 1, 0
    return spec


def _study(out: Path, *extra: str) -> int:
    return main(["study", "lm-en-gpu-contenders", "--out", str(out), "--device", "cpu", "--bf16", "off",
                 "--no-progress", *extra])


KEPT = ("summary.json", "metrics.jsonl", "train_config.json")  # what .gitignore keeps of a study's run folder


def test_the_gpu_study_runs_end_to_end_at_a_tiny_size_in_slices(tiny_pack, tmp_path, monkeypatch, capsys):
    from headmix.study import report

    monkeypatch.setitem(builtin.BUILTIN, "lm-en-gpu-contenders", lambda: _tiny_spec(tiny_pack))
    monkeypatch.setattr(report, "plot", lambda table, out: [])  # the figures are tested in test_study.py
    spec = _tiny_spec(tiny_pack)
    rows = [r.name for r in spec.rows]
    assert rows[:3] == ["GQA", "Gated", "GQE"] and rows[-2:] == ["MoA kv2", "MoSA"]
    out = tmp_path / "study"
    assert _study(out, "--max-runs", "3") == 75  # a slice: three runs, then it stops between runs
    assert "stopped between runs (--max-runs 3); 3 of" in capsys.readouterr().err
    assert len(list(out.glob("runs/*/seed-1/summary.json"))) == 3
    assert not (out / "shared").exists()  # no corpus read, no tokenizer trained: the pack is the data
    for run in out.glob("runs/*/seed-1"):
        assert (run / "tokenizer/tokenizer.json").read_bytes() == (tiny_pack / "tokenizer/tokenizer.json").read_bytes()
        # the pack's stream is eos-first: the run records that convention, in its options and in its model
        assert json.loads((run / "train_config.json").read_text())["sequence_start"] == "eos"
        assert json.loads((run / "config.json").read_text())["sequence_start"] == "eos"
    assert all(json.loads(p.read_text())["device"] == "cpu" for p in out.glob("timing/*.json"))
    # a later slice on a "fresh machine": only the records travel (no weights, no checkpoints, no token cache)
    fresh = tmp_path / "fresh"
    for path in out.rglob("*"):
        rel = path.relative_to(out)
        keep = rel.parts[0] in ("timing", "configs") or rel.name == "study.json" or (
            rel.parts[0] == "runs" and rel.name in KEPT)
        if path.is_file() and keep:
            (fresh / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, fresh / rel)
    status = 75
    while status == 75:
        status = _study(fresh, "--max-runs", "3")
    assert status == 0
    runs = sorted(fresh.glob("runs/*/seed-1"))
    assert len(runs) == len(rows)
    for run in runs:
        cfg = json.loads((run / "train_config.json").read_text())
        assert cfg["pack"] == str(tiny_pack.resolve()) and cfg["data"] == [] and cfg["tokenizer"] is None
        assert not (run / "checkpoints").exists()
    table = json.loads((fresh / "results.json").read_text())
    assert table["complete"] and table["attention_macs"] == "causal" and table["attention_macs_other"] == "full"
    md = (fresh / "results.md").read_text()
    assert "counted `causal`" in md and "| ratio, full count |" in md and "Warning" not in md
    # the report is recomputed from the records alone
    shutil.copy2(fresh / "results.md", tmp_path / "results.md")
    assert _study(fresh, "--report") == 0
    assert (fresh / "results.md").read_text() == (tmp_path / "results.md").read_text()
    # where the pack lives does not define the study: the same pack moved elsewhere reads the same study
    moved = tmp_path / "moved"
    shutil.copytree(tiny_pack, moved)
    monkeypatch.setitem(builtin.BUILTIN, "lm-en-gpu-contenders", lambda: _tiny_spec(moved))
    assert _study(fresh, "--report") == 0


def test_timings_of_another_device_are_refused_and_marked(tiny_pack, tmp_path, monkeypatch, capsys):
    from headmix.study.report import interleaved_markdown

    monkeypatch.setitem(builtin.BUILTIN, "lm-en-gpu-contenders", lambda: _tiny_spec(tiny_pack))
    out = tmp_path / "study"
    assert _study(out, "--max-runs", "1") == 75
    record = out / "timing" / "Gated.json"
    timing = json.loads(record.read_text())
    record.write_text(json.dumps({**timing, "device": "cuda:0"}))
    before = sorted(p.name for p in out.rglob("*"))
    capsys.readouterr()
    assert _study(out, "--max-runs", "1") == 2
    err = capsys.readouterr().err.strip()
    assert "'Gated' was timed on cuda" in err and "this command runs on cpu" in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in out.rglob("*")) == before  # nothing trained, nothing written
    rows = [{"name": "GQA"}] + [{"name": n, "equal_time_interleaved": {
        "ratio": 1.1, "low": 1.0, "high": 1.2, "row_step": {}, "baseline_step": {}, "valid_nll": {},
        "timing": {"device": d, "method": "interleaved"}}} for n, d in (("A", "cpu"), ("B", "cuda:0"))]
    assert "timed on different devices (cpu, cuda)" in "\n".join(interleaved_markdown({"baseline": "GQA",
                                                                                      "rows": rows}))
    for row, name in zip(rows[1:], ("NVIDIA H100 80GB HBM3", "NVIDIA H200")):  # two GPU models: marked too
        row["equal_time_interleaved"]["timing"] = {"device": "cuda:0", "machine": {"device_name": name}}
    assert "timed on different devices (cuda NVIDIA H100 80GB HBM3, cuda NVIDIA H200)" in "\n".join(
        interleaved_markdown({"baseline": "GQA", "rows": rows}))


def test_a_pack_study_is_refused_in_one_line_without_its_pack(tiny_pack, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(builtin.BUILTIN, "lm-en-gpu-contenders",
                        lambda: builtin.gpu_contenders_spec(pack=str(tmp_path / "none")))
    assert _study(tmp_path / "s") == 2
    err = capsys.readouterr().err
    assert "token pack not found" in err and "headmix data pack" in err and not (tmp_path / "s").exists()
    monkeypatch.setitem(builtin.BUILTIN, "lm-en-gpu-contenders",
                        lambda: builtin.gpu_contenders_spec(pack=str(tiny_pack)))
    assert _study(tmp_path / "s") == 2
    assert "is not the expected pack" in capsys.readouterr().err and not (tmp_path / "s").exists()
    assert _study(tmp_path / "s", "--data", "x.jsonl") == 2  # a corpus beside the pack
    assert "give either data or pack" in capsys.readouterr().err
    assert _study(tmp_path / "s", "--max-runs", "0") == 2
    assert "max_runs must be a positive integer" in capsys.readouterr().err


def test_the_committed_pack_is_the_builtins_and_the_study_is_sized_as_documented():
    spec = get_study("lm-en-gpu-contenders")
    pack = load_pack(ROOT / spec.pack, spec.pack_sha256)  # every file checked against the recorded checksums
    size = sum(p.stat().st_size for p in pack.path.rglob("*") if p.is_file())
    assert size <= 40e6 and pack.manifest["vocab_size"] == 16000
    assert pack.manifest["source"][0]["name"] == "en-docs.jsonl.gz"
    assert pack.manifest["splits"]["train"]["tokens"] > 8_000_000
    base = spec.baseline_config()
    att = base.decoder_self_attention
    assert base.d_model >= 512 and base.decoder_layers >= 8 and spec.training["max_len"] >= 1024
    assert (att.num_heads, att.kv_heads, base.ffn, base.positions) == (8, 2, "swiglu", "rotary")
    planned = plan(spec)
    assert [r.name for r in planned][:3] == ["GQA", "Gated", "GQE"]
    assert {"MoA kv2", "MoSA"} <= {r.name for r in planned} and spec.attention_macs == "causal"
    assert all(abs(r.macs_ratio - 1) <= 0.02 for r in planned)
    assert spec.drop_checkpoints and spec.max_steps * spec.training["max_tokens"] == 400 * 16384
    # sized from lm-en-gpu's measured H100 throughput: the slowest row's run is estimated at most 2 minutes
    assert "to be measured" in spec.gpu and "326k tokens/s" in spec.gpu
    slowest = float(spec.gpu.split(" s (a row at")[0].rsplit(" ", 1)[1])
    assert slowest <= 120


@pytest.mark.gpu
def test_the_gpu_study_runs_on_cuda_at_a_tiny_size(tiny_pack, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setitem(builtin.BUILTIN, "lm-en-gpu-contenders", lambda: _tiny_spec(tiny_pack))
    out = tmp_path / "study"
    assert main(["study", "lm-en-gpu-contenders", "--out", str(out), "--device", "cuda", "--no-progress"]) == 0
    assert all(json.loads(p.read_text())["device"].startswith("cuda") for p in out.glob("timing/*.json"))
    summary = json.loads((out / "runs/GQA/seed-1/summary.json").read_text())
    assert summary["machine"]["device_type"] == "cuda"
