"""Tokenizers whose special tokens are not headmix's ``<pad> <s> </s> <unk> <mask>`` at ids 0-4 (issue 52, item 3):
the Llama 3 and Qwen3 layouts (special tokens at the end of the vocabulary, no padding token, or a padding token
that is also a real token), built here with the ``tokenizers`` library, as a tokenizer of its own and inside a
Hugging Face model folder built from a config. Training, validation, generation and export take the special ids
from the tokenizer's and the model's own configs; ``--init-from`` a folder with a tokenizer uses it; what does not
match the parent, or a role no config names, is refused in one line before anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

#: The two layouts: the special tokens appended after the BPE vocabulary, and what tokenizer_config.json names.
LAYOUTS = {
    # Llama 3: <|begin_of_text|> / <|end_of_text|>, no padding token
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>"],
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}),
    # Qwen3: no bos token in the tokenizer (the model's config.json names one), pad <|endoftext|>, eos <|im_end|>
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
}


def foreign_tokenizer(folder: Path, layout: str | tuple[list[str], dict], texts: list[str],
                      size: int = 290) -> dict[str, int]:
    """A byte-level BPE of ``size`` ids trained on ``texts`` with no special token among them, the layout's
    special tokens appended after it, saved with its ``tokenizer_config.json`` in ``folder``; returns the ids of
    the appended tokens by name. ``layout``: a name of :data:`LAYOUTS`, or its ``(specials, config)``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=size, special_tokens=[], show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    specials, config = LAYOUTS[layout] if isinstance(layout, str) else layout
    tok.add_special_tokens(specials)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return {t: tok.token_to_id(t) for t in specials}


def corpus_texts(docs_file: Path) -> list[str]:
    return [json.loads(line)["text"] for line in docs_file.read_text().splitlines()]


