"""The time-beside-compute table (``headmix bench layers --compute``, :mod:`headmix.bench.compute`): the minimal
MAC count it sets beside each time, its rows and baselines, what each block records, resuming, and its verdicts."""

from __future__ import annotations

import dataclasses
import json

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
    path = tmp_path / "compute.json"
    argv = ["bench", "layers", "--compute", "--tiny", "--device", "cpu", "--compute-json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    blocks = json.loads(path.read_text())["blocks"]
    assert len(blocks) == 1
    block = blocks[0]
    assert (block["d_model"], block["seq"], block["threads"], block["mode"]) == (64, 16, 1, "eager")
    assert [r["layer"] for r in block["rows"]] == [r.name for r in compute.ROWS]
    for r in block["rows"]:
        assert "error" not in r, r
        assert r["mac_ratio"] == r["macs"]["routed"] / r["macs"]["baseline"]
        for what in ("step", "prefill"):
            assert r[f"{what}_ratio"]["low"] <= r[f"{what}_ratio"]["median"] <= r[f"{what}_ratio"]["high"]
            assert r[f"{what}_ms"]["routed"] > 0 and r[f"{what}_ms"]["baseline"] > 0
        assert r["aten_ops"]["baseline"] > 0 and r["saved_bytes"]["baseline"] > 0
        assert ("step_vs_dense" in r) == r["layer"].startswith("MoH")
        assert f"| {r['layer']} | {r['baseline']} | {r['mac_ratio']:.2f} |" in out
    assert sorted(block["growth"]["step"]) == ["16", "32", "8"]
    assert block["growth"]["step"]["8"] == 1.0
    assert "#### where the time goes" in out and "commit" in out and "torch" in out
    assert len(block["profiles"]) == compute.PROFILED_ROWS
    assert main([*argv, "--resume"]) == 0  # every block there: nothing measured again
    assert "### d_model" not in capsys.readouterr().out
    assert json.loads(path.read_text())["blocks"] == blocks


def test_verdicts_and_ratio_cells():
    assert compute._verdict(0.79, 0.80) == "met"
    assert compute._verdict(0.85, 0.80) == "missed by 0.05"
    assert compute.ratio_stats([2.0, 3.0, 6.0], [2.0, 2.0, 3.0]) == {"median": 1.5, "low": 1.0, "high": 2.0}
    block = {"device": "cpu", "d_model": 8, "seq": 4, "batch": 1, "mode": "eager", "dtype": "float32", "threads": 1,
             "rows": [{"layer": "L", "baseline": "B", "mac_ratio": 0.5, "step_ratio": {"median": 0.7, "low": 0.6,
                                                                                      "high": 0.8},
                       "prefill_ratio": {"median": 0.55, "low": 0.55, "high": 0.55},
                       "aten_ops": {"routed": 30, "baseline": 10}, "saved_bytes": {"routed": 11, "baseline": 10}}]}
    row = [line for line in compute.format_block(block) if line.startswith("| L |")][0]
    assert row == "| L | B | 0.50 | 0.70 [0.60-0.80] | missed by 0.10 | 0.55 |  | 30 / 10 = 3.00x | 1.10x |"


@pytest.mark.parametrize("argv, message", [
    (["--compute-time", "0"], "--compute-time must be >= 1, got [0]"),
    (["--compute-repeats", "0"], "--compute-repeats must be >= 1, got 0"),
    (["--resume"], "--resume needs --compute-json"),
    (["--compute-clock", "cpu", "--compute-threads", "1", "2"], "--compute-clock cpu measures one thread"),
])
def test_bad_compute_options_are_one_line_errors(argv, message, capsys):
    assert main(["bench", "layers", "--compute", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


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
    assert main(["bench", "layers", "--compute", "--device", "cpu", "--compute-d-model", "64", "--compute-time", "16",
                 "--compute-threads", "1", "--compute-repeats", "1", "--compute-modes", "compiled",
                 "--compute-rows", "MoH per", "MoH one", "--no-compute-profile", "--compute-json", str(path)]) == 0
    rows = json.loads(path.read_text())["blocks"][0]["rows"]
    assert len(rows) == 2
    for r in rows:
        assert all(r["inductor_kernels"][name] > 0 for name in ("routed", "baseline", "dense")), r
