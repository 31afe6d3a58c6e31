"""What headmix's vLLM model serves and the one-line refusals of the rest (headmix.serving.support), without vLLM;
tests/test_vllm.py runs the served kinds in vLLM."""

from __future__ import annotations

import dataclasses

import pytest

from headmix.models.config import AttentionConfig
from headmix.models.presets import get_config
from headmix.serving.support import NotServableError, check_head_size, check_servable

#: Every causal preset vLLM serves (the kinds and decoder options of the lm presets), and the reason each of the
#: others is refused.
SERVED = ["tiny-mha", "tiny-moa", "tiny-moh", "tiny-switchhead", "llama-tiny-mha", "llama-tiny-moa",
          "llama-tiny-moh", "llama-tiny-switchhead", "llama-tiny-moa-kv2", "llama-tiny-jetmoe", "llama3-tiny-gqa",
          "llama3-tiny-gated", "llama3-tiny-moh-per-group", "llama-mini-mha", "mini-moa", "llama3-tiny-gqe"]
REFUSED = {"llama-tiny-talking-heads": "Talking-Heads mixes the attention scores across heads",
           "tiny-talking-heads": "Talking-Heads mixes the attention scores across heads",
           "llama-tiny-mosa": "MoSA's heads attend to token subsets"}


@pytest.mark.parametrize("name", SERVED)
def test_causal_presets_are_served(name):
    check_servable(get_config(name, task="lm"))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_presets_name_why_and_where_else(name):
    with pytest.raises(NotServableError) as caught:
        check_servable(get_config(name, task="lm"))
    message = str(caught.value)
    assert REFUSED[name] in message and "headmix generate" in message and "\n" not in message


def _with_attention(name: str, **changes):
    config = get_config(name, task="lm")
    return config.replace(decoder_self_attention=dataclasses.replace(config.decoder_self_attention, **changes))


@pytest.mark.parametrize("name", ["llama-tiny-moa", "llama-tiny-moh", "llama-tiny-switchhead"])
def test_random_routing_controls_are_refused(name):
    with pytest.raises(NotServableError, match=r"random-routing control .* continuous batching .*`headmix generate`"):
        check_servable(_with_attention(name, router="random"))


def test_decoupled_key_size_is_refused():
    with pytest.raises(NotServableError, match=r"decoupled key size \(decoder_self_attention.key_dim=32, head_dim=16\)"):
        check_servable(_with_attention("llama-tiny-mha", key_dim=32))
    check_servable(_with_attention("llama-tiny-mha", key_dim=16))  # equal sizes: not decoupled


def test_other_tasks_are_refused():
    with pytest.raises(NotServableError, match="causal language models .* not task 'translation'"):
        check_servable(get_config("tiny-mha", task="translation"))


def test_head_size_refusal_names_the_accepted_sizes():
    check_head_size(64, [32, 64, 128], "CPU_ATTN")
    check_head_size(16, [], "ANY")  # an empty list: the backend takes any size
    with pytest.raises(NotServableError, match=r"CPU_ATTN attention does not take heads of size 16; it accepts "
                                               r"\[32, 64, 128\]"):
        check_head_size(16, [128, 32, 64], "CPU_ATTN")


def test_noisy_router_is_served():
    check_servable(get_config("llama-tiny-moa", task="lm").replace(
        decoder_self_attention=AttentionConfig(kind="moa", num_experts=4, top_k=2, head_dim=32, router="noisy_topk",
                                               rotary=True)))


def test_the_query_norm_router_is_served():
    """MoH-LLaMA3's parameter-free rule, globally and routed per K/V group (tests/test_vllm.py runs it in vLLM)."""
    check_servable(_with_attention("llama-tiny-moh", router="query_norm"))
    check_servable(_with_attention("llama3-tiny-moh-per-group", router="query_norm", top_k=2, num_shared_heads=0))


def test_gqe_is_served_in_both_shared_head_forms_but_not_its_random_control():
    check_servable(_with_attention("llama3-tiny-gqe", shared_head_kv="head0"))
    check_servable(_with_attention("llama3-tiny-gqe", shared_head_kv="mean", hard_slot_scale="p"))
    with pytest.raises(NotServableError, match="random-routing control"):
        check_servable(_with_attention("llama3-tiny-gqe", router="random"))


