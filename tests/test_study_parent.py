"""Continuation studies (``StudySpec.parent``): one parent trained once and shared by every row and seed, rows
that convert it (``init_options``) and keep its shape (``matching = "none"``), and the report's conversion table
(loss at conversion and after, MACs per token in both conventions, the parent's hash as every run recorded it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headmix.data import load_embedded_documents, write_jsonl_documents
from headmix.study import StudySpec, plan, run_study, write_report
from headmix.study.runner import PARENT_DIR, PARENT_RECORD, finished_results
from headmix.study.spec import ParentSpec, RowSpec

_TRAINING = {"max_len": 32, "max_tokens": 600, "vocab_size": 300, "warmup_steps": 1, "eval_every": 2,
             "log_every": 2, "save_every": 2, "average_last": 1, "keep_checkpoints": 2, "valid_size": 0.05,
             "test_size": 0.05, "lr": 1e-3}


@pytest.fixture(scope="module")
def docs_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    write_jsonl_documents(load_embedded_documents(sources="kjv-bible")[:60], path)
    return path


def _spec(docs: Path, **kw) -> StudySpec:
    values = dict(name="tiny-upcycle", task="lm", baseline="llama3-tiny-gqa", data=[str(docs)], seeds=[1, 2],
                  max_steps=2, matching="none", training=dict(_TRAINING),
                  parent=ParentSpec(max_steps=4, seed=7, training={"lr": 3e-3}),
                  rows=[RowSpec("dense"),
                        RowSpec("query-norm", init_options={"attention": "moh", "num_shared_heads": 2, "top_k": 2,
                                                            "router": "query_norm", "moh_impl": "sparse"}),
                        RowSpec("learned", init_options={"attention": "moh", "num_shared_heads": 2, "top_k": 2}),
                        RowSpec("pruned", init_options={"attention": "mha", "keep_heads": 2,
                                                        "calibration_batches": 1}, control_of="learned")])
    values.update(kw)
    spec = StudySpec(**values)
    spec.validate()
    return spec


def test_rows_keep_the_parents_shape_and_are_planned_from_their_conversion(docs_file):
    planned = {r.name: r for r in plan(_spec(docs_file))}
    assert planned["dense"].macs_ratio == 1.0
    assert planned["query-norm"].config.decoder_self_attention.router == "query_norm"
    assert planned["learned"].config.decoder_self_attention.kind == "moh"
    pruned = planned["pruned"].config.decoder_self_attention
    assert (pruned.kind, pruned.num_heads, pruned.kv_heads) == ("mha", 4, 2)  # 2 query heads of 4 per K/V group
    # not matched: each row at its own MACs (fewer active heads), none refused for it
    assert planned["pruned"].macs_ratio < 0.9 and planned["query-norm"].macs_ratio < 1.0
    # the same row in a study that matches MACs is refused for its MACs
    with pytest.raises(ValueError, match="outside the tolerance"):
        plan(StudySpec(name="m", task="lm", baseline="llama3-tiny-gqa", matching="macs",
                       rows=[RowSpec("GQA"), RowSpec("fewer", {"kind": "mha", "num_heads": 4, "kv_heads": 2})]))
    plan(StudySpec(name="m", task="lm", baseline="llama3-tiny-gqa", matching="none",
                   rows=[RowSpec("GQA"), RowSpec("fewer", {"kind": "mha", "num_heads": 4, "kv_heads": 2})]))


@pytest.mark.parametrize("changes,message", [
    ({"matching": "macs"}, 'set matching = "none"'),
    ({"matching": "sizes"}, "matching must be one of"),
    ({"rows": [RowSpec("dense"), RowSpec("x", {"kind": "moh", "num_heads": 8})]}, "sets no attention or solve"),
    ({"rows": [RowSpec("dense", init_options={"attention": "moh"})]}, "first row"),
    ({"parent": ParentSpec(max_steps=0)}, "parent.max_steps must be a positive integer"),
    ({"parent": ParentSpec(max_steps=4, training={"seed": 2})}, "parent.training must not set"),
    ({"parent": None}, "give the study a parent"),
    ({"rows": [RowSpec("dense"), RowSpec("x", {"kind": "moh"}, init_options={"attention": "moh"})]},
     "not both"),
])
def test_a_continuation_spec_refuses_what_it_cannot_do(docs_file, changes, message):
    with pytest.raises(ValueError, match=message):
        _spec(docs_file, **changes)


def test_a_conversion_the_parent_cannot_take_is_refused_by_row_before_anything_is_written(docs_file, tmp_path):
    spec = _spec(docs_file, rows=[RowSpec("dense"), RowSpec("too many", init_options={
        "attention": "moh", "num_shared_heads": 2, "top_k": 7})])
    with pytest.raises(ValueError, match=r"row 'too many': init_options: top_k \(7\) must be between 1 and the 6"):
        run_study(spec, tmp_path / "s", log=lambda m: None)
    assert not (tmp_path / "s").exists()


def test_a_parent_spec_from_toml(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('name = "s"\ntask = "lm"\nbaseline = "llama3-tiny-gqa"\nmatching = "none"\nmax_steps = 3\n'
                    '[parent]\nmax_steps = 5\nseed = 2\ntraining = { lr = 3e-3 }\n'
                    '[[rows]]\nname = "dense"\n[[rows]]\nname = "q"\n'
                    'init_options = { attention = "moh", num_shared_heads = 4, top_k = 2, router = "query_norm" }\n')
    spec = StudySpec.load(path)
    assert spec.parent == ParentSpec(max_steps=5, seed=2, training={"lr": 3e-3})
    assert spec.rows[1].init_options["router"] == "query_norm"
    path.write_text(path.read_text().replace("seed = 2", "seed = 2\ncolour = 1"))
    with pytest.raises(ValueError, match="parent takes the fields"):
        StudySpec.load(path)


def test_one_parent_is_trained_once_and_every_run_continues_it(tmp_path, docs_file, monkeypatch):
    import headmix.training as training

    trained = []
    real_train = training.train

    def counting_train(cfg, **kw):
        trained.append((Path(cfg.out).name, cfg.seed, cfg.max_steps, cfg.lr, cfg.init_from is not None))
        return real_train(cfg, **kw)

    monkeypatch.setattr(training, "train", counting_train)
    spec, out = _spec(docs_file), tmp_path / "study"
    results = run_study(spec, out, log=lambda m: None)
    # the parent first (its steps, seed and learning rate), once; then every row and seed from it
    assert trained[0] == (PARENT_DIR, 7, 4, 3e-3, False)
    assert sorted(trained[1:]) == sorted((f"seed-{s}", s, 2, 1e-3, True) for s in (1, 2) for _ in range(4))
    parent = json.loads((out / PARENT_DIR / PARENT_RECORD).read_text())
    # the finished parent keeps what the study keeps of a finished run (its newest checkpoint) and its final model
    assert len(list((out / PARENT_DIR / "checkpoints").iterdir())) == spec.keep_checkpoints == 1
    from headmix.storage.files import sha256_file

    assert parent["sha256"] == sha256_file(out / PARENT_DIR / "model.safetensors")
    starts = [r.summary["init_from"] for r in results]
    assert {s["sha256"] for s in starts} == {parent["sha256"]} and {Path(s["path"]).name for s in starts} == {"parent"}
    by = {(r.row, r.seed): r for r in results}
    assert by[("pruned", 1)].summary["init_from"]["options"]["keep_heads"] == 2
    # the dense continuation starts exactly at the parent (its loss at conversion is the parent's loss)
    parent_nll = json.loads((out / PARENT_DIR / "summary.json").read_text())["valid"]["nll"]
    assert by[("dense", 1)].summary["init_from"]["valid_at_start"]["nll"] == pytest.approx(parent_nll, rel=1e-6)

    # a second call trains nothing: the parent and the runs are finished
    trained.clear()
    run_study(spec, out, log=lambda m: None)
    assert trained == []

    table = write_report(spec, plan(spec), finished_results(spec, out, lambda m: None), out)
    cont = {r["name"]: r for r in table["continuation"]["rows"]}
    assert table["continuation"]["parent_sha256"] == [parent["sha256"]] and table["parent"]["sha256"] == parent["sha256"]
    start = {s: by[("learned", s)].summary["init_from"]["valid_at_start"]["nll"] -
             by[("dense", s)].summary["init_from"]["valid_at_start"]["nll"] for s in (1, 2)}
    assert cont["learned"]["at_conversion_vs_baseline"]["mean"] == pytest.approx(sum(start.values()) / 2)
    after = {s: by[("pruned", s)].summary["valid"]["nll"] - by[("dense", s)].summary["valid"]["nll"] for s in (1, 2)}
    assert cont["pruned"]["after_vs_baseline"]["mean"] == pytest.approx(sum(after.values()) / 2)
    assert cont["dense"]["attention_macs_per_token"]["full"] > cont["pruned"]["attention_macs_per_token"]["full"]
    from headmix.study.matching import attention_macs_of

    pruned_config = plan(spec)[3].config
    for convention in ("full", "causal"):  # per token at the block length (32: one 128 x 128 tile, so equal here)
        assert cont["pruned"]["attention_macs_per_token"][convention] == attention_macs_of(
            pruned_config, None, 32, "computed", convention) / 32
    md = (out / "results.md").read_text()
    assert "#### From the parent: conversion and continuation" in md and parent["sha256"][:16] in md
    assert "#### Equal steps: every row the same steps, at its own MACs" in md and "equal macs" not in md.lower()
    assert "every run recorded these weights" in md
    assert "| pruned | pruned: 2 query heads kept per K/V group |" in md

    # the records without the parent's weights (a clone of a committed study): refused in one line, nothing rewritten
    (out / PARENT_DIR / "model.safetensors").rename(tmp_path / "parent-weights")
    before = (out / PARENT_DIR / "metrics.jsonl").read_bytes()
    with pytest.raises(FileNotFoundError, match="the parent .* has finished but its model.safetensors is missing"):
        run_study(_spec(docs_file, seeds=[1, 2, 3], rows=[*_spec(docs_file).rows, RowSpec("more", init_options={
            "attention": "moh", "num_shared_heads": 1, "top_k": 3})]), out, log=lambda m: None)
    assert (out / PARENT_DIR / "metrics.jsonl").read_bytes() == before and trained == []
    assert not (out / "timing" / "more.json").exists()  # the new row was not timed either
    (tmp_path / "parent-weights").rename(out / PARENT_DIR / "model.safetensors")

    # a run that recorded another parent is named in the report
    summary_path = out / by[("learned", 2)].folder / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["init_from"]["sha256"] = "0" * 64
    summary_path.write_text(json.dumps(summary))
    write_report(spec, plan(spec), finished_results(spec, out, lambda m: None), out)
    assert "runs recorded 2 different parents' weights" in (out / "results.md").read_text()


def test_a_parent_without_its_weights_is_retrained_and_kept_only_with_the_recorded_sha256(tmp_path, docs_file):
    """A clone of a finished continuation study (the parent's records, not its weights): ``retrain_parent`` trains
    the parent again beside its records and puts its final files back when its weights' sha256 is the recorded one
    (the records stay byte for byte), also one recorded before headmix sorted the file's safetensors metadata (the
    same weights, the entries in the other order: the file comes back as recorded); a recorded sha256 the retrained
    weights do not have is refused in one line, and the study's parent stays as it was."""
    from headmix.storage.files import sha256_file

    spec, out = _spec(docs_file, seeds=[1], rows=[RowSpec("dense")]), tmp_path / "study"
    run_study(spec, out, log=lambda m: None)
    parent = out / PARENT_DIR
    recorded = json.loads((parent / PARENT_RECORD).read_text())["sha256"]
    records = {name: (parent / name).read_bytes() for name in ("summary.json", "metrics.jsonl", PARENT_RECORD)}
    for name in ("model.safetensors", "config.json"):
        (parent / name).unlink()
    with pytest.raises(FileNotFoundError, match="give --retrain-parent"):
        run_study(spec, out, log=lambda m: None)

    run_study(spec, out, log=lambda m: None, retrain_parent=True)
    assert sha256_file(parent / "model.safetensors") == recorded and (parent / "config.json").is_file()
    assert {name: (parent / name).read_bytes() for name in records} == records
    assert not (parent / "retrained").exists()
    run_study(spec, out, log=lambda m: None)  # whole again: no flag needed

    # a parent recorded before headmix sorted the safetensors metadata (its entries in the other order): the same
    # weights are recognised, and the file comes back byte for byte as recorded
    from headmix.storage.safetensors_header import metadata_orders, read_header, write_header

    write_header(parent / "model.safetensors", metadata_orders(read_header(parent / "model.safetensors"))[1])
    unsorted = sha256_file(parent / "model.safetensors")
    assert unsorted != recorded
    (parent / PARENT_RECORD).write_text(json.dumps({**json.loads(records[PARENT_RECORD]), "sha256": unsorted}))
    (parent / "model.safetensors").unlink()
    run_study(spec, out, log=lambda m: None, retrain_parent=True)
    assert sha256_file(parent / "model.safetensors") == unsorted

    (parent / "model.safetensors").unlink()
    (parent / PARENT_RECORD).write_text(json.dumps({**json.loads(records[PARENT_RECORD]), "sha256": "0" * 64}))
    with pytest.raises(ValueError, match=r"the retrained parent's weights have sha256 .* the recorded parent's "
                                         r"000000000000\.\.\.") as err:
        run_study(spec, out, log=lambda m: None, retrain_parent=True)
    assert "\n" not in str(err.value) and not (parent / "model.safetensors").exists()
    assert sha256_file(parent / "retrained" / "model.safetensors") == recorded  # sorted, as headmix writes it


