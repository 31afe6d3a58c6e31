"""Issue 32: what a new user hit in the first hour (each defect reproduced here, and the things added for it)."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest
import torch

from headmix.models import ModelConfig
from headmix.models.config import AttentionConfig
from headmix.storage.files import sha256_file

ROOT = Path(__file__).resolve().parents[1]

KINDS = {"mha": dict(kind="mha", num_heads=4), "moa": dict(kind="moa", num_experts=4, top_k=2, head_dim=8),
         "moh": dict(kind="moh", num_heads=4, num_shared_heads=1, top_k=2),
         "talking_heads": dict(kind="talking_heads", num_heads=4),
         "switchhead": dict(kind="switchhead", num_heads=2, num_experts=4, top_k=2)}

# a field with a non-None default, a value other than that default, and a kind that does not use it
FOREIGN = [("router", "noisy_topk", "talking_heads"), ("renormalize", "live", "mha"), ("load_balance_weight", 0.5, "switchhead"),
           ("z_loss_weight", 0.5, "moh"), ("pre_softmax", False, "moh"), ("post_softmax", False, "mha"),
           ("expert_impl", "sorted", "talking_heads"), ("load_balance_fractions", "per_token", "switchhead")]


# --------------------------------------------------------------------------- options that do nothing

@pytest.mark.parametrize("field,value,kind", FOREIGN)
def test_a_field_the_kind_does_not_use_is_refused(field, value, kind):
    with pytest.raises(ValueError, match=rf"^attention\.{field} applies to kind .* it must be unset \(None\) for kind '{kind}'"):
        AttentionConfig(**KINDS[kind], **{field: value})


def test_the_issues_moh_example_is_refused_naming_the_first_foreign_field():
    # router applies to MoH too (its random-routing control): z_loss_weight is the first field it does not use
    with pytest.raises(ValueError, match=r"attention\.z_loss_weight applies to kind 'moa' only"):
        AttentionConfig(kind="moh", num_heads=4, num_shared_heads=1, top_k=2, router="noisy_topk", z_loss_weight=0.5,
                        pre_softmax=False)


@pytest.mark.parametrize("field,value,kind", FOREIGN)
def test_unset_fields_take_their_kinds_default_and_stay_unset_for_other_kinds(field, value, kind):
    from headmix.models.config import _KIND_DEFAULTS, _KIND_FIELDS, _takes_default

    for name, fields in KINDS.items():
        expected = _KIND_DEFAULTS[field] if _takes_default(field, name) else None
        assert getattr(AttentionConfig(**fields), field) == expected
    own = _KIND_FIELDS[field][0]
    assert getattr(AttentionConfig(**KINDS[own], **{field: value}), field) == value


def test_defaults_filled_in_are_the_layers_defaults():
    moa = AttentionConfig(**KINDS["moa"]).build(32)
    assert (moa.router.router_type, moa.router.renormalize, moa.load_balance_weight, moa.z_loss_weight) == \
        ("softmax", "detached", 0.01, 0.001)
    th = AttentionConfig(**KINDS["talking_heads"]).build(32)
    assert th.pre_mix is not None and th.post_mix is not None


def test_json_with_a_foreign_field_set_is_refused_naming_the_role():
    data = ModelConfig(task="lm", vocab_size=50, d_model=32, ffn_dim=64, encoder_layers=0, decoder_layers=1).to_dict()
    data["decoder_self_attention"]["z_loss_weight"] = 0.5
    with pytest.raises(ValueError, match=r"^decoder_self_attention\.z_loss_weight applies to kind 'moa' only"):
        ModelConfig.from_dict(data)
    data["decoder_self_attention"]["z_loss_weigth"] = 0.5
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['z_loss_weigth'\] in decoder_self_attention"):
        ModelConfig.from_dict(data)


def test_an_old_json_storing_every_fields_default_still_loads():
    """Before issue 32 every config stored router="softmax", pre_softmax=true, ... for every kind: such a file
    loads, as the config it always meant; a foreign field stored with another value (never used) is refused."""
    old = {"kind": "mha", "num_heads": 4, "router": "softmax", "renormalize": "detached", "load_balance_weight": 0.01,
           "z_loss_weight": 0.001, "pre_softmax": True, "post_softmax": True, "expert_impl": "auto",
           "load_balance_fractions": "normalized"}
    assert AttentionConfig.from_dict(old) == AttentionConfig(kind="mha", num_heads=4)
    for field, value, kind in FOREIGN:
        if field in old:
            with pytest.raises(ValueError, match=rf"attention\.{field} applies to kind"):
                AttentionConfig.from_dict({**old, field: value})
    assert AttentionConfig.from_dict({**old, "kind": "moa", "num_heads": None, "num_experts": 4, "top_k": 2,
                                      "head_dim": 8, "z_loss_weight": 0.0}).z_loss_weight == 0.0


def test_every_stored_model_config_of_the_studies_still_loads_and_round_trips():
    files = [f for f in glob.glob(str(ROOT / "studies" / "**" / "*.json"), recursive=True)]
    configs = [json.loads(Path(f).read_text()) for f in files]
    configs = [c for c in configs if isinstance(c, dict) and "d_model" in c and "task" in c]
    assert len(configs) >= 8
    for data in configs:
        config = ModelConfig.from_dict(data)
        assert ModelConfig.from_dict(json.loads(config.to_json())) == config


# --------------------------------------------------------------------------- a failed first run

def lm_args(out: Path, data: Path, *extra: str) -> list[str]:
    return ["train", "lm", "--preset", "tiny-mha", "--out", str(out), "--data", str(data), "--vocab-size", "300",
            "--max-steps", "1", "--max-tokens", "256", "--max-len", "32", "--no-progress", *extra]


@pytest.mark.parametrize("bad,message", [
    (["--preset", "tiny-moe"], "unknown model 'tiny-moe'"),
    (["--vocab-size", "50"], "--vocab-size must be >= 262"),
    (["--max-tokens", "10"], r"--max-tokens \(10\) must be >= max_len \(32\)"),
])
def test_a_mistake_the_options_show_fails_before_anything_is_written(tmp_path, docs_file, capsys, bad, message):
    from headmix.cli.main import main

    out = tmp_path / "bad1"
    assert main(lm_args(out, docs_file, *bad)) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and __import__("re").search(message, err), err
    assert not out.exists()


def test_data_given_as_a_folder_says_so(tmp_path, docs_file, capsys):
    from headmix.cli.main import main

    assert main(lm_args(tmp_path / "run", tmp_path)) == 2
    err = capsys.readouterr().err
    assert f"data {tmp_path} is a folder; expected a file (lm: a JSONL or plain-text file of documents)" in err


def test_a_run_that_failed_before_its_first_step_does_not_lock_its_folder(tmp_path, docs_file, capsys):
    """The issue's case: a first attempt that failed after writing its config (here: a corpus with the wrong
    field, found only when read) must not refuse the corrected command on the same folder."""
    from headmix.cli.main import main

    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text("".join(json.dumps({"body": line}) + "\n" for line in docs_file.read_text().splitlines()))
    out = tmp_path / "bad1"
    assert main(lm_args(out, wrong)) == 2
    assert not out.exists()  # a failed start leaves no run folder it created
    out.mkdir()  # a folder the user made is kept
    assert main(lm_args(out, wrong)) == 2
    assert (out / "train_config.json").is_file()  # the failed attempt got that far
    capsys.readouterr()
    assert main(lm_args(out, docs_file)) == 0
    err = capsys.readouterr().err
    assert "but it never trained a step (no checkpoint): starting it over" in err
    stored = json.loads((out / "train_config.json").read_text())
    assert stored["data"] == [str(docs_file.resolve())] and (out / "model.safetensors").is_file()
    # once it has trained, the folder keeps its options
    assert main(lm_args(out, docs_file, "--seed", "2")) == 2
    assert "was created with seed=1; this command has seed=2" in capsys.readouterr().err


def test_only_a_never_trained_run_starts_over(tmp_path):
    from headmix.runs import Run, RunMismatchError

    def open_run(seed, restart=True):
        return Run.create_or_resume(tmp_path / "r", {"seed": seed}, identity=["seed"], restart_untrained=restart)

    with open_run(1) as run:
        (run.data_dir).mkdir()
        (run.data_dir / "train.jsonl").write_text("{}\n")
    with pytest.raises(RunMismatchError, match="created with seed=1"):
        open_run(2, restart=False)  # a study's shared folder, or any caller that did not ask
    with open_run(2) as run:
        assert run.read_config()["seed"] == 2 and not run.data_dir.exists()
        (run.checkpoints_dir / "step_00000001").mkdir(parents=True)
    with pytest.raises(RunMismatchError, match="created with seed=2"):
        open_run(3)
    assert Run(tmp_path / "r").read_config()["seed"] == 2


# --------------------------------------------------------------------------- TrainConfig

@pytest.mark.parametrize("options,message", [
    (dict(task="lmm"), "task must be one of"), (dict(max_steps=-3), "max_steps must be a positive integer"),
    (dict(warmup_steps=-1), "warmup_steps must be a non-negative integer"),
    (dict(vocab_size=50), "vocab_size must be >= 262"),
])
def test_train_config_is_checked_on_construction(options, message):
    from headmix.training import TrainConfig

    with pytest.raises(ValueError, match=message):
        TrainConfig(out="x", **options)


def test_the_default_schedule_leaves_its_warm_up():
    from headmix.training import TrainConfig, lr_multiplier

    cfg = TrainConfig(out="x")
    assert cfg.resolved_warmup_steps == cfg.max_steps // 10 and cfg.schedule_warning() is None
    peak = [lr_multiplier(s, schedule="linear", warmup_steps=cfg.resolved_warmup_steps, max_steps=cfg.max_steps)
            for s in range(cfg.max_steps)]
    assert max(peak) == 1.0 and peak[-1] < 0.01
    assert TrainConfig(out="x", warmup_steps=7).resolved_warmup_steps == 7
    assert TrainConfig(out="x", max_steps=30, warmup_steps=4000).schedule_warning() == (
        "warmup_steps (4000) >= max_steps (30): the learning rate stays in its warm-up, at most 0.0075 of lr, "
        "and never decays")


def test_a_json_presets_vocab_size_is_the_default(tmp_path):
    from headmix.models import get_config
    from headmix.training import TrainConfig

    path = tmp_path / "m.json"
    get_config("tiny-mha", task="lm", vocab_size=500).save_json(path)
    assert TrainConfig(out="x", task="lm", preset=str(path)).vocab_size == 500
    assert TrainConfig(out="x", task="lm", preset=str(path), vocab_size=400).vocab_size == 400
    assert TrainConfig(out="x", task="lm", preset="tiny-mha").vocab_size == 8000


def test_the_data_line_is_for_people():
    from headmix.training.setup import describe_sizes

    assert describe_sizes({"train": 1383, "valid": 29, "dropped_valid": 0}) == "train 1,383, valid 29, dropped valid 0"


def test_malformed_corpus_lines_are_reported_once(tmp_path, docs_file, capsys):
    import warnings

    from headmix.cli.main import main

    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps({"body": f"line {i}"}) + "\n" for i in range(5)) + docs_file.read_text())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(lm_args(tmp_path / "run", mixed, "--warmup-steps", "2")) == 0
    err = capsys.readouterr().err
    assert "[headmix] warning: warmup_steps (2) >= max_steps (1): the learning rate stays in its warm-up" in err
    assert not [w for w in caught if "malformed" in str(w.message)]
    assert len([line for line in err.splitlines() if "malformed" in line]) == 1 and err.count(f"{mixed}:1:") == 1
    assert "[headmix] skipped 5 malformed line(s) (--strict makes them an error)" in err


# --------------------------------------------------------------------------- issue 42: plain text, versions

JSONL_EXPECTED = ('expected JSONL: one JSON object a line with the document in a string field "text"; or plain text '
                  'in a .txt file, documents separated by blank lines')


def test_plain_text_documents_are_separated_by_blank_lines(tmp_path):
    import gzip

    from headmix.data import document_format, read_documents

    text = "In the beginning\nGod created.\n\n\n  \nAnd the earth\nwas without form.\n\nThe last\none.\n"
    docs = read_documents(_write(tmp_path / "corpus.txt", text))
    assert [d.text for d in docs] == ["In the beginning\nGod created.", "And the earth\nwas without form.", "The last\none."]
    assert [d.id for d in docs] == ["corpus.txt:1", "corpus.txt:6", "corpus.txt:9"]
    # without any blank line: one document a line
    lines = read_documents(_write(tmp_path / "lines.txt", "one\ntwo\nthree"))
    assert [(d.text, d.id) for d in lines] == [("one", "lines.txt:1"), ("two", "lines.txt:2"), ("three", "lines.txt:3")]
    gz = tmp_path / "corpus.txt.gz"
    gz.write_bytes(gzip.compress(text.encode()))
    assert [d.text for d in read_documents(gz)] == [d.text for d in docs]
    # the format: by the name, else by the first non-blank line
    jsonl_text = '{"text": "a {b}"}\n'
    assert [document_format(_write(tmp_path / name, body)) for name, body in
            [("a.jsonl", jsonl_text), ("a.json.gz", jsonl_text), ("a.txt", jsonl_text), ("a.dat", "\n" + jsonl_text),
             ("b.dat", "plain {words}\n"), ("c", "x")]] == ["jsonl", "jsonl", "text", "jsonl", "text", "text"]
    assert [d.text for d in read_documents(tmp_path / "a.txt")] == ['{"text": "a {b}"}']  # .txt: read as text


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_lm_trains_on_a_plain_text_file(tmp_path, capsys):
    from headmix.cli.main import main
    from headmix.data import load_embedded_documents, read_jsonl_documents

    docs = load_embedded_documents(sources="kjv-bible")[:40]
    corpus = _write(tmp_path / "corpus.txt", "\n\n".join(d.text.replace("\n\n", "\n") for d in docs) + "\n")
    assert main(lm_args(tmp_path / "run", corpus)) == 0
    split = [read_jsonl_documents(tmp_path / "run" / "data" / f"{s}.jsonl") for s in ("train", "valid", "test")]
    assert sum(len(s) for s in split) == 40 and all(split)  # 40 documents, split by document
    assert "malformed" not in capsys.readouterr().err


def test_a_malformed_documents_file_names_the_formats_expected(tmp_path, capsys):
    from headmix.cli.main import main
    from headmix.data import CorpusError, read_documents, read_tsv_pairs

    prose = _write(tmp_path / "corpus.jsonl", "Plain prose, not JSON.\nMore prose.\n")
    with pytest.raises(CorpusError, match="no valid documents .*" + JSONL_EXPECTED.replace(".", r"\.")):
        read_documents(prose)
    with pytest.raises(CorpusError, match=r"corpus\.jsonl:1: bad JSON: .*; " + JSONL_EXPECTED.replace(".", r"\.")):
        read_documents(prose, strict=True)
    assert main(lm_args(tmp_path / "run", prose)) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and JSONL_EXPECTED in err
    pairs = _write(tmp_path / "pairs.tsv", "only one column\n")
    with pytest.raises(CorpusError, match=r"expected TSV: source<TAB>target\[<TAB>document id\] a line"):
        read_tsv_pairs(pairs)


def test_evaluate_says_which_split_it_scored_and_its_help_the_default(lm_run, capsys):
    from headmix.cli.main import main

    assert main(["evaluate", str(lm_run), "--no-progress"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["split"] == "test"
    assert f"[headmix] evaluate scored the test split of {lm_run} (training reports the valid split: --split valid " \
           "to compare)" in out.err
    assert main(["evaluate", str(lm_run), "--split", "valid", "--no-progress"]) == 0
    assert f"[headmix] evaluate scored the valid split of {lm_run}\n" in capsys.readouterr().err
    assert main(["evaluate", "--help"]) == 0
    assert "(default: test; training reports the valid split)" in " ".join(capsys.readouterr().out.split())


def test_a_plain_install_cannot_pick_an_untested_torch():
    """pyproject's torch range is the README's "Supported versions" (2.10 to 2.13) and holds the pinned release."""
    import re

    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    deps = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    torch_spec = next(r.specifier for r in deps if r.name == "torch")
    assert [v for v in ("2.9.1", "2.10.0", "2.13.0", "2.13.1", "2.14.0", "2.14.1", "2.15.0") if v in torch_spec] == \
        ["2.10.0", "2.13.0", "2.13.1"]
    readme = (ROOT / "README.md").read_text()
    oldest, newest = re.search(r"PyTorch (\d+\.\d+) \(the first with a public .*?\) to (\d+\.\d+);", readme).groups()
    assert (oldest, newest) == ("2.10", "2.13")
    assert torch_spec.contains(f"{oldest}.0") and not torch_spec.contains(f"{newest[:2]}{int(newest[2:]) + 1}.0")
    pinned = re.search(r"^TORCH \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert torch_spec.contains(pinned)
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme  # how to get the CPU wheel


def test_gpu_check_without_torch_in_its_interpreter_says_so_in_one_line(tmp_path):
    """An interpreter without torch (here this one with -I -S: no site-packages) and a missing one stop the script
    in one line naming the interpreter and PYTHON=, before anything runs."""
    import os
    import subprocess
    import sys

    fake = tmp_path / "python-without-torch"
    fake.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n')
    fake.chmod(0o755)
    for python, says in ((str(fake), f"{fake} has no torch"), (str(tmp_path / "nowhere"), f"no interpreter {tmp_path}/nowhere")):
        proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "quick", "--tiny", "--out",
                               str(tmp_path / "out")], env={**os.environ, "PYTHON": python}, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and says in proc.stderr and "PYTHON=.venv/bin/python" in proc.stderr
        assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_a_corpus_with_no_valid_line_is_one_error_without_a_warning(tmp_path):
    import warnings

    from headmix.data import CorpusError, read_jsonl_documents

    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"body": f"line {i}"}) + "\n" for i in range(3)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning would raise here instead of the CorpusError
        with pytest.raises(CorpusError, match="no valid documents"):
            read_jsonl_documents(bad)


# --------------------------------------------------------------------------- text generation

def tiny_lm(vocab_size: int = 40, positions: str = "rotary"):
    import torch

    from headmix.models import ModelConfig, build_model

    torch.manual_seed(0)
    config = ModelConfig(task="lm", vocab_size=vocab_size, d_model=32, ffn_dim=64, encoder_layers=0, decoder_layers=2,
                         norm="pre", positions=positions, max_positions=64,
                         decoder_self_attention=AttentionConfig(kind="mha", num_heads=4), dropout=0.0)
    return build_model(config).eval()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.8),
                                                     (0.9, 7, 0.6), (1.0, 1, None), (1.0, None, 0.01)])
def test_filter_logits_matches_hugging_faces_warpers(temperature, top_k, top_p):
    import torch
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    from headmix.models import filter_logits

    torch.manual_seed(1)
    logits = torch.randn(6, 50) * 3
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k is not None:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        warpers.append(TopPLogitsWarper(top_p))
    theirs = LogitsProcessorList(warpers)(None, logits.clone())
    ours = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    assert torch.equal(ours.isinf(), theirs.isinf())
    torch.testing.assert_close(ours[~ours.isinf()], theirs[~theirs.isinf()])


def reference_sample(model, prompt, max_len, temperature, top_k, top_p, seed):
    """A plain loop: the whole prefix through the model at every step (no cache), the filter written out."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    tokens, out = prompt.clone(), []
    done = torch.zeros(prompt.shape[0], dtype=torch.bool)
    for _ in range(max_len):
        with torch.no_grad():
            logits = model(tokens).logits[:, -1].float().log_softmax(-1)
        logits[:, model.config.pad_id] = float("-inf")
        logits = logits / temperature
        if top_k is not None:
            kth = logits.sort(-1, descending=True).values[:, top_k - 1:top_k]
            logits[logits < kth] = float("-inf")
        if top_p is not None:
            for row in logits:
                probs = row.softmax(-1)
                order = probs.argsort(descending=True)
                mass = 0.0
                for i in order.tolist():
                    if mass >= top_p:
                        row[i] = float("-inf")
                    mass += float(probs[i])
        token = torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]
        token = token.masked_fill(done, model.config.pad_id)
        done |= token.eq(model.config.eos_id)
        out.append(token)
        tokens = torch.cat([tokens, token[:, None]], 1)
        if bool(done.all()):
            break
    return torch.stack(out, 1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.8, 6, None), (1.2, None, 0.7)])
