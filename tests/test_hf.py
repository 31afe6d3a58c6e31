"""headmix causal LMs as Hugging Face models (headmix.hf), checked against transformers itself: the Auto
classes, save_pretrained / from_pretrained, generate (greedy, beam, sampling, left padding, the layers' own
caches), the loss with the routing losses, Trainer, refusals, and headmix folders <-> HF folders."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

import headmix  # noqa: E402
from headmix.hf import HeadmixCache, HeadmixConfig, HeadmixForCausalLM, hf_to_headmix, run_to_hf  # noqa: E402
from headmix.cli.main import main as cli_main  # noqa: E402
from headmix.models import build_model, get_config  # noqa: E402
from headmix.models.generation import beam_search, greedy_decode  # noqa: E402

VOCAB = 50
# every attention kind, MoA with grouped K/V heads, the JetMoE-style expert feed-forward, and absolute
# (sinusoidal) positions with LayerNorm, MLP and biases
PRESETS = ["llama-tiny-mha", "llama-tiny-moa", "llama-tiny-moh", "llama-tiny-talking-heads", "llama-tiny-switchhead",
           "llama-tiny-moa-kv2", "llama-tiny-jetmoe", "tiny-moa"]
SRC = Path(headmix.__file__).resolve().parent.parent


def headmix_lm(preset: str, seed: int = 0, **changes):
    torch.manual_seed(seed)
    config = get_config(preset, task="lm", vocab_size=VOCAB)
    return build_model(config.replace(**changes) if changes else config).eval()


def prompt(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    """Token ids without pad (0), bos (1) or eos (2)."""
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------- config
def test_config_carries_headmix_config_and_the_standard_names():
    model = headmix_lm("llama-tiny-moa-kv2")
    config = HeadmixConfig(headmix=model.config)
    assert config.model_type == "headmix"
    assert config.model_config() == model.config
    att = model.config.decoder_self_attention
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.intermediate_size) == \
        (VOCAB, model.config.d_model, model.config.decoder_layers, model.config.ffn_dim)
    assert (config.num_key_value_heads, config.num_attention_heads, config.head_dim) == \
        (att.kv_heads, att.top_k * att.kv_heads, att.head_dim)
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)
    assert config.aux_loss_weights == {"load_balance_weight": att.load_balance_weight, "z_loss_weight": att.z_loss_weight}
    assert HeadmixConfig.from_dict(config.to_dict()).headmix == config.headmix
    assert transformers.AutoConfig.for_model("headmix").model_type == "headmix"


def test_config_refuses_an_unknown_attention_kind_and_other_tasks():
    data = get_config("llama-tiny-moa", task="lm", vocab_size=VOCAB).to_dict()
    data["decoder_self_attention"]["kind"] = "mla"
    with pytest.raises(ValueError, match=r"decoder_self_attention\.kind .*'mla'"):
        HeadmixConfig(headmix=data)
    with pytest.raises(ValueError, match="task must be 'lm'"):
        HeadmixConfig(headmix=get_config("tiny-moa", task="translation", vocab_size=VOCAB))


# ------------------------------------------------------------------------------- forward, round trip
@pytest.mark.parametrize("preset", PRESETS)
def test_wrapped_model_gives_headmix_logits_and_shares_its_weights(preset):
    model = headmix_lm(preset)
    ids = prompt(2, 7)
    expected = model(ids).logits
    hf = HeadmixForCausalLM.from_headmix(model).eval()
    assert hf.to_headmix() is model
    assert torch.equal(hf(ids).logits, expected)
    assert torch.equal(hf(ids, attention_mask=torch.ones_like(ids)).logits, expected)
    assert all(a is b for a, b in zip(hf.model.parameters(), model.parameters()))


@pytest.mark.parametrize("preset", PRESETS)
def test_save_pretrained_then_auto_model_gives_bit_identical_logits(preset, tmp_path):
    hf = HeadmixForCausalLM.from_headmix(headmix_lm(preset)).eval()
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "headmix" and saved["headmix"] == hf.config.headmix
    assert saved["auto_map"] == {"AutoConfig": "configuration_headmix.HeadmixConfig",
                                 "AutoModelForCausalLM": "modeling_headmix.HeadmixForCausalLM"}
    assert set(load_file(tmp_path / "model.safetensors")) == set(hf.state_dict())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is HeadmixForCausalLM
    ids = prompt(2, 9)
    assert torch.equal(loaded(ids).logits, hf(ids).logits)
    for name, tensor in hf.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    for name, buffer in hf.named_buffers():  # the sinusoidal table is not saved: it is computed again
        assert torch.equal(dict(loaded.named_buffers())[name], buffer), name


def test_loading_refuses_weights_missing_a_tensor(tmp_path):
    HeadmixForCausalLM.from_headmix(headmix_lm("llama-tiny-moa")).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.decoder.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"miss 1 tensor\(s\) .*'model\.decoder\.layers\.1\.self_attn\.k_proj\.weight'") as err:
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "\n" not in str(err.value)


def test_loading_refuses_an_unknown_attention_kind(tmp_path):
    HeadmixForCausalLM.from_headmix(headmix_lm("llama-tiny-moa")).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["headmix"]["decoder_self_attention"]["kind"] = "mla"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"decoder_self_attention\.kind must be one of .*got 'mla'") as err:
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------- generation
@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_generate_gives_headmix_generate_tokens(preset):
    model = headmix_lm(preset)
    hf = HeadmixForCausalLM.from_headmix(model)
    ids = prompt(2, 5)
    expected = greedy_decode(model, ids, 8).tokens
    out = hf.generate(ids, max_new_tokens=8, do_sample=False, suppress_tokens=[0])  # headmix never emits pad
    new = out[:, ids.shape[1]:]
    assert torch.equal(new, expected[:, :new.shape[1]]) and torch.equal(expected[:, new.shape[1]:], torch.zeros_like(expected[:, new.shape[1]:]))
    assert torch.equal(hf.generate(ids, max_new_tokens=8, do_sample=False, suppress_tokens=[0], use_cache=False), out)


@pytest.mark.parametrize("preset", ["llama-tiny-moa-kv2", "llama-tiny-moh", "tiny-moa", "zero-padded-moa"])
def test_left_padded_batch_gives_each_rows_own_logits_and_tokens(preset):
    """Rotary (positions from the cache; RoPE is relative) and sinusoidal (positions from the mask) alike;
    with ``zero_padded_queries`` a padded query's output is zero, so a new token must never count as padding."""
    if preset == "zero-padded-moa":
        attention = get_config("llama-tiny-moa-kv2", task="lm", vocab_size=VOCAB).decoder_self_attention
        model = headmix_lm("llama-tiny-moa-kv2", decoder_self_attention=dataclasses.replace(attention, zero_padded_queries=True))
    else:
        model = headmix_lm(preset)
    hf = HeadmixForCausalLM.from_headmix(model)
    long, short = prompt(1, 7, seed=2), prompt(1, 4, seed=3)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1)])
    mask = torch.tensor([[1] * 7, [0] * 3 + [1] * 4])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = hf(ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(logits[1, 3:], model(short).logits[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[0], model(long).logits[0], rtol=0, atol=1e-5)
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, suppress_tokens=[0], eos_token_id=None)
    assert torch.equal(out[0, 7:], greedy_decode(model, long, 6).tokens[0])
    assert torch.equal(out[1, 7:], greedy_decode(model, short, 6).tokens[0])
    uncached = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, suppress_tokens=[0],
                           eos_token_id=None, use_cache=False)
    assert torch.equal(uncached, out)