def hf_folder(folder: Path, layout: str, docs_file: Path, heads: int = 4) -> dict[str, int]:
    """A tiny Hugging Face model of the layout's family (Llama or Qwen3, grouped K/V heads) with its tokenizer, its
    ``config.json`` naming the special ids as the released models do (Qwen3: bos <|endoftext|>, eos <|im_end|>)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    ids = foreign_tokenizer(folder, layout, corpus_texts(docs_file))
    common = dict(vocab_size=max(ids.values()) + 9, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=64)  # padded embeddings
    torch.manual_seed(0)
    if layout == "llama3":
        model = LlamaForCausalLM(LlamaConfig(**common, bos_token_id=ids["<|begin_of_text|>"],
                                             eos_token_id=ids["<|end_of_text|>"]))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8, bos_token_id=ids["<|endoftext|>"],
                                             eos_token_id=ids["<|im_end|>"], tie_word_embeddings=True))
    model.save_pretrained(folder)
    return ids


def lm_args(out: Path, data: Path, *extra: str) -> list[str]:
    return ["train", "lm", "--out", str(out), "--data", str(data), "--max-steps", "2", "--max-tokens", "256",
            "--max-len", "32", "--no-progress", *extra]


# --------------------------------------------------------------------------- the tokenizer


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_foreign_tokenizer_takes_its_special_ids_from_its_configs(tmp_path, docs_file, layout):
    from headmix.data import Tokenizer

    ids = hf_folder(tmp_path / "hf", layout, docs_file)
    tok = Tokenizer.load(tmp_path / "hf")
    if layout == "llama3":
        expected = (None, ids["<|begin_of_text|>"], ids["<|end_of_text|>"])
    else:  # the tokenizer names no bos: the model's config.json does
        expected = (ids["<|endoftext|>"], ids["<|endoftext|>"], ids["<|im_end|>"])
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == expected
    assert (tok.unk_id, tok.mask_id) == (None, None) and not tok.headmix_layout
    text = "In the beginning <|end_of_text|> <s>"
    encoded = tok.encode(text, add_bos=True, add_eos=True)
    assert encoded[0] == expected[1] and encoded[-1] == expected[2] and tok.decode(encoded) == text
    assert set(encoded[1:-1]).isdisjoint(ids.values())  # special-token text in the data is ordinary text
    # saved with its roles: it loads the same without the model's config.json
    tok.save(tmp_path / "saved")
    again = Tokenizer.load(tmp_path / "saved")
    assert (again.pad_id, again.bos_id, again.eos_id) == expected


def test_a_tokenizer_without_its_configs_is_refused_naming_them(tmp_path, docs_file):
    from headmix.data import Tokenizer

    foreign_tokenizer(tmp_path, "llama3", corpus_texts(docs_file))
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match=r"or name its special tokens \(tokenizer_config.json beside tokenizer.json\)"):
        Tokenizer.load(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    with pytest.raises(ValueError, match=r"^the eos token '<\|eot_id\|>' is not in the tokenizer's vocabulary$"):
        Tokenizer.load(tmp_path)


# --------------------------------------------------------------------------- training, generation, export


@pytest.fixture(scope="module")
def trained(tmp_path_factory, docs_file):
    """A run of each layout ``--init-from`` its Hugging Face folder, with no ``--tokenizer``: the folder's own."""
    from headmix.cli.main import main

    root = tmp_path_factory.mktemp("foreign")
    runs = {}
    for layout in LAYOUTS:
        ids = hf_folder(root / layout, layout, docs_file)
        assert main(lm_args(root / f"run-{layout}", docs_file, "--init-from", str(root / layout))) == 0
        runs[layout] = (root / layout, root / f"run-{layout}", ids)
    return runs


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_init_from_a_folder_trains_with_its_own_tokenizer_and_special_ids(trained, layout):
    """The run keeps the folder's tokenizer (and its roles, in the run's ``tokenizer_config.json``) and the
    parent's special ids; a Qwen3 padding token that is its bos token is no padding (``pad_id`` ``None``); the
    training and validation blocks are the tokenizer's ids, separated by its eos token."""
    from headmix.data import Tokenizer
    from headmix.runs import load_run
    from headmix.tasks import get_task

    folder, out, ids = trained[layout]
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    config = json.loads((out / "config.json").read_text())
    eos = ids["<|end_of_text|>"] if layout == "llama3" else ids["<|im_end|>"]
    bos = ids["<|begin_of_text|>"] if layout == "llama3" else ids["<|endoftext|>"]
    assert (config["pad_id"], config["bos_id"], config["eos_id"]) == (None, bos, eos)
    run = load_run(out)
    assert (run.tokenizer.bos_id, run.tokenizer.eos_id) == (bos, eos)
    task = get_task("lm")
    valid = task.dataset(task.read_items(task.split_path(out / "data", "valid")), run.tokenizer, 32)
    assert valid.stream[0] == eos and (valid.stream == eos).sum() > 1
    batch = next(iter(task.loader(valid, run.tokenizer, max_tokens=256, train=False, seed=1)))
    assert int(batch["input_ids"].max()) < run.model.config.vocab_size and 0 not in ids.values()
    assert Tokenizer.load(out / "tokenizer").special_tokens == Tokenizer.load(folder).special_tokens
    from headmix.interop import from_pretrained

    assert from_pretrained(folder).config.pad_id is None  # Qwen3's pad <|endoftext|> is its bos: a real token


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_generate_and_export_use_the_tokenizers_special_ids(trained, layout, tmp_path, capsys):
    """``headmix generate`` puts the tokenizer's bos first and stops at its eos; ``export-hf`` writes a tokenizer
    whose bos / eos / pad are the run's, which ``AutoTokenizer`` reads and puts first as headmix does."""
    import torch
    import transformers

    from headmix.cli.main import main
    from headmix.models import generate_text
    from headmix.runs import load_run

    _, out, _ = trained[layout]
    run = load_run(out)
    assert run.tokenizer.encode("In the", add_bos=True)[0] == run.model.config.bos_id
    expected = generate_text(run.model, run.tokenizer, ["In the beginning"], max_new_tokens=4)
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "In the beginning", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out == "In the beginning" + expected[0] + "\n"
    assert main(["export-hf", str(out), str(tmp_path / "hf")]) == 0
    import headmix.hf  # noqa: F401

    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    cfg = run.model.config
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (cfg.bos_id, cfg.eos_id, cfg.pad_id)
    assert tok("In the")["input_ids"] == run.tokenizer.encode("In the", add_bos=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert (model.config.bos_token_id, model.config.eos_token_id) == (cfg.bos_id, cfg.eos_id)
    ids = torch.tensor([run.tokenizer.encode("In the beginning", add_bos=True)])
    torch.testing.assert_close(model(ids).logits, run.model.eval()(ids).logits, atol=1e-5, rtol=0)


def refused(args: list[str], out: Path, capsys) -> str:
    from headmix.cli.main import main

    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not out.exists()
    return err


def test_a_tokenizer_or_vocabulary_that_does_not_match_the_parent_is_refused_before_writing(trained, docs_file,
                                                                                          tmp_path, capsys):
    folder, _, ids = trained["llama3"]
    out = tmp_path / "x"
    size = max(ids.values()) + 1
    assert refused(lm_args(out, docs_file, "--init-from", str(folder), "--vocab-size", "400"), out, capsys) == (
        f"headmix train: error: --vocab-size 400 does not match the tokenizer of init_from {folder} ({size} ids), "
        f"which its model was trained with: leave out --vocab-size")
    other = tmp_path / "other"  # the Qwen3 layout: its eos token is another id than the Llama model's
    theirs = foreign_tokenizer(other, "qwen3", corpus_texts(docs_file))
    (other / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}))
    assert f"--tokenizer {other}: its eos token is id {theirs['<|im_end|>']}, none of the stop ids " \
           f"[{ids['<|end_of_text|>']}] of the model of init_from {folder}: give the tokenizer its model was trained " \
           f"with" in refused(
               lm_args(out, docs_file, "--init-from", str(folder), "--tokenizer", str(other)), out, capsys)
    swapped = tmp_path / "swapped"  # the parent's own tokenizer, its bos role given to another token
    shutil.copy(folder / "tokenizer.json", swapped.mkdir() or swapped / "tokenizer.json")
    (swapped / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>"}))
    assert f"--tokenizer {swapped}: its bos token is id {ids['<|end_of_text|>']}, the model of init_from {folder} " \
           f"has bos_id {ids['<|begin_of_text|>']}: give the tokenizer its model was trained with" in refused(
               lm_args(out, docs_file, "--init-from", str(folder), "--tokenizer", str(swapped)), out, capsys)
    bigger = tmp_path / "bigger"
    foreign_tokenizer(bigger, "llama3", corpus_texts(docs_file), size=400)
    assert f"--tokenizer {bigger} has 403 ids but the model of init_from {folder} embeds {size + 8}" in refused(
        lm_args(out, docs_file, "--init-from", str(folder), "--tokenizer", str(bigger)), out, capsys)


def test_a_folder_without_a_tokenizer_or_a_missing_one_is_refused_before_writing(trained, docs_file, tmp_path, capsys):
    folder, _, _ = trained["llama3"]
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    out = tmp_path / "x"
    assert f"--init-from {bare} has no tokenizer" in refused(lm_args(out, docs_file, "--init-from", str(bare)), out,
                                                             capsys)
    assert refused(lm_args(out, docs_file, "--init-from", str(tmp_path / "nowhere")), out, capsys) == (
        f"headmix train: error: --init-from {tmp_path / 'nowhere'} not found")


def test_a_role_no_config_names_is_refused_in_one_line(docs_file, tmp_path, capsys):
    """A Qwen3 tokenizer alone names no bos token (its model's config.json does): a new model on it is refused,
    naming the token; an eos token is needed too."""
    tok = tmp_path / "qwen3-tokenizer"
    foreign_tokenizer(tok, "qwen3", corpus_texts(docs_file))
    out = tmp_path / "x"
    args = lm_args(out, docs_file, "--tokenizer", str(tok), "--preset", "tiny-mha")
    assert refused(args, out, capsys) == (
        f"headmix train: error: --tokenizer {tok} names no bos token, which task 'lm' needs: name it (bos_token) in "
        f"the tokenizer_config.json beside its tokenizer.json")
    (tok / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>"}))
    assert "names no eos token, which task 'lm' needs" in refused(args, out, capsys)
    (tok / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}))
    assert "names no pad token or mask token, which task 'mlm' needs" in refused(
        ["train", "mlm", *args[2:]], out, capsys)


