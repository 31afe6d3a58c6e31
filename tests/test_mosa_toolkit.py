"""Mixture of Sparse Attention in the toolkit: AttentionConfig, counting, matching, presets, the position-load
analysis, a tiny study row trained on the embedded corpus, and model-level generation under the threshold
rule."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from headmix import MixtureOfSparseAttention
from headmix.analysis import position_load
from headmix.models import AttentionConfig, analytic_macs, analytic_parameters, build_model, count_parameters, get_config
from headmix.models.counting import mosa_macs
from headmix.study import StudySpec, match_attention, plan, run_study
from headmix.study.spec import RowSpec


def mosa_config(**kw) -> AttentionConfig:
    fields = dict(kind="mosa", num_sparse_heads=5, num_dense_heads=1, head_dim=8, sparsity=4, bias=False)
    fields.update(kw)
    return AttentionConfig(**fields)


def tiny_lm(attention: AttentionConfig, **changes):
    base = get_config("llama-tiny-mha", task="lm")
    return base.replace(decoder_self_attention=attention, **changes)


def test_config_builds_the_layer_and_other_kinds_refuse_its_fields():
    att = mosa_config(include_first=True, rotary=True, rotary_fraction=0.5)
    layer = att.build(64)
    assert isinstance(layer, MixtureOfSparseAttention)
    assert (layer.num_sparse_heads, layer.num_dense_heads, layer.head_dim, layer.sparsity, layer.include_first) == \
        (5, 1, 8, 4, True)
    assert layer.rotary.rotary_dim == 4
    assert AttentionConfig.from_dict(json.loads(json.dumps(att.to_dict()))) == att
    default_head = mosa_config(head_dim=None, num_sparse_heads=7).build(64)
    assert default_head.head_dim == 8  # 64 // (7 + 1)
    for field, value in (("num_sparse_heads", 4), ("sparsity", 8), ("tokens_per_head", 4), ("num_dense_heads", 1),
                         ("include_first", True)):
        with pytest.raises(ValueError, match=f"attention.{field} applies to kind 'mosa' only"):
            AttentionConfig(kind="mha", num_heads=4, **{field: value})


@pytest.mark.parametrize("changes, match", [
    (dict(num_sparse_heads=None), "num_sparse_heads is required"),
    (dict(sparsity=None), "exactly one of sparsity and tokens_per_head"),
    (dict(tokens_per_head=4), "exactly one of sparsity and tokens_per_head"),
    (dict(sparsity=0.5), "sparsity must be a number >= 1"),
    (dict(sparsity=None, tokens_per_head=1), "tokens_per_head must be an integer >= 2"),
    (dict(bias=True), "bias must be false for kind 'mosa'"),
    (dict(num_dense_heads=-1), "num_dense_heads must be a non-negative integer"),
])
def test_config_errors_are_one_line_and_name_the_field(changes, match):
    with pytest.raises(ValueError, match=match) as err:
        mosa_config(**changes)
    assert "\n" not in str(err.value)


def test_model_level_errors_heads_that_do_not_divide_and_too_sparse():
    with pytest.raises(ValueError, match=r"decoder_self_attention.num_sparse_heads \+ num_dense_heads \(6\) must divide "
                                         r"d_model \(64\)"):
        tiny_lm(mosa_config(head_dim=None))
    with pytest.raises(ValueError, match=r"decoder_self_attention.sparsity \(200\) leaves fewer than two tokens per "
                                         r"head of a max_positions \(256\) sequence"):
        tiny_lm(mosa_config(sparsity=200))
    tiny_lm(mosa_config(sparsity=128))  # 256 // 128 = 2: allowed
    base = get_config("tiny-mha", task="translation")
    with pytest.raises(ValueError, match="cross_attention.kind 'mosa' is not allowed"):
        base.replace(cross_attention=mosa_config())


def test_macs_and_parameters_by_hand_and_measured():
    att = mosa_config()
    d, t = 64, 50
    k = 50 // 4
    by_hand = 5 * (t * d + 4 * k * d * 8 + 2 * k * k * 8) + 1 * (4 * t * d * 8 + 2 * t * t * 8)
    assert mosa_macs(att, d, t) == by_hand
    assert mosa_macs(mosa_config(sparsity=100), d, t) == 5 * (t * d + 4 * 2 * d * 8 + 2 * 2 * 2 * 8) + \
        (4 * t * d * 8 + 2 * t * t * 8)  # k clamped to 2
    assert mosa_macs(mosa_config(sparsity=None, tokens_per_head=7), d, t) == \
        5 * (t * d + 4 * 7 * d * 8 + 2 * 7 * 7 * 8) + (4 * t * d * 8 + 2 * t * t * 8)
    config = tiny_lm(att)
    count = analytic_macs(config, tgt_len=t)
    assert count.full["decoder.self_attention"] == 2 * by_hand  # two layers
    model = build_model(config)
    layer = model.decoder.layers[0].self_attn
    assert sum(p.numel() for p in layer.parameters()) == 5 * d + 4 * 6 * d * 8
    assert analytic_parameters(config).total == count_parameters(model)


def test_matching_solves_heads_or_sparsity_at_the_baselines_macs():
    base = get_config("llama-tiny-mha", task="lm")
    fixed = {"kind": "mosa", "num_dense_heads": 1, "head_dim": 16, "bias": False}
    heads = match_attention(base, {**fixed, "sparsity": 8}, ["num_sparse_heads"])
    assert heads.attention.num_sparse_heads == 38 and abs(heads.ratio - 1) <= 0.02
    sparsity = match_attention(base, {**fixed, "num_sparse_heads": 16}, ["sparsity"])
    assert abs(sparsity.ratio - 1) <= 0.02
    k = 128 // sparsity.attention.sparsity
    assert mosa_macs(sparsity.attention, 64, 128) == 2 * 0 + 16 * (128 * 64 + 4 * k * 64 * 16 + 2 * k * k * 16) + \
        (4 * 128 * 64 * 16 + 2 * 128 * 128 * 16)
    # the preset is that solution
    assert get_config("llama-tiny-mosa", task="lm").decoder_self_attention.num_sparse_heads == 38


def _batches():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(3, 1000, (3, 20), generator=g)
    a[1, 14:] = 0  # padding (pad_id 0)
    b = torch.randint(3, 1000, (2, 12), generator=g)
    b[0, 2:] = 0  # 2 real tokens, fewer than k = 12 // 4: empty slots
    return [{"input_ids": a}, {"input_ids": b}]


def test_position_load_counts_each_heads_chosen_positions():
    torch.manual_seed(0)
    model = build_model(tiny_lm(mosa_config(include_first=True))).eval()
    report = position_load(model, _batches())
    assert [l.name for l in report.layers] == ["decoder.layers.0.self_attn", "decoder.layers.1.self_attn"]
    # by hand: run the decoder and count the routing's chosen positions over real tokens
    expected = torch.zeros(5, 20, dtype=torch.long)
    real = torch.zeros(20, dtype=torch.long)
    for batch in _batches():
        ids = batch["input_ids"]
        routing = dict(model.decoder(ids).routing)["decoder.layers.0.self_attn"]
        for b in range(ids.shape[0]):
            for h in range(5):
                for p in routing.positions[b, h].tolist():
                    if p >= 0:
                        assert int(ids[b, p]) != 0  # a padded token is never chosen
                        expected[h, p] += 1
            real[:ids.shape[1]] += (ids[b] != 0).long()
    layer = report.layers[0]
    assert layer.chosen == expected.tolist() and layer.real == real.tolist()
    assert layer.first_token_rate == [1.0] * 5  # include_first
    h, t = 2, 15
    assert layer.chosen_rate[h][t] == pytest.approx(expected[h, t].item() / real[t].item())
    assert "| 0 | 1.000 |" in report.to_markdown()
    with pytest.raises(ValueError, match="needs a MixtureOfSparseAttention layer"):
        position_load(build_model(get_config("llama-tiny-mha", task="lm")), _batches())


def test_model_generation_with_the_cache_gives_the_full_forward_tokens_under_the_threshold_rule():
    """Calibrate every MoSA layer's thresholds on training batches (top-k), switch to the threshold rule, and
    generate greedily with the cache; re-running the full forward pass on the growing sequence gives the
    same tokens."""
    torch.manual_seed(0)
    model = build_model(tiny_lm(mosa_config())).eval()
    train = [torch.randint(3, 1000, (4, 24), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    routings = {}
    for ids in train:
        for name, routing in model.decoder(ids).routing:
            routings.setdefault(name, []).append(routing)
    layers = dict(model.named_modules())
    for name, rs in routings.items():
        layers[name].calibrate_thresholds(rs)
        layers[name].selection = "threshold"
    prompt = torch.randint(3, 1000, (2, 5), generator=torch.Generator().manual_seed(9))
    out = model(prompt, use_cache=True)
    tokens = []
    for _ in range(6):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(nxt)
        out = model(nxt, state=out.state, use_cache=True)
    full = prompt
    for _ in range(6):
        nxt = model(full).logits[:, -1].argmax(-1, keepdim=True)
        full = torch.cat([full, nxt], dim=1)
    assert torch.equal(torch.cat(tokens, dim=1), full[:, 5:])


def test_a_mosa_study_row_trains_on_the_embedded_corpus(tmp_path, docs_file):
    row = RowSpec("MoSA", {"kind": "mosa", "num_dense_heads": 1, "head_dim": 16, "sparsity": 4, "bias": False},
                  ["num_sparse_heads"])
    spec = StudySpec(name="tiny-mosa", task="lm", baseline="llama-tiny-mha", data=[str(docs_file)], seeds=[1],
                     max_steps=3, rows=[RowSpec("MHA"), row],
                     training={"max_len": 32, "max_tokens": 400, "vocab_size": 300, "warmup_steps": 1,
                               "eval_every": 3, "log_every": 1, "save_every": 3, "average_last": 1,
                               "keep_checkpoints": 1, "valid_size": 0.05, "test_size": 0.05})
    spec.validate()
    planned = plan(spec)
    assert planned[1].config.decoder_self_attention.kind == "mosa" and abs(planned[1].macs_ratio - 1) <= 0.02
    results = run_study(spec, tmp_path / "study", log=lambda m: None)
    assert [r.row for r in results] == ["MHA", "MoSA"]
    folder = tmp_path / "study" / results[1].folder
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["valid"]["nll"] > 0
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    train_records = [m for m in metrics if m.get("split", "train") == "train" and "loss" in m]
    assert len(train_records) == 3 and train_records[-1]["load_cv"] == pytest.approx(0.0)  # expert choice: even


def test_bench_matches_heads_by_macs_and_runs_at_a_tiny_size():
    from headmix.bench.mosa import bench_mosa, cache_bytes, matched_sparse_heads

    heads, ratio = matched_sparse_heads(32, 2, 64, head_dim=8, sparsity=4, dense_heads=1)
    mha = 2 * (4 * 64 * 32 * 16 + 2 * 64 * 64 * 16)
    per_head = 64 * 32 + 4 * 16 * 32 * 8 + 2 * 16 * 16 * 8
    dense = 4 * 64 * 32 * 8 + 2 * 64 * 64 * 8
    assert ratio == pytest.approx((heads * per_head + dense) / mha)
    assert all(abs(ratio - 1) <= abs((n * per_head + dense) / mha - 1) for n in (heads - 1, heads + 1))
    rows = bench_mosa([64], embed_dim=32, heads=2, head_dim=8, sparsity=4, dense_heads=1, batch_tokens=128,
                      repeats=1, warmup=0, device=torch.device("cpu"), dtype=torch.float32)
    assert rows[0]["mosa"].startswith(f"{heads} sparse + 1 dense x 8, k 16") and rows[0]["batch"] == 2
    assert rows[0]["params_ratio"] == pytest.approx((heads * (32 + 4 * 32 * 8) + 4 * 32 * 8) / (4 * 32 * 32))
    cache = cache_bytes(64, embed_dim=32, heads=2, head_dim=8, sparsity=4, dense_heads=1, batch=2,
                        device=torch.device("cpu"), dtype=torch.float32)
    assert cache["mha_bytes"] == 2 * 32 * 4
    assert cache["mosa_expected_bytes"] == pytest.approx((2 * heads * 8 * 16 / 64 + 2 * 8) * 4)


def test_a_trained_mosa_lm_generates_through_headmix_generate_and_hf_generate(tmp_path, docs_file, capsys):
    """Training a MoSA LM stores calibrated thresholds with the model; ``headmix calibrate RUN`` computes the same
    ones for an existing run (under its lock, rewriting model.safetensors); ``headmix generate`` and Hugging Face
    ``generate`` on the exported folder then continue a prompt with the same tokens. A model whose thresholds
    were never calibrated is refused in one line naming the command."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from headmix.cli.main import main as cli_main
    from headmix.models import greedy_decode
    from headmix.training import TrainConfig, train

    run = tmp_path / "run"
    train(TrainConfig(task="lm", preset="llama-tiny-mosa", out=str(run), data=[str(docs_file)], vocab_size=300,
                      max_steps=3, max_tokens=400, max_len=32, warmup_steps=1, log_every=1, eval_every=3,
                      save_every=3, keep_checkpoints=1, average_last=1, valid_size=0.05, test_size=0.05,
                      progress=False))
    thresholds = {k: v for k, v in load_file(run / "model.safetensors").items() if k.endswith("score_threshold")}
    assert len(thresholds) == 2 and all(not torch.isnan(v).any() for v in thresholds.values())
    assert cli_main(["calibrate", str(run)]) == 0
    again = load_file(run / "model.safetensors")
    assert all(torch.equal(again[k], v) for k, v in thresholds.items())  # the same batches, the same thresholds
    assert "stored in" in capsys.readouterr().out

    assert cli_main(["generate", str(run), "--prompt", "In the beginning", "--max-new-tokens", "8", "--jsonl"]) == 0
    continuation = json.loads(capsys.readouterr().out)["continuation"]
    assert cli_main(["export-hf", str(run), str(tmp_path / "hf")]) == 0
    import headmix.hf  # noqa: F401  (registers the Auto classes)

    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = tokenizer("In the beginning", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True) == continuation
    assert all(layer.selection == "topk" for layer in model.modules() if isinstance(layer, MixtureOfSparseAttention))
    with torch.no_grad():  # a plain forward scores under expert choice, as in training: no cache by default
        assert model(**ids).cache is None and model(**ids, labels=ids["input_ids"]).loss is not None

    fresh = build_model(get_config("llama-tiny-mosa", task="lm"))
    with pytest.raises(ValueError, match=r"^the model's MoSA layers have no calibrated thresholds.*headmix calibrate RUN"):
        greedy_decode(fresh, torch.tensor([[1, 5, 6]]), max_len=3)
    with pytest.raises(ValueError, match="has no MoSA layer"):
        from headmix.models import calibrate_mosa
        calibrate_mosa(build_model(get_config("llama-tiny-mha", task="lm")), [torch.tensor([[1, 5, 6]])])