def test_padded_queries_are_left_out_of_the_routing_losses():
    """With an attention mask the padded tokens count nowhere: the aux loss is headmix's, whose rule marks the
    token pad_id as padding."""
    model = headmix_lm("llama-tiny-moa")
    hf = HeadmixForCausalLM.from_headmix(model)
    ids = prompt(2, 6)
    ids[1, :2] = 0
    out = hf(ids, attention_mask=ids.ne(0).long())
    assert torch.equal(out.aux_loss, model(ids).aux_loss)
    assert not torch.equal(out.aux_loss, hf(ids).aux_loss)  # no mask: every token counts


def test_rotary_model_refuses_positions_that_restart():
    hf = HeadmixForCausalLM.from_headmix(headmix_lm("llama-tiny-mha"))
    ids = prompt(1, 6)
    shifted = hf(ids, position_ids=torch.arange(6)[None] + 5).logits  # consecutive: the same scores
    torch.testing.assert_close(shifted, hf(ids).logits, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="position_ids must grow by one"):
        hf(ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))


@pytest.mark.parametrize("preset", ["llama-tiny-moa-kv2", "llama-tiny-switchhead", "llama-tiny-talking-heads"])
def test_beam_search_and_sampling_with_the_cache_equal_without(preset):
    hf = HeadmixForCausalLM.from_headmix(headmix_lm(preset))
    ids = prompt(2, 4)
    beams = hf.generate(ids, max_new_tokens=6, num_beams=3, do_sample=False, eos_token_id=None)
    assert torch.equal(hf.generate(ids, max_new_tokens=6, num_beams=3, do_sample=False, eos_token_id=None,
                                   use_cache=False), beams)
    torch.manual_seed(5)
    sampled = hf.generate(ids, max_new_tokens=6, do_sample=True, top_k=10, eos_token_id=None)
    torch.manual_seed(5)
    assert torch.equal(hf.generate(ids, max_new_tokens=6, do_sample=True, top_k=10, eos_token_id=None,
                                   use_cache=False), sampled)