def test_a_new_model_on_a_foreign_tokenizer_trains_with_its_ids(docs_file, tmp_path):
    """A preset's model on a Llama 3 tokenizer (no padding token): pad_id None, bos / eos the tokenizer's."""
    from headmix.cli.main import main

    tok = tmp_path / "llama3-tokenizer"
    ids = foreign_tokenizer(tok, "llama3", corpus_texts(docs_file))
    out = tmp_path / "run"
    assert main(lm_args(out, docs_file, "--tokenizer", str(tok), "--preset", "tiny-mha")) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["pad_id"], config["bos_id"], config["eos_id"]) == (
        293, None, ids["<|begin_of_text|>"], ids["<|end_of_text|>"])


# --------------------------------------------------------------------------- docs/hf.md's commands


def test_the_commands_of_docs_hf_run_as_written(docs_file, tmp_path, monkeypatch):
    """The ``headmix train`` commands of docs/hf.md ("From a checkpoint to a routed model"), as written, on local
    models built from a config: ``path/to/Qwen3-folder`` a tiny Qwen3 with its tokenizer (8 query heads on 2 K/V
    heads) and ``runs/dense`` a headmix run continued from a Llama of that shape; only the run's size is added
    (steps, batch and block length; the last value of a repeated option wins)."""
    import re
    import shlex

    from headmix.cli.main import main

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "hf.md").read_text()
    block = re.search(r"\*\*From the command line\*\*.*?```bash\n(.*?)```", text, flags=re.S).group(1)
    commands = [shlex.split(c, comments=True) for c in block.replace("\\\n", " ").splitlines()]
    commands = [c for c in commands if c]
    assert len(commands) == 3 and all(c[:3] == ["headmix", "train", "lm"] for c in commands)
    monkeypatch.chdir(tmp_path)
    shutil.copy(docs_file, tmp_path / "docs.jsonl")
    hf_folder(tmp_path / "path" / "to" / "Qwen3-folder", "qwen3", docs_file, heads=8)
    hf_folder(tmp_path / "llama", "llama3", docs_file, heads=8)
    size = ["--max-steps", "1", "--max-tokens", "256", "--max-len", "32", "--no-progress"]
    assert main(["train", "lm", "--init-from", "llama", "--data", "docs.jsonl", "--out", "runs/dense", *size]) == 0
    for command in commands:
        assert main([*command[1:], *size]) == 0, command
        out = Path(command[command.index("--out") + 1])
        assert json.loads((out / "summary.json").read_text())["steps"] == 1
    assert (Path("runs/gqe/tokenizer/tokenizer.json").read_bytes()
            == Path("path/to/Qwen3-folder/tokenizer.json").read_bytes())


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_distilling_from_a_hugging_face_folder_uses_its_own_tokenizer(trained, layout, docs_file, tmp_path):
    """``--init-from F --distill-from F`` with no ``--tokenizer``: the run takes the folder's tokenizer (so the
    parent's check passes), records the parent's weights and logs the KL."""
    from headmix.cli.main import main

    folder, _, _ = trained[layout]
    out = tmp_path / "distilled"
    assert main(lm_args(out, docs_file, "--init-from", str(folder), "--distill-from", str(folder),
                        "--distill-temperature", "2")) == 0
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    parent = json.loads((out / "train_config.json").read_text())["distill_parent"]
    assert Path(parent["path"]) == folder.resolve() and parent["sha256"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("distill_kl" in r for r in records)
