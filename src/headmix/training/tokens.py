"""The run's tokenizer against its task and its parent model: the special ids a model gets, and what
:meth:`~headmix.training.config.TrainConfig.validate` checks before anything is written. Apart from
:mod:`headmix.training.setup` so that the config can call it without an import circle (setup imports the config);
it reads a run's settings through :class:`TokenizerSettings`, so it imports no config either, not even for type
checking."""

from __future__ import annotations

from typing import Any, Protocol

from ..data import Tokenizer
from ..models import ModelConfig


class TokenizerSettings(Protocol):
    """What this module reads of a run's settings (:class:`headmix.training.config.TrainConfig` has them)."""

    task: str
    tokenizer: str | None
    init_from: str | None
    vocab_size: int | None
    resolved_init_options: dict[str, Any]
    _parent_tokenizer: bool
    _vocab_size_given: bool


def parent_config(cfg: TokenizerSettings) -> ModelConfig:
    """The model config of ``cfg.init_from``, read without its weights (a headmix folder's own, a Hugging Face
    folder's as :func:`headmix.interop.from_pretrained` converts it)."""
    from ..interop.upcycle import source_config, split_options

    return source_config(cfg.init_from, split_options(cfg.resolved_init_options)[1])


def special_ids(cfg: TokenizerSettings, tok: Tokenizer, parent: ModelConfig | None = None) -> dict[str, int | None]:
    """The model's ``pad_id``, ``bos_id`` and ``eos_id`` for a run with the tokenizer ``tok``: the tokenizer's own
    (named by its files: :meth:`Tokenizer.load`), and where it names none, the parent model's (``init_from``).
    A one-line ``ValueError`` names a token the run needs that neither has, or one they disagree on (the model's
    embeddings were trained with the other); the tokenizer's eos agrees with the parent where it is one of the
    parent's stop ids (Llama 3.1 Instruct's tokenizer names ``<|eot_id|>``, its config ``<|end_of_text|>`` first),
    and the run keeps the parent's ``stop_ids``. A causal LM's padding token that is also its bos, eos or a stop
    token (Qwen3's
    ``<|endoftext|>``) is a real token of its text, not padding: the model gets ``pad_id=None`` (padding, at the end
    of a causal block, is masked out of the loss and never attended to by a real token)."""
    roles = {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}
    source = f"the model of init_from {cfg.init_from}"
    if parent is not None:
        if tok.vocab_size > parent.vocab_size:
            raise ValueError(f"tokenizer {cfg.tokenizer} has {tok.vocab_size} ids but {source} embeds "
                             f"{parent.vocab_size}: give the tokenizer its model was trained with")
        for role in roles:
            theirs = getattr(parent, f"{role}_id")
            if roles[role] is None:
                roles[role] = theirs
            elif role == "eos" and roles[role] not in parent.stop_token_ids():
                raise ValueError(f"tokenizer {cfg.tokenizer}: its eos token is id {roles[role]}, none of the stop ids "
                                 f"{parent.stop_token_ids()} of {source}: give the tokenizer its model was trained "
                                 f"with")
            elif role != "eos" and theirs is not None and theirs != roles[role]:
                raise ValueError(f"tokenizer {cfg.tokenizer}: its {role} token is id {roles[role]}, {source} has "
                                 f"{role}_id {theirs}: give the tokenizer its model was trained with")
    needed = {"lm": ("bos", "eos"), "mlm": ("bos", "eos", "pad", "mask"), "translation": ("bos", "eos", "pad")}[cfg.task]
    missing = [r for r in needed if (tok.mask_id if r == "mask" else roles[r]) is None]
    if missing:
        tokens = " or ".join(f"{r} token" for r in missing)
        where = (f"neither tokenizer {cfg.tokenizer} nor {source} names a {tokens}" if parent is not None else
                 f"tokenizer {cfg.tokenizer} names no {tokens}")
        raise ValueError(f"{where}, which task {cfg.task!r} needs: name it (" + ", ".join(f"{r}_token" for r in missing)
                         + ") in the tokenizer_config.json beside its tokenizer.json")
    stops = parent.stop_token_ids() if parent is not None else []
    if roles["pad"] is not None and roles["pad"] in (roles["bos"], roles["eos"], *stops):
        if cfg.task != "lm":
            raise ValueError(f"tokenizer {cfg.tokenizer}: its pad token is also its bos or eos token (id "
                             f"{roles['pad']}); task {cfg.task!r} needs a padding token of its own")
        roles["pad"] = None
    return {f"{role}_id": index for role, index in roles.items()}


def check_tokenizer(cfg: TokenizerSettings) -> None:
    """What :meth:`TrainConfig.validate` checks of the run's tokenizer before anything is written: a
    ``vocab_size`` asked for beside the parent's own tokenizer must be its size, and the special ids must serve
    the task and agree with the parent model (:func:`special_ids`). One-line errors."""
    from ..storage.errors import short_error

    try:
        tok = Tokenizer.load(cfg.tokenizer)
    except ValueError as err:
        raise ValueError(f"tokenizer {cfg.tokenizer}: {err}") from None
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises a bare Exception for a bad file
        raise ValueError(f"tokenizer {cfg.tokenizer}: {short_error(err)}") from None
    if cfg._parent_tokenizer and cfg._vocab_size_given and cfg.vocab_size != tok.vocab_size:
        raise ValueError(f"vocab_size {cfg.vocab_size} does not match the tokenizer of init_from {cfg.init_from} "
                         f"({tok.vocab_size} ids), which its model was trained with: leave out --vocab-size")
    special_ids(cfg, tok, parent_config(cfg) if cfg.init_from is not None else None)
