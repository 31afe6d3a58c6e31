"""The Hugging Face configuration of a headmix causal language model (``model_type = "headmix"``).

:class:`HeadmixConfig` carries headmix's own :class:`~headmix.models.ModelConfig` as a plain dict (the field
``headmix`` of ``config.json``), so every attention kind and option headmix has (MoA, MoH, SwitchHead,
Talking-Heads, MHA; ``kv_heads``, key size, rotary, norms, feed-forward kinds, and any field added later)
round-trips without a list here to keep in sync. The names ``transformers`` code reads (``vocab_size``,
``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ...) are read-only properties computed from
it; the routing losses' weights (MoA eq. 17's ``alpha`` and ``beta``, MoH's and the expert feed-forward's
load-balancing weights) stay in the attention and model configs, where the layers read them:
:attr:`HeadmixConfig.aux_loss_weights` lists them.

This file is copied into every folder a :class:`HeadmixConfig` is saved to (``auto_map``): it imports headmix
by absolute name, so loading such a folder with ``trust_remote_code=True`` needs ``pip install headmix``.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from headmix.models.config import VERSION_FIELD, ModelConfig, check_written_by

#: The ``HeadmixConfig`` attributes saved next to ``headmix`` (the rest of ``config.json`` is transformers').
TOKEN_FIELDS = {"pad_token_id": "pad_id", "bos_token_id": "bos_id", "eos_token_id": "eos_id"}


def causal_lm_config(headmix: dict[str, Any] | ModelConfig | None) -> ModelConfig:
    """The validated headmix :class:`ModelConfig` of a causal LM (``task="lm"``) from a dict (``config.json``'s
    ``headmix``), a ``ModelConfig``, or ``None`` (a small default Llama-style MHA model); a ``ValueError`` names
    the offending field (an attention kind headmix does not know: ``decoder_self_attention.kind``)."""
    if headmix is None:
        return ModelConfig(task="lm", vocab_size=32000, d_model=512, ffn_dim=1376, encoder_layers=0, decoder_layers=6,
                           norm="pre", norm_type="rmsnorm", positions="rotary", ffn="swiglu", bias=False,
                           scale_embeddings=False, share_embeddings=False, dropout=0.0, label_smoothing=0.0)
    config = headmix if isinstance(headmix, ModelConfig) else ModelConfig.from_dict(dict(headmix))
    if config.task != "lm":
        raise ValueError(f"headmix.task must be 'lm' (a causal language model) for HeadmixConfig, got {config.task!r}")
    return config


class HeadmixConfig(PretrainedConfig):
    """A headmix causal LM for ``transformers``: ``HeadmixConfig(headmix=model_config.to_dict())``.

    ``headmix``: the headmix :class:`~headmix.models.ModelConfig` (a dict, or a ``ModelConfig``), validated on
    construction. ``use_cache``: whether ``forward`` returns a cache by default (not when it is given ``labels``).
    ``pad_token_id``, ``bos_token_id``, ``eos_token_id``: the ids ``generate`` uses, by default headmix's
    ``pad_id``, ``bos_id`` and its stop ids (``eos_id``, or the list ``stop_ids``: ``generate``, the
    ``generation_config.json`` ``save_pretrained`` writes and vLLM stop at each); the model itself always treats
    ``pad_id`` as its padding row."""

    model_type = "headmix"
    keys_to_ignore_at_inference = ["cache", "past_key_values", "lm_loss", "aux_loss", "routing"]

    def __init__(self, headmix: dict[str, Any] | ModelConfig | None = None, use_cache: bool = True, **kwargs: Any):
        from headmix import __version__

        model_config = causal_lm_config(headmix)
        self.headmix = model_config.to_dict()
        kwargs.pop(VERSION_FIELD, None)  # a loaded file's, checked by from_dict; saving records this headmix's
        setattr(self, VERSION_FIELD, __version__)
        self.use_cache = use_cache
        defaults = {"pad_token_id": model_config.pad_id, "bos_token_id": model_config.bos_id,
                    "eos_token_id": model_config.eos_token_id_field()}  # every stop id: generate and vLLM stop at each
        for name in TOKEN_FIELDS:
            setattr(self, name, kwargs.pop(name, defaults[name]))
        kwargs.pop("tie_word_embeddings", None)  # headmix ties by construction (share_embeddings), never by name
        super().__init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """``PretrainedConfig.from_dict`` (how ``config.json`` is read), refusing in one line a config without
        its ``headmix`` field (else a default model would be built and loaded with a page of mismatches) or
        one written by a newer headmix."""
        if not isinstance(config_dict.get("headmix"), dict):
            raise ValueError("config.json has no 'headmix' field (the headmix model config every headmix folder "
                             "holds): not a folder headmix wrote, or a damaged one")
        check_written_by(config_dict.get(VERSION_FIELD), "config.json")
        return super().from_dict(config_dict, **kwargs)

    def model_config(self) -> ModelConfig:
        """The headmix :class:`ModelConfig` (a new validated object each call)."""
        return causal_lm_config(self.headmix)

    @property
    def _attention(self) -> dict[str, Any]:
        return self.headmix["decoder_self_attention"]

    @property
    def vocab_size(self) -> int:
        return self.headmix["vocab_size"]

    @property
    def hidden_size(self) -> int:
        return self.headmix["d_model"]

    @property
    def intermediate_size(self) -> int:
        return self.headmix["ffn_dim"]

    @property
    def num_hidden_layers(self) -> int:
        return self.headmix["decoder_layers"]

    @property
    def max_position_embeddings(self) -> int:
        return self.headmix["max_positions"]

    @property
    def num_attention_heads(self) -> int:
        """Query heads a token uses: ``num_heads``; MoA: ``top_k * kv_heads`` (its selected experts); GQE: its
        ``top_k * kv_heads`` slots and the shared head."""
        att = self._attention
        if att["kind"] == "moa":
            return att["top_k"] * (att["kv_heads"] or 1)
        if att["kind"] == "gqe":
            gqe = self.model_config().decoder_self_attention
            _, kv, top_k = gqe.gqe_sizes()
            return top_k * kv + int(gqe.shared_head is not False)
        return att["num_heads"]

    @property
    def num_key_value_heads(self) -> int:
        """Key/value heads in the cache: ``kv_heads`` where set (MoA: 1 by default), else ``num_heads``."""
        att = self._attention
        if att["kind"] == "gqe":
            return self.model_config().decoder_self_attention.gqe_sizes()[1]  # unset: the paper's 8
        if att.get("kv_heads") is not None:
            return att["kv_heads"]
        return 1 if att["kind"] == "moa" else att["num_heads"]

    @property
    def head_dim(self) -> int:
        return self.model_config().decoder_self_attention.resolved_head_dim(self.hidden_size)

    @property
    def tie_word_embeddings(self) -> bool:
        """headmix's ``share_embeddings`` (one parameter, so ``transformers`` has nothing to tie)."""
        return self.headmix["share_embeddings"]

    @property
    def aux_loss_weights(self) -> dict[str, float]:
        """The weights of the routing losses the model adds to ``loss``: MoA's ``load_balance_weight``
        (alpha, eq. 17) and ``z_loss_weight`` (beta), MoH's and GQE's ``load_balance_weight``, and with
        ``ffn="moe_swiglu"`` the experts' ``ffn_load_balance_weight``; ``{}`` for a model without routing."""
        att, weights = self._attention, {}
        if att["kind"] in ("moa", "moh", "gqe"):
            weights["load_balance_weight"] = att["load_balance_weight"]
        if att["kind"] == "moa":
            weights["z_loss_weight"] = att["z_loss_weight"]
        if self.headmix["ffn"] == "moe_swiglu":
            weights["ffn_load_balance_weight"] = self.headmix["ffn_load_balance_weight"]
        return weights