def test_beam_search_finds_headmix_beam_search_hypothesis():
    """One beam search per prompt (headmix's has no batch-level tie rules to match): the same best sequence."""
    model = headmix_lm("llama-tiny-moh")
    hf = HeadmixForCausalLM.from_headmix(model)
    ids = prompt(1, 5)
    ours = beam_search(model, ids, beam_size=3, max_len=6, length_penalty=1.0).tokens
    theirs = hf.generate(ids, max_new_tokens=6, num_beams=3, do_sample=False, length_penalty=1.0,
                         suppress_tokens=[0], early_stopping=True)[:, 5:]
    assert torch.equal(theirs[:, :ours.shape[1]], ours)


def test_cache_holds_each_layers_own_heads_and_crops():
    model = headmix_lm("llama-tiny-moa-kv2")
    hf = HeadmixForCausalLM.from_headmix(model)
    ids = prompt(2, 6)
    out = hf(ids, use_cache=True)
    cache = out.cache
    assert isinstance(cache, HeadmixCache) and cache.get_seq_length() == 6 and len(cache) == 2
    att = model.config.decoder_self_attention
    assert [tuple(c.key.shape) for c in cache.state.self_attn] == [(2, att.kv_heads, 6, att.head_dim)] * 2
    assert cache.nbytes == model(ids, use_cache=True).state.nbytes
    step = hf(prompt(2, 1, seed=9), cache=cache)
    full = hf(torch.cat([ids, prompt(2, 1, seed=9)], 1))
    torch.testing.assert_close(step.logits[:, -1], full.logits[:, -1], rtol=0, atol=1e-5)
    cache.crop(-3)  # drop the last three positions, then feed them again
    assert cache.get_seq_length() == 4
    again = hf(torch.cat([ids, prompt(2, 1, seed=9)], 1)[:, 4:], cache=cache)
    torch.testing.assert_close(again.logits, full.logits[:, 4:], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="cache must be a HeadmixCache"):
        hf(ids, cache=transformers.DynamicCache())


def test_other_attention_kinds_cache_all_their_heads():
    for preset, heads in (("llama-tiny-moa", 1), ("llama-tiny-mha", 4)):
        hf = HeadmixForCausalLM.from_headmix(headmix_lm(preset))
        assert hf.config.num_key_value_heads == heads
        cache = hf(prompt(1, 3), use_cache=True).cache
        assert {c.key.shape[1] for c in cache.state.self_attn} == {heads}


# ---------------------------------------------------------------------------------------------- loss
def test_loss_is_the_shifted_cross_entropy_plus_the_routing_losses():
    model = headmix_lm("llama-tiny-jetmoe")
    hf = HeadmixForCausalLM.from_headmix(model)
    ids = prompt(2, 8)
    labels = ids.clone()
    labels[0, 3] = -100
    out = hf(ids, labels=labels)
    own = model(ids, labels=labels)  # one convention: headmix's own model shifts as well
    torch.testing.assert_close(out.lm_loss, own.lm_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.loss, own.loss, rtol=1e-6, atol=0)
    assert torch.equal(out.aux_loss, model(ids).aux_loss) and float(out.aux_loss.detach()) > 0
    assert torch.equal(out.loss, out.lm_loss + out.aux_loss)
    assert out.cache is None  # no cache with labels
    routed = hf(ids, output_routing=True).routing
    assert [name for name, _ in routed] == [name for name, _ in model(ids).routing]


SHIFTED_MESSAGE = r"^labels are input_ids shifted by one: labels are now the inputs themselves"