def test_every_learned_router_of_lm_en_upcycle_gets_a_task_gradient_from_its_zero_initialisation():
    """The study's learned rows start from zero router weights (a tie that ``torch.topk`` breaks by position):
    the task loss alone (no auxiliary loss) must still move every routing parameter, at the first step."""
    import torch

    from headmix.interop.upcycle import upcycle_model
    from headmix.models import build_model, get_config
    from headmix.study import get_study

    spec = get_study("lm-en-upcycle")
    learned = [r for r in spec.rows if r.init_options.get("attention") == "moh"
               and r.init_options.get("router", "softmax") == "softmax"]
    names = ["learned 75%", "learned 50%", "learned per group 50%"]
    assert [r.name for r in learned] == names + [n + " distilled" for n in names]
    torch.manual_seed(0)
    parent = build_model(get_config("llama3-tiny-gqa", task="lm"))
    ids = torch.randint(4, parent.config.vocab_size, (2, 12))
    for row in learned:
        model = upcycle_model(parent, **row.init_options)
        routing = {n: p for n, p in model.named_parameters()
                   if n.rsplit(".", 2)[-2] in ("routed_gate", "shared_gate", "group_gate")}
        assert routing and all(not p.detach().any() for p in routing.values()), row.name
        model(ids, labels=ids).lm_loss.backward()
        for name, p in routing.items():
            assert p.grad is not None and float(p.grad.abs().max()) > 1e-6, (row.name, name)


