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


def _small_gqa(d_model: int, layers: int, block: int):
    """A Llama-style grouped-query baseline (8 heads on 2 K/V heads, head size d_model / 8) small enough that one
    unit of head size moves a row's MACs by several percent."""
    from headmix.study.builtin import llama_model

    return llama_model(AttentionConfig(kind="mha", num_heads=8, kv_heads=2), 300, d_model=d_model, layers=layers,
                       max_positions=block)


def test_a_small_gated_row_reaches_two_percent_by_a_finer_step_than_its_head_size():
    """d_model 128, heads of 16: the headwise-gated row's head sizes step by 6% (15: 0.96x, 16: 1.02x), so no
    head size is within 2% (the solver refused the row before); with the query/key size a unit off the head size
    it is."""
    from headmix.study.matching import attention_macs_of, conventions_for, inherited_options

    base = _small_gqa(128, 1, 32)
    target = attention_macs_of(base, None, 32)
    gated = {"kind": "mha", "num_heads": 8, "kv_heads": 2, "output_gate": "headwise"}
    conventions = {**inherited_options(base), **conventions_for("mha", base)}
    by_head = [attention_macs_of(with_attention(base, AttentionConfig(**conventions, **gated, head_dim=h)), None, 32)
               / target for h in range(2, 65)]
    assert min(abs(r - 1) for r in by_head) > 0.02  # no head size alone
    m = match_attention(base, gated, ["head_dim"], prefer={"head_dim": 16}, tgt_len=32)
    assert (m.attention.head_dim, m.attention.key_dim) == (16, 15)
    assert abs(m.ratio - 1) <= 0.02
    assert m.macs == attention_macs_of(with_attention(base, m.attention), None, 32)
    # a row that a head size alone can match keeps its query/key size (the committed plans do not move)
    plain = match_attention(base, {"kind": "mha", "num_heads": 4, "kv_heads": 2}, ["head_dim"],
                            prefer={"head_dim": 16}, tgt_len=32)
    assert plain.attention.key_dim is None and abs(plain.ratio - 1) <= 0.02


def test_a_random_twin_without_a_finer_step_names_its_step_and_the_tolerance_that_lets_it_run():
    """The issue's case: GQE's random-routing twin (no router, no separate query/key size) on d_model 48 is
    0.975x at heads of 11 and 1.064x at 12: the error says so and points to ``tolerance``, which (as
    docs/study.md says) lets the row run at its closest size and is stated in the report with every ratio."""
    from headmix.study.report import aggregate, to_markdown

    base = _small_gqa(48, 2, 128)
    twin = {"kind": "moh", "num_heads": 8, "kv_heads": 2, "route_per_group": True, "num_shared_heads": 1,
            "top_k": 1, "moh_impl": "sparse", "router": "random"}
    rows = [RowSpec("GQA"), RowSpec("GQE random", twin, ["head_dim"], {"head_dim": 6})]
    spec = StudySpec(name="small", task="lm", baseline=base.to_dict(), rows=rows, training={"max_len": 128})
    with pytest.raises(ValueError, match=r"closest is 0\.975x .*head sizes step by 8\.9% of its MACs here \(11: "
                                         r"0\.975x, 12: 1\.064x\), more than the 2% tolerance can bridge: widen the "
                                         r"spec's `tolerance`"):
        plan(spec)
    spec.tolerance = 0.03
    planned = plan(spec)
    assert planned[1].config.decoder_self_attention.head_dim == 11
    assert planned[1].macs_ratio == pytest.approx(0.975, abs=5e-4)
    md = to_markdown(aggregate(spec, planned, []))
    assert "every row's attention MACs within 3% of its" in md and "(0.975x)" in md
    for bad in (0, 1, -0.1):
        spec.tolerance = bad
        with pytest.raises(ValueError, match="tolerance must be in \\(0, 1\\)"):
            spec.validate()


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
    # the corpus is read, split and tokenised once for the whole study (2 rows x 2 seeds)
    from headmix.tasks import get_task

    task_class = type(get_task("lm"))
    calls = {"read_corpus": 0, "split_corpus": 0, "dataset": 0}
    for name in calls:
        def spy(self, *a, _name=name, _real=getattr(task_class, name), **kw):
            calls[_name] += 1
            return _real(self, *a, **kw)

        monkeypatch.setattr(task_class, name, spy)
    out = tmp_path / "study"
    first = run_study(spec, out, log=lambda m: None)
    assert trained == [("MHA", 1), ("MoA", 1)] and len(first) == 2

    # a second seed: the finished runs are read, not retrained
    spec2 = _spec(docs_file, seeds=[1, 2])
    trained.clear()
    results = run_study(spec2, out, log=lambda m: None)
    assert trained == [("MHA", 2), ("MoA", 2)] and len(results) == 4
    assert calls == {"read_corpus": 1, "split_corpus": 1, "dataset": 2}  # train and valid, tokenised once
    # every run reads the study's one split and tokenizer; no run folder holds a copy of the splits
    assert all((out / "shared/data" / f"{s}.jsonl").is_file() for s in ("train", "valid", "test"))
    assert all([p.name for p in (out / r.folder / "data").iterdir()] == ["shared.json"] for r in results)
    assert len({(out / r.folder / "tokenizer/tokenizer.json").read_bytes() for r in results}) == 1
    assert all(r.summary["machine"]["torch_threads"] >= 1 and r.summary["machine"]["device_type"] == "cpu"
               for r in results)
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
    for name in ("lm-en", "translation-en-de", "lm-en-llama", "lm-en-contenders", "lm-en-gpu", "lm-en-gpu-large"):
        spec = get_study(name)
        rows = plan(spec)
        assert len(spec.seeds) >= 3
        assert all(abs(r.macs_ratio - 1) <= 0.02 for r in rows), [(r.name, r.macs_ratio) for r in rows]
    # lm-en-gpu is the spec measured on the H100 (../shared/gpu-2026-11-23/study/gpu-lm.toml): the same rows
    gpu = {r.name: r.to_dict()["attention"] for r in plan(get_study("lm-en-gpu"))}
    assert {n: a["head_dim"] for n, a in gpu.items()} == {"MHA": 64, "MoA E=12": 84, "MoA E=48": 83, "MoH": 64,
                                                          "SwitchHead": 96}
    large = get_study("lm-en-gpu-large")
    assert large.max_steps * large.training["max_tokens"] >= 50_000_000
    assert [r.name for r in large.rows] == ["MHA", "MoA", "MoH", "SwitchHead"]