def test_pre_shifted_labels_are_refused_as_by_the_plain_model():
    """``labels = x[:, 1:]`` for ``input_ids = x[:, :-1]`` (headmix's old convention) would train the model to
    predict the token two ahead: the wrapper refuses them with the plain model's message (one shared check);
    the inputs themselves, with ``-100`` anywhere, pass, as in the plain model."""
    model = headmix_lm("llama-tiny-moa")
    hf = HeadmixForCausalLM.from_headmix(model)
    x = prompt(2, 9)
    for forward in (model, hf):
        with pytest.raises(ValueError, match=SHIFTED_MESSAGE):
            forward(x[:, :-1], labels=x[:, 1:])
    partly_ignored = x[:, 1:].clone()
    partly_ignored[1, 4:] = -100  # padding ignored in the shifted labels: still shifted
    with pytest.raises(ValueError, match=SHIFTED_MESSAGE):
        hf(x[:, :-1], labels=partly_ignored)
    labels = x.clone()
    labels[0, :3] = -100
    assert torch.isfinite(hf(x, labels=labels).loss)


def test_trainer_refuses_pre_shifted_labels(tmp_path):
    """The ``Trainer`` route: a dataset of pre-shifted labels stops the first step with the same message."""
    hf = HeadmixForCausalLM.from_headmix(headmix_lm("llama-tiny-mha"))
    rows = prompt(4, 12)
    data = [{"input_ids": row[:-1], "labels": row[1:]} for row in rows]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1,
                                          report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    with pytest.raises(ValueError, match=SHIFTED_MESSAGE):
        transformers.Trainer(model=hf, args=args, train_dataset=data).train()


@pytest.mark.parametrize("preset,tied", [("llama-tiny-moa", False), ("llama-tiny-moa", True)])
def test_resize_token_embeddings_keeps_the_old_ids_and_a_consistent_model(preset, tied, tmp_path):
    """``resize_token_embeddings`` as ``transformers`` defines it: the logits of the old ids unchanged, the new
    vocabulary size everywhere (embedding, untied head, both configs), the model saved and reloaded the same;
    a size that would drop a special token is refused without changing anything."""
    model = HeadmixForCausalLM.from_headmix(headmix_lm(preset, share_embeddings=tied)).eval()
    ids = prompt(2, 7)
    with torch.no_grad():
        before = model(ids).logits
    model.resize_token_embeddings(VOCAB + 5, pad_to_multiple_of=8)
    size = 56
    with torch.no_grad():
        after = model(ids).logits
    assert after.shape == (2, 7, size)
    torch.testing.assert_close(after[..., :VOCAB], before, rtol=0, atol=0)
    assert model.config.vocab_size == model.model.config.vocab_size == size
    assert model.get_input_embeddings().weight.shape[0] == size
    assert (model.get_output_embeddings() is None) == tied
    if not tied:
        assert model.get_output_embeddings().weight.shape[0] == size
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(transformers.AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, after)
    with pytest.raises(ValueError, match=r"new_num_tokens=2: eos_id must be a token id in \[0, vocab_size=2\)"):
        model.resize_token_embeddings(2)
    with pytest.raises(ValueError, match="new_num_tokens must be a positive integer"):
        model.resize_token_embeddings(0)
    assert model.config.vocab_size == size and model.get_input_embeddings().weight.shape[0] == size


def test_trainer_lowers_the_loss_with_the_aux_loss_included(tmp_path):
    config = get_config("llama-tiny-moa", task="lm", vocab_size=VOCAB)
    attention = config.decoder_self_attention.__class__(**{**config.decoder_self_attention.to_dict(),
                                                            "load_balance_weight": 1.0})
    torch.manual_seed(0)
    hf = HeadmixForCausalLM(HeadmixConfig(headmix=config.replace(decoder_self_attention=attention)))
    ids = prompt(1, 16)[0]
    data = [{"input_ids": ids, "labels": ids}] * 8  # one batch, the same every step
    batch = torch.stack([ids] * 4)
    with torch.no_grad():
        first = hf(batch, labels=batch)
    assert float(first.aux_loss) > 0.5  # the weight 1.0 makes the load-balancing loss stand out in the log
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=6,
                                          learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
                                          use_cpu=True, disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=hf, args=args, train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 6
    assert losses[0] == pytest.approx(float(first.lm_loss + first.aux_loss), abs=1e-3)  # lm + aux, not lm alone
    assert losses[-1] < losses[0] - 0.5
    with torch.no_grad():
        after = hf(batch, labels=batch)
    assert float(after.lm_loss) < float(first.lm_loss)


