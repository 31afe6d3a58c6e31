"""Every stop token of a source, end to end (issue 57, item 1): tiny model folders in the layouts of Llama 3.1
Instruct (``config.json`` and ``generation_config.json`` ``eos_token_id`` ``[<|end_of_text|>, <|eom_id|>,
<|eot_id|>]``, the tokenizer's eos ``<|eot_id|>``) and Qwen3 (``config.json`` eos ``<|im_end|>``,
``generation_config.json`` ``[<|im_end|>, <|endoftext|>]``, the tokenizer's eos ``<|im_end|>``, no bos), built
here without the network. Each goes through conversion or upcycling (``headmix.interop``, ``train lm
--init-from``), export (``save_pretrained``, ``export-hf``, ``causal_lm_to_llama``) and a reload with plain
``transformers``; the configs keep every stop id, and ``generate`` (headmix's, ``headmix generate`` and
``transformers``') stops at a stop id that is not the first. The weights are set so that the model emits that id
as its second new token, and an ordinary token after it: a dropped id makes generation run on.
vLLM serving the export: tests/test_vllm.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from test_foreign_tokenizers import corpus_texts, foreign_tokenizer  # noqa: E402

LLAMA31_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"]
#: Each layout: its special tokens (appended to the vocabulary in this order), its tokenizer_config.json, its
#: config.json's bos and eos, its generation_config.json's eos (tokens by name), and the stop token that is not
#: the first, at which the forced model stops.
LAYOUTS = {
    "llama31-instruct": dict(
        specials=LLAMA31_SPECIALS, tokenizer={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        bos="<|begin_of_text|>", eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
        generation=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], stop="<|eom_id|>"),
    "qwen3": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        tokenizer={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        bos="<|endoftext|>", eos="<|im_end|>", generation=["<|im_end|>", "<|endoftext|>"], stop="<|endoftext|>"),
}
#: The forced chain: after the prompt's last token ``a`` the model emits ``b``, then the layout's stop token, then
#: ``c`` (ordinary tokens, one byte each: the prompt's text encodes to ``[bos, a]``).
CHAIN = ("a", "b", "c")


def ids_of(names, ids: dict[str, int]):
    return [ids[n] for n in names] if isinstance(names, list) else ids[names]


def force_chain(embed: torch.Tensor, head: torch.Tensor, final_norm: torch.Tensor, zeroed: list[torch.Tensor],
                chain: list[int]) -> None:
    """Make a decoder emit each token of ``chain`` after the one before it (``a -> b -> stop -> c``): the attention
    and feed-forward outputs (``zeroed``) are zero, so the last position's hidden state is its token's embedding;
    the chain's tokens embed as the first unit vectors, and the output row of each reads the unit vector of the
    token before it (every other row is zero). The same for a ``transformers`` model and a headmix one."""
    with torch.no_grad():
        for t in zeroed:
            t.zero_()
        final_norm.fill_(1.0)
        head.zero_()
        for k, token in enumerate(chain):
            embed[token].zero_()
            embed[token, k] = 1.0
            if k + 1 < len(chain):
                head[chain[k + 1], k] = 1.0


def chain(ids: dict[str, int], layout: str) -> list[int]:
    a, b, c = (ids[t] for t in CHAIN)
    return [a, b, ids[LAYOUTS[layout]["stop"]], c]


def force_hf(model, chain: list[int]) -> None:
    layers = model.model.layers
    force_chain(model.model.embed_tokens.weight, model.lm_head.weight, model.model.norm.weight,
                [w for layer in layers for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)], chain)


def force_headmix(model, chain: list[int]) -> None:
    layers = model.decoder.layers
    force_chain(model.decoder.embed.tokens.weight, model.output_proj.weight, model.decoder.final_norm.weight,
                [w for layer in layers for w in (layer.self_attn.out_proj.weight, layer.ffn.down_proj.weight)], chain)


def source_folder(folder: Path, layout: str, docs_file: Path, **sizes) -> dict[str, int]:
    """A tiny Hugging Face model in the layout (Llama 3.1 Instruct or Qwen3, grouped K/V heads, untied output)
    with its tokenizer, ``config.json`` and ``generation_config.json`` naming the stop ids as the released models
    do, its weights forced to stop at the layout's non-first stop id (:func:`force_chain`); returns the special
    tokens' ids and those of :data:`CHAIN` by name. ``sizes``: other config fields (``hidden_size``, ...)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    spec = LAYOUTS[layout]
    ids = foreign_tokenizer(folder, (spec["specials"], spec["tokenizer"]), corpus_texts(docs_file))
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    common = dict(vocab_size=max(ids.values()) + 7, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                  bos_token_id=ids[spec["bos"]], eos_token_id=ids_of(spec["eos"], ids))
    common.update(sizes)
    torch.manual_seed(0)
    model = (LlamaForCausalLM(LlamaConfig(**common)) if layout.startswith("llama") else
             Qwen3ForCausalLM(Qwen3Config(**common, head_dim=common["hidden_size"] // common["num_attention_heads"])))
    model.generation_config.eos_token_id = ids_of(spec["generation"], ids)
    ids.update({t: vocab[t] for t in CHAIN})
    force_hf(model, chain(ids, layout))
    model.save_pretrained(folder)
    return ids


def expected_stops(layout: str, ids: dict[str, int]) -> list[int]:
    """Every stop id of the layout, as headmix keeps them: the config's, then the generation config's others."""
    spec = LAYOUTS[layout]
    eos = ids_of(spec["eos"], ids)
    return list(dict.fromkeys([*(eos if isinstance(eos, list) else [eos]), *ids_of(spec["generation"], ids)]))


def prompt(ids: dict[str, int], layout: str) -> list[int]:
    return [ids[LAYOUTS[layout]["bos"]], ids["a"]]


def hf_new_tokens(folder: Path, ids: dict[str, int], layout: str) -> list[int]:
    """The greedy continuation ``transformers`` generates from the folder (loaded as the existing tests do)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    src = torch.tensor([prompt(ids, layout)])
    out = model.generate(src, max_new_tokens=6, do_sample=False)
    return out[0, src.shape[1]:].tolist()


def headmix_new_tokens(model, ids: dict[str, int], layout: str) -> list[int]:
    """headmix's greedy continuation of one prompt: it ends where decoding stopped."""
    from headmix.models import greedy_decode

    return greedy_decode(model, torch.tensor([prompt(ids, layout)]), 6).tokens[0].tolist()


def written_stops(folder: Path) -> tuple:
    return tuple(json.loads((folder / name).read_text())["eos_token_id"]
                 for name in ("config.json", "generation_config.json"))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_source_itself_stops_at_its_non_first_stop_id(tmp_path, docs_file, layout):
    """The forced source, under ``transformers``, stops at the layout's non-first stop id; with only its first
    stop id it runs on (what every later test checks would happen to a model that dropped the others)."""
    import transformers

    ids = source_folder(tmp_path / "src", layout, docs_file)
    stop = ids[LAYOUTS[layout]["stop"]]
    assert hf_new_tokens(tmp_path / "src", ids, layout) == [ids['b'], stop]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src")
    first = expected_stops(layout, ids)[0]
    out = model.generate(torch.tensor([prompt(ids, layout)]), max_new_tokens=4, do_sample=False, eos_token_id=first)
    assert out[0, 2:].tolist()[:3] == chain(ids, layout)[1:]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_conversion_and_upcycling_keep_every_stop_id_through_export(tmp_path, docs_file, layout):
    """``load_llama`` / ``load_qwen3`` (``from_pretrained``) and ``upcycle`` keep every stop id of the folder
    (``config.json``'s list, ``generation_config.json``'s, the tokenizer's eos); headmix's ``generate`` stops at the
    non-first one; ``save_pretrained`` (``from_headmix``), ``export-hf`` and ``causal_lm_to_llama`` /
    ``causal_lm_to_qwen3`` write them all to ``config.json`` and ``generation_config.json``, and ``transformers``
    reloading each stops there too."""
    import shutil

    from headmix.cli.main import main
    from headmix.hf import HeadmixForCausalLM
    from headmix.interop import causal_lm_to_llama, causal_lm_to_qwen3, from_pretrained, upcycle
    from headmix.interop.upcycle import source_config

    ids = source_folder(tmp_path / "src", layout, docs_file)
    stops, stop = expected_stops(layout, ids), ids[LAYOUTS[layout]["stop"]]
    assert source_config(tmp_path / "src").stop_token_ids() == stops  # what train --init-from checks against
    converted = from_pretrained(tmp_path / "src")
    assert converted.config.stop_token_ids() == stops and converted.config.eos_id == stops[0]
    assert headmix_new_tokens(converted, ids, layout) == [ids['b'], stop]
    to_hf = causal_lm_to_llama if layout.startswith("llama") else causal_lm_to_qwen3
    to_hf(converted).save_pretrained(tmp_path / "back")
    assert written_stops(tmp_path / "back") == (stops, stops)
    assert hf_new_tokens(tmp_path / "back", ids, layout) == [ids['b'], stop]

    model = upcycle(tmp_path / "src", attention="moh", num_shared_heads=1, top_k=2)
    assert model.config.stop_token_ids() == stops
    assert headmix_new_tokens(model, ids, layout) == [ids['b'], stop]
    HeadmixForCausalLM.from_headmix(model).save_pretrained(tmp_path / "wrapped")
    assert written_stops(tmp_path / "wrapped") == (stops, stops)
    assert hf_new_tokens(tmp_path / "wrapped", ids, layout) == [ids['b'], stop]
    model.save_pretrained(tmp_path / "saved")  # headmix's own form, with the source's tokenizer
    (tmp_path / "saved" / "tokenizer").mkdir()
    shutil.copy(tmp_path / "src" / "tokenizer.json", tmp_path / "saved" / "tokenizer" / "tokenizer.json")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["stop_ids"] == stops
    assert main(["export-hf", str(tmp_path / "saved"), str(tmp_path / "hf")]) == 0
    assert written_stops(tmp_path / "hf") == (stops, stops)
    assert hf_new_tokens(tmp_path / "hf", ids, layout) == [ids['b'], stop]


def lm_args(out: Path, data: Path, *extra: str) -> list[str]:
    return ["train", "lm", "--out", str(out), "--data", str(data), "--max-steps", "2", "--max-tokens", "256",
            "--max-len", "32", "--no-progress", *extra]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_init_from_trains_with_the_folders_own_tokenizer_and_keeps_its_stop_ids(tmp_path, docs_file, layout, capsys):
    """``train lm --init-from`` a Llama 3.1 Instruct folder accepts its own tokenizer (eos ``<|eot_id|>``, one of
    the model's stop ids but not the first) and a Qwen3 one (eos ``<|im_end|>``); the run's model keeps every stop
    id with the tokenizer's eos as its ``eos_id``; ``headmix generate`` stops at the non-first stop id; its
    ``export-hf`` folder carries them all, and its tokenizer's eos is the source tokenizer's."""
    import transformers
    from safetensors.torch import save_file

    from headmix.cli.main import main
    from headmix.runs import load_run

    ids = source_folder(tmp_path / "src", layout, docs_file)
    stops, stop = expected_stops(layout, ids), ids[LAYOUTS[layout]["stop"]]
    out = tmp_path / "run"
    assert main(lm_args(out, docs_file, "--init-from", str(tmp_path / "src"))) == 0
    config = json.loads((out / "config.json").read_text())
    tokenizer_eos = ids[LAYOUTS[layout]["tokenizer"]["eos_token"]]
    assert (config["eos_id"], config["stop_ids"]) == (tokenizer_eos, stops)
    run = load_run(out)
    force_headmix(run.model, chain(ids, layout))  # training moved the weights: force the chain again, in the run's own file
    save_file({k: v.contiguous() for k, v in run.model.state_dict().items()}, str(out / "model.safetensors"))
    capsys.readouterr()
    assert run.tokenizer.encode("a", add_bos=True) == prompt(ids, layout)
    assert main(["generate", str(out), "--prompt", "a", "--max-new-tokens", "6", "--jsonl"]) == 0
    continuation = json.loads(capsys.readouterr().out)["continuation"]
    assert continuation == "b"  # then the stop token (special: not in the text), and no "c"
    assert main(["export-hf", str(out), str(tmp_path / "hf")]) == 0
    assert written_stops(tmp_path / "hf") == (stops, stops)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").eos_token_id == tokenizer_eos
    assert hf_new_tokens(tmp_path / "hf", ids, layout) == [ids['b'], stop]


def test_a_tokenizer_whose_eos_is_no_stop_id_of_the_parent_is_refused_in_one_line(tmp_path, docs_file, capsys):
    """A tokenizer whose eos is none of the parent's stop ids is refused before anything is written, in one line
    naming its eos id and the parent's stop ids."""
    from headmix.cli.main import main

    ids = source_folder(tmp_path / "src", "llama31-instruct", docs_file)
    other = tmp_path / "other"
    foreign_tokenizer(other, (LLAMA31_SPECIALS, {"bos_token": "<|begin_of_text|>",
                                                 "eos_token": "<|reserved_special_token_0|>"}),
                      corpus_texts(docs_file))
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(lm_args(out, docs_file, "--init-from", str(tmp_path / "src"), "--tokenizer", str(other))) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not out.exists()
    stops = expected_stops("llama31-instruct", ids)
    assert (f"--tokenizer {other}: its eos token is id {ids['<|reserved_special_token_0|>']}, none of the stop ids "
            f"{stops} of the model of init_from {tmp_path / 'src'}: give the tokenizer its model was trained with") in err


def test_stored_configs_without_stop_ids_read_as_eos_alone_and_bad_ones_are_refused():
    """A config stored before ``stop_ids`` reads as ``eos_id`` alone, and its Hugging Face config names that one
    id; ``stop_ids`` without ``eos_id``, repeated or out of the vocabulary is refused in one line."""
    from headmix.hf import HeadmixConfig
    from headmix.models import ModelConfig

    old = ModelConfig(task="lm", vocab_size=50, encoder_layers=0, decoder_layers=1, eos_id=5).to_dict()
    del old["stop_ids"]
    config = ModelConfig.from_dict(old)
    assert config.stop_ids is None and config.stop_token_ids() == [5]
    assert HeadmixConfig(headmix=config).eos_token_id == 5
    many = config.replace(stop_ids=[5, 9, 7])
    assert ModelConfig.from_dict(json.loads(many.to_json())).stop_token_ids() == [5, 9, 7]
    assert HeadmixConfig(headmix=many).eos_token_id == [5, 9, 7]
    for bad, what in (([9, 7], "among them eos_id"), ([5, 5], "distinct"), ([5, 50], "vocab_size=50")):
        with pytest.raises(ValueError, match=f"^stop_ids must be .*{what}"):
            config.replace(stop_ids=bad)


def test_beam_search_and_sampling_stop_at_every_stop_id(tmp_path, docs_file):
    """headmix's beam search ends a hypothesis at any stop id (and keeps that id), as greedy decoding and
    sampling do."""
    from headmix.interop import from_pretrained
    from headmix.models import beam_search, sample_decode

    ids = source_folder(tmp_path / "src", "llama31-instruct", docs_file)
    stop = ids["<|eom_id|>"]
    model = from_pretrained(tmp_path / "src")
    src = torch.tensor([prompt(ids, "llama31-instruct")])
    assert beam_search(model, src, beam_size=2, max_len=6).tokens[0].tolist() == [ids['b'], stop]
    drawn = sample_decode(model, src, 6, temperature=0.01, generator=torch.Generator().manual_seed(0))
    assert drawn.tokens[0].tolist() == [ids['b'], stop]


def test_a_tokenizer_eos_that_no_config_names_is_a_stop_id_too(tmp_path, docs_file):
    """A folder whose configs name only ``<|end_of_text|>`` (as Llama 3 Instruct's first release did) with a
    tokenizer whose eos is ``<|eot_id|>``: the converted model stops at both, and so does the parent config that
    ``train --init-from`` checks its tokenizer against."""
    from headmix.interop import from_pretrained
    from headmix.interop.upcycle import source_config

    ids = source_folder(tmp_path / "src", "llama31-instruct", docs_file)
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**config, "eos_token_id": ids["<|end_of_text|>"]}))
    (tmp_path / "src" / "generation_config.json").unlink()
    expected = [ids["<|end_of_text|>"], ids["<|eot_id|>"]]
    assert from_pretrained(tmp_path / "src").config.stop_token_ids() == expected
    assert source_config(tmp_path / "src").stop_token_ids() == expected
