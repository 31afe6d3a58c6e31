"""``headmix bench attention``, ``models`` and ``decode``: what they count and print (no timing asserted)."""

from __future__ import annotations

import pytest
import torch

from headmix.attention import MixtureOfAttentionHeads, MultiHeadAttention
from headmix.bench.decode import step_bytes
from headmix.bench.models import bench_models, synthetic_batch, with_expert_impl
from headmix.cli.main import main
from headmix.models import build_model, get_config


def test_step_bytes_counts_distinct_selected_experts():
    layer = MixtureOfAttentionHeads(16, 5, 2, 4)
    index = torch.tensor([[0, 3], [3, 1], [0, 1]])  # experts 0, 1, 3: three distinct
    per_expert = 2 * 16 * 4 * 4  # W_q^i and W_o^i, float32
    shared = (5 * 16 + 2 * (16 * 4 + 4) + 16) * 4  # router, k/v projections with biases, output bias
    assert step_bytes(layer, 100.0, index) == 3 * per_expert + shared + 100.0
    mha = MultiHeadAttention(16, 2)
    assert step_bytes(mha, 10.0, None) == sum(p.numel() for p in mha.parameters()) * 4 + 10.0


def test_with_expert_impl_reaches_every_moa_layer():
    config = with_expert_impl(get_config("tiny-moa", task="translation"), "sorted")
    layers = [m for m in build_model(config).modules() if isinstance(m, MixtureOfAttentionHeads)]
    assert len(layers) == 6 and all(m.expert_impl == "sorted" for m in layers)


def test_synthetic_batch_is_padded_and_shifted():
    config = get_config("tiny-mha", task="translation")
    batch = synthetic_batch(config, 6, 8, 5, torch.Generator().manual_seed(0))
    assert batch["src"].shape == (6, 8) and batch["tgt_in"].shape == (6, 5) and batch["tgt_out"].shape == (6, 5)
    assert bool((batch["src"] == config.pad_id).any())  # some sentences are shorter than 8
    assert bool((batch["src"][:, 0] != config.pad_id).all())  # none is empty
    assert 4 <= batch["mean_src"] <= 8


def test_bench_models_rows_name_the_baseline():
    rows = bench_models(["tiny"], batch=2, src_len=4, tgt_len=4, impls=["sorted"], repeats=1, warmup=0)
    assert [r["model"] for r in rows] == ["tiny-mha", "tiny-moa", "tiny-moa (sorted)"]
    assert rows[0]["ratio"] == 1.0 and rows[0]["macs_ratio"] == 1.0
    assert rows[1]["macs_ratio"] == rows[2]["macs_ratio"] != 1.0


def test_bench_decode_cli(capsys):
    threads = torch.get_num_threads()  # --threads sets torch's thread count for the process: restore it
    try:
            code = main(["bench", "decode", "--batches", "2", "--experts", "4", "--impls", "auto", "sorted",
                     "--embed-dim", "16", "--top-k", "2", "--head-dim", "8", "--prompt", "3", "--steps", "2",
                     "--repeats", "1", "--threads", "1", "--clock", "cpu"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0
    assert "CPU time of this process" in out and "read bandwidth" in out
    assert [line.split("|")[2].strip() for line in out.splitlines() if line.startswith("| 2 ")] == [
        "headmix MHA", "MoA 2K4E8D auto", "MoA 2K4E8D sorted"]


def test_bench_bad_arguments(capsys):
    assert main(["bench", "decode", "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    assert main(["bench", "models", "--threads", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err


def test_bench_models_demo_pair_is_the_demos_models():
    from headmix.training.demo import demo_models

    rows = bench_models(["demo"], batch=2, src_len=4, tgt_len=4, impls=[], repeats=1, warmup=0)
    models = demo_models()
    assert [r["model"] for r in rows] == ["demo mini-mha (MHA 4 heads of 32)", "demo MoA 4K16E48D"]
    att = models["moa"].decoder_self_attention
    assert (att.top_k, att.num_experts, att.head_dim) == (4, 16, 48)
    assert rows[0]["ratio"] == 1.0 and rows[1]["macs_ratio"] != 1.0


def test_expert_growth_divides_by_the_fewest_experts_row_of_the_same_sequence():
    from headmix.bench.attention import expert_growth

    rows = [{"seq": 128, "layer": "torch MHA", "fwd_bwd_ms": 1.0},
            {"seq": 128, "layer": "MoA 8K8E64D", "fwd_bwd_ms": 200.0},
            {"seq": 128, "layer": "MoA 8K64E64D", "fwd_bwd_ms": 230.0},
            {"seq": 512, "layer": "MoA 8K8E64D", "fwd_bwd_ms": 100.0},
            {"seq": 512, "layer": "MoA 8K64E64D", "fwd_bwd_ms": 150.0}]
    assert expert_growth(rows, 8, 64, [64, 8]) == ["seq 128: fwd+bwd over MoA 8K8E64D: E=64 1.15x",
                                                   "seq 512: fwd+bwd over MoA 8K8E64D: E=64 1.50x"]
    assert expert_growth(rows, 8, 64, [8]) == []


def test_gpu_layer_table_runs_at_tiny_sizes_on_cpu(capsys):
    """The GPU check's layer table (``headmix bench layers``, which the check runs as ``python -m
    headmix.bench.gpu_layers``) and grouped-projection table: every row printed, measured or with why it was left
    out, against baselines measured in the same run."""
    from headmix.bench import gpu_layers

    assert main(["bench", "layers", "--tiny", "--device", "cpu", "--no-triton"]) == 0
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0].lstrip("| "): line for line in out.splitlines() if line.startswith("| ")}
    for spec in gpu_layers.LAYERS:
        assert spec.name in rows, spec.name
        if spec.needs:
            assert "skipped: needs Triton" in rows[spec.name] or "needs CUDA" in rows[spec.name]
    measured = rows["MoA dense"].split(" | ")
    assert measured[1] == "8K32E8D" and float(measured[2]) > 0 and int(measured[5]) > 0  # wall ms, ATen ops
    assert rows[gpu_layers.BASELINE].split(" | ")[3] == "1.00"
    assert "re-timed after the other rows" in out
    for variant in ("two dense Linear", "grouped dense", "grouped sorted"):
        assert variant in rows, variant
    with pytest.raises(SystemExit):
        gpu_layers.main(["--device", "cpu", "--batch", "0"])


def test_benchmarks_default_to_bfloat16_on_cuda_and_refuse_unknown_dtypes():
    import torch

    from headmix.bench.timing import bench_dtype

    assert bench_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert bench_dtype(None, torch.device("cpu")) == torch.float32
    assert bench_dtype("float32", torch.device("cuda")) == torch.float32
    with pytest.raises(ValueError, match="--dtype must be one of float32, bfloat16, float16, got 'fp8'"):
        bench_dtype("fp8", torch.device("cpu"))