# --------------------------------------------------------------------------------- headmix folders
def test_run_folder_to_hf_folder_and_back_without_loss(tmp_path, capsys):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    model = headmix_lm("llama-tiny-moh")
    run = tmp_path / "run"
    model.save_pretrained(run)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    (run / "tokenizer").mkdir()
    Tokenizer(WordLevel(vocab, unk_token="<pad>")).save(str(run / "tokenizer" / "tokenizer.json"))
    assert cli_main(["export-hf", str(run), str(tmp_path / "hf")]) == 0
    out = tmp_path / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json", "modeling_headmix.py"} <= set(os.listdir(out))
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    back = hf_to_headmix(out)
    assert back.config == model.config
    assert back.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
    back.save_pretrained(tmp_path / "again")
    assert load_file(tmp_path / "again" / "model.safetensors").keys() == load_file(run / "model.safetensors").keys()
    with pytest.raises(ValueError, match="exists"):
        run_to_hf(run, out)
    assert cli_main(["export-hf", str(run), str(out)]) == 2  # refused in one line, the folder untouched
    assert "choose a new folder" in capsys.readouterr().err


def tiny_run(folder: Path, preset: str = "llama-tiny-moa", **changes) -> Path:
    """A folder as `headmix train lm` leaves it (model, config, tokenizer), with a byte-level BPE of headmix's own
    trained on a few sentences and a fresh model of that vocabulary."""
    from headmix.data import train_tokenizer

    texts = ["In the beginning was the word, and the word was with God.", "The quick brown fox jumps over the dog.",
             "A tiny model continues a tiny prompt, token by token."] * 4
    tok = train_tokenizer(texts, vocab_size=300, min_frequency=1)
    torch.manual_seed(0)
    config = get_config(preset, task="lm", vocab_size=tok.vocab_size).replace(
        pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id, **changes)
    build_model(config).save_pretrained(folder)
    tok.save(folder / "tokenizer")
    return folder


def test_exported_tokenizer_adds_bos_so_pipeline_and_generate_continue_as_headmix_generate(tmp_path, capsys):
    """The exported tokenizer puts bos first, as headmix trains and generates: ``pipeline("text-generation")``
    and ``model.generate(**tokenizer(text))`` on the exported folder continue each prompt exactly as
    ``headmix generate`` does on the run."""
    run = tiny_run(tmp_path / "run")
    prompts = ["In the beginning", "The quick brown fox jumps"]
    assert cli_main(["generate", str(run), "--max-new-tokens", "12", "--jsonl",
                     *[a for p in prompts for a in ("--prompt", p)]]) == 0
    expected = [json.loads(line)["continuation"] for line in capsys.readouterr().out.splitlines()]
    assert cli_main(["export-hf", str(run), str(tmp_path / "hf")]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    from headmix.data import Tokenizer
    own = Tokenizer.load(run / "tokenizer" / "tokenizer.json")
    assert model.generation_config.suppress_tokens == [own.pad_id]  # headmix never generates padding either
    generator = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    for text, continuation in zip(prompts, expected):
        ids = tokenizer(text, return_tensors="pt")
        assert ids["input_ids"][0].tolist() == own.encode(text, add_bos=True)
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
        assert tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True) == continuation
        piped = generator(text, max_new_tokens=12, do_sample=False, return_full_text=False)
        assert piped[0]["generated_text"] == continuation


def test_exported_tokenizer_loads_with_plain_transformers(tmp_path):
    """The exported tokenizer names a fast tokenizer class every transformers knows, its model_max_length is the
    model's context, and it loads in a process that never imports headmix, with no question asked (stdin closed:
    a prompt would read EOF and fail)."""
    run = tiny_run(tmp_path / "run")
    assert cli_main(["export-hf", str(run), str(tmp_path / "hf")]) == 0
    stored = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    max_positions = get_config("llama-tiny-moa", task="lm").max_positions
    assert stored["tokenizer_class"] == "PreTrainedTokenizerFast" and stored["model_max_length"] == max_positions
    code = ("import sys, transformers; folder = sys.argv[1]; "
            "tokenizers = [transformers.PreTrainedTokenizerFast.from_pretrained(folder), "
            "transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=False)]; "
            "assert 'headmix' not in sys.modules; "
            "print([(t.model_max_length, t('In the beginning').input_ids[0]) for t in tokenizers])")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "hf")], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    bos = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").bos_token_id
    assert done.stdout.strip() == str([(max_positions, bos)] * 2)
    assert "custom code" not in done.stdout + done.stderr