def test_the_long_contenders_study_is_the_short_one_with_four_times_the_tokens():
    """``lm-en-contenders-long`` shows the trend with training length: the same models, data and settings as
    ``lm-en-contenders`` (the baseline, its two best rows and GQE's three controls), only four times the steps."""
    short, long = get_study("lm-en-contenders"), get_study("lm-en-contenders-long")
    assert long.max_steps == 4 * short.max_steps and long.training == short.training
    assert long.baseline == short.baseline and long.task == short.task
    same = {r.name: r.config for r in plan(short)}
    assert [r.name for r in plan(long)] == ["GQA", "Gated", "GQE", "GQE random", "GQE static", "GQE hard-only",
                                            "GQE mean", "GQE mean random", "GQE mean hard-only"]
    assert {r.name: r.control_of for r in long.rows if r.control_of} == {
        "GQE random": "GQE", "GQE static": ["GQE", "GQE mean"], "GQE mean random": "GQE mean"}
    assert all(r.config == same[r.name] for r in plan(long))


def test_cli_plan_and_list(capsys, tmp_path):
    from headmix.cli.main import main

    assert main(["study", "--list"]) == 0
    listed = {line.split(":")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "sized for the CPU" in listed["lm-en"] and "wants a GPU" in listed["lm-en-gpu"]
    assert "2 (MHA) to 4 (MoA E=48) minutes" in listed["lm-en-gpu"]  # 11.5M tokens x 3 at 326k/s and 0.44x
    assert "ESTIMATE" in listed["lm-en-gpu-large"]
    assert main(["study", "lm-en", "--plan", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["name"] == "MHA" and all(abs(r["attention_macs_ratio"] - 1) <= 0.02 for r in rows)
    assert main(["study", "lm-en", "--json"]) == 2
    assert "--json goes with --plan" in capsys.readouterr().err
    assert main(["study", "nope"]) == 2
    assert "unknown study" in capsys.readouterr().err
    # --device, --bf16, --compile, --data and --drop-checkpoints reach the spec the runs are made from
    import os

    from headmix.cli.main import build_parser
    from headmix.cli.study import apply_overrides

    spec = get_study("lm-en")
    apply_overrides(spec, build_parser().parse_args(["study", "lm-en", "--device", "cuda:1", "--bf16", "on", "--compile",
                                                     "--drop-checkpoints", "--data", "x.jsonl"]))
    assert (spec.training["device"], spec.training["bf16"], spec.training["compile"]) == ("cuda:1", "on", True)
    assert spec.drop_checkpoints is True and spec.data == [os.path.abspath("x.jsonl")]
    assert main(["study", "lm-en", "--out", str(tmp_path / "s"), "--device", "gpu"]) == 2
    assert "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu'" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_plan_prints_a_table_of_the_matched_rows(capsys):
    """``--plan``: a header (the baseline, the tolerance, the lengths MACs are counted at), then one line per row
    with its attention, attention MACs, their ratio to the baseline's, the model's MACs and parameters and the
    solved fields with the values found; not the JSON of every field."""
    from headmix.cli.main import main

    assert main(["study", "lm-en", "--plan"]) == 0
    head, columns, *lines = capsys.readouterr().out.splitlines()
    assert head.startswith("study lm-en: lm, baseline mini-mha;") and "within 2%" in head and "128 target" in head
    assert columns.split() == ["row", "attention", "attention", "MACs", "vs", "baseline", "MACs", "parameters",
                               "solved"]
    planned = plan(get_study("lm-en"))
    assert len(lines) == len(planned)
    for line, row in zip(lines, planned):
        att = row.config.decoder_self_attention
        solved = "–" if row.name == "MHA" else f"head_dim={att.head_dim}"
        assert line.startswith(row.name + " ") and line.endswith(solved), line
        assert f" {row.attention_macs:,} " in line and f" {row.macs_ratio:.3f}x " in line
        assert f" {row.macs:,} " in line and f" {row.parameters:,} " in line
    assert "MoA 4K16E41D" in lines[3] and lines[3].endswith("head_dim=41")
    assert main(["study", "translation-en-de", "--plan"]) == 0
    assert "counted at 10 source + 10 target tokens" in capsys.readouterr().out.splitlines()[0]


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
    # the shared folder stores the convention its runs train with; one prepared before it (a committed study's)
    # keeps its runs eos-first when it is prepared again
    stored_config = tmp_path / "shared" / "train_config.json"
    stored = json.loads(stored_config.read_text())
    assert stored["sequence_start"] == "bos"
    stored_config.write_text(json.dumps({k: v for k, v in stored.items() if k != "sequence_start"}))
    prepare_shared_data(cfg, lambda m: None)
    assert json.loads(stored_config.read_text())["sequence_start"] == "eos"
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
    first = lines.index(header)
    assert lines[first + 3].startswith("| SH | SwitchHead 2×47, top 2 of 4 experts |")
    assert lines[first + 3].endswith("| -0.300 [-1.000, +0.400] | no significant difference | +0.100 [+0.050, +0.150] | higher | – |")
    assert lines[first + 2].endswith("| – | baseline | – | baseline | 1,000 |")
    table["metrics"], table["task"] = ["valid_nll"], "lm"
    header = next(line for line in to_markdown(table).splitlines() if line.startswith("| row"))
    assert header.endswith("| valid_nll | Δ valid_nll [95% CI] | verdict | tokens/s |")


# ------------------------------------------------------------------------------------ equal time, GPU studies

def _run(row, seed, steps_times_nll, seconds, tokens=1000, machine=None):
    from headmix.study import RunResult

    summary = {"valid": {"nll": 0.0, "ppl": 1.0}, "train_seconds": seconds, "tokens": tokens,
               "machine": machine or {"device_type": "cpu", "device_name": "X", "torch_threads": 2, "torch": "t"}}
    return RunResult(row, seed, f"runs/{row}/seed-{seed}", summary, {},
                     {s: v for s, (t, v) in steps_times_nll.items()}, {s: t for s, (t, v) in steps_times_nll.items()})


def test_equal_time_by_hand_on_made_up_curves():
    """The validation NLL at the baseline's training time, read off made-up curves by hand."""
    from types import SimpleNamespace

    from headmix.study.report import equal_time, equal_time_markdown

    results = [_run("MHA", 1, {10: (5.0, 5.0), 20: (10.0, 4.0)}, 10.0),
               _run("MHA", 2, {10: (6.0, 5.2), 20: (12.0, 4.2)}, 12.0),
               # slower: at 10 s (seed 1) 4.8 + (3.6 - 4.8) * 2/8 = 4.5; at 12 s (seed 2) 5.0 - 1.2 * 3/9 = 4.6
               _run("Slow", 1, {10: (8.0, 4.8), 20: (16.0, 3.6)}, 16.0),
               _run("Slow", 2, {10: (9.0, 5.0), 20: (18.0, 3.8)}, 18.0),
               # seed 1 ended at 9 s, before the baseline's 10 s
               _run("Short", 1, {10: (4.0, 4.9), 20: (9.0, 4.1)}, 9.0),
               _run("Short", 2, {10: (5.0, 4.9), 20: (13.0, 4.1)}, 13.0)]
    planned = [SimpleNamespace(name=n) for n in ("MHA", "Slow", "Short")]
    timed = equal_time(planned, results)
    slow = timed["Slow"]
    assert slow["baseline_seconds"] == {"1": 10.0, "2": 12.0}
    assert slow["valid_nll"]["1"] == pytest.approx(4.5) and slow["valid_nll"]["2"] == pytest.approx(4.6)
    d = [4.5 - 4.0, 4.6 - 4.2]
    m, sd = sum(d) / 2, abs(d[0] - d[1]) / math.sqrt(2)
    half = 12.706205 * sd / math.sqrt(2)
    vs = slow["vs_baseline"]
    assert vs["mean"] == pytest.approx(m) and vs["low"] == pytest.approx(m - half, rel=1e-5)
    assert vs["high"] == pytest.approx(m + half, rel=1e-5)
    assert vs["verdict"] == "no significant difference (2 seeds: fewer than 3)"
    # tokens/s relative to the baseline: the means over seeds, 1000/16 and 1000/18 against 1000/10 and 1000/12
    assert slow["tokens_per_second_ratio"] == pytest.approx((1000 / 16 + 1000 / 18) / (1000 / 10 + 1000 / 12))
    assert timed["Short"]["not_reached"] == [1] and timed["Short"]["vs_baseline"] is None
    assert timed["Short"]["valid_nll"]["2"] == pytest.approx(4.9 + (4.1 - 4.9) * 7 / 8)
    assert timed["MHA"]["summary"]["mean"] == pytest.approx(4.1) and timed["MHA"]["tokens_per_second_ratio"] == 1.0
    rows = [{"name": n, "equal_time": timed[n]} for n in ("MHA", "Slow", "Short")]
    lines = equal_time_markdown({"rows": rows, "baseline": "MHA"})
    assert "| Short | " in lines[-1] and "not reached (seed 1 ended at 9 s)" in lines[-1]
    assert lines[-2].startswith("| Slow | 0.64 | 11 | 4.550 ± 0.071 | +0.450 [")


def test_along_training_by_hand_on_made_up_curves():
    """The gap at a quarter, half, three quarters and the end of the steps: the last baseline validation at or
    before each, paired by seed; a seed the row lacks is left out, a step it never validated is "–"."""
    from headmix.study.report import along_training, along_training_markdown

    base = {"1": {"20": 6.0, "50": 5.5, "70": 5.0, "100": 4.8}, "2": {"20": 6.2, "50": 5.4, "70": 5.1, "100": 4.6}}
    gated = {"1": {"20": 5.8, "50": 5.4, "70": 5.0, "100": 4.9}, "2": {"20": 5.9, "50": 5.2, "70": 5.2, "100": 4.7}}
    sparse = {"1": {"20": 5.0, "100": 4.0}}  # validated less often, one seed
    table = {"baseline": "B", "max_steps": 100, "rows": [{"name": "B"}, {"name": "G"}, {"name": "S"}],
             "curves": {"B": base, "G": gated, "S": sparse}}
    steps, deltas = along_training(table)
    assert steps == [20, 50, 70, 100]  # the quarters 25, 50, 75, 100: the last validation at or before each
    assert list(deltas) == ["G", "S"]
    first = deltas["G"][0]
    d = [5.8 - 6.0, 5.9 - 6.2]
    m, sd = sum(d) / 2, abs(d[0] - d[1]) / math.sqrt(2)
    half = 12.706205 * sd / math.sqrt(2)
    assert first["mean"] == pytest.approx(m) and first["low"] == pytest.approx(m - half, rel=1e-5)
    assert [c["mean"] for c in deltas["G"][1:]] == pytest.approx([-0.15, 0.05, 0.1])
    assert deltas["S"][0]["mean"] == pytest.approx(-1.0) and deltas["S"][0]["low"] is None
    assert deltas["S"][1] is None and deltas["S"][2] is None and deltas["S"][3]["mean"] == pytest.approx(-0.8)
    lines = along_training_markdown(table)
    assert lines[-4] == "| row | step 20 | step 50 | step 70 | step 100 |"
    assert lines[-1] == "| S | -1.000 | – | – | -0.800 |"


def test_validation_times_of_old_and_new_metrics_files(tmp_path):
    """Old metrics.jsonl: ``time`` on train records only, mapped to the validation steps by interpolation;
    newer validation records carry their own."""
    from headmix.study.runner import validation_times

    records = [{"split": "valid", "step": 10, "nll": 6.0},  # before the first train record: from step 0, time 0
               {"split": "train", "step": 25, "time": 2.0}, {"split": "train", "step": 50, "time": 4.0},
               {"split": "valid", "step": 50, "nll": 5.0}, {"split": "train", "step": 75, "time": 7.0},
               {"split": "valid", "step": 60, "nll": 4.9}, {"split": "train", "step": 100, "time": 9.0},
               {"split": "valid", "step": 100, "nll": 4.5, "time": 9.5},
               {"split": "valid", "step": 100, "nll": 4.4, "averaged": 1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert validation_times(tmp_path) == {10: pytest.approx(2.0 * 10 / 25), 50: 4.0,
                                          60: pytest.approx(4.0 + 3.0 * 10 / 25), 100: 9.5}


def test_machines_are_reported_per_row_with_a_warning_when_they_differ():
    from headmix.study.report import machines, machines_markdown

    gpu = {"device_type": "cuda", "device_name": "NVIDIA H100", "torch_threads": 16, "torch": "2.11"}
    results = [_run("MHA", 1, {}, 1.0), _run("MoA", 1, {}, 1.0, machine=gpu)]
    ran_on = machines(results)
    assert ran_on == {"MHA": ["X (cpu), 2 threads, torch t"], "MoA": ["NVIDIA H100 (cuda), 16 threads, torch 2.11"]}
    rows = [{"name": n, "machines": ran_on[n]} for n in ran_on]
    assert "Warning" in "\n".join(machines_markdown({"rows": rows, "machines_differ": True}))


def test_shared_splits_of_another_split_are_refused(tmp_path, docs_file):
    from headmix.tasks import get_task
    from headmix.runs import Run
    from headmix.training import TrainConfig
    from headmix.training.config import IDENTITY
    from headmix.training.setup import prepare_data, prepare_shared_data

    common = dict(task="lm", data=[str(docs_file)], vocab_size=300, split_seed=3, valid_size=0.05, test_size=0.05)
    shared = prepare_shared_data(TrainConfig(out=str(tmp_path / "shared"), seed=3, **common), lambda m: None).parent
    ok = TrainConfig(out=str(tmp_path / "run"), seed=1, shared_data=str(shared), tokenizer=str(shared / "tokenizer"),
                     **common)
    with Run.create_or_resume(ok.out, ok.to_dict(), identity=IDENTITY) as run:
        parts, _ = prepare_data(ok, run, lambda m: None)
    assert parts["valid"] == ok.task_spec.read_items(shared / "data/valid.jsonl") and parts["valid"]
    assert [p.name for p in (tmp_path / "run/data").iterdir()] == ["shared.json"]  # no copy of the splits
    assert get_task("lm").stored_split(tmp_path / "run", "valid").resolve() == (shared / "data/valid.jsonl").resolve()
    for change in ({"valid_size": 0.1}, {"split_seed": 4}):
        bad = TrainConfig(out=str(tmp_path / f"bad{len(change)}{list(change)[0]}"), seed=1, shared_data=str(shared),
                          tokenizer=str(shared / "tokenizer"), **{**common, **change})
        with Run.create_or_resume(bad.out, bad.to_dict(), identity=IDENTITY) as run:
            with pytest.raises(ValueError, match=f"shared_data .* {list(change)[0]}="):
                prepare_data(bad, run, lambda m: None)


def _tiny_gpu_spec(docs: Path):
    """``lm-en-gpu`` as built in, at a size the CPU trains in seconds (its rows, matching and options kept)."""
    from headmix.models.presets import llama_model, mha
    from headmix.study.builtin import lm_en_gpu

    spec = lm_en_gpu()
    spec.baseline = llama_model(mha(6), 300, d_model=96, layers=1, max_positions=64).to_dict()
    spec.data, spec.seeds, spec.max_steps = [str(docs)], [1], 2
    spec.training.update({"max_len": 32, "max_tokens": 256, "vocab_size": 300, "warmup_steps": 1, "eval_every": 1,
                          "log_every": 1, "save_every": 1, "valid_size": 0.05, "test_size": 0.05})
    for row in spec.rows:
        row.prefer = {"head_dim": 16}
    return spec


def _run_tiny_gpu_study(tmp_path, docs_file, monkeypatch, device):
    from headmix.cli.main import main
    from headmix.study import builtin

    monkeypatch.setitem(builtin.BUILTIN, "lm-en-gpu", lambda: _tiny_gpu_spec(docs_file))
    out = tmp_path / "gpu-study"
    assert main(["study", "lm-en-gpu", "--out", str(out), "--device", device, "--bf16", "off", "--no-progress"]) == 0
    return out


def test_lm_en_gpu_runs_through_the_cli_at_a_tiny_size(tmp_path, docs_file, monkeypatch):
    out = _run_tiny_gpu_study(tmp_path, docs_file, monkeypatch, "cpu")
    runs = sorted(out.glob("runs/*/seed-1"))
    assert len(runs) == 5
    for run in runs:
        cfg = json.loads((run / "train_config.json").read_text())
        assert (cfg["device"], cfg["bf16"], cfg["compile"]) == ("cpu", "off", False)
        assert not (run / "checkpoints").exists() and (run / "model.safetensors").is_file()  # dropped, model kept
    md = (out / "results.md").read_text()
    assert "Equal time: what to train on this machine" in md and "| MoA E=48 | " in md
    assert (out / "valid_curves_time.png").is_file()
    table = json.loads((out / "results.json").read_text())
    assert table["rows"][0]["equal_time"]["tokens_per_second_ratio"] == 1.0
    assert table["machines_differ"] is False and "Warning" not in md  # every run on this machine
    # --report rewrites the report from the finished runs, training nothing
    from headmix.cli.main import main

    (out / "results.md").unlink()
    assert main(["study", "lm-en-gpu", "--out", str(out), "--bf16", "off", "--report"]) == 0  # bf16 defines it
    assert "Equal time" in (out / "results.md").read_text()


def test_drop_checkpoints_keeps_what_it_did_not_write(tmp_path, docs_file):
    import shutil

    from headmix.study.runner import drop_checkpoints

    spec = _spec(docs_file, seeds=[1], rows=[RowSpec("MHA")], keep_checkpoints=None)
    out = tmp_path / "study"
    results = run_study(spec, out, log=lambda m: None)
    folder = out / results[0].folder
    # a run that has not finished (no summary yet) keeps its checkpoints: it resumes from them
    unfinished = tmp_path / "unfinished"
    shutil.copytree(folder, unfinished)
    (unfinished / "summary.json").unlink()
    kept = sorted(p.name for p in (unfinished / "checkpoints").iterdir())
    assert kept and drop_checkpoints(unfinished, lambda m: None) == []
    assert sorted(p.name for p in (unfinished / "checkpoints").iterdir()) == kept
    (folder / "checkpoints" / "mine.txt").write_text("a user's file")
    assert len(list((folder / "checkpoints").iterdir())) > 1
    assert drop_checkpoints(folder, lambda m: None)  # keep=0: every checkpoint the run wrote
    assert [p.name for p in (folder / "checkpoints").iterdir()] == ["mine.txt"]
    assert (folder / "model.safetensors").is_file() and (folder / "summary.json").is_file()


def test_a_finished_run_keeps_its_newest_good_checkpoint_only(tmp_path, docs_file, capsys):
    """By default (``keep_checkpoints = 1``) a finished run keeps its newest checkpoint; a damaged checkpoint
    does not count as the kept one (the newest intact one is kept, the run resumes from it, the damaged one is
    left alone); with no intact checkpoint nothing is removed; ``--keep-checkpoints`` overrides the spec."""
    import shutil

    from headmix.cli.main import build_parser
    from headmix.cli.study import apply_overrides
    from headmix.models import ModelConfig, build_model
    from headmix.runs import Run
    from headmix.study.runner import drop_checkpoints

    training = {**_spec(docs_file).training, "keep_checkpoints": 3}
    spec = _spec(docs_file, seeds=[1], rows=[RowSpec("MHA")], max_steps=6, training=training)
    assert spec.keep_checkpoints == 1 and spec.finished_checkpoints == 1
    out = tmp_path / "study"
    folder = out / run_study(spec, out, log=lambda m: None)[0].folder
    assert [p.name for p in (folder / "checkpoints").iterdir()] == ["step_00000006"]

    kept_all = tmp_path / "all"
    run_study(_spec(docs_file, seeds=[1], rows=[RowSpec("MHA")], max_steps=6, training=training,
                    keep_checkpoints=None), kept_all, log=lambda m: None)
    every = kept_all / "runs/MHA/seed-1"
    names = ["step_00000002", "step_00000004", "step_00000006"]
    assert sorted(p.name for p in (every / "checkpoints").iterdir()) == names
    # the newest damaged (truncated weights): the one before it is kept, the oldest removed
    damaged = tmp_path / "damaged"
    shutil.copytree(every, damaged)
    weights = damaged / "checkpoints" / names[2] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert [p.name for p in drop_checkpoints(damaged, lambda m: None, keep=1)] == names[:1]
    assert sorted(p.name for p in (damaged / "checkpoints").iterdir()) == names[1:]
    model = build_model(ModelConfig.load_json(damaged / "config.json"))
    path, _, info = Run(damaged).latest_intact_checkpoint(model)
    assert path.name == names[1] and info["step"] == 4
    # no checkpoint intact: none removed
    for name in names[1:2]:
        (damaged / "checkpoints" / name / "state.json").write_text("")
    assert drop_checkpoints(damaged, lambda m: None, keep=1) == []
    assert sorted(p.name for p in (damaged / "checkpoints").iterdir()) == names[1:]
    # keep 2 of the intact three
    assert [p.name for p in drop_checkpoints(every, lambda m: None, keep=2)] == names[:1]
    with pytest.raises(ValueError, match="keep must be an integer >= 0"):
        drop_checkpoints(every, lambda m: None, keep=-1)

    # the command line: N or all, overriding the spec's drop_checkpoints; one-line errors
    parse = build_parser().parse_args
    for given, expected in ((["--keep-checkpoints", "3"], 3), (["--keep-checkpoints", "all"], None),
                            (["--no-drop-checkpoints"], 1), ([], 1)):
        spec = get_study("lm-en-gpu")
        assert spec.drop_checkpoints is True
        apply_overrides(spec, parse(["study", "lm-en-gpu", *given]))
        assert spec.finished_checkpoints == (0 if not given else expected), given
    spec = get_study("lm-en")
    with pytest.raises(ValueError, match="give --drop-checkpoints or --keep-checkpoints, not both"):
        apply_overrides(spec, parse(["study", "lm-en", "--drop-checkpoints", "--keep-checkpoints", "1"]))
    with pytest.raises(SystemExit):
        parse(["study", "lm-en", "--keep-checkpoints", "-1"])
    assert "--keep-checkpoints: must be an integer >= 0 or 'all', got '-1'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="keep_checkpoints must be an integer >= 0 or null"):
        _spec(docs_file, keep_checkpoints=-1)


@pytest.mark.gpu
def test_lm_en_gpu_runs_on_cuda(tmp_path, docs_file, monkeypatch):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    out = _run_tiny_gpu_study(tmp_path, docs_file, monkeypatch, "cuda")
    summary = json.loads(next(out.glob("runs/MHA/seed-1")).joinpath("summary.json").read_text())
    assert summary["machine"]["device_type"] == "cuda"
    assert summary["machine"]["device_name"] == torch.cuda.get_device_name(0)


@pytest.mark.parametrize("name", ["lm-en", "lm-en-llama", "translation-en-de", "lm-en-contenders",
                                  "lm-en-contenders-long", "lm-en-upcycle"])
def test_the_committed_studies_can_still_be_continued(name):
    """A change of a built-in spec or of the attention config's stored form must not turn the committed study
    folder into "another study" (it could no longer be continued or reported)."""
    from headmix.study import get_study, plan
    from headmix.study.runner import check_plan

    spec = get_study(name)
    check_plan(spec, plan(spec), Path(__file__).resolve().parents[1] / "studies" / name)


def test_the_report_names_grouped_heads_routing_per_group_and_gates():
    from headmix.study.report import _attention_text

    assert _attention_text({"kind": "mha", "num_heads": 8, "head_dim": 16, "kv_heads": 2, "qk_norm": True,
                            "output_gate": "headwise"}) == "MHA 8×16, 2 K/V heads, QK-norm, headwise gate"
    assert _attention_text({"kind": "moh", "num_heads": 8, "head_dim": 28, "kv_heads": 2, "route_per_group": True,
                            "num_shared_heads": 1, "top_k": 1, "moh_impl": "sparse"}) == \
        "MoH 8×28, 1 shared, top 1, sparse, 2 K/V heads, routed per group"
    assert _attention_text({"kind": "mha", "num_heads": 4, "head_dim": 32, "kv_heads": 4}) == "MHA 4×32"


@pytest.mark.parametrize("name,spec", [("lm-en", "lm-en"), ("lm-en-llama", "lm-en-llama"),
                                       ("translation-en-de", "translation-en-de"),
                                       ("lm-en-moh-sparse", "studies/lm-en-moh-sparse.toml"),
                                       ("lm-en-contenders", "lm-en-contenders"),
                                       ("lm-en-contenders-long", "lm-en-contenders-long"),
                                       ("lm-en-upcycle", "lm-en-upcycle")])
def test_the_committed_reports_are_recomputed_from_their_run_records(name, spec, tmp_path, monkeypatch):
    """Every number of a committed study's report comes from the run records committed beside it: the report
    rewritten from a copy of the folder (no weights, no checkpoints) is the committed one."""
    import shutil

    from headmix.cli.main import main

    root = Path(__file__).resolve().parents[1]
    committed = root / "studies" / name
    copy = tmp_path / name
    shutil.copytree(committed, copy, ignore=shutil.ignore_patterns("*.png"))
    monkeypatch.chdir(root)
    assert main(["study", spec, "--out", str(copy), "--report"]) == 0
    assert (copy / "results.md").read_text() == (committed / "results.md").read_text()
    assert json.loads((copy / "results.json").read_text()) == json.loads((committed / "results.json").read_text())


def test_the_docs_hold_each_committed_studys_report_as_committed():
    """docs/study.md's result tables are the committed reports (which the recompute test above rewrites from
    the run records alone): rewriting the page from them changes nothing, so no figure there is typed by hand."""
    from headmix.study import docs as study_docs

    root = Path(__file__).resolve().parent.parent
    page = root / "docs" / "study.md"
    assert set(study_docs.studies_named(page)) >= {"lm-en", "lm-en-llama", "translation-en-de", "lm-en-contenders",
                                                   "lm-en-contenders-long", "lm-en-upcycle"}
    assert study_docs.rewrite(page, root / "studies") == page.read_text(), \
        "docs/study.md is stale: python -m headmix.study.docs --write docs/study.md"


def test_a_docs_block_of_a_study_that_does_not_exist_is_refused(tmp_path):
    from headmix.study import docs as study_docs

    page = tmp_path / "page.md"
    page.write_text("x\n<!-- study-report nowhere:begin -->\nold\n<!-- study-report nowhere:end -->\n")
    with pytest.raises(ValueError, match="docs name the study 'nowhere'"):
        study_docs.rewrite(page, tmp_path)
    (tmp_path / "nowhere").mkdir()
    (tmp_path / "nowhere" / "results.md").write_text("### nowhere: lm\n\n#### Table\n\n| a |\n")
    assert study_docs.rewrite(page, tmp_path) == (
        "x\n<!-- study-report nowhere:begin -->\n##### Table\n\n| a |\n<!-- study-report nowhere:end -->\n")


def test_an_older_study_json_reads_with_the_defaults_it_stored_for_other_kinds_unset():
    """A ``study.json`` of an older version stored every field's default for every kind (``router="softmax"`` on
    MHA rows); read back, such a field is unset for the kinds that do not use it, and a field the row's kind
    resolves on construction holds its resolved value, as this version writes them."""
    from headmix.models.config import AttentionConfig
    from headmix.study.runner import _with_new_defaults

    stored = {"rows": [{"name": "MHA", "attention": {"kind": "mha", "num_heads": 4, "head_dim": 32,
                                                     "router": "softmax"}},
                       {"name": "MoH", "attention": {"kind": "moh", "num_heads": 4, "head_dim": 32, "top_k": 2,
                                                     "num_shared_heads": 1, "head_weighting": None}}]}
    mha, moh = (row["attention"] for row in _with_new_defaults(stored)["rows"])
    assert mha["router"] is None and mha == AttentionConfig(kind="mha", num_heads=4, head_dim=32).to_dict()
    assert moh["head_weighting"] == AttentionConfig(kind="moh", num_heads=4, head_dim=32, top_k=2,
                                                    num_shared_heads=1).head_weighting is not None


def test_retime_measures_again_only_what_other_code_timed_and_keeps_the_old_record(tmp_path, docs_file, monkeypatch):
    """``headmix study --retime``: rows timed by another commit are timed again (the runs stay), the new record
    keeps the old one under ``previous``, a second call times nothing (a stopped re-timing continues), and code
    with local changes is refused."""
    import headmix.provenance as provenance
    import headmix.study.timing as timing

    commit = {"now": "aaaa111"}
    monkeypatch.setattr(provenance, "source_commit", lambda: commit["now"])
    measured = []

    def fake_measure_row(spec, out, baseline_config, row_config, row_name, **kw):
        measured.append(row_name)
        return {"row": row_name, "ratio": 1.0 + len(measured) / 10, "low": 1.0, "high": 2.0,
                "software": {"commit": commit["now"]}, "measured_at": f"t{len(measured)}"}

    monkeypatch.setattr(timing, "measure_row", fake_measure_row)
    spec = _spec(docs_file, seeds=[1])
    out = tmp_path / "study"
    run_study(spec, out, log=lambda m: None)
    summaries = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/summary.json")}
    assert measured == ["MoA"] and len(summaries) == 2
    run_study(spec, out, log=lambda m: None, retime=True)
    assert measured == ["MoA"]  # timed by this code already
    commit["now"] = "bbbb222"
    run_study(spec, out, log=lambda m: None)
    assert measured == ["MoA"]  # without --retime a record is kept whoever measured it
    run_study(spec, out, log=lambda m: None, retime=True)
    record = json.loads((out / "timing" / "MoA.json").read_text())
    assert measured == ["MoA", "MoA"] and record["ratio"] == pytest.approx(1.2)
    assert record["software"]["commit"] == "bbbb222"
    assert record["previous"] == {"ratio": pytest.approx(1.1), "low": 1.0, "high": 2.0, "measured_at": "t1",
                                  "commit": "aaaa111"}
    run_study(spec, out, log=lambda m: None, retime=True)
    assert measured == ["MoA", "MoA"]
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/summary.json")} == summaries  # no run retrained
    run_study(_spec(docs_file, seeds=[1, 2]), out, log=lambda m: None, retime=True)
    assert not list(out.glob("runs/*/seed-2"))  # a re-timing trains no run, not even an unfinished one
    commit["now"] = "bbbb222+"
    with pytest.raises(ValueError, match="retime needs this code's commit"):
        run_study(spec, out, log=lambda m: None, retime=True)
