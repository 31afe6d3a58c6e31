"""Upcycling (issue 44): every dense source headmix reads (Hugging Face Llama / Qwen3 / gated Qwen3 folders, a
headmix run, an export-hf folder) -> MoH with the learned (zero-initialised), query-norm or random router, and the
statically pruned dense control whose heads are ranked on calibration batches; through Python and through
``headmix train lm --init-from SRC --init-options JSON``. With every head active the converted model computes the
source's logits; impossible requests are refused in one line naming the option before anything is written."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from headmix.interop import from_pretrained, head_importance, upcycle, upcycle_model, upcycled_config
from headmix.models import build_model, get_config, load_pretrained

transformers = pytest.importorskip("transformers")

from test_bench_commands import one_thread_after  # noqa: E402,F401  (a fixture)
from test_first_hour import lm_args  # noqa: E402
from test_hf import tiny_run  # noqa: E402
from test_interop import hf_llama, tokens  # noqa: E402
from test_interop_gqa import gated_qwen3, hf_qwen3  # noqa: E402

ROUTERS = ["softmax", "query_norm", "random"]


def logits(model, ids):
    with torch.no_grad():
        return model.eval()(ids).logits


def gqa_model(seed: int = 0, kv_heads: int | None = 2, **changes):
    """A dense headmix Llama-style LM: 4 query heads on ``kv_heads`` K/V heads, weights spread so heads differ."""
    torch.manual_seed(seed)
    config = get_config("llama-tiny-mha", task="lm", vocab_size=60)
    att = dataclasses.replace(config.decoder_self_attention, kv_heads=kv_heads, **changes)
    model = build_model(config.replace(decoder_self_attention=att)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    return model


# ------------------------------------------------------------------------------------- Hugging Face folders
HF_SOURCES = {"llama": lambda: hf_llama(), "qwen3": lambda: hf_qwen3(), "gated-qwen3": lambda: gated_qwen3("headwise")}


@pytest.mark.parametrize("source", list(HF_SOURCES))
@pytest.mark.parametrize("router", ROUTERS)
def test_hugging_face_folders_with_every_head_active_keep_the_logits(source, router, tmp_path):
    """Llama, Qwen3 and gated Qwen3 folders (4 query heads on 2 K/V heads) -> MoH, global (1 shared + top 3) and
    per K/V group (top 2 of 2), through ``from_pretrained`` and ``upcycle``: the source's logits."""
    hf = HF_SOURCES[source]()
    hf.save_pretrained(tmp_path)
    ids = tokens(2, 9)
    expected = logits(hf, ids)
    for options in (dict(num_shared_heads=1, top_k=3), dict(num_shared_heads=0, top_k=2, route_per_group=True)):
        for model in (from_pretrained(tmp_path, attention="moh", router=router, **options),
                      upcycle(tmp_path, attention="moh", router=router, **options)):
            att = model.config.decoder_self_attention
            assert att.kind == "moh" and (att.router or "softmax") == router
            torch.testing.assert_close(logits(model, ids), expected, rtol=1e-4, atol=1e-5)


def test_a_zero_initialised_learned_router_prunes_by_position_at_conversion():
    """Equal scores: ``torch.topk`` keeps the first routed heads, for every token."""
    model = upcycle_model(gqa_model(), attention="moh", num_shared_heads=1, top_k=2)
    layer = model.decoder.layers[0].self_attn
    out = layer(torch.randn(2, 5, 64), is_causal=True)
    assert torch.equal(out.routing.expert_index.sort(1).values, torch.tensor([[0, 1]] * 10))


# ------------------------------------------------------------------------------- headmix run and export-hf
@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("layout", [dict(num_shared_heads=2, top_k=2), dict(num_shared_heads=0, top_k=2,
                                                                            route_per_group=True)])
