"""Errors of the Hugging Face conversions and upcycling that name the bad key (issue 52, item 4): a misspelt or
unknown keyword of ``from_pretrained`` / ``load_*`` / ``upcycle`` / ``--init-options`` is named in one line with the
options valid for that kind only (and the closest one); ``top_k`` says what it expects; a headmix folder given to
the Hugging Face route names the headmix route; a folder that is no model, or a path that does not exist, says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Llama (8 query heads on 2 K/V heads), a headmix save_pretrained folder of it, an empty folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from headmix.interop import from_pretrained

    root = tmp_path_factory.mktemp("conversions")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=8, num_key_value_heads=2,
                                 max_position_embeddings=32)).save_pretrained(root / "llama")
    from_pretrained(root / "llama").save_pretrained(root / "headmix")
    (root / "empty").mkdir()
    return root


MOH = {"attention": "moh", "num_shared_heads": 4, "top_k": 2}


@pytest.mark.parametrize("call", ["from_pretrained", "load_llama"])
@pytest.mark.parametrize("options,message", [
    ({"attention": "moh", "num_shared_head": 4, "top_k": 2},
     "'num_shared_head' is not a conversion option (did you mean 'num_shared_heads'?): expected attention, "
     "num_shared_heads, top_k, pad_id, stop_ids, expand_kv, torch_dtype or a field of 'moh' attention (router, "),
    ({**MOH, "routr": "query_norm"}, "'routr' is not a conversion option (did you mean 'router'?)"),
    ({"keep_heads": 2}, "'keep_heads' is an upcycling option, not a conversion option: convert and upcycle with "
                        "headmix.interop.upcycle(folder, ...)"),
    ({**MOH, "top_k": "2"}, "attention='moh' needs top_k, a positive integer, got '2'"),
])
def test_a_conversion_names_the_bad_key_in_one_line(folders, call, options, message):
    import headmix.interop as interop

    with pytest.raises(ValueError) as err:
        getattr(interop, call)(folders / "llama", **options)
    text = str(err.value)
    assert text.startswith(message) and "\n" not in text
    if "field of 'moh'" in message:  # only the options of MoH: no other kind's fields, no field the source fixes
        for other in ("num_experts", "z_loss_weight", "keep_heads", "kv_heads", "num_heads", "sparsity"):
            assert f" {other}," not in text and f"({other}," not in text


def test_jetmoe_names_the_bad_key_too(tmp_path):
    import torch
    from transformers import JetMoeConfig, JetMoeForCausalLM

    from headmix.interop import from_pretrained

    torch.manual_seed(0)
    JetMoeForCausalLM(JetMoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                   num_key_value_heads=2, kv_channels=8, num_local_experts=2, num_experts_per_tok=1,
                                   max_position_embeddings=32)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"^'pad' is not an option of load_jetmoe \(did you mean 'pad_id'\?\): "
                                         r"expected pad_id, torch_dtype$"):
        from_pretrained(tmp_path, pad=3)


@pytest.mark.parametrize("options,message", [
    ({**MOH, "routr": "x"}, "'routr' is not an upcycling option (did you mean 'router'?): expected attention, "
                            "num_shared_heads, top_k, router, route_per_group or a field of 'moh' attention ("),
    ({"attention": "mha", "keep_head": 2}, "'keep_head' is not an upcycling option (did you mean 'keep_heads'?): "
                                           "expected attention, keep_heads, calibration_batches or a field of 'mha' "
                                           "attention (dropout, "),
    ({**MOH, "top_k": "2"}, "top_k must be a positive integer for attention 'moh', got '2'"),
    ({**MOH, "top_k": 0}, "top_k must be a positive integer for attention 'moh', got 0"),
])
def test_upcycle_names_the_bad_key_with_that_kinds_options_only(folders, options, message):
    from headmix.interop import upcycle

    with pytest.raises(ValueError) as err:
        upcycle(folders / "headmix", **options)
    text = str(err.value)
    assert text.startswith(message) and "\n" not in text and len(text) < 400
    assert "num_experts" not in text and ("keep_heads" not in text) == (options["attention"] == "moh")


def test_the_hugging_face_route_names_the_headmix_route_and_a_folder_that_is_no_model(folders):
    from headmix.interop import from_pretrained, load_qwen3, upcycle

    with pytest.raises(ValueError, match=r"^from_pretrained: .*headmix is a folder headmix wrote \(a run, "
                                         r"save_pretrained or export-hf\), not a Hugging Face checkpoint: load it with "
                                         r"headmix.models.load_pretrained \(upcycle it with headmix.interop.upcycle"):
        from_pretrained(folders / "headmix")
    with pytest.raises(ValueError, match=r"^load_qwen3: .*headmix is a folder headmix wrote"):
        load_qwen3(folders / "headmix")
    with pytest.raises(ValueError, match=r"^from_pretrained: .*empty holds no model \(no config.json\)"):
        from_pretrained(folders / "empty")
    with pytest.raises(ValueError, match=r"^init_from .*empty holds no model \(no config.json\)"):
        upcycle(folders / "empty", **MOH)
    with pytest.raises(FileNotFoundError, match=r"^from_pretrained: .*nowhere not found$"):
        from_pretrained(folders / "nowhere")


def test_init_options_name_the_bad_key_briefly_before_writing(folders, docs_file, tmp_path, capsys):
    from headmix.cli.main import main
    from headmix.data import train_tokenizer

    texts = [json.loads(line)["text"] for line in Path(docs_file).read_text().splitlines()]
    tokenizer = train_tokenizer(texts, 300).save(tmp_path / "tokenizer").parent
    out = tmp_path / "x"
    args = ["train", "lm", "--init-from", str(folders / "llama"), "--tokenizer", str(tokenizer), "--out", str(out),
            "--data", str(docs_file), "--init-options", json.dumps({**MOH, "routr": "x"})]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("headmix train: error: init_options: 'routr' is not an upcycling option (did you mean "
                          "'router'?): expected attention, num_shared_heads, top_k, router, route_per_group or a "
                          "field of 'moh' attention (")
    assert len(err) < 450 and "\n" not in err and "keep_heads" not in err and not out.exists()
