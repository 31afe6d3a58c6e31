"""``headmix demo``: the size the device picks (CPU or GPU), the options each size trains with, the GPU-sized
code path run tiny on CPU, and (``gpu``-marked) the real GPU demo configuration briefly on a GPU."""

from __future__ import annotations

import dataclasses
import gzip
from pathlib import Path

import pytest
import torch

from headmix.cli.main import main
from headmix.study.matching import attention_macs_of
from headmix.training import TrainConfig
from headmix.training import demo
from headmix.training.demo import CPU_DEMO, GPU_DEMO, SIZES, demo_models, demo_size, run_demo

CORPUS = Path(demo.__file__).resolve().parents[1] / "data" / "embedded" / "lohelp.de-en.tsv.gz"


def fake_cuda(monkeypatch) -> None:
    """``pick_device`` as on a machine with a CUDA GPU (``auto`` and ``cuda`` give ``cuda:0``; the report
    names the device without asking CUDA for its name)."""
    real = demo.pick_device
    monkeypatch.setattr(demo, "describe_device", str)
    monkeypatch.setattr(demo, "pick_device",
                        lambda name: torch.device("cuda", 0) if name in ("auto", "cuda", "cuda:0") else real(name))


def captured_configs(monkeypatch) -> list[TrainConfig]:
    """Replace the data set-up and the training loop by stand-ins that record the ``TrainConfig`` of each
    run and stop it before it trains (``run_demo`` then returns ``{"stopped_by": ...}``)."""
    seen: list[TrainConfig] = []
    monkeypatch.setattr(demo, "prepare_shared_data", lambda cfg, log: Path(cfg.out) / "tokenizer")

    def train(cfg, stop=None):
        seen.append(cfg)
        return {"stopped_by": "test"}

    monkeypatch.setattr(demo, "train", train)
    return seen


def test_the_device_picks_the_demo_size(monkeypatch):
    assert demo_size("cpu") == (CPU_DEMO, torch.device("cpu"))
    fake_cuda(monkeypatch)
    assert demo_size("auto") == (GPU_DEMO, torch.device("cuda", 0))
    assert demo_size("cpu")[0] is CPU_DEMO
    with pytest.raises(ValueError, match="device"):
        demo_size("tpu")


def test_cpu_demo_trains_as_it_always_did(tmp_path, monkeypatch):
    """``--device cpu`` keeps the CPU demo's options (those of the 450-step demo that gave MoA 2.22 / MHA
    1.14 BLEU), even on a CUDA machine: only ``device`` is now named instead of ``auto``."""
    fake_cuda(monkeypatch)
    seen = captured_configs(monkeypatch)
    assert run_demo(tmp_path, device="cpu", progress=False) == {"stopped_by": "test"}
    (cfg,) = seen
    before = TrainConfig(preset=str(tmp_path / "moa_config.json"), out=str(tmp_path / "moa"),
                         tokenizer=str(tmp_path / "shared" / "tokenizer"), max_steps=450, warmup_steps=100, lr=2e-3,
                         log_every=10, eval_every=10**9, save_every=25, keep_checkpoints=5, average_last=5,
                         progress=False, task="translation", seed=1, split_seed=1, max_tokens=2000, max_len=128)
    assert {**cfg.to_dict(), "device": "auto"} == before.to_dict()
    assert cfg.device == "cpu"
    moa = demo_models(size=CPU_DEMO)["moa"].decoder_self_attention
    assert (moa.top_k, moa.num_experts, moa.head_dim) == (4, 16, 48)


def test_demo_overrides_replace_the_sizes_budget(tmp_path, monkeypatch):
    seen = captured_configs(monkeypatch)
    run_demo(tmp_path, device="cpu", steps=7, progress=False)
    assert seen[0].max_steps == 7