def test_sampling_draws_what_a_plain_loop_draws(temperature, top_k, top_p):
    import torch

    from headmix.models import sample_decode

    model = tiny_lm()
    prompt = torch.tensor([[1, 5, 9, 3], [1, 7, 7, 8], [1, 4, 30, 2]])
    expected = reference_sample(model, prompt, 40, temperature, top_k, top_p, seed=3)
    assert bool(expected.eq(model.config.eos_id).any())  # some row ends: what follows its eos is padding
    for use_cache in (True, False):
        got = sample_decode(model, prompt, 40, temperature=temperature, top_k=top_k, top_p=top_p,
                            generator=torch.Generator().manual_seed(3), use_cache=use_cache)
        assert torch.equal(got.tokens, expected)


def test_temperature_zero_is_greedy_and_top_k_one_samples_the_argmax():
    import torch

    from headmix.models import greedy_decode, sample_decode

    model = tiny_lm()
    prompt = torch.tensor([[1, 5, 9, 3], [1, 7, 7, 8]])
    greedy = greedy_decode(model, prompt, 10)
    assert torch.equal(sample_decode(model, prompt, 10, temperature=0).tokens, greedy.tokens)
    assert torch.equal(sample_decode(model, prompt, 10, temperature=2.0, top_k=1,
                                     generator=torch.Generator().manual_seed(0)).tokens, greedy.tokens)