def _talking_heads_folders(root):
    """A Talking-Heads model in each folder form: a run (train_config.json beside the model), headmix's own
    save_pretrained form, and an export-hf folder."""
    import torch

    from headmix.hf import run_to_hf
    from headmix.models import build_model

    torch.manual_seed(0)
    model = build_model(get_config("llama-tiny-talking-heads", task="lm"))
    run, native = root / "run", root / "native"
    model.save_pretrained(run)
    (run / "train_config.json").write_text("{}")
    model.save_pretrained(native)
    return {"run": run, "native": native, "hf": run_to_hf(native, root / "hf")}


def test_the_refusal_first_names_what_works_for_that_folder(tmp_path):
    """check_servable takes a folder, a ModelConfig or AutoConfig's HeadmixConfig; with a folder the first
    suggestion is the one that works for its form (``headmix generate`` refuses an export-hf folder)."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig

    import headmix.hf  # noqa: F401  (AutoConfig reads headmix folders)

    folders = _talking_heads_folders(tmp_path)
    first = {"run": f"generate with `headmix generate {folders['run']} --prompt TEXT`",
             "native": f"generate with headmix: `headmix.models.load_pretrained('{folders['native']}')`",
             "hf": f"generate with transformers: `import headmix.hf`, then "
                   f"`AutoModelForCausalLM.from_pretrained('{folders['hf']}')`"}
    for form, folder in folders.items():
        for given in (folder, str(folder)) + ((AutoConfig.from_pretrained(folder),) if form == "hf" else ()):
            with pytest.raises(NotServableError) as caught:
                check_servable(given)
            message = str(caught.value)
            assert "\n" not in message and message.split(": ", 1)[1].startswith(first[form]), (form, message)
    with pytest.raises(NotServableError, match=r"^config must be a headmix ModelConfig, a HeadmixConfig or a folder "
                                               r"headmix wrote, got LlamaConfig \(model_type 'llama': not a headmix"):
        from transformers import LlamaConfig
        check_servable(LlamaConfig())


def test_the_check_command_says_in_one_line_per_folder(tmp_path, capsys):
    """``python -m headmix.serving.check FOLDER ...``: one line per folder, the serve flags its form needs, exit
    status 1 when one is refused."""
    pytest.importorskip("transformers")
    from headmix.models import build_model
    from headmix.serving.check import main

    folders = _talking_heads_folders(tmp_path / "th")
    served = tmp_path / "gqe"
    build_model(get_config("llama3-tiny-gqe", task="lm")).save_pretrained(served)
    assert main([str(served)]) == 0
    assert capsys.readouterr().out == (f"{served}: served (gqe, heads of 8, in float32 as saved): vllm serve "
                                       f"{served} --config-format headmix --skip-tokenizer-init\n")
    assert main([str(served), str(folders["hf"]), str(tmp_path / "missing")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[1].startswith(f"{folders['hf']}: not served: Talking-Heads mixes")
    assert lines[2].startswith(f"{tmp_path / 'missing'}: not served: ") and "config.json not found" in lines[2]


def test_a_folder_tells_vllm_the_dtype_its_weights_were_saved_in(tmp_path):
    """The config vLLM reads of a run folder (``--config-format headmix``) and of an export-hf folder names the
    dtype of the saved weights: float32 saved, float32 read; bfloat16 saved, bfloat16 read (export-hf loads a run
    as headmix does, in float32, and its config says so)."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoConfig

    from headmix.hf import run_to_hf
    from headmix.models import build_model
    from headmix.serving.plugin import hf_config_of_folder
    from headmix.storage.safetensors_header import floating_dtype

    model = build_model(get_config("llama3-tiny-gqe", task="lm"))
    for dtype in (torch.float32, torch.bfloat16):
        run = tmp_path / f"run-{dtype}"
        model.to(dtype).save_pretrained(run)
        (run / "train_config.json").write_text("{}")
        out = run_to_hf(run, tmp_path / f"hf-{dtype}")
        stored = getattr(torch, floating_dtype(out / "model.safetensors"))
        assert hf_config_of_folder(run).dtype == dtype and stored == torch.float32
        assert hf_config_of_folder(out).dtype == stored
        assert AutoConfig.from_pretrained(out).dtype == stored  # vLLM's reading of an export (config_format "hf")