def test_gpu_demo_is_the_papers_base_model_against_matched_moa_in_bf16(tmp_path, monkeypatch):
    models = demo_models(size=GPU_DEMO)
    base, moa = models["mha"], models["moa"]
    assert (base.d_model, base.ffn_dim, base.encoder_layers, base.decoder_layers) == (512, 2048, 6, 6)
    att = moa.decoder_self_attention
    assert (att.kind, att.top_k, att.num_experts) == ("moa", 8, 16)
    assert abs(attention_macs_of(moa, None, None) / attention_macs_of(base, None, None) - 1) <= 0.02
    fake_cuda(monkeypatch)
    seen = captured_configs(monkeypatch)
    run_demo(tmp_path, progress=False)  # auto: the (fake) CUDA device
    (cfg,) = seen
    assert (cfg.device, cfg.bf16, cfg.max_steps, cfg.max_tokens) == ("cuda:0", "on", GPU_DEMO.steps, GPU_DEMO.max_tokens)
    assert (cfg.warmup_steps, cfg.lr, cfg.average_last) == (GPU_DEMO.warmup_steps, GPU_DEMO.lr, GPU_DEMO.average_last)


def tiny_gpu_size(corpus: Path) -> demo.DemoSize:
    """The GPU demo with its models, corpus and budget made tiny (bf16 autocast kept on)."""
    return dataclasses.replace(GPU_DEMO, baseline="tiny-mha", moa={"kind": "moa", "num_experts": 4, "top_k": 2},
                               prefer_head_dim=16, steps=2, max_tokens=600, warmup_steps=1,
                               eval_sentences=3, beam_size=1, data=(str(corpus),), vocab_size=300)


@pytest.mark.filterwarnings("ignore:the largest group holds")
def test_gpu_sized_demo_runs_tiny_on_cpu(tmp_path, capsys):
    corpus = tmp_path / "corpus.tsv"
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        corpus.write_text("".join(next(f) for _ in range(300)), encoding="utf-8")
    report = run_demo(tmp_path / "demo", device="cpu", size=tiny_gpu_size(corpus), progress=True)
    captured = capsys.readouterr()
    printed = captured.out
    # its output captured (not a terminal): each model's progress as a line a log can read
    assert captured.err.count("[headmix] train: step 2/2 (100%), loss ") == 2
    assert "[headmix] evaluating moa on 3 test sentences (beam 1)" in printed
    assert report["setup"]["size"] == "gpu" and report["setup"]["device"] == "cpu" and report["setup"]["bf16"] == "on"
    for name in ("moa", "mha"):
        assert report[name]["steps"] == 2
        assert [type(v) for v in report[name]["load_average"]] == [float, float]  # at the start and end of training
        assert len(report[name]["examples"]) <= 3
        hypotheses = (tmp_path / "demo" / name / "test_hypotheses.txt").read_text(encoding="utf-8").splitlines()
        assert len(hypotheses) == 3
    assert report["comparison"]["sentences"] == 3
    assert 0 < report["total_seconds"]
    assert f"configuration gpu ({GPU_DEMO.description}) on cpu, " in printed
    assert f"{report['total_seconds'] / 60:.1f} minutes in all" in printed
    assert "load average (start, end)" in printed and "validation perplexity (lower is better): MoA " in printed
    assert (tmp_path / "demo" / "report.json").exists()


def test_demo_command_passes_device_and_size(monkeypatch):
    calls = []
    monkeypatch.setattr(demo, "run_demo", lambda out, **kw: calls.append(kw) or {})
    assert main(["demo", "--device", "cpu", "--no-progress"]) == 0
    assert calls[-1]["device"] == "cpu" and calls[-1]["size"] is None and calls[-1]["steps"] is None
    assert main(["demo", "--size", "gpu", "--steps", "3"]) == 0
    assert calls[-1]["size"] is SIZES["gpu"] and calls[-1]["steps"] == 3 and calls[-1]["device"] == "auto"


def test_demo_command_refuses_an_unknown_device(tmp_path, capsys):
    assert main(["demo", "--device", "tpu", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "device" in err[0] and "'tpu'" in err[0]


@pytest.mark.gpu
def test_gpu_demo_configuration_runs_on_the_gpu(tmp_path):
    """The real GPU demo (transformer-base vs MoA 8K16E, bf16, 8192-token batches), briefly."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    report = run_demo(tmp_path, steps=20, eval_sentences=20, progress=False)
    assert report["setup"]["size"] == "gpu" and report["setup"]["device"].startswith("cuda")
    assert report["moa"]["model"].startswith("MoA 8K16E") and report["mha"]["model"] == "MHA 8 heads of 64"
    assert report["moa"]["steps"] == report["mha"]["steps"] == 20
    assert report["comparison"]["sentences"] == 20