class CharTokenizer:
    """A tokenizer for tests: one id per character (ids 5..), bos 1, eos 2, pad 0."""

    bos_id, eos_id, pad_id = 1, 2, 0

    def encode(self, text, *, add_bos=False):
        return ([self.bos_id] if add_bos else []) + [5 + (ord(c) % 30) for c in text]

    def decode(self, ids):
        return "".join(chr(ord("a") + i - 5) for i in ids if i >= 5)


def test_generate_text_batches_prompts_of_any_length_and_repeats_with_a_seed():
    import torch

    from headmix.models import generate_text, greedy_decode

    model, tok = tiny_lm(), CharTokenizer()
    prompts = ["abc", "hello", "xy", "abd"]
    alone = [generate_text(model, tok, p, max_new_tokens=6)[0] for p in prompts]
    ids = torch.tensor([[tok.bos_id, *tok.encode("abc")]])
    assert alone[0] == tok.decode(greedy_decode(model, ids, 6).tokens[0].tolist())
    assert generate_text(model, tok, prompts, max_new_tokens=6) == alone
    assert generate_text(model, tok, prompts, max_new_tokens=6, batch_size=1) == alone
    sampled = generate_text(model, tok, prompts, max_new_tokens=6, temperature=1.5, seed=4)
    assert generate_text(model, tok, prompts, max_new_tokens=6, temperature=1.5, seed=4) == sampled
    assert sampled != generate_text(model, tok, prompts, max_new_tokens=6, temperature=1.5, seed=5)


