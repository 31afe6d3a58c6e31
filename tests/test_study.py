"""headmix study: MACs matching, paired statistics against hand computations, a tiny study end to end
(2 rows, 2 seeds, a few steps) with resume, and the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from headmix.data import load_embedded_documents, write_jsonl_documents
from headmix.models import AttentionConfig, analytic_macs, build_model, get_config
from headmix.study import (StudySpec, get_study, match_attention, paired_difference, plan, run_study, summarize,
                           t_quantile, write_report)
from headmix.study.matching import with_attention
from headmix.study.spec import RowSpec


def test_t_quantiles_match_the_published_table():
    # Student-t 0.975 quantiles from the standard table (e.g. NIST/SEMATECH e-Handbook, Table 1.3.6.7.2)
    for df, value in ((1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (9, 2.262), (30, 2.042)):
        assert t_quantile(0.975, df) == pytest.approx(value, abs=5e-4)
    assert t_quantile(0.025, 4) == pytest.approx(-2.776, abs=5e-4)
    assert t_quantile(0.95, 5) == pytest.approx(2.015, abs=5e-4)


def test_paired_difference_by_hand():
    row = {1: 5.0, 2: 4.0, 3: 6.5, 7: 1.0}  # seed 7 has no baseline: not paired
    base = {1: 4.0, 2: 4.5, 3: 5.0}
    diff = paired_difference(row, base)
    d = [1.0, -0.5, 1.5]
    m = sum(d) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / 2)
    half = 4.302653 * sd / math.sqrt(3)
    assert diff.seeds == [1, 2, 3] and diff.n == 3
    assert diff.mean == pytest.approx(m) and diff.std == pytest.approx(sd)
    assert diff.low == pytest.approx(m - half, abs=1e-5) and diff.high == pytest.approx(m + half, abs=1e-5)
    assert diff.significant is False and diff.verdict(lower_is_better=True) == "no significant difference"
    clear = paired_difference({1: 1.0, 2: 1.1, 3: 0.9}, {1: 2.0, 2: 2.0, 3: 2.05})
    assert clear.significant is True
    assert clear.verdict(lower_is_better=True) == "better than the baseline"
    assert clear.verdict(lower_is_better=False) == "worse than the baseline"
    one = paired_difference({1: 2.0}, {1: 1.0})
    assert one.low is None and one.significant is None and one.verdict(True) == "too few seeds for an interval"
    s = summarize([1.0, 2.0, 4.0])
    assert s.mean == pytest.approx(7 / 3) and s.std == pytest.approx(math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2
                                                                                 + (4 - 7 / 3) ** 2) / 2))
    with pytest.raises(ValueError, match="share no seed"):
        paired_difference({1: 1.0}, {2: 1.0})


def _attention_macs(config, tgt_len):
    return sum(v for k, v in analytic_macs(config, None, tgt_len).full.items() if k.endswith("attention"))


def test_match_attention_sizes_a_variant_to_the_baseline():
    base = get_config("mini-mha", task="lm")
    target = _attention_macs(base, 128)
    m = match_attention(base, {"kind": "moa", "num_experts": 16, "top_k": 4}, ["head_dim"], prefer={"head_dim": 32},
                        tgt_len=128)
    got = _attention_macs(with_attention(base, m.attention), 128)
    assert got == m.macs and abs(got / target - 1) <= 0.02
    # the preferred size wins among the feasible ones; a plain search for the closest would differ
    feasible = [d for d in range(1, 257) if abs(_attention_macs(with_attention(
        base, AttentionConfig(kind="moa", num_experts=16, top_k=4, head_dim=d)), 128) / target - 1) <= 0.02]
    assert m.attention.head_dim == min(feasible, key=lambda d: abs(d - 32))
    with pytest.raises(ValueError, match="closest is"):
        match_attention(base, {"kind": "talking_heads", "num_heads": 4}, ["head_dim"], tolerance=1e-6, tgt_len=128)
    with pytest.raises(ValueError, match="both fixed"):
        match_attention(base, {"kind": "moa", "num_experts": 4, "top_k": 2}, ["top_k"])


def test_rows_keep_the_baselines_conventions():
    """A row changes the kind of attention, not the model's conventions: a Llama-style baseline's rows have no
    biases and rotary positions unless the row fixes them."""
    base = get_config("llama-mini-mha", task="lm")
    assert base.decoder_self_attention.bias is False and base.decoder_self_attention.rotary is True
    for fixed in ({"kind": "moa", "num_experts": 8, "top_k": 4}, {"kind": "switchhead", "num_heads": 2,
                                                                   "num_experts": 4, "top_k": 2}):
        att = match_attention(base, fixed, ["head_dim"], prefer={"head_dim": 32}).attention
        assert (att.kind, att.bias, att.rotary) == (fixed["kind"], False, True)
        assert [n for n, _ in build_model(with_attention(base, att)).named_parameters() if "bias" in n] == []
    fixed_bias = {"kind": "moa", "num_experts": 8, "top_k": 4, "bias": True, "rotary_base": 500.0}
    att = match_attention(base, fixed_bias, ["head_dim"], prefer={"head_dim": 32}).attention
    assert (att.bias, att.rotary_base) == (True, 500.0)


def _spec(docs: Path, **kw) -> StudySpec:
    values = dict(name="tiny", task="lm", baseline="tiny-mha", data=[str(docs)], seeds=[1, 2], max_steps=4,
                  rows=[RowSpec("MHA"), RowSpec("MoA", {"kind": "moa", "num_experts": 4, "top_k": 2}, ["head_dim"],
                                                {"head_dim": 16})],
                  training={"max_len": 32, "max_tokens": 600, "vocab_size": 300, "warmup_steps": 2, "eval_every": 2,
                            "log_every": 2, "save_every": 2, "average_last": 1, "keep_checkpoints": 2,
                            "valid_size": 0.05, "test_size": 0.05})
    values.update(kw)
    spec = StudySpec(**values)
    spec.validate()
    return spec


@pytest.fixture(scope="module")
def docs_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    write_jsonl_documents(load_embedded_documents(sources="kjv-bible")[:60], path)
    return path


def test_tiny_study_end_to_end_with_resume(tmp_path, docs_file, monkeypatch):
    import headmix.training as training

    spec = _spec(docs_file, seeds=[1])
    planned = plan(spec)
    assert [r.name for r in planned] == ["MHA", "MoA"]
    assert planned[0].macs_ratio == 1.0 and abs(planned[1].macs_ratio - 1) <= 0.02
    assert planned[1].config.decoder_self_attention.kind == "moa"

    trained = []
    real_train = training.train

    def counting_train(cfg, **kw):
        trained.append((Path(cfg.out).parent.name, cfg.seed))
        return real_train(cfg, **kw)

    monkeypatch.setattr(training, "train", counting_train)
    out = tmp_path / "study"
    first = run_study(spec, out, log=lambda m: None)
    assert trained == [("MHA", 1), ("MoA", 1)] and len(first) == 2

    # a second seed: the finished runs are read, not retrained
    spec2 = _spec(docs_file, seeds=[1, 2])
    trained.clear()
    results = run_study(spec2, out, log=lambda m: None)
    assert trained == [("MHA", 2), ("MoA", 2)] and len(results) == 4
    # every run, whatever its seed, has the same split and the same tokenizer
    for name in ("data/valid.jsonl", "data/train.jsonl", "tokenizer/tokenizer.json"):
        assert len({(out / r.folder / name).read_bytes() for r in results}) == 1, name
    table = write_report(spec2, plan(spec2), results, out)

    # the statistics in the table, by hand from the runs' summaries
    nll = {(r.row, r.seed): json.loads((out / r.folder / "summary.json").read_text())["valid"]["nll"] for r in results}
    moa = table["rows"][1]
    d = [nll[("MoA", s)] - nll[("MHA", s)] for s in (1, 2)]
    m, sd = sum(d) / 2, abs(d[0] - d[1]) / math.sqrt(2)
    half = 12.706205 * sd / math.sqrt(2)
    vs = moa["vs_baseline"]["valid_nll"]
    assert vs["mean"] == pytest.approx(m) and vs["std"] == pytest.approx(sd)
    assert vs["low"] == pytest.approx(m - half, rel=1e-5) and vs["high"] == pytest.approx(m + half, rel=1e-5)
    assert moa["metrics"]["valid_nll"]["mean"] == pytest.approx((nll[("MoA", 1)] + nll[("MoA", 2)]) / 2)
    assert table["rows"][0]["attention_macs_ratio"] == 1.0
    assert sorted(table["curves"]["MoA"]) == ["1", "2"] and sorted(table["curves"]["MoA"]["1"], key=int) == ["2", "4"]
    md = (out / "results.md").read_text()
    assert "| MoA |" in md and f"{m:+.3f}" in md
    assert {p.name for p in out.iterdir()} >= {"results.json", "results.md", "valid_curves.png", "quality_vs_params.png"}

    # the same folder with another study is refused, nothing trained
    other = _spec(docs_file, max_steps=6)
    trained.clear()
    with pytest.raises(ValueError, match="another study"):
        run_study(other, out, log=lambda m: None)
    assert trained == []


def test_spec_errors_name_the_field(tmp_path):
    base = dict(name="s", task="lm", baseline="tiny-mha", rows=[{"name": "MHA"}])
    StudySpec.from_dict(base)
    for changes, message in (({"task": "speech"}, "task must be one of"),
                             ({"rows": [{"name": "X", "attention": {"kind": "moa"}}]}, "first row"),
                             ({"rows": [{"name": "MHA"}, {"name": "MHA"}]}, "distinct names"),
                             ({"seeds": [1, 1]}, "seeds must be distinct"),
                             ({"max_steps": 0}, "max_steps must be a positive integer"),
                             ({"training": {"seed": 3}}, "training must not set"),
                             ({"colour": "red"}, "unknown field"),
                             ({"rows": [{"name": "MHA"}, {"name": "M", "solve": ["colour"],
                                                          "attention": {"kind": "moa"}}]}, "solve must name")):
        with pytest.raises(ValueError, match=message):
            StudySpec.from_dict({**base, **changes})
    spec_file = tmp_path / "s.toml"
    spec_file.write_text('name = "s"\ntask = "lm"\nbaseline = "tiny-mha"\ndata = ["d.jsonl"]\n[[rows]]\nname = "MHA"\n')
    loaded = StudySpec.load(spec_file)
    assert loaded.data == [str(tmp_path / "d.jsonl")]
    with pytest.raises(ValueError, match="unknown study"):
        get_study("nope")


def test_builtin_studies_are_matched_within_two_percent():
    for name in ("lm-en", "translation-en-de", "lm-en-llama"):
        spec = get_study(name)
        rows = plan(spec)
        assert len(spec.seeds) >= 3
        assert all(abs(r.macs_ratio - 1) <= 0.02 for r in rows), [(r.name, r.macs_ratio) for r in rows]


def test_cli_plan_and_list(capsys):
    from headmix.cli.main import main

    assert main(["study", "--list"]) == 0
    assert "lm-en" in capsys.readouterr().out
    assert main(["study", "lm-en", "--plan"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["name"] == "MHA" and all(abs(r["attention_macs_ratio"] - 1) <= 0.02 for r in rows)
    assert main(["study", "nope"]) == 2
    assert "unknown study" in capsys.readouterr().err


def test_demo_pair_is_matched_and_the_paired_bleu_test_is_sacrebleus():
    import sacrebleu

    from headmix.training.demo import demo_models, paired_bleu

    models = demo_models()
    moa, mha = models["moa"].decoder_self_attention, models["mha"].decoder_self_attention
    assert (moa.kind, moa.num_experts, moa.top_k) == ("moa", 16, 4) and mha.kind == "mha"
    att = {n: sum(v for k, v in analytic_macs(c).full.items() if k.endswith("attention")) for n, c in models.items()}
    assert abs(att["moa"] / att["mha"] - 1) <= 0.02
    refs = ["the cat sat on the mat", "there is a dog in the garden", "open the file menu", "save the document now"]
    good = ["the cat sat on the mat", "there is a dog in the garden", "open the file menu", "save the document"]
    bad = ["a cat sits on a mat", "a dog is in a garden", "the menu file", "document save"]
    result = paired_bleu(good, bad, refs, samples=200)
    expected = sacrebleu.corpus_bleu(good, [refs]).score - sacrebleu.corpus_bleu(bad, [refs]).score
    assert result["bleu_difference"] == pytest.approx(expected)
    same = paired_bleu(bad, bad, refs, samples=200)
    assert same["bleu_difference"] == 0.0 and same["distinguishable"] is False
    with pytest.raises(ValueError, match="same length"):
        paired_bleu(good, bad[:2], refs)


def test_a_study_folder_without_its_data_splits_keeps_its_tokenizer(tmp_path, docs_file):
    """What is committed of a study (records, the shared tokenizer, no splits) is enough to go on: the
    shared folder gets the same seeded splits back and keeps its tokenizer byte for byte."""
    from headmix.runs import Run
    from headmix.training import TrainConfig
    from headmix.training.config import IDENTITY
    from headmix.training.setup import prepare_data, prepare_shared_data

    cfg = TrainConfig(task="lm", out=str(tmp_path / "shared"), data=[str(docs_file)], vocab_size=300, seed=3,
                      split_seed=3, valid_size=0.05, test_size=0.05)
    from headmix.data import train_tokenizer

    tok_dir = prepare_shared_data(cfg, lambda m: None)
    valid = (tmp_path / "shared/data/valid.jsonl").read_bytes()
    for f in (tmp_path / "shared" / "data").iterdir():
        f.unlink()
    # the committed tokenizer is kept as it is, not trained again (another vocabulary shows it)
    other = train_tokenizer(["some other text to learn a vocabulary from"] * 3, 280)
    other.save(tok_dir)
    tokenizer = (tok_dir / "tokenizer.json").read_bytes()
    with Run.create_or_resume(cfg.out, cfg.to_dict(), identity=IDENTITY) as run:
        _, tok = prepare_data(cfg, run, lambda m: None)
    assert tok.vocab_size == other.vocab_size != 300 and tok.encode("learn a vocabulary") == other.encode(
        "learn a vocabulary")
    assert (tok_dir / "tokenizer.json").read_bytes() == tokenizer
    assert (tmp_path / "shared/data/valid.jsonl").read_bytes() == valid


def test_a_translation_study_scores_each_run_with_bleu(tmp_path, pairs_file):
    spec = StudySpec(name="tiny-tr", task="translation", baseline="tiny-mha", data=[str(pairs_file)], seeds=[1],
                     max_steps=2, rows=[RowSpec("MHA")], bleu_sentences=5, bleu_beam=1,
                     training={"max_len": 32, "max_tokens": 600, "vocab_size": 300, "warmup_steps": 1,
                               "eval_every": 2, "log_every": 1, "save_every": 2, "average_last": 1,
                               "valid_size": 0.05, "test_size": 0.05})
    spec.validate()
    out = tmp_path / "study"
    results = run_study(spec, out, log=lambda m: None)
    stored = json.loads((out / results[0].folder / "study_eval.json").read_text())
    assert stored["sentences"] == 5 and results[0].evaluation == stored
    table = write_report(spec, plan(spec), results, out)
    assert table["metrics"][:2] == ["valid_nll", "valid_ppl"] and "bleu" in table["metrics"]
    assert table["rows"][0]["metrics"]["bleu"]["mean"] == stored["bleu"]


def test_translation_table_shows_the_nll_difference_beside_bleus():
    from headmix.study.report import to_markdown

    def stat(mean):
        return {"mean": mean, "std": 0.1}

    att = {"kind": "switchhead", "num_heads": 2, "head_dim": 47, "num_experts": 4, "top_k": 2}
    rows = [{"name": "MHA", "attention": {"kind": "mha", "num_heads": 4, "head_dim": 32}, "attention_macs": 6e6,
             "attention_macs_ratio": 1.0, "parameters": 2e6, "seeds": [1, 2, 3], "vs_baseline": {},
             "metrics": {"valid_nll": stat(4.8), "bleu": stat(1.5), "tokens_per_second": stat(1000.0)}},
            {"name": "SH", "attention": att, "attention_macs": 6e6, "attention_macs_ratio": 1.0, "parameters": 2e6,
             "seeds": [1, 2, 3], "metrics": {"valid_nll": stat(4.9), "bleu": stat(1.2)},
             "vs_baseline": {"bleu": {"mean": -0.3, "low": -1.0, "high": 0.4, "verdict": "no significant difference"},
                             "valid_nll": {"mean": 0.1, "low": 0.05, "high": 0.15, "verdict": "higher"}}}]
    table = {"name": "t", "task": "translation", "max_steps": 4, "seeds": [1, 2, 3], "baseline": "MHA",
             "baseline_preset": "mini-mha", "tolerance": 0.02, "metrics": ["valid_nll", "bleu"], "rows": rows}
    lines = to_markdown(table).splitlines()
    header = next(line for line in lines if line.startswith("| row"))
    assert header.endswith("| Δ bleu [95% CI] | verdict (bleu) | Δ valid_nll [95% CI] | verdict (valid_nll) | tokens/s |")
    assert lines[-1].startswith("| SH | SwitchHead 2×47, top 2 of 4 experts |")
    assert lines[-1].endswith("| -0.300 [-1.000, +0.400] | no significant difference | +0.100 [+0.050, +0.150] | higher | – |")
    assert lines[-2].endswith("| – | baseline | – | baseline | 1,000 |")
    table["metrics"], table["task"] = ["valid_nll"], "lm"
    header = next(line for line in to_markdown(table).splitlines() if line.startswith("| row"))
    assert header.endswith("| valid_nll | Δ valid_nll [95% CI] | verdict | tokens/s |")
