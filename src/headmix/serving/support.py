"""What headmix's vLLM model serves, and a one-line refusal for the rest (docs/serving.md, "What is served").

This module does not import vLLM: the refusals are checked (and tested) without it.

Served: causal LMs (task ``"lm"``) with MHA / GQA / MQA (``kv_heads``; QK-norm; ``output_gate`` headwise or
elementwise), MoA with any ``kv_heads`` and router ``softmax`` or ``noisy_topk`` (its noise is training-only),
MoH with every ``head_weighting`` and a learned router, or MoH-LLaMA3's parameter-free ``router="query_norm"``,
with or without ``route_per_group``, and SwitchHead; pre- or post-norm,
RMSNorm or LayerNorm, rotary (any ``rotary_base`` and ``rotary_fraction``), learned or sinusoidal positions,
the ``mlp`` (ReLU / GELU), ``swiglu`` and ``moe_swiglu`` (JetMoE) feed-forwards, tied or untied output.

Also the paper's GQE (``kind="gqe"``, both ``shared_head_kv`` forms; its random control excepted).

Refused, naming what to use instead (first what works for the folder at hand, :func:`elsewhere`): Talking-Heads (it mixes attention scores across heads, which paged
attention never forms), MoSA (each head attends to its own subset of tokens, chosen from the whole sequence),
a decoupled key size (``key_dim`` unlike ``head_dim``: the model caches keys and values of one head size, the only
form vLLM's CPU attention takes), the random-routing controls (their draws are keyed on the batch row and position of a fixed batch,
which continuous batching does not keep), and a head size the attention backend refuses (checked where the
model is built, against the backend's own list).

Across ranks (vLLM's ``tensor_parallel_size``), :func:`check_tensor_parallel` refuses a size that does not divide
what the model splits: query heads, K/V heads (or fewer K/V heads than ranks, a divisor of them: replicated),
MoA's K/V heads or else its experts, SwitchHead's heads, GQE's K/V groups, the feed-forward width.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..models.config import ModelConfig

#: The architecture name headmix's Hugging Face folders carry (``config.json``'s ``architectures``), under which
#: the plugin registers the vLLM model.
ARCHITECTURE = "HeadmixForCausalLM"

#: Where a refused model still generates, when its folder is not known.
ELSEWHERE = ("generate with `headmix generate` (a run folder) or, for an export-hf folder, with transformers' "
             "generate through headmix.hf (HeadmixForCausalLM)")


def elsewhere(folder: str | os.PathLike | None) -> str:
    """Where the model of ``folder`` generates instead of vLLM, first what works for that folder's form: a run
    (``headmix generate``), a Hugging Face folder (``export-hf``: transformers through headmix.hf), or headmix's
    own ``save_pretrained`` form; :data:`ELSEWHERE` when ``folder`` is None or not a folder headmix wrote."""
    from ..models.folders import is_headmix_run, read_folder_config

    if folder is None or not (Path(folder) / "config.json").is_file():
        return ELSEWHERE
    if is_headmix_run(folder):
        return f"generate with `headmix generate {folder} --prompt TEXT`"
    try:
        hugging_face = read_folder_config(Path(folder))[1]
    except ValueError:
        return ELSEWHERE
    if hugging_face:
        return (f"generate with transformers: `import headmix.hf`, then "
                f"`AutoModelForCausalLM.from_pretrained('{folder}')` and its generate")
    return (f"generate with headmix: `headmix.models.load_pretrained('{folder}')` and `headmix.models.greedy_decode`, "
            f"or `headmix export-hf {folder} OUT` for transformers' generate")


def servable_config(config: Any) -> tuple[ModelConfig, str | None]:
    """``config`` as a headmix :class:`ModelConfig` and the folder it came from (None when not known): a
    ``ModelConfig``, a :class:`~headmix.hf.HeadmixConfig` (``AutoConfig.from_pretrained`` of a headmix folder after
    ``import headmix.hf``, or vLLM's ``hf_config``), or a folder headmix wrote (read as JSON)."""
    from ..models.folders import read_folder_config

    if isinstance(config, ModelConfig):
        return config, None
    if isinstance(config, (str, os.PathLike)):
        return read_folder_config(Path(config))[0], str(config)
    if callable(getattr(config, "model_config", None)):
        folder = getattr(config, "name_or_path", None) or None
        return config.model_config(), folder
    kind = getattr(config, "model_type", None)
    raise NotServableError(f"config must be a headmix ModelConfig, a HeadmixConfig or a folder headmix wrote, got "
                           f"{type(config).__name__}" + (f" (model_type {kind!r}: not a headmix model)" if kind else ""))


class NotServableError(ValueError):
    """A headmix model vLLM cannot serve (the message names what, why, and what to use instead)."""


def attention_head_sizes(config: ModelConfig) -> tuple[int, ...]:
    """The head sizes the paged attention of ``config``'s decoder holds (query/key size = value size)."""
    att = config.decoder_self_attention
    return (att.resolved_head_dim(config.d_model),)


def check_servable(config: ModelConfig | Any) -> None:
    """A one-line :class:`NotServableError` unless headmix's vLLM model computes what ``config``'s model
    computes (the module docstring lists both). ``config``: a ``ModelConfig``, a ``HeadmixConfig`` or a folder
    (:func:`servable_config`); with a folder, the message's first suggestion is what works for it."""
    config, folder = servable_config(config)
    instead = elsewhere(folder)
    if config.task != "lm":
        raise NotServableError(f"vLLM serves headmix causal language models (task 'lm'), not task {config.task!r}")
    att = config.decoder_self_attention
    if att.kind == "talking_heads":
        raise NotServableError("Talking-Heads mixes the attention scores across heads, which vLLM's paged attention "
                               f"never forms: {instead}")
    if att.kind == "mosa":
        raise NotServableError("MoSA's heads attend to token subsets each head chooses from the whole sequence, "
                               f"which vLLM's paged attention cannot hold: {instead}")
    if att.router == "random":
        raise NotServableError(f"the random-routing control (decoder_self_attention.router='random') draws its "
                               f"choices per batch row and position, which vLLM's continuous batching does not "
                               f"keep: {instead}")
    if att.key_dim is not None and att.key_dim != att.resolved_head_dim(config.d_model):
        raise NotServableError(f"a decoupled key size (decoder_self_attention.key_dim={att.key_dim}, head_dim="
                               f"{att.resolved_head_dim(config.d_model)}) is not served: headmix's vLLM model caches keys "
                               f"and values of one head size (vLLM's CPU attention has no other); {instead}")


def check_tensor_parallel(config: ModelConfig, ranks: int) -> None:
    """A one-line :class:`NotServableError` unless headmix's vLLM model splits ``config``'s model over ``ranks``
    tensor-parallel ranks (docs/serving.md, "Across devices"): every rank the same share of the heads (MHA, MoH,
    SwitchHead), of the K/V heads or, fewer K/V heads than ranks, each held whole by ``ranks / kv_heads`` ranks
    (vLLM's rule for GQA), MoA's K/V heads or else its experts, and of the feed-forward width. The refusal lists
    the sizes that work (:func:`tensor_parallel_sizes`)."""
    try:
        _check_split(config, ranks)
    except NotServableError as err:
        sizes = ", ".join(str(size) for size in tensor_parallel_sizes(config))
        raise NotServableError(f"{err} (the sizes that work for this model: {sizes})") from None


def tensor_parallel_sizes(config: ModelConfig) -> list[int]:
    """Every ``tensor_parallel_size`` headmix's vLLM model splits ``config``'s model over, from 1 (each divides the
    query heads, or MoA's K/V heads or experts, so none is larger than those)."""
    att = config.decoder_self_attention
    largest = max(att.num_heads or 0, att.num_experts or 0, att.kv_heads or 0, 1)
    sizes = []
    for ranks in range(1, largest + 1):
        try:
            _check_split(config, ranks)
        except NotServableError:
            continue
        sizes.append(ranks)
    return sizes


def _check_split(config: ModelConfig, ranks: int) -> None:
    """:func:`check_tensor_parallel`'s refusal, without the list of the sizes that work."""
    if ranks == 1:
        return
    att, where = config.decoder_self_attention, f"tensor_parallel_size={ranks}"

    def refuse(what: str) -> NotServableError:
        return NotServableError(f"{where} does not divide {what}: serve with a tensor_parallel_size that does")

    if att.kind == "gqe":  # split by K/V group
        if att.gqe_sizes()[1] % ranks:
            raise refuse(f"the paper's GQE's decoder_self_attention.kv_heads={att.gqe_sizes()[1]} (split by K/V "
                         f"group)")
    elif att.kind == "moa":
        kv = att.kv_heads or 1
        if kv % ranks and att.num_experts % ranks:
            raise refuse(f"MoA's decoder_self_attention.kv_heads={kv} (split by K/V head) nor its "
                         f"decoder_self_attention.num_experts={att.num_experts} (split by expert)")
    else:
        if att.num_heads % ranks:
            raise refuse(f"decoder_self_attention.num_heads={att.num_heads}")
        kv = att.kv_heads or att.num_heads
        if kv % ranks and ranks % kv:
            raise NotServableError(f"{where} and decoder_self_attention.kv_heads={kv}: neither divides the other "
                                   f"(the K/V heads are split over the ranks, or each held whole by ranks / kv_heads "
                                   f"of them): serve with a tensor_parallel_size that does")
    if config.ffn_dim % ranks:
        raise refuse(f"ffn_dim={config.ffn_dim}")


def check_head_size(size: int, accepted: list[int] | tuple[int, ...], backend: str,
                    folder: str | os.PathLike | None = None) -> None:
    """A one-line :class:`NotServableError` when the attention ``backend`` (its name) refuses heads of ``size``;
    ``accepted`` is the backend's list (empty: any size); ``folder``: the model's, for :func:`elsewhere`."""
    if accepted and size not in accepted:
        raise NotServableError(f"vLLM's {backend} attention does not take heads of size {size}; it accepts "
                               f"{sorted(accepted)}: build the model with one of those head sizes, or {elsewhere(folder)}")