def test_headmix_folders_with_every_head_active_keep_the_logits(router, layout, tmp_path):
    """A run's ``save_pretrained`` folder and its ``export-hf`` folder -> MoH: the source's logits exactly (the
    same float32 arithmetic in the same order per head)."""
    from headmix.hf import run_to_hf

    att = get_config("llama-tiny-mha", task="lm", vocab_size=60).decoder_self_attention
    run = tiny_run(tmp_path / "run", preset="llama-tiny-mha",
                   decoder_self_attention=dataclasses.replace(att, kv_heads=2))  # 4 query heads on 2 K/V heads
    source = load_pretrained(run)
    ids = torch.randint(3, source.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    expected = logits(source, ids)
    run_to_hf(run, tmp_path / "hf")
    for folder in (run, tmp_path / "hf"):
        model = upcycle(folder, attention="moh", router=router, **layout)
        torch.testing.assert_close(logits(model, ids), expected, rtol=0, atol=1e-5)
        if router == "softmax":
            routers = [p for n, p in model.named_parameters() if n.split(".")[-2] in ("routed_gate", "shared_gate",
                                                                                      "group_gate")]
            assert routers and all((p == 0).all() for p in routers)


def test_fewer_active_heads_drop_exactly_the_unselected_heads_contributions():
    """query_norm with 1 shared + top 1 of 3: each token's output is the source's without the unselected heads,
    the heads the rule picks for it (checked on layer 0, whose input is the same in both models)."""
    source = gqa_model(kv_heads=None)
    model = upcycle_model(source, attention="moh", num_shared_heads=1, top_k=1, router="query_norm")
    assert source.decoder.layers[0].self_attn.out_proj.bias is None
    x = torch.randn(2, 6, 64)
    dense, moh = source.decoder.layers[0].self_attn, model.decoder.layers[0].self_attn
    out = moh(x, is_causal=True)
    q = dense.q_proj(x).view(12, 4, 16)[:, 1:]
    chosen = q.norm(dim=-1).argmax(-1) + 1  # the routed head with the largest query norm
    expected = torch.zeros_like(out.output)
    contributions = _head_contributions(dense, x)
    for token in range(12):
        b, t = divmod(token, 6)
        expected[b, t] = contributions[b, 0, t] + contributions[b, chosen[token], t]  # the preset has no biases
    torch.testing.assert_close(out.output, expected, rtol=0, atol=1e-5)


def _head_contributions(layer, x, padding=None):
    """Each head's ``H^i W_O^i`` ``(batch, heads, time, d_model)``, computed head by head from the projections."""
    b, t, _ = x.shape
    h, d = layer.num_heads, layer.head_dim
    group = h // layer.kv_heads
    out = []
    for i in range(h):
        kv = i // group
        q = (x @ layer.q_proj.weight[i * d:(i + 1) * d].T).unsqueeze(1)
        k = (x @ layer.k_proj.weight[kv * d:(kv + 1) * d].T).unsqueeze(1)
        v = (x @ layer.v_proj.weight[kv * d:(kv + 1) * d].T).unsqueeze(1)
        if layer.q_proj.bias is not None:
            q = q + layer.q_proj.bias[i * d:(i + 1) * d]
        if layer.rotary is not None:
            q, k = layer.rotary(q), layer.rotary(k)
        mask = torch.ones(t, t).tril().bool()[None, None]
        if padding is not None:
            mask = mask & ~padding[:, None, None, :]
        scores = (q @ k.transpose(-1, -2)) / d ** 0.5
        o = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v
        out.append(o.squeeze(1) @ layer.out_proj.weight[:, i * d:(i + 1) * d].T)
    return torch.stack(out, 1)


# ------------------------------------------------------------------------------------------------ pruning
def test_head_importance_is_the_mean_norm_of_each_heads_contribution_over_real_tokens():
    source = gqa_model()
    ids = torch.randint(3, 60, (3, 8), generator=torch.Generator().manual_seed(2))
    ids[1, 5:] = source.config.pad_id  # padding: not measured
    inputs = []
    handle = source.decoder.layers[1].self_attn.register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
    scores = head_importance(source, [ids])
    handle.remove()
    padding = ids == source.config.pad_id
    norms = _head_contributions(source.decoder.layers[1].self_attn, inputs[0], padding).norm(dim=-1)  # (b, h, t)
    expected = norms.permute(0, 2, 1)[~padding].mean(0)
    torch.testing.assert_close(scores[1].float(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_heads,keep", [(2, 1), (None, 3)])
def test_pruning_keeps_the_most_important_heads_and_drops_the_others_exactly(kv_heads, keep):
    """GQA (2 groups of 2): the most important head of each group; MHA: the 3 most important heads, with their
    K/V heads. The pruned model's logits equal the source's with the dropped heads' output columns zeroed."""
    source = gqa_model(kv_heads=kv_heads)
    batches = [torch.randint(3, 60, (2, 8), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    pruned = upcycle_model(source, attention="mha", keep_heads=keep, batches=batches)
    att = pruned.config.decoder_self_attention
    scores = head_importance(source, batches)
    reference = copy.deepcopy(source)
    for layer, score in zip(reference.decoder.layers, scores):
        if kv_heads:
            dropped = [g * 2 + int(score[g * 2:g * 2 + 2].argmin()) for g in range(2)]
        else:
            dropped = score.argsort()[:4 - keep].tolist()
        with torch.no_grad():
            for h in dropped:
                layer.self_attn.out_proj.weight[:, h * 16:(h + 1) * 16] = 0
    assert att.kind == "mha" and att.num_heads == (2 if kv_heads else 3) and att.kv_heads == kv_heads
    ids = tokens(2, 9)
    torch.testing.assert_close(logits(pruned, ids), logits(reference, ids), rtol=0, atol=1e-5)
    everything = upcycle_model(source, attention="mha", keep_heads=2 if kv_heads else 4, batches=batches)
    torch.testing.assert_close(logits(everything, ids), logits(source, ids), rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("options,message", [
    (dict(attention="moh", num_shared_heads=1, top_k=4), r"^top_k \(4\) must be between 1 and the 3 routed heads "),
    (dict(attention="moh", num_shared_heads=0, top_k=3, route_per_group=True),
     r"^top_k \(3\) must be between 1 and the 2 routed heads per K/V group"),
    (dict(attention="moh", num_shared_heads=4, top_k=1), r"^num_shared_heads \(4\) must leave a head to route"),
    (dict(attention="mha", keep_heads=0), r"^keep_heads must be between 1 and the 2 query heads per K/V group"),
    (dict(attention="mha", keep_heads=3), r"^keep_heads must be between 1 and the 2 query heads per K/V group"),
    (dict(attention="moh", num_shared_heads=1, top_k=1, router="noisy"), r"^router must be one of"),
    (dict(attention="moa"), r"^attention must be one of \('moh', 'mha'\)"),
    (dict(attention="mha", router="query_norm"), r"^router applies to attention 'moh'"),
    (dict(attention="moh", num_shared_heads=1, top_k=1, kv_heads=1), r"^'kv_heads' is not an upcycling option"),
    (dict(attention="moh", num_shared_heads=1, top_k=1, topk=1), r"^'topk' is not an upcycling option"),
])
def test_impossible_requests_are_refused_in_one_line_naming_the_option(options, message):
    with pytest.raises(ValueError, match=message) as err:
        upcycled_config(gqa_model().config, **options)
    assert "\n" not in str(err.value)


def test_a_source_that_is_not_dense_attention_is_refused():
    config = get_config("llama-tiny-moh", task="lm", vocab_size=60)
    with pytest.raises(ValueError, match=r"^init_from: the source's attention is 'moh'; upcycling starts from dense"):
        upcycled_config(config, attention="moh", num_shared_heads=1, top_k=1)
    with pytest.raises(ValueError, match="keep_heads needs calibration batches"):
        upcycle_model(gqa_model(), attention="mha", keep_heads=1)


# ------------------------------------------------------------------------------------ headmix train lm
@pytest.fixture(scope="module")
def dense_run(tmp_path_factory, docs_file):
    from headmix.cli.main import main

    out = tmp_path_factory.mktemp("upcycle") / "dense"
    args = lm_args(out, docs_file, "--max-steps", "2")
    args[args.index("tiny-mha")] = "llama-tiny-mha"
    assert main(args) == 0
    return out


def continue_args(out, docs_file, source, options, *extra):
    args = lm_args(out, docs_file, "--init-from", str(source), "--init-options", json.dumps(options), *extra)
    args.remove("--preset"), args.remove("tiny-mha")
    return args


def test_train_from_a_headmix_run_records_the_loss_at_conversion(dense_run, docs_file, tmp_path):
    """``--init-options`` on a headmix run: MoH with the query-norm rule, every head active; the validation of
    the converted model before its first step is the source's final validation (same model function, same
    split), written as step 0 of the curve and in the summary."""
    from headmix.cli.main import main

    out = tmp_path / "moh"
    options = {"attention": "moh", "num_shared_heads": 2, "top_k": 2, "router": "query_norm"}
    assert main(continue_args(out, docs_file, dense_run, options)) == 0
    config = json.loads((out / "config.json").read_text())["decoder_self_attention"]
    assert (config["kind"], config["router"], config["top_k"]) == ("moh", "query_norm", 2)
    summary = json.loads((out / "summary.json").read_text())
    source = json.loads((dense_run / "summary.json").read_text())["valid"]
    assert summary["init_from"]["options"] == options and summary["init_from"]["kind"] == "headmix run"
    assert summary["init_from"]["valid_at_start"]["loss"] == pytest.approx(source["loss"], abs=1e-5)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    start = [r for r in records if r["split"] == "valid" and r["step"] == 0]
    assert len(start) == 1 and start[0]["loss"] == summary["init_from"]["valid_at_start"]["loss"]


def test_train_the_pruning_control_from_a_headmix_run(dense_run, docs_file, tmp_path):
    from headmix.cli.main import main

    out = tmp_path / "pruned"
    options = {"attention": "mha", "keep_heads": 2, "calibration_batches": 2}
    assert main(continue_args(out, docs_file, dense_run, options)) == 0
    config = json.loads((out / "config.json").read_text())["decoder_self_attention"]
    assert (config["kind"], config["num_heads"]) == ("mha", 2)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["init_from"]["valid_at_start"]["loss"] > 0


@pytest.mark.parametrize("options,message", [
    ({"attention": "moh", "num_shared_heads": 1, "top_k": 4}, "init_options: top_k (4) must be between 1 and the 3"),
    ({"attention": "mha", "keep_heads": 0}, "init_options: keep_heads must be between 1 and the layer's 4 heads"),
    ({"attention": "moh", "num_shared_heads": 1, "top_k": 1, "pad_id": 3}, "apply to a Hugging Face init_from"),
])
def test_train_refuses_an_impossible_upcycling_before_writing(dense_run, docs_file, tmp_path, capsys, options,
                                                              message):
    from headmix.cli.main import main

    out = tmp_path / "x"
    assert main(continue_args(out, docs_file, dense_run, options)) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not out.exists()


def test_train_refuses_a_source_that_is_not_dense_before_writing(docs_file, tmp_path, capsys):
    from headmix.cli.main import main

    source = tiny_run(tmp_path / "moa", preset="llama-tiny-moa")
    out = tmp_path / "x"
    assert main(continue_args(out, docs_file, source, {"attention": "moh", "num_shared_heads": 1, "top_k": 1})) == 2
    assert "the source's attention is 'moa'" in capsys.readouterr().err and not out.exists()



def test_the_upcycle_benchmark_command_prints_every_row(capsys, one_thread_after):
    """``headmix bench upcycle`` at a tiny size: a row per upcycling target beside the dense baseline (what it
    measures is checked by reading it, not by timing here)."""
    from headmix.bench.upcycle import ROWS
    from headmix.cli.main import main

    assert main(["bench", "upcycle", "--d-model", "32", "--layers", "1", "--ffn-dim", "32", "--vocab-size", "50",
                 "--batch", "1", "--length", "8", "--repeats", "1", "--calibration-batches", "1", "--threads", "1"]) == 0
    rows = [line.split(" | ")[0].lstrip("| ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["dense (baseline)", *ROWS]


def test_a_hugging_face_source_that_is_not_dense_is_refused_before_its_weights_are_read(tmp_path):
    from test_interop import hf_jetmoe_model

    hf_jetmoe_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"^init_from: the source's attention is 'moa'"):
        upcycle(tmp_path, attention="moh", num_shared_heads=1, top_k=1, expand_kv=True)