def test_generate_text_feeds_the_model_bos_then_the_prompt(monkeypatch):
    """As the training blocks start: a prompt without bos would be text the model never saw begin."""
    from headmix.models import generate_text, generation

    fed = []
    real = generation.sample_decode

    def spy(model, src, *args, **kwargs):
        fed.extend(src.tolist())
        return real(model, src, *args, **kwargs)

    monkeypatch.setattr(generation, "sample_decode", spy)
    tok = CharTokenizer()
    generate_text(tiny_lm(), tok, ["hello", "ab", "xy"], max_new_tokens=2)
    assert sorted(fed) == sorted([tok.bos_id, *tok.encode(p)] for p in ["hello", "ab", "xy"])


@pytest.mark.parametrize("options,message", [
    (dict(temperature=-1), "temperature must be a number >= 0"), (dict(top_k=0), "top_k must be a positive integer"),
    (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"), (dict(max_new_tokens=0), "max_new_tokens must be"),
    (dict(max_new_tokens=70), r"max_new_tokens \(70\) \+ the longest prompt \(3 tokens\) exceed the model's "
                              r"max_positions \(64\)"),
])
@pytest.mark.parametrize("positions", ["learned", "rotary"])  # a rotary model has its max_positions too
def test_generate_text_refuses_bad_options_in_one_line(options, message, positions):
    from headmix.models import generate_text

    model = tiny_lm(positions=positions)
    with pytest.raises(ValueError, match=message):
        generate_text(model, CharTokenizer(), ["ab"], **options)


# --------------------------------------------------------------------------- a trained run: generate, --init-from

@pytest.fixture(scope="module")
def lm_run(tmp_path_factory, docs_file) -> Path:
    from headmix.cli.main import main

    out = tmp_path_factory.mktemp("runs") / "lm"
    assert main(lm_args(out, docs_file, "--max-steps", "3")) == 0
    return out


def test_generate_command_continues_prompts_from_the_command_line_and_a_file(lm_run, tmp_path, capsys):
    from headmix.cli.main import main
    from headmix.models import generate_text
    from headmix.runs import load_run

    run = load_run(lm_run)
    prompts = ["In the beginning", "And God said"]
    expected = generate_text(run.model, run.tokenizer, prompts, max_new_tokens=5)
    capsys.readouterr()
    assert main(["generate", str(lm_run), "--prompt", prompts[0], "--prompt", prompts[1], "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out == "".join(p + e + "\n" for p, e in zip(prompts, expected))
    file = tmp_path / "prompts.txt"
    file.write_text("\n".join(prompts) + "\n")
    sampled = generate_text(run.model, run.tokenizer, prompts, max_new_tokens=5, temperature=0.9, top_p=0.9, seed=7)
    assert main(["generate", str(lm_run), "--prompts", str(file), "--max-new-tokens", "5", "--temperature", "0.9",
                 "--top-p", "0.9", "--seed", "7", "--jsonl"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines == [{"prompt": p, "continuation": e} for p, e in zip(prompts, sampled)]


@pytest.mark.parametrize("args,message", [
    (["--top-k", "5"], "--top-k and --top-p choose among the tokens a sample is drawn from: give --temperature > 0"),
    (["--top-p", "1.5"], "argument --top-p: expected a number in (0, 1], got 1.5"),
    (["--temperature", "-1"], "argument --temperature: expected a number >= 0, got -1.0"),
])
def test_generate_command_refuses_bad_options_in_one_line(lm_run, capsys, args, message):
    from headmix.cli.main import main

    assert main(["generate", str(lm_run), "--prompt", "x", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def final_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "model.safetensors"))


def test_init_from_a_headmix_run_starts_from_its_weights_and_tokenizer(lm_run, docs_file, tmp_path):
    import torch

    from headmix.cli.main import main

    out = tmp_path / "continued"
    # the run's own tokenizer (300 ids, its embeddings' ids) is taken; --vocab-size 300 (lm_args) matches it
    args = lm_args(out, docs_file, "--init-from", str(lm_run), "--lr", "1e-9", "--warmup-steps", "0")
    args.remove("--preset"), args.remove("tiny-mha")
    assert main(args) == 0
    before, after = final_weights(lm_run), final_weights(out)
    assert before.keys() == after.keys()
    for name in before:
        torch.testing.assert_close(after[name], before[name], atol=1e-6, rtol=0)
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == (lm_run / "tokenizer" / "tokenizer.json").read_bytes()
    summary = json.loads((out / "summary.json").read_text())
    start = summary["init_from"].pop("valid_at_start")  # the loaded model's validation, before the first step
    # which weights exactly: the source's model.safetensors by its sha256
    assert summary["init_from"] == {"path": str(lm_run.resolve()), "kind": "headmix run",
                                    "sha256": sha256_file(lm_run / "model.safetensors")} and summary["preset"] is None
    assert start["loss"] == pytest.approx(json.loads((lm_run / "summary.json").read_text())["valid"]["loss"], abs=1e-5)
    assert json.loads((out / "train_config.json").read_text())["init_from"] == str(lm_run)


def test_init_from_a_hugging_face_llama_folder_converts_it(docs_file, tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from headmix.cli.main import main
    from headmix.data import train_tokenizer
    from headmix.interop import from_pretrained

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
    folder = tmp_path / "llama"
    llama.save_pretrained(folder)
    texts = [json.loads(line)["text"] for line in docs_file.read_text().splitlines()]
    train_tokenizer(texts, 300).save(folder)  # the folder's own tokenizer (its ids are LlamaConfig's bos 1, eos 2)
    options = {"attention": "moh", "num_shared_heads": 1, "top_k": 3}
    out = tmp_path / "moh"
    args = lm_args(out, docs_file, "--init-from", str(folder), "--init-options", json.dumps(options), "--lr", "1e-9",
                   "--warmup-steps", "0")
    args.remove("--preset"), args.remove("tiny-mha")
    assert main(args) == 0
    converted = from_pretrained(folder, **options).state_dict()
    after = final_weights(out)
    assert converted.keys() == after.keys()
    for name in converted:
        torch.testing.assert_close(after[name], converted[name], atol=1e-6, rtol=0)
    init = json.loads((out / "summary.json").read_text())["init_from"]
    assert init.pop("valid_at_start")["loss"] > 0
    assert init == {"path": str(folder.resolve()), "kind": "hugging face", "options": options,
                    "sha256": sha256_file(folder / "model.safetensors")}


@pytest.mark.parametrize("extra,message", [
    (["--preset", "tiny-moa"], "--preset 'tiny-moa' and init_from"),
    (["--init-options", "{\"attention\": \"moh\"}"],
     "num_shared_heads must be a non-negative integer for attention 'moh', got None"),
])
def test_init_from_refuses_contradictions_before_writing(lm_run, docs_file, tmp_path, capsys, extra, message):
    from headmix.cli.main import main

    args = lm_args(tmp_path / "x", docs_file, "--init-from", str(lm_run), *extra)
    args.remove("--preset"), args.remove("tiny-mha")
    assert main(args) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_init_from_a_folder_without_a_model_says_so(docs_file, tmp_path, capsys):
    from headmix.cli.main import main

    args = lm_args(tmp_path / "x", docs_file, "--init-from", str(tmp_path))
    args.remove("--preset"), args.remove("tiny-mha")
    assert main(args) == 2
    assert f"--init-from {tmp_path} holds no model (no config.json): expected a folder headmix wrote (a finished run" in \
        capsys.readouterr().err


def test_init_from_an_export_or_a_trainer_checkpoint_reads_it_without_a_prompt(lm_run, docs_file, tmp_path, capsys,
                                                                                 monkeypatch):
    """``--init-from`` an ``export-hf`` folder and a Hugging Face ``Trainer`` checkpoint of the exported model start
    from their weights (read as JSON and safetensors: no remote code, no prompt; standard input is closed), with
    the export's own tokenizer; a checkpoint saved without its tokenizer is refused in one line asking for
    ``--tokenizer``, and runs with it."""
    import io

    import torch
    import transformers

    from headmix.cli.main import main

    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # a prompt would fail here
    exported = tmp_path / "hf"
    assert main(["export-hf", str(lm_run), str(exported)]) == 0
    out = tmp_path / "from-export"
    args = lm_args(out, docs_file, "--init-from", str(exported), "--lr", "1e-9", "--warmup-steps", "0")
    args.remove("--preset"), args.remove("tiny-mha")
    assert main(args) == 0
    before = final_weights(lm_run)
    for name, tensor in final_weights(out).items():
        torch.testing.assert_close(tensor, before[name], atol=1e-6, rtol=0)
    assert json.loads((out / "summary.json").read_text())["init_from"]["kind"] == "headmix folder"

    import headmix.hf  # noqa: F401

    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    ids = torch.full((4, 16), 40)
    trainer = transformers.Trainer(model=model, train_dataset=[{"input_ids": ids[0], "labels": ids[0]}] * 4,
                                   args=transformers.TrainingArguments(
                                       output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=4,
                                       max_steps=1, learning_rate=1e-3, report_to=[], save_steps=1, use_cpu=True,
                                       disable_tqdm=True))
    trainer.train()
    checkpoint = tmp_path / "trainer" / "checkpoint-1"
    args = lm_args(tmp_path / "x", docs_file, "--init-from", str(checkpoint))
    args.remove("--preset"), args.remove("tiny-mha")
    capsys.readouterr()
    assert main(args) == 2
    assert f"--init-from {checkpoint} has no tokenizer" in capsys.readouterr().err and not (tmp_path / "x").exists()
    out = tmp_path / "from-checkpoint"
    args = lm_args(out, docs_file, "--init-from", str(checkpoint), "--tokenizer", str(lm_run / "tokenizer"),
                   "--lr", "1e-9", "--warmup-steps", "0")
    args.remove("--preset"), args.remove("tiny-mha")
    assert main(args) == 0
    trained = {k: v for k, v in model.state_dict().items()}
    for name, tensor in final_weights(out).items():
        torch.testing.assert_close(tensor, trained["model." + name], atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- the layers

def all_layers():
    from headmix import (MixtureOfAttentionHeads, MixtureOfHeadsAttention, MultiHeadAttention, SwitchHeadAttention,
                         TalkingHeadsAttention)

    return {"mha": MultiHeadAttention(16, 4, key_dim=6), "moa": MixtureOfAttentionHeads(16, 6, 2, 8, kv_heads=2),
            "moh": MixtureOfHeadsAttention(16, 4, 1, 2), "th": TalkingHeadsAttention(16, 4),
            "switchhead": SwitchHeadAttention(16, 2, 5, 3, head_dim=7)}


REPRS = {"mha": "embed_dim=16, num_heads=4, head_dim=4, key_dim=6",
         "moa": "embed_dim=16, num_experts=6, top_k=2, head_dim=8, kv_heads=2",
         "moh": "embed_dim=16, num_heads=4, num_shared_heads=1, top_k=2, head_dim=4, key_dim=4",
         "th": "embed_dim=16, num_heads=4, head_dim=4, key_dim=4",
         "switchhead": "embed_dim=16, num_heads=2, num_experts=5, top_k=3, head_dim=7"}


@pytest.mark.parametrize("name", sorted(REPRS))
def test_repr_shows_the_sizes(name):
    layer = all_layers()[name]
    assert layer.extra_repr() == REPRS[name]
    assert repr(layer).splitlines()[1].strip() == REPRS[name]


@pytest.mark.parametrize("name", sorted(REPRS))
def test_every_layers_forward_has_a_docstring_naming_its_output(name):
    doc = type(all_layers()[name]).forward.__doc__
    assert doc and "AttentionOutput" in doc and "key_padding_mask" in doc


@pytest.mark.parametrize("name", sorted(REPRS))
def test_an_input_of_another_dtype_is_one_line_naming_it(name):
    import torch

    layer = all_layers()[name]
    x = torch.randn(2, 3, 16)
    with pytest.raises(ValueError, match=r"^query has dtype torch.float16 but the layer's weights are torch.float32: "
                                         r"convert one to the other \(layer.to\(torch.float16\)"):
        layer(x.half())
    with pytest.raises(ValueError, match=r"^key has dtype torch.float64"):
        layer(x, x.double()[:, :2])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts by itself
        assert layer(x.bfloat16()).output.shape == (2, 3, 16)


def test_from_torch_refuses_a_sequence_first_module_unless_told():
    import torch

    from headmix import MultiHeadAttention

    ref = torch.nn.MultiheadAttention(16, 4).eval()  # batch_first=False, torch's default
    with pytest.raises(ValueError, match=r"^module has batch_first=False .* pass allow_seq_first=True"):
        MultiHeadAttention.from_torch(ref)
    layer = MultiHeadAttention.from_torch(ref, allow_seq_first=True).eval()
    x = torch.randn(5, 3, 16)  # (time, batch, embed_dim) for the torch module
    expected, _ = ref(x, x, x, need_weights=False)
    torch.testing.assert_close(layer(x.transpose(0, 1)).output.transpose(0, 1), expected)


# --------------------------------------------------------------------------- the command line

def test_version_and_help_speak_to_a_user(capsys):
    from headmix import __version__
    from headmix.cli.main import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"headmix {__version__}\n"
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "process-wide" not in text and "library functions" not in text
    assert "`headmix COMMAND --help` describes a command" in text and "generate" in text
    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-progress do not show progress: a bar on a terminal" in text and "do not:" not in text


class FakeBar:
    made: list = []

    def __init__(self, total, desc, unit):
        self.total, self.desc, self.unit, self.updates, self.closed = total, desc, unit, 0, False
        FakeBar.made.append(self)

    def update(self, n):
        self.updates += n

    def close(self):
        self.closed = True


def fake_progress_bar(total, desc, unit, enabled):
    return FakeBar(total, desc, unit) if enabled else None


def test_evaluate_shows_a_progress_bar_of_its_batches(lm_run, monkeypatch, capsys):
    from headmix.cli.main import main
    from headmix.evaluation import loss

    monkeypatch.setattr(loss, "progress_bar", fake_progress_bar)
    FakeBar.made = []
    assert main(["evaluate", str(lm_run), "--split", "valid"]) == 0
    assert len(FakeBar.made) == 1
    bar = FakeBar.made[0]
    assert bar.total >= 1 and bar.updates == bar.total and bar.closed and bar.unit == "batch"
    FakeBar.made = []
    assert main(["evaluate", str(lm_run), "--split", "valid", "--no-progress"]) == 0
    assert FakeBar.made == []


def test_translate_shows_a_progress_bar_of_its_sentences(monkeypatch):
    import torch

    from headmix.evaluation import translate, translation
    from headmix.models import build_model, get_config

    monkeypatch.setattr(translation, "progress_bar", fake_progress_bar)
    FakeBar.made = []
    torch.manual_seed(0)
    model = build_model(get_config("tiny-mha", task="translation", vocab_size=40))
    translate(model, CharTokenizerWithEos(), ["ab", "abc", "b"], beam_size=1, batch_size=2, max_len_b=2, progress=True)
    assert [(b.total, b.updates, b.closed, b.unit) for b in FakeBar.made] == [(3, 3, True, "sentence")]


class CharTokenizerWithEos(CharTokenizer):
    def encode(self, text, *, add_bos=False, add_eos=False):
        return super().encode(text, add_bos=add_bos) + ([self.eos_id] if add_eos else [])


# --------------------------------------------------------------------------- examples/

def run_example(name: str, argv: list[str]):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_example_layer_in_your_model_learns_to_copy(capsys):
    first = run_example("layer_in_your_model", ["--steps", "1"])
    last = run_example("layer_in_your_model", ["--steps", "40"])
    assert last < first / 2
    assert "embed_dim=64, num_experts=16, top_k=4, head_dim=16" in capsys.readouterr().out


def test_example_continue_training_llama(tmp_path, docs_file, capsys):
    texts = run_example("continue_training_llama", ["--out", str(tmp_path), "--data", str(docs_file), "--steps", "1",
                                                    "--vocab-size", "300"])
    assert len(texts) == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["init_from"]["options"] == {"attention": "moh", "num_shared_heads": 1, "top_k": 2}
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["decoder_self_attention"]["kind"] == "moh"


@pytest.mark.slow
def test_example_study_on_your_text(tmp_path, docs_file):
    text = tmp_path / "notes.txt"
    text.write_text("\n\n".join(json.loads(line)["text"] for line in docs_file.read_text().splitlines()))
    table = run_example("study_on_your_text", ["--text", str(text), "--out", str(tmp_path / "study"), "--steps", "1",
                                               "--seeds", "1", "2", "--vocab-size", "300"])
    assert all(f"| {row} |" in table for row in ("MHA", "MoA", "MoH"))


def test_examples_readme_lists_every_example():
    listed = (ROOT / "examples" / "README.md").read_text()
    for script in (ROOT / "examples").glob("*.py"):
        assert f"[`{script.name}`]({script.name})" in listed
    assert "the Hugging Face recipe, [docs/hf.md](../docs/hf.md)" in listed


# --------------------------------------------------------------------------- docs

def python_snippets(path: Path) -> list[str]:
    import re

    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_the_readme_gives_its_two_commands_with_the_makefiles_timing_and_a_row_for_each_question():
    """The README's two commands each carry one timing, the Makefile's (no log of timings per commit); its
    "Where to go next" table answers distilling, lm-eval and serving across ranks, each row linking a section that
    exists; the docs name what vLLM serves as docs/serving.md does."""
    import re

    readme, makefile = (ROOT / "README.md").read_text(), (ROOT / "Makefile").read_text()
    for command in ("demo", "test"):
        line = next(l for l in readme.splitlines() if l.startswith(f"make {command} "))
        timing = re.search(rf"^#   make {command} .*?(\d+(?:-\d+)?) min", makefile, re.M).group(1)
        assert re.findall(r"\d+(?:-\d+)? minutes?", line)[0].startswith(timing), line
        assert len(re.findall(r"\(\d+ under load\)|\d+ s\b", line)) == 0, line
    assert not re.search(r"fresh clone at [0-9a-f]{7}", readme)
    table = readme.split("## Where to go next", 1)[1].split("\n## ", 1)[0]
    for question, page, section in (("distil", "docs/training.md", "## Distillation"),
                                    ("headmix lm-eval", "docs/hf.md", "## Evaluating with lm-evaluation-harness"),
                                    ("several devices", "docs/serving.md", "## Across devices")):
        row = next((l for l in table.splitlines() if question in l), None)
        assert row and f"]({page})" in row and section in (ROOT / page).read_text(), question
    hf = " ".join((ROOT / "docs" / "hf.md").read_text().split())
    assert "not GQE" not in hf and "every kind but Talking-Heads, MoSA" in hf


@pytest.mark.parametrize("doc", ["README.md", "docs/layers.md", "docs/models.md", "docs/hf.md"])
def test_the_python_snippets_of_the_docs_run(doc, tmp_path, monkeypatch):
    """Each doc's snippets in order, in one namespace (a reader runs them top to bottom); the checkpoint folder
    docs/models.md names is a tiny Qwen3 built from a config."""
    if doc == "docs/hf.md":
        pytest.importorskip("transformers")
    snippets = python_snippets(ROOT / doc)
    assert snippets
    monkeypatch.chdir(tmp_path)
    if "path/to/Qwen3-0.6B" in (ROOT / doc).read_text():
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        config = transformers.Qwen3Config(vocab_size=8000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        transformers.Qwen3ForCausalLM(config).save_pretrained(tmp_path / "path" / "to" / "Qwen3-0.6B")
    namespace = {"__name__": "__snippet__"}
    for snippet in snippets:
        exec(compile(snippet, f"{doc} snippet", "exec"), namespace)


def test_translate_points_a_language_model_to_generate(lm_run, capsys):
    from headmix.cli.main import main

    assert main(["translate", str(lm_run)]) == 2
    assert f"headmix translate needs a translation run (for a language model: headmix generate {lm_run}" in \
        capsys.readouterr().err


def test_progress_off_a_terminal_is_a_line_at_a_steady_interval():
    """Off a terminal (a log file, a cluster job's log) training prints one line every ``interval`` seconds and
    one at the end: step of total, loss, tokens/s, elapsed and the time remaining, from this process's steps."""
    import io

    from headmix.training.progress import Progress

    now = [0.0]
    log = io.StringIO()  # not a terminal
    progress = Progress(10, stream=log, interval=30, clock=lambda: now[0])
    for step in range(1, 11):  # 10 s and 100 tokens a step
        now[0] += 10
        progress.update(step, 6.0 - step / 10, 100)
    progress.close()
    assert log.getvalue().splitlines() == [
        "[headmix] train: step 3/10 (30%), loss 5.700, 10 tokens/s, elapsed 0:00:30, remaining ~0:01:10",
        "[headmix] train: step 6/10 (60%), loss 5.400, 10 tokens/s, elapsed 0:01:00, remaining ~0:00:40",
        "[headmix] train: step 9/10 (90%), loss 5.100, 10 tokens/s, elapsed 0:01:30, remaining ~0:00:10",
        "[headmix] train: step 10/10 (100%), loss 5.000, 10 tokens/s, elapsed 0:01:40, remaining ~0:00:00"]
    # a resumed run (from step 4) estimates from its own steps; a run bounded by time has no total
    now[0], log = 0.0, io.StringIO()
    resumed = Progress(10, 4, stream=log, interval=30, clock=lambda: now[0])
    now[0] = 40.0
    resumed.update(5, 4.0, 2000)
    assert log.getvalue() == ("[headmix] train: step 5/10 (50%), loss 4.000, 50 tokens/s, elapsed 0:00:40, "
                              "remaining ~0:03:20\n")
    resumed.close()  # nothing new since the last line
    assert log.getvalue().count("\n") == 1
    now[0], log = 0.0, io.StringIO()
    timed = Progress(None, stream=log, interval=30, clock=lambda: now[0])
    now[0] = 3725.0
    timed.update(7, 3.0, 0)
    assert log.getvalue() == "[headmix] train: step 7, loss 3.000, 0 tokens/s, elapsed 1:02:05\n"
    with pytest.raises(ValueError, match="interval must be a positive number"):
        Progress(10, interval=0)


def test_progress_on_a_terminal_is_the_bar_and_a_training_run_logs_its_progress(tmp_path, docs_file, capsys):
    import io

    from headmix.cli.main import main
    from headmix.training.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    bar = Progress(4, stream=screen, interval=1e-9)
    bar.update(1, 2.5, 10)
    bar.close()
    assert "[headmix]" not in screen.getvalue() and "1/4" in screen.getvalue() and "loss=2.500" in screen.getvalue()
    # `headmix train` with its output captured (not a terminal): the last line of progress, no bar
    args = [a for a in lm_args(tmp_path / "run", docs_file, "--max-steps", "2") if a != "--no-progress"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "[headmix] train: step 2/2 (100%), loss " in err and "remaining ~0:00:00" in err and "step/s" not in err
    assert main(lm_args(tmp_path / "quiet", docs_file)) == 0  # --no-progress: none
    assert "[headmix] train: step" not in capsys.readouterr().err