def test_export_hf_of_an_export_keeps_its_tokenizer_and_every_file_has_one_mode(tmp_path):
    """``headmix export-hf`` of an export folder writes the same model with the same tokenizer (its files as they
    are); the weights have the mode of every other file of the folder (safetensors creates them 0600), in an
    export and in ``HeadmixForCausalLM.save_pretrained``'s folder."""
    import stat

    run = tiny_run(tmp_path / "run")
    assert cli_main(["export-hf", str(run), str(tmp_path / "hf")]) == 0
    assert cli_main(["export-hf", str(tmp_path / "hf"), str(tmp_path / "hf2")]) == 0
    first, second = tmp_path / "hf", tmp_path / "hf2"
    assert (second / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()
    assert (second / "tokenizer_config.json").read_bytes() == (first / "tokenizer_config.json").read_bytes()
    text = "In the beginning"
    assert (transformers.AutoTokenizer.from_pretrained(second)(text).input_ids
            == transformers.AutoTokenizer.from_pretrained(first)(text).input_ids)
    HeadmixForCausalLM.from_pretrained(str(first)).save_pretrained(tmp_path / "saved")
    for folder in (first, second, tmp_path / "saved"):
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
        assert "model.safetensors" in modes and set(modes.values()) == {modes["config.json"]}, (folder, modes)


def test_boundary_errors_are_one_line_naming_the_argument_or_file(tmp_path):
    """An empty prompt, token ids outside the vocabulary, hf_to_headmix on a run folder, load_pretrained on a
    Llama folder, a config.json without its headmix field: each a one-line ValueError saying what was expected."""
    from headmix.models import load_pretrained

    model = headmix_lm("llama-tiny-mha")
    hf = HeadmixForCausalLM.from_headmix(model).eval()
    with pytest.raises(ValueError, match=r"^input_ids is empty: generate needs a prompt of at least one token"):
        hf.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"^input_ids must be token ids in \[0, vocab_size=50\), got ids from 3 to 50$"):
        hf(torch.tensor([[3, 50]]))
    model.save_pretrained(tmp_path / "run")
    with pytest.raises(ValueError, match=r"run\b.* is a headmix run \(or save_pretrained\) folder, not a Hugging Face "
                                         r"one: load it with headmix.models.load_pretrained"):
        hf_to_headmix(tmp_path / "run")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2)).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match=r"llama holds a Hugging Face 'llama' model, not a headmix one: convert it "
                                         r"with headmix.interop.from_pretrained"):
        load_pretrained(tmp_path / "llama")
    hf.save_pretrained(tmp_path / "hf")
    assert torch.equal(load_pretrained(tmp_path / "hf")(prompt(1, 5)).logits, model(prompt(1, 5)).logits)
    data = json.loads((tmp_path / "hf" / "config.json").read_text())
    del data["headmix"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(data))
    for load in (transformers.AutoModelForCausalLM.from_pretrained, load_pretrained):
        with pytest.raises(ValueError, match=r"config.json has no 'headmix' field \(the headmix model config"):
            load(tmp_path / "hf")


def test_saved_configs_record_the_headmix_version_and_a_newer_one_is_refused(tmp_path):
    """``config.json`` (headmix's own, and a Hugging Face folder's) records the headmix that wrote it; a folder
    from a newer headmix is refused in one line naming both versions, before its unknown fields are read."""
    from headmix.models import load_pretrained

    model = headmix_lm("llama-tiny-mha")
    model.save_pretrained(tmp_path / "own")
    HeadmixForCausalLM.from_headmix(model).save_pretrained(tmp_path / "hf")
    newer = "99.0.0"
    for folder, loaders in ((tmp_path / "own", [load_pretrained]),
                            (tmp_path / "hf", [load_pretrained, transformers.AutoModelForCausalLM.from_pretrained])):
        data = json.loads((folder / "config.json").read_text())
        assert data["headmix_version"] == headmix.__version__
        data.update(headmix_version=newer, a_field_of_the_future=1)
        (folder / "config.json").write_text(json.dumps(data))
        for load in loaders:
            with pytest.raises(ValueError, match=rf"config.json was written by headmix {newer}, newer than this "
                                                 rf"headmix {headmix.__version__}: upgrade headmix"):
                load(folder)
    from headmix.runs import RunError, load_run

    tiny_run(tmp_path / "run")  # a run folder: the same one line, not "damaged" with a rebuild hint
    data = json.loads((tmp_path / "run" / "config.json").read_text())
    (tmp_path / "run" / "config.json").write_text(json.dumps({**data, "headmix_version": newer}))
    with pytest.raises(RunError, match=rf"^\S+config.json was written by headmix {newer}, newer than this headmix "
                                       rf"{headmix.__version__}: upgrade headmix \(pip install -U headmix\) to read it$"):
        load_run(tmp_path / "run")


