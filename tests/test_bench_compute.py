"""The time-beside-compute table (``headmix bench compute``, :mod:`headmix.bench.compute`): the minimal MAC count it
sets beside each time, its rows and baselines, its named sizes, what each block records (ratios from the same run's
rounds), resuming, its verdicts, and the allocator setting ``--malloc`` asks for (and only that one)."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import statistics
import sys

import pytest

from headmix.bench import compute
from headmix.cli.main import main
from headmix.models import AttentionConfig
from headmix.models.counting import attention_macs, causal_pairs, minimal_attention_macs


def test_minimal_macs_of_gqe_count_only_the_selected_queries():
    """GQE computes every expert's query in one GEMM; a token needs its k G selected ones and the shared head's."""
    d, t, dh, experts, kv, k = 256, 64, 16, 16, 8, 1
    att = AttentionConfig(kind="gqe", num_experts=experts, kv_heads=kv, top_k=k, head_dim=dh)
    pairs = causal_pairs(t)
    want = (t * d * experts  # router
            + t * d * (k * kv + 1) * dh  # the selected queries and the shared head's
            + 2 * t * d * kv * dh  # the G K/V heads
            + (k * kv + 1) * 2 * pairs * dh  # the slots' and the shared head's attention
            + t * (k * kv + 2) * dh * d)  # W_O over k G hard slots, the weighted slot and the shared head
    assert minimal_attention_macs(att, d, t) == want
    assert attention_macs(att, d, t, t, causal=True)[0] - want == t * d * (experts - k * kv) * dh


@pytest.mark.parametrize("impl", ["dense", "sparse", "auto", None])
def test_minimal_macs_of_moh_are_its_sparse_form_whatever_impl_computes(impl):
    att = AttentionConfig(kind="moh", num_heads=8, num_shared_heads=2, top_k=2, head_dim=16, moh_impl=impl)
    sparse = attention_macs(dataclasses.replace(att, moh_impl="sparse"), 128, 32, 32, causal=True)[0]
    dense = attention_macs(dataclasses.replace(att, moh_impl="dense"), 128, 32, 32, causal=True)[0]
    assert minimal_attention_macs(att, 128, 32) == sparse < dense


@pytest.mark.parametrize("att", [AttentionConfig(kind="mha", num_heads=4, kv_heads=2),
                                 AttentionConfig(kind="moa", num_experts=8, top_k=2, head_dim=16),
                                 AttentionConfig(kind="switchhead", num_heads=2, num_experts=4, top_k=2, head_dim=16)])
def test_minimal_macs_of_layers_that_compute_only_what_they_use_are_their_count(att):
    assert minimal_attention_macs(att, 64, 32) == attention_macs(att, 64, 32, 32, causal=True)[0]
    assert minimal_attention_macs(att, 64, 32, causal=False) == attention_macs(att, 64, 32, 32)[0]


@pytest.mark.parametrize("d_model", [64, 1024, 2048])
def test_each_row_is_against_the_dense_layer_of_its_heads_and_kv_heads(d_model):
    """The baseline has the routed layer's width, query heads (MoA: k x kv_heads) and K/V heads, every head on;
    MoH's own dense form differs from the routed row only in moh_impl."""
    for row in compute.ROWS:
        routed, base = row.routed(d_model), row.baseline(d_model)
        assert base.kind == "mha", row.name
        layer, dense = routed.build(d_model), base.build(d_model)
        if routed.kind == "gqe":
            assert (routed.num_experts, routed.kv_heads) == (dense.num_heads, dense.kv_heads), row.name
        elif routed.kind == "moh":
            assert (layer.num_heads, layer.kv_heads) == (dense.num_heads, dense.kv_heads), row.name
            assert row.dense_form(d_model) == dataclasses.replace(routed, moh_impl="dense"), row.name
            assert routed.moh_impl == "sparse", row.name
        elif routed.kind == "moa":
            assert (routed.top_k * routed.kv_heads, routed.kv_heads) == (dense.num_heads, dense.kv_heads), row.name
        if routed.kind != "switchhead":
            assert layer.head_dim == dense.head_dim, row.name
    h = d_model // 64 if d_model >= 512 else 8
    gqe = compute.ROWS[0].routed(d_model)
    assert (gqe.num_experts, gqe.kv_heads, gqe.top_k) == (h, h // 2, 1)  # the paper's setting: 16 on 8 at 1024
    assert [compute.heads_of(d_model, e) for e in compute.GROWTH] == [h, 2 * h, 4 * h]


def test_tiny_table_records_every_row_and_resumes(tmp_path, capsys):
    """Each row: routed layer against its dense baseline, the time ratios taken from this run's own rounds (the
    median of the per-round ratios of the times recorded beside them), the minimal MAC ratio and the ATen op
    ratio, printed and recorded."""
    path = tmp_path / "compute.json"
    argv = ["bench", "compute", "--tiny", "--device", "cpu", "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    blocks = json.loads(path.read_text())["blocks"]
    assert len(blocks) == 1
    block = blocks[0]
    assert (block["size"], block["d_model"], block["seq"], block["batch"], block["threads"], block["mode"]) == (
        "tiny", 64, 16, 1, 1, "eager")
    assert [r["layer"] for r in block["rows"]] == [r.name for r in compute.ROWS]
    for r in block["rows"]:
        assert "error" not in r, r
        assert r["mac_ratio"] == r["macs"]["routed"] / r["macs"]["baseline"]
        assert r["aten_ratio"] == r["aten_ops"]["routed"] / r["aten_ops"]["baseline"]
        for what in ("step", "prefill"):
            rounds = r[f"{what}_rounds_ms"]
            assert sorted(rounds) == (["baseline", "dense", "routed"] if "step_vs_dense" in r
                                      else ["baseline", "routed"])
            assert all(len(times) == 1 and times[0] > 0 for times in rounds.values())
            assert r[f"{what}_ms"] == {name: statistics.median(times) for name, times in rounds.items()}
            assert r[f"{what}_ratio"] == pytest.approx(compute.ratio_stats(rounds["routed"], rounds["baseline"]),
                                                       rel=1e-12)
        assert ("step_vs_dense" in r) == r["layer"].startswith("MoH")
        if "step_vs_dense" in r:
            assert r["step_vs_dense"] == pytest.approx(r["step_rounds_ms"]["routed"][0]
                                                       / r["step_rounds_ms"]["dense"][0], rel=1e-12)
        assert (f"| {r['layer']} | {r['baseline']} | {r['mac_ratio']:.2f} | {r['step_ratio']['median']:.2f} |"
                in out)
        assert f"{r['aten_ops']['routed']} / {r['aten_ops']['baseline']} = {r['aten_ratio']:.2f}x |" in out
    assert sorted(block["growth"]["step"]) == ["16", "32", "8"]
    assert block["growth"]["step"]["8"] == 1.0
    assert "#### where the time goes" in out and "commit" in out and "torch" in out
    assert len(block["profiles"]) == compute.PROFILED_ROWS
    assert main([*argv, "--resume"]) == 0  # every block there: nothing measured again
    assert "### d_model" not in capsys.readouterr().out
    assert json.loads(path.read_text())["blocks"] == blocks


def test_the_study_size_is_what_lm_en_trains_at_and_the_gpu_size_what_the_gpu_check_runs():
    """``study``: lm-en's model width (mini-mha), block length and blocks per batch (max_tokens / max_len), with the
    rows' heads of 16; ``gpu``: the size the GPU check's compute part asks for."""
    from headmix.bench import gpu_check
    from headmix.bench.kinds import heads_for
    from headmix.models.presets import PRESETS
    from headmix.study.builtin import lm_en

    spec = lm_en()
    study = compute.SIZES["study"]
    assert study.d_model == PRESETS[spec.baseline].build("lm", 8000).d_model == 128
    assert study.seqs == (spec.training["max_len"],) == (128,)
    assert study.batch == spec.training["max_tokens"] // spec.training["max_len"] == 16
    assert heads_for(study.d_model) == (8, 16)
    assert (compute.SIZES["1024"].d_model, compute.SIZES["1024"].seqs, compute.SIZES["1024"].batch) == (
        1024, (1024, 4096), 1)
    assert (compute.SIZES["gpu"].d_model, compute.SIZES["gpu"].seqs, compute.SIZES["gpu"].batch) == (2048, (4096,), 1)
    for step in gpu_check.STEPS["compute"]:
        assert step.full[:4] == ["-m", "headmix.bench.compute", "--size", "gpu"]


def _resolved(argv: list[str], device_type: str = "cpu") -> list:
    import argparse

    p = argparse.ArgumentParser()
    compute.add_arguments(p)
    args = p.parse_args(argv)
    compute.check_args(args, device_type)
    return args.sizes


def test_sizes_by_name_by_default_and_of_ones_own():
    assert [s.name for s in _resolved([])] == ["study", "1024"]
    assert [s.name for s in _resolved([], "cuda")] == ["gpu"]
    assert _resolved(["--size", "gpu", "study"]) == [compute.SIZES["gpu"], compute.SIZES["study"]]
    own = _resolved(["--d-model", "96", "192", "--time", "32", "64"])
    assert [(s.d_model, s.seqs, s.batch) for s in own] == [(96, (32, 64), 1), (192, (32, 64), 1)]
    assert [(s.d_model, s.seqs, s.batch) for s in _resolved(["--tiny", "--size", "1024"])] == [(64, (16,), 1)]


def test_named_sizes_run_one_after_the_other_in_one_run(tmp_path, capsys, monkeypatch):
    """``--size study 1024``: one block per size and length, in order, each heading naming its size (the sizes made
    tiny here: the code path, not the measurement)."""
    monkeypatch.setitem(compute.SIZES, "study", compute.Size("study", 64, (16,), 2))
    monkeypatch.setitem(compute.SIZES, "1024", compute.Size("1024", 32, (8, 12), 1))
    import torch

    path = tmp_path / "sizes.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # the command measures at 1 and gives the count back
    try:
        assert main(["bench", "compute", "--size", "study", "1024", "--device", "cpu", "--threads", "1", "--repeats",
                     "1", "--modes", "eager", "--rows", "GQE (paper)", "--no-profile", "--json", str(path)]) == 0
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    blocks = json.loads(path.read_text())["blocks"]
    assert [(b["size"], b["d_model"], b["seq"], b["batch"]) for b in blocks] == [
        ("study", 64, 16, 2), ("1024", 32, 8, 1), ("1024", 32, 12, 1)]
    assert all(len(b["rows"]) == 1 and "error" not in b["rows"][0] for b in blocks)
    assert [line for line in out.splitlines() if line.startswith("### ")] == [
        "### study size: d_model 64, T 16, batch 2, eager, float32, 1 threads",
        "### 1024 size: d_model 32, T 8, batch 1, eager, float32, 1 threads",
        "### 1024 size: d_model 32, T 12, batch 1, eager, float32, 1 threads"]


class _FakeLibc:
    """glibc's ``mallopt`` recorded instead of made (the test process keeps its own allocator setting)."""

    def __init__(self, calls: list):
        self.calls = calls

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


@pytest.fixture
def mallopt_calls(monkeypatch):
    """The ``mallopt`` calls :func:`headmix.keep_freed_memory` makes, with the process's record of the setting
    (``headmix.process._kept``) starting unset; both restored afterwards."""
    from headmix import process

    if sys.platform != "linux":
        pytest.skip("keep_freed_memory sets glibc's allocator on Linux only")
    calls: list = []
    real = ctypes.CDLL
    monkeypatch.setattr(ctypes, "CDLL", lambda name, *a, **kw: _FakeLibc(calls) if name == "libc.so.6"
                        else real(name, *a, **kw))
    monkeypatch.setattr(process, "_kept", False)
    return calls


@pytest.mark.parametrize("malloc", ["default", "keep"])
def test_malloc_default_measures_without_the_allocator_setting(malloc, mallopt_calls, tmp_path, capsys):
    """``--malloc default`` makes no allocator setting at all (the headmix command no longer makes it for every
    benchmark before this one runs); ``keep`` makes it before the first block. Header and records say which held."""
    from headmix.process import freed_memory_kept

    path = tmp_path / "malloc.json"
    assert main(["bench", "compute", "--tiny", "--device", "cpu", "--rows", "GQE (paper)", "--no-profile",
                 "--malloc", malloc, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    block = json.loads(path.read_text())["blocks"][0]
    if malloc == "default":
        assert mallopt_calls == [] and not freed_memory_kept()
        assert "freed memory returned (glibc default)" in out
    else:
        assert sorted(mallopt_calls) == [(-3, 1 << 30), (-1, 1 << 30)] and freed_memory_kept()
        assert "freed memory kept (headmix.keep_freed_memory)" in out
    assert (block["malloc"], block["freed_memory_kept"]) == (malloc, malloc == "keep")


def test_malloc_default_is_refused_where_freed_memory_is_already_kept(mallopt_calls, monkeypatch, capsys):
    from headmix import process

    monkeypatch.setattr(process, "_kept", True)
    assert main(["bench", "compute", "--tiny", "--device", "cpu", "--malloc", "default"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--malloc default: this process already keeps freed memory" in err[0]


def test_the_other_benchmarks_still_keep_freed_memory(mallopt_calls, capsys):
    pytest.importorskip("transformers")
    assert main(["bench", "kv-cache", "--embed-dim", "32", "--head-dim", "8", "--top-k", "2", "--experts", "4",
                 "--kv-heads", "1", "--tokens", "4", "--dtype", "float32"]) == 0
    assert sorted(mallopt_calls) == [(-3, 1 << 30), (-1, 1 << 30)]


def test_verdicts_and_ratio_cells():
    assert compute._verdict(0.79, 0.80) == "met"
    assert compute._verdict(0.85, 0.80) == "missed by 0.05"
    assert compute.ratio_stats([2.0, 3.0, 6.0], [2.0, 2.0, 3.0]) == {"median": 1.5, "low": 1.0, "high": 2.0}
    block = {"device": "cpu", "d_model": 8, "seq": 4, "batch": 1, "mode": "eager", "dtype": "float32", "threads": 1,
             "rows": [{"layer": "L", "baseline": "B", "mac_ratio": 0.5, "step_ratio": {"median": 0.7, "low": 0.6,
                                                                                      "high": 0.8},
                       "prefill_ratio": {"median": 0.55, "low": 0.55, "high": 0.55},
                       "aten_ops": {"routed": 30, "baseline": 10}, "aten_ratio": 3.0, "saved_bytes": {"routed": 11, "baseline": 10}}]}
    row = [line for line in compute.format_block(block) if line.startswith("| L |")][0]
    assert row == "| L | B | 0.50 | 0.70 [0.60-0.80] | missed by 0.10 | 0.55 |  | 30 / 10 = 3.00x | 1.10x |"


@pytest.mark.parametrize("argv, message", [
    (["compute", "--time", "0", "--d-model", "64"], "--time must be >= 1, got [0]"),
    (["compute", "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["compute", "--resume"], "--resume needs --json"),
    (["compute", "--clock", "cpu", "--threads", "1", "2"], "--clock cpu measures one thread"),
    (["compute", "--size", "study", "--d-model", "64"], "give --size or a size of your own (--d-model), not both"),
    (["compute", "--time", "64"], "a size of your own needs --d-model and --time"),
    (["compute", "--size", "huge"], "invalid choice: 'huge'"),
    (["layers", "--compute", "--compute-time", "1024"], "--compute: the time-beside-compute table is its own command "
                                                        "now: headmix bench compute --size 1024"),
])
def test_bad_compute_options_are_one_line_errors(argv, message, capsys):
    assert main(["bench", *argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and (len(err) == 1 or "invalid choice" in message), err


def test_saved_bytes_leave_out_the_parameters_a_layer_holds_anyway():
    import torch

    from headmix.bench.attention import saved_activation_bytes

    lin = torch.nn.Linear(8, 4, bias=False)
    x = torch.randn(3, 8, requires_grad=True)

    def step():
        lin(x).sum().backward()

    with_weight = saved_activation_bytes(step)
    assert saved_activation_bytes(step, exclude=list(lin.parameters())) == x.nbytes == with_weight - lin.weight.nbytes


@pytest.mark.slow
def test_compiled_rows_are_compiled_each_one(tmp_path, monkeypatch):
    """Every row's layers compile afresh: without forgetting the earlier rows' frames, the shared compiled functions
    pass dynamo's recompile limit and later rows silently run eagerly (no kernel generated). Two rows of three
    layers each, the limit set to three (a minute or two on 2 cores)."""
    import torch

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 3)
    path = tmp_path / "compiled.json"
    assert main(["bench", "compute", "--device", "cpu", "--d-model", "64", "--time", "16", "--threads", "1",
                 "--repeats", "1", "--modes", "compiled", "--rows", "MoH per", "MoH one", "--no-profile",
                 "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["blocks"][0]["rows"]
    assert len(rows) == 2
    for r in rows:
        assert all(r["inductor_kernels"][name] > 0 for name in ("routed", "baseline", "dense")), r
