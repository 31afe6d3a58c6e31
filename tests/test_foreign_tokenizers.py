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
    if layout == "llama3":  # Llama 3's tokenizer.json puts <|begin_of_text|> before every text; Qwen3's adds nothing
        from tokenizers import processors

        bos = specials[0]
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                                          special_tokens=[(bos, tok.token_to_id(bos))])])
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
    # its sequence convention is what transformers' tokenizer of the same files puts first: Llama 3's bos, Qwen3's none
    import transformers

    assert tok.sequence_start == again.sequence_start == {"llama3": "bos", "qwen3": "none"}[layout]
    plain = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")("In the")["input_ids"]
    assert plain == ([expected[1]] if layout == "llama3" else []) + tok.encode("In the")


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
    training and validation blocks are the tokenizer's ids, each document as the parent's tokenizer starts a text
    (Llama 3: ``bos text eos``; Qwen3: ``text eos``), which the run stores as its convention."""
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
    start = {"llama3": "bos", "qwen3": "none"}[layout]
    assert config["sequence_start"] == json.loads((out / "train_config.json").read_text())["sequence_start"] == start
    docs = task.read_items(task.split_path(out / "data", "valid"))
    valid = task.dataset(docs, run.tokenizer, 32, sequence_start=run.model.config.sequence_start)
    head = [bos] if layout == "llama3" else []
    assert valid.stream.tolist() == [i for doc in docs for i in [*head, *run.tokenizer.encode(doc.text), eos]]
    batch = next(iter(task.loader(valid, run.tokenizer, max_tokens=256, train=False, seed=1)))
    assert int(batch["input_ids"].max()) < run.model.config.vocab_size and 0 not in ids.values()
    assert Tokenizer.load(out / "tokenizer").special_tokens == Tokenizer.load(folder).special_tokens
    from headmix.interop import from_pretrained

    assert from_pretrained(folder).config.pad_id is None  # Qwen3's pad <|endoftext|> is its bos: a real token


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_generate_and_export_use_the_tokenizers_special_ids(trained, layout, tmp_path, capsys, monkeypatch):
    """``headmix generate`` starts the prompt as the run's documents start (Llama 3: its bos; Qwen3: nothing) and
    stops at its eos; ``export-hf`` writes a tokenizer whose bos / eos / pad are the run's, which ``AutoTokenizer``
    reads and which starts a text as headmix does, with ``add_bos_token`` true exactly for a bos convention."""
    import torch
    import transformers

    from headmix.cli.main import main
    from headmix.models import generate_text
    from headmix.models.config import sequence_prefix
    from headmix.runs import load_run

    _, out, _ = trained[layout]
    run = load_run(out)
    cfg = run.model.config
    start = sequence_prefix(cfg)
    assert start == ([cfg.bos_id] if layout == "llama3" else [])
    assert prompt_fed(run, monkeypatch) == start + run.tokenizer.encode("In the beginning")
    monkeypatch.undo()
    expected = generate_text(run.model, run.tokenizer, ["In the beginning"], max_new_tokens=4)
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "In the beginning", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out == "In the beginning" + expected[0] + "\n"
    assert main(["export-hf", str(out), str(tmp_path / "hf")]) == 0
    import headmix.hf  # noqa: F401

    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (cfg.bos_id, cfg.eos_id, cfg.pad_id)
    assert tok("In the")["input_ids"] == start + run.tokenizer.encode("In the")
    added = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["add_bos_token"]
    assert added is (layout == "llama3")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert (model.config.bos_token_id, model.config.eos_token_id) == (cfg.bos_id, cfg.eos_id)
    ids = torch.tensor([start + run.tokenizer.encode("In the beginning")])
    torch.testing.assert_close(model(ids).logits, run.model.eval()(ids).logits, atol=1e-5, rtol=0)


#: The one document the convention tests score (shorter than a run's 32-token blocks: one block, whole).
ONE_DOCUMENT = "In the beginning was the word."


def scored_by_evaluate_and_by_hand(run_folder: Path, copy: Path) -> tuple[dict, list[float], list[int]]:
    """``headmix evaluate``'s result on a copy of the run whose valid split is :data:`ONE_DOCUMENT` alone, and the
    loss of each token of that document computed by hand: the model run on the convention's start, the text and its
    eos (:func:`sequence_prefix`), each token scored after all before it; and those ids."""
    import shutil

    import torch
    import torch.nn.functional as F

    from headmix.models.config import sequence_prefix
    from headmix.runs import load_run
    from headmix.tasks import evaluate_run

    if not copy.exists():
        shutil.copytree(run_folder, copy)
    (copy / "data" / "valid.jsonl").write_text(json.dumps({"text": ONE_DOCUMENT, "id": "one", "source": "t"}) + "\n")
    result = evaluate_run(copy, split="valid")
    run = load_run(copy)
    cfg = run.model.config
    ids = sequence_prefix(cfg) + run.tokenizer.encode(ONE_DOCUMENT) + [cfg.eos_id]
    assert len(ids) - 1 <= json.loads((copy / "train_config.json").read_text())["max_len"]  # one block
    with torch.no_grad():
        logits = run.model(torch.tensor([ids[:-1]])).logits[0]
    return result, F.cross_entropy(logits.float(), torch.tensor(ids[1:]), reduction="none").tolist(), ids


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_evaluate_scores_each_document_after_the_start_the_model_was_trained_with(trained, layout, tmp_path):
    """``headmix evaluate`` scores a document as the run's convention starts it: after Llama 3's bos every token of
    the text is scored, its first one included; with Qwen3's (no start token) the text's first token is given and
    the scoring starts at its second. The mean and the count equal the loss computed by hand through the model."""
    from headmix.runs import load_run

    _, out, ids_of = trained[layout]
    result, by_hand, ids = scored_by_evaluate_and_by_hand(out, tmp_path / "run")
    text = load_run(out).tokenizer.encode(ONE_DOCUMENT)
    if layout == "llama3":
        assert ids[:2] == [ids_of["<|begin_of_text|>"], text[0]] and len(by_hand) == len(text) + 1
    else:
        assert ids[0] == text[0] and len(by_hand) == len(text)
    assert result["tokens"] == len(by_hand)
    assert result["nll"] == pytest.approx(sum(by_hand) / len(by_hand), abs=1e-5)


def without_convention(run_folder: Path, copy: Path) -> Path:
    """A copy of the run as headmix stored it before the sequence convention: ``sequence_start`` in neither its model
    config nor its ``train_config.json``."""
    import shutil

    shutil.copytree(run_folder, copy)
    for name in ("config.json", "train_config.json"):
        data = json.loads((copy / name).read_text())
        del data["sequence_start"]
        (copy / name).write_text(json.dumps(data, indent=2) + "\n")
    return copy


def prompt_fed(run, monkeypatch) -> list[int]:
    """The token ids ``generate_text`` feeds the model for the prompt "In the beginning"."""
    from headmix.models import generate_text, generation

    seen, decode = [], generation.sample_decode
    monkeypatch.setattr(generation, "sample_decode", lambda model, src, *args, **kwargs: seen.append(src.tolist())
                        or decode(model, src, *args, **kwargs))
    generate_text(run.model, run.tokenizer, ["In the beginning"], max_new_tokens=2)
    assert len(seen) == 1 and len(seen[0]) == 1
    return seen[0][0]


def test_a_run_stored_before_the_convention_reads_as_it_was_trained_eos_first(trained, tmp_path, monkeypatch):
    """A run stored without ``sequence_start`` trained on the eos-first stream: it loads with ``"eos"``, ``evaluate``
    scores a document after eos (equal to the loss by hand), ``generate`` starts the prompt with eos, a resumed
    training keeps it, and its export's tokenizer puts eos first, not bos (``add_bos_token`` false)."""
    import transformers

    from headmix.cli.main import main
    from headmix.runs import load_run
    from headmix.training.sequence_start import stored_sequence_start

    old = without_convention(trained["llama3"][1], tmp_path / "old")
    run = load_run(old)
    cfg = run.model.config
    assert cfg.sequence_start == "eos" and stored_sequence_start(old) == "eos"
    result, by_hand, ids = scored_by_evaluate_and_by_hand(old, old)
    assert ids[0] == cfg.eos_id and ids[1] == run.tokenizer.encode(ONE_DOCUMENT)[0]
    assert result["tokens"] == len(by_hand) and result["nll"] == pytest.approx(sum(by_hand) / len(by_hand), abs=1e-5)
    assert prompt_fed(run, monkeypatch) == [cfg.eos_id, *run.tokenizer.encode("In the beginning")]
    assert main(["export-hf", str(old), str(tmp_path / "hf")]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("In the")["input_ids"] == [cfg.eos_id, *run.tokenizer.encode("In the")]
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["add_bos_token"] is False
    import headmix.hf  # noqa: F401

    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.model_config().sequence_start \
        == "eos"


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


def test_a_hugging_face_folder_starts_its_documents_as_its_own_tokenizer_does(docs_file, tmp_path):
    """A Llama-architecture checkpoint whose tokenizer adds no bos (SmolLM's, say) converts with sequence_start
    "none", not the Llama family's "bos", read without its weights (``--init-from``) and with them; a folder
    without a tokenizer takes its family's."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    from headmix.interop import from_pretrained
    from headmix.interop.upcycle import source_config

    folder = tmp_path / "llama"
    hf_folder(folder, "llama3", docs_file)
    assert from_pretrained(folder).config.sequence_start == source_config(folder).sequence_start == "bos"
    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    hf.post_processor = processors.ByteLevel(trim_offsets=False)  # adds no token
    hf.save(str(folder / "tokenizer.json"))
    assert from_pretrained(folder).config.sequence_start == source_config(folder).sequence_start == "none"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    assert from_pretrained(folder).config.sequence_start == source_config(folder).sequence_start == "bos"


def test_a_tokenizer_that_starts_a_text_with_another_token_is_refused_in_one_line(docs_file, tmp_path, capsys):
    """A tokenizer whose post-processor puts a token other than its bos or eos before every text has no sequence
    convention of headmix's: refused before anything is written, naming it and the token."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    tok = tmp_path / "tok"
    ids = foreign_tokenizer(tok, "llama3", corpus_texts(docs_file))
    other = "<|reserved_special_token_0|>"
    hf = HFTokenizer.from_file(str(tok / "tokenizer.json"))
    hf.post_processor = processors.TemplateProcessing(single=f"{other} $A", special_tokens=[(other, ids[other])])
    hf.save(str(tok / "tokenizer.json"))
    out = tmp_path / "run"
    assert (f"{tok}: the tokenizer's post-processor puts '{other}' before every text, which is neither its bos token "
            f"('<|begin_of_text|>') nor its eos token ('<|end_of_text|>')") in refused(
        lm_args(out, docs_file, "--tokenizer", str(tok)), out, capsys)


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