def test_lm_en_upcycle_continues_every_conversion_with_and_without_distillation_each_router_against_pruning():
    """Issue 52: every conversion row of ``lm-en-upcycle`` once with the LM loss alone and once distilled from the
    parent (the same conversion, the defaults: weight 0.5, temperature 1); every router row is paired with the
    pruned row of the same active heads, and the learned router per group with its random twin, in both forms."""
    from headmix.study import get_study

    spec = get_study("lm-en-upcycle")
    rows = {r.name: r for r in spec.rows}
    plain = [r for r in spec.rows if r.distill is None]
    assert [r.name for r in spec.rows] == [r.name for r in plain] + [r.name + " distilled" for r in plain]
    for row in plain:
        twin = rows[row.name + " distilled"]
        assert twin.distill == {} and twin.distill_options == {} and twin.init_options == row.init_options
        assert twin.controls == [c + " distilled" for c in row.controls]
    pruned_of = {name: c.name for c in plain if c.name.startswith("pruned") for name in c.controls}
    assert pruned_of == {"learned 75%": "pruned 75%", "query-norm 75%": "pruned 75%", "learned 50%": "pruned 50%",
                         "query-norm 50%": "pruned 50%", "learned per group 50%": "pruned 50%"}
    assert rows["per group 50% random"].controls == ["learned per group 50%"]
    # each pruned row keeps as many query heads (of the parent's 8 on 2 K/V heads) as a token of its routers uses
    for name, pruned in pruned_of.items():
        options, groups = rows[name].init_options, 2
        active = (options["num_shared_heads"] + options["top_k"]) * (groups if options.get("route_per_group") else 1)
        assert rows[pruned].init_options["keep_heads"] * groups == active, name