def test_vllm_serves_a_headmix_model_in_its_saved_dtype_unless_told_otherwise():
    """vLLM's ``dtype="auto"`` serves a float32 model in its platform's preferred 16-bit dtype; the plugin's resolver
    keeps a headmix model's saved dtype where the platform supports it, and leaves other models to vLLM."""
    import torch

    from headmix.serving.plugin import saved_dtype_resolver

    def vllm_auto(model_type, config_dtype, *, is_pooling_model):  # vLLM's rule: downcast float32
        return torch.bfloat16 if config_dtype == torch.float32 else config_dtype

    supported = [torch.bfloat16, torch.float16, torch.float32]
    resolve = saved_dtype_resolver(vllm_auto, lambda: supported)
    assert resolve("headmix", torch.float32, is_pooling_model=False) == torch.float32
    assert resolve("headmix", torch.bfloat16, is_pooling_model=False) == torch.bfloat16
    assert resolve("llama", torch.float32, is_pooling_model=False) == torch.bfloat16
    supported.remove(torch.float32)  # a platform without float32: vLLM's choice
    assert resolve("headmix", torch.float32, is_pooling_model=False) == torch.bfloat16


#: vLLM names headmix uses that vLLM does not document for out-of-tree models: only in plugin.patch_vllm_internals.
VLLM_INTERNALS = {"MODELS_CONFIG_MAP", "MODEL_ARCH_CONFIG_CONVERTORS", "ModelArchConfigConvertorBase"}


def test_no_private_vllm_name_outside_the_one_version_checked_function():
    """Every module of headmix that imports from vLLM imports public names only (none starting with ``_``, none of
    the tables above), but inside ``headmix.serving.plugin.patch_vllm_internals``, and reads no ``_`` attribute of
    a vLLM module (read from the source: no vLLM needed)."""
    import ast
    from pathlib import Path

    import headmix

    found = []
    for path in Path(headmix.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        allowed = {id(node) for function in ast.walk(tree) if isinstance(function, ast.FunctionDef)
                   and function.name == "patch_vllm_internals" and path.name == "plugin.py"
                   for node in ast.walk(function)}
        vllm_names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                for alias in node.names:
                    vllm_names.add(alias.asname or alias.name)
                    if (alias.name.startswith("_") or alias.name in VLLM_INTERNALS) and id(node) not in allowed:
                        found.append(f"{path.name}: {node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                vllm_names.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "vllm")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in vllm_names and id(node) not in allowed):
                found.append(f"{path.name}: {node.value.id}.{node.attr}")
    assert found == []


def test_bench_serve_decode_macs_count_one_query_per_step():
    """``headmix bench serve``'s decode MACs: for the dense GQA model, each step one query over its context
    (attention_macs with one target token over ``s`` keys, less the K/V projections of the ``s - 1`` cached tokens)
    plus the feed-forward and the logits of one token; prefill the causal prompt and one token's logits."""
    from headmix.bench.serve import GQA, minimal_model_macs
    from headmix.models.counting import attention_macs, ffn_macs
    from headmix.models.presets import llama_model

    config = llama_model(GQA, 96, d_model=128, layers=3, max_positions=64)
    d, layers, prompt, steps = 128, 3, 7, 5
    cached_kv = d * GQA.kv_heads * 2 * GQA.head_dim  # one cached token's K and V projections
    attention = sum(layers * (attention_macs(GQA, d, 1, s)[0] - (s - 1) * cached_kv)
                    for s in range(prompt + 1, prompt + steps + 1))
    assert minimal_model_macs(config, "decode", prompt, steps) == (
        attention + steps * (layers * ffn_macs(config, 1) + d * 96), attention)
    prefill = layers * attention_macs(GQA, d, prompt, prompt, causal=True)[0]
    assert minimal_model_macs(config, "prefill", prompt, steps) == (
        prefill + layers * ffn_macs(config, prompt) + d * 96, prefill)


def test_bench_serve_refuses_a_negative_profile_in_one_line():
    """``--profile`` counts operations to print: a negative count is refused before anything starts."""
    import argparse

    from headmix.bench import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    with pytest.raises(ValueError, match=r"^--profile must be >= 0 .*got -1$"):
        serve.run(parser.parse_args(["--profile", "-1"]))