# ----------------------------------------------------------------------------- imports, remote code
def test_the_cache_goes_by_either_name_and_old_transformers_is_refused_at_import():
    """``past_key_values`` (the cache's name before transformers 5.24) and ``cache`` are the same argument, and
    the output holds the cache as ``cache`` on every supported version; a transformers older than 5.17 is
    refused when ``headmix.hf`` is imported, in one line naming both versions."""
    hf = HeadmixForCausalLM.from_headmix(headmix_lm("llama-tiny-moa")).eval()
    ids = prompt(2, 6)
    with torch.no_grad():
        whole = hf(ids).logits
        for name in ("cache", "past_key_values"):
            first = hf(ids[:, :4], use_cache=True)
            assert isinstance(first.cache, HeadmixCache) and first.cache.get_seq_length() == 4
            rest = hf(ids[:, 4:], attention_mask=torch.ones(2, 6, dtype=torch.long), **{name: first.cache})
            torch.testing.assert_close(rest.logits, whole[:, 4:], rtol=1e-5, atol=1e-5)
    code = "import transformers; transformers.__version__ = '5.16.2'; import headmix.hf"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(SRC)})
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == ("ImportError: headmix.hf needs transformers >=5.17,<6 (installed: "
                                                    "5.16.2): pip install 'headmix[hf]'")


def test_import_headmix_does_not_import_transformers_and_headmix_hf_registers():
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    script = ("import sys, headmix\nassert 'transformers' not in sys.modules\nimport headmix.hf, transformers\n"
              "print(transformers.AutoConfig.for_model('headmix').__class__.__name__)")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "HeadmixConfig"


def test_a_saved_folder_needs_headmix_installed_for_remote_code(tmp_path):
    """Without headmix importable, trust_remote_code=True fails with transformers' one-line install hint."""
    HeadmixForCausalLM.from_headmix(headmix_lm("llama-tiny-mha")).save_pretrained(tmp_path)
    script = ("import sys, importlib.abc\n"
              "class NoHeadmix(importlib.abc.MetaPathFinder):\n"
              "    def find_spec(self, name, path, target=None):\n"
              "        if name.split('.')[0] == 'headmix':\n"
              "            raise ImportError(f'No module named {name!r}')\n"
              "sys.meta_path.insert(0, NoHeadmix())\n"
              "from transformers import AutoModelForCausalLM\n"
              f"AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, trust_remote_code=True)\n")
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": ""}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "ImportError: This modeling file requires the following packages that were not found in your environment: "
        "headmix. Run `pip install headmix`")


def test_the_recipe_example_runs_at_a_tiny_size(tmp_path):
    """examples/hf_llama_to_moh.py end to end: Llama folder -> MoH -> Trainer -> save_pretrained -> Auto -> generate."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_llama_to_moh", SRC.parent / "examples" / "hf_llama_to_moh.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    text = tmp_path / "text.txt"
    text.write_text("In the beginning was the word, and the word was with the text. " * 40)
    result = example.main(["--out", str(tmp_path / "out"), "--text", str(text), "--steps", "3", "--d-model", "32",
                           "--heads", "8", "--kv-heads", "2", "--shared-heads", "1", "--top-k", "2", "--block", "32",
                           "--batch", "4", "--route-per-group"])
    assert len(result["losses"]) == 3
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    attention = saved["headmix"]["decoder_self_attention"]
    assert attention["kind"] == "moh"
    assert (attention["kv_heads"], attention["route_per_group"]) == (2, True)  # the Llama's K/V heads, GQE routing
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")) is HeadmixForCausalLM
