"""A headmix causal language model as a Hugging Face ``transformers`` model: :class:`HeadmixForCausalLM`
(``generate``, ``Trainer``, PEFT, ``save_pretrained`` / ``AutoModelForCausalLM.from_pretrained``) and
:class:`HeadmixCache`, the ``transformers`` cache that holds headmix's own per-layer caches.

The model is a thin wrapper: ``self.model`` is a headmix :class:`~headmix.models.CausalLanguageModel` (its
parameters under ``model.``), and the forward pass is the headmix decoder's, with Hugging Face's conventions
at the edges:

- ``attention_mask`` ``(batch, past + time)``, 1 = a token, 0 = padding (none: no padding at all, as every
  ``transformers`` model; headmix's own models treat the token ``pad_id`` as padding instead);
- ``labels`` are the inputs (not shifted): the loss predicts ``labels[:, t + 1]`` from ``logits[:, t]``,
  ``-100`` ignored; ``lm_loss`` is that cross-entropy (with the config's ``label_smoothing``), ``aux_loss`` the
  sum of the routing losses of every layer, each with its weights from the config (MoA eq. 17:
  ``L = L_model + sum_layers (alpha L_a + beta L_z)``; MoH's and the expert feed-forward's load balancing), and
  ``loss = lm_loss + aux_loss``: what ``Trainer`` backpropagates;
- ``position_ids`` ``(batch, time)`` (``generate`` derives them from the mask) place the tokens in absolute
  position embeddings (``positions="learned"`` / ``"sinusoidal"``). Rotary positions come from the cache:
  token ``t`` of a call is rotated to ``past + t``, the position of its key in the cache. RoPE scores depend
  on positions only through ``m - n`` (RoFormer eq. 16), so a left-padded row, whose real tokens all sit
  ``p`` positions further on with the ``p`` padded keys masked, gets the scores of the unpadded row: the
  ``position_ids`` of such a row (consecutive over its tokens) are accepted and mean the same; others
  (packed sequences with restarting positions) are refused.
- ``cache``: a :class:`HeadmixCache`; ``generate`` makes one (never a ``DynamicCache``), so every attention kind
  keeps its own cache: MoA its shared key/value heads (``kv_heads``, one by default), SwitchHead its mixed
  values, MHA / MoH / Talking-Heads their ``kv_heads`` heads.

This file is copied into every folder the model is saved to (``auto_map``): it imports headmix by absolute name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from headmix.models.generation import mosa_layers, threshold_selection
from headmix.models.transformer import (CausalLanguageModel, DecoderState, Embeddings, build_model, check_labels,
                                        sinusoidal_table)

from .configuration_headmix import HeadmixConfig

#: The name ``transformers`` gives the cache (``forward``'s and ``generate``'s argument, the output's field):
#: ``cache`` in the newest releases, ``past_key_values`` before (5.17 to 5.23). headmix accepts both names
#: as arguments and returns the cache under the installed version's name (and as ``cache``).
CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class HeadmixCache(Cache):
    """The decoding state of a headmix causal LM inside ``transformers``: ``state`` is headmix's
    :class:`~headmix.models.transformer.DecoderState` (one :class:`~headmix.attention.KVCache` per layer, in the
    layer's own form, and the number of positions seen), replaced by each forward pass. Beam search reorders
    it (:meth:`reorder_cache`), assisted decoding crops it (:meth:`crop`)."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.state: DecoderState | None = None

    def __len__(self) -> int:
        return self.num_layers

    def __repr__(self) -> str:
        return f"HeadmixCache(num_layers={self.num_layers}, length={self.get_seq_length()})"

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.state is None else int(self.state.length)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # grows without bound

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.state is not None

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def batch_size(self) -> int:
        caches = [] if self.state is None else [c for c in self.state.self_attn if c is not None]
        return caches[0].key.shape[0] if caches else -1

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached keys and values."""
        return 0 if self.state is None else self.state.nbytes

    def reset(self) -> None:
        self.state = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep the batch rows ``beam_idx`` (beam search)."""
        if self.state is not None:
            self.state = self.state.reorder(beam_idx.to(self._device()))

    def batch_select_indices(self, indices: Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self.reorder_cache(torch.arange(self.batch_size, device=self._device()).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` positions (``transformers`` 5 passes a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"tokens_to_remove must be <= 0 (the number of positions to drop, negated), got {tokens_to_remove}")
        if tokens_to_remove == 0 or self.state is None:
            return
        keep = self.get_seq_length() + tokens_to_remove
        if keep < 0:
            raise ValueError(f"cannot remove {-tokens_to_remove} positions from a cache of {self.get_seq_length()}")
        caches = [None if c is None else type(c)(c.key[:, :, :keep], c.value[:, :, :keep], c.layer_id, c.static)
                  for c in self.state.self_attn]
        self.state = DecoderState(caches, list(self.state.cross_attn), keep)

    def _device(self) -> torch.device:
        caches = [c for c in self.state.self_attn if c is not None]
        return caches[0].key.device


@dataclass
class HeadmixCausalLMOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` (``loss``, ``logits``, ``cache``) plus the two parts of ``loss``: ``lm_loss``
    (the next-token cross-entropy) and ``aux_loss`` (the weighted routing losses, a zero tensor for a model
    without routing), and, with ``output_routing=True``, ``routing``: ``(layer name, Routing)`` for every routed
    layer."""

    lm_loss: Tensor | None = None
    aux_loss: Tensor | None = None
    routing: list | None = None

    if CACHE_NAME != "cache":
        @property
        def cache(self) -> HeadmixCache | None:
            """The cache (``past_key_values`` in this ``transformers`` version)."""
            return self.past_key_values


class HeadmixForCausalLM(PreTrainedModel, GenerationMixin):
    """A headmix :class:`~headmix.models.CausalLanguageModel` as a ``transformers`` causal LM (module docstring).

    ``HeadmixForCausalLM(config)`` builds fresh weights with headmix's initialisation;
    :meth:`from_headmix` wraps an existing headmix model without copying it; :meth:`to_headmix` gives it back."""

    config_class = HeadmixConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    accepts_loss_kwargs = False  # loss is a mean per batch: Trainer scales it for gradient accumulation itself
    _no_split_modules = ["DecoderLayer"]

    def __init__(self, config: HeadmixConfig, headmix_model: CausalLanguageModel | None = None):
        super().__init__(config)
        if headmix_model is None:
            headmix_model = build_model(config.model_config())
        elif not isinstance(headmix_model, CausalLanguageModel):
            raise ValueError(f"headmix_model must be a headmix CausalLanguageModel, got {type(headmix_model).__name__}")
        self.model = headmix_model
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """No parameter is touched: the weights are headmix's (initialised when the headmix model is built, or
        loaded). The one computed buffer, the sinusoidal position table (not saved), is filled again: loading
        builds the model on the meta device, where it has no values."""
        if isinstance(module, Embeddings) and module.sinusoids is not None:
            table = sinusoidal_table(*module.sinusoids.shape)
            if module.sinusoids.is_meta:
                module.sinusoids = table
            else:
                with torch.no_grad():
                    module.sinusoids.copy_(table)

    @classmethod
    def from_headmix(cls, model: CausalLanguageModel) -> HeadmixForCausalLM:
        """Wrap a headmix causal LM (its parameters are shared, not copied)."""
        if not isinstance(model, CausalLanguageModel):
            raise ValueError(f"model must be a headmix CausalLanguageModel, got {type(model).__name__}")
        weight = next(model.parameters())
        wrapped = cls(HeadmixConfig(headmix=model.config), headmix_model=model)
        wrapped.config.dtype = weight.dtype
        if model.config.pad_id is not None:  # headmix's decoding never generates padding: nor does generate()
            wrapped.generation_config.suppress_tokens = [model.config.pad_id]
        return wrapped

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> None:
        """``PreTrainedModel.save_pretrained``; then the weight files get the mode of the folder's other files
        (``config.json``'s): safetensors creates them 0600."""
        import os
        import stat
        from pathlib import Path

        super().save_pretrained(save_directory, *args, **kwargs)
        config = Path(save_directory) / "config.json"
        if config.is_file():
            for weights in Path(save_directory).glob("*.safetensors"):
                os.chmod(weights, stat.S_IMODE(config.stat().st_mode))

    def to_headmix(self) -> CausalLanguageModel:
        """The headmix model inside (shared, not copied): headmix's ``generate``, ``save_pretrained``, analyses."""
        return self.model

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> HeadmixForCausalLM:
        """``PreTrainedModel.from_pretrained``, refusing weights that miss a tensor of the model or hold one it
        does not have (a one-line ``ValueError`` naming the first), where ``transformers`` would only warn."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
        for kind, what in (("missing_keys", "miss"), ("unexpected_keys", "hold unknown")):
            names = sorted(info.get(kind) or ())
            if names:
                raise ValueError(f"{pretrained_model_name_or_path}: the weights {what} {len(names)} tensor(s) of "
                                 f"{cls.__name__}, first {names[0]!r}")
        return (model, info) if want_info else model

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.decoder.embed.tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.decoder.embed.tokens = value

    def get_output_embeddings(self) -> nn.Linear | None:
        """The untied output projection; ``None`` with ``share_embeddings`` (the embedding is the projection)."""
        return self.model.output_proj

    def set_output_embeddings(self, value: nn.Linear) -> None:
        if self.model.output_proj is None:
            raise ValueError("set_output_embeddings: this model ties its output projection to the input embedding "
                             "(share_embeddings=True): set the input embedding instead")
        self.model.output_proj = value

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """``PreTrainedModel.resize_token_embeddings`` for a headmix model: the embedding, the output projection
        (when untied; a tied one follows the embedding) and both configs (``vocab_size``) change together, after
        every check, so a refused call changes nothing. The rows of the kept ids are unchanged; new rows are
        initialised as ``transformers`` does (``mean_resizing``)."""
        old = self.get_input_embeddings()
        if new_num_tokens is None and pad_to_multiple_of is None:
            return old
        size = old.num_embeddings if new_num_tokens is None else new_num_tokens
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"new_num_tokens must be a positive integer, got {new_num_tokens!r}")
        if pad_to_multiple_of is not None:
            if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of <= 0:
                raise ValueError(f"pad_to_multiple_of must be a positive integer, got {pad_to_multiple_of!r}")
            size = -(-size // pad_to_multiple_of) * pad_to_multiple_of
        try:
            config = self.model.config.replace(vocab_size=size)
        except ValueError as err:
            raise ValueError(f"new_num_tokens={size}: {err}") from None
        # transformers' helper rebinds the weight of the module it is given: give it a stand-in
        stand_in = nn.Embedding(old.num_embeddings, old.embedding_dim, _weight=old.weight.detach(), _freeze=True)
        resized = self._get_resized_embeddings(stand_in, size, mean_resizing=mean_resizing)
        embedding = nn.Embedding(size, old.embedding_dim, padding_idx=config.pad_id, _weight=resized.weight.detach(),
                                 device=old.weight.device, dtype=old.weight.dtype)
        embedding.requires_grad_(old.weight.requires_grad)
        head = self.model.output_proj
        if head is not None:
            head = self._get_resized_lm_head(head, size, mean_resizing=mean_resizing)
            head.requires_grad_(self.model.output_proj.weight.requires_grad)
        self.set_input_embeddings(embedding)
        if head is not None:
            self.set_output_embeddings(head)
        self.model.config = self.model.decoder.config = config
        self.config.headmix = config.to_dict()
        self.vocab_size = size
        return embedding

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``GenerationMixin.generate``, with every MoSA layer under the causal threshold rule (calibrated
        thresholds needed: ``headmix calibrate RUN``); an empty prompt is refused in one line."""
        ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
        if isinstance(ids, Tensor) and ids.dim() == 2 and ids.shape[1] == 0:
            raise ValueError("input_ids is empty: generate needs a prompt of at least one token (e.g. bos)")
        with threshold_selection(self.model):
            return super().generate(*args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any) -> None:
        """``generate``'s cache: a :class:`HeadmixCache` (a user's own must be one), none with ``use_cache=False``."""
        cache = model_kwargs.get(CACHE_NAME)
        if cache is not None:
            check_cache(cache)
            cache._is_user_defined = True
            return
        if generation_config.use_cache is False:
            return
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(f"cache_implementation must be None or 'dynamic' for headmix models (their own cache), "
                             f"got {generation_config.cache_implementation!r}")
        model_kwargs[CACHE_NAME] = HeadmixCache(self.config.num_hidden_layers)

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: HeadmixCache | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        output_routing: bool = False,
        past_key_values: HeadmixCache | None = None,
        **kwargs: Any,
    ) -> HeadmixCausalLMOutput:
        """Logits of ``input_ids`` ``(batch, time)`` (module docstring for the masks, positions, loss, cache).
        ``use_cache`` defaults to ``config.use_cache`` without ``labels`` and to False with them;
        ``logits_to_keep`` (without ``labels``) computes the logits of the last so many positions only."""
        unknown = sorted(k for k, v in kwargs.items() if v is not None)
        if unknown:
            raise ValueError(f"HeadmixForCausalLM.forward got unsupported argument(s) {unknown}")
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("input_ids is required (inputs_embeds is not supported: headmix embeds token ids itself)")
        if output_attentions or output_hidden_states:
            raise ValueError("output_attentions and output_hidden_states are not supported by headmix models")
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise ValueError("pass the cache as cache or as past_key_values (its name before transformers 5.24), not both")
        cache = past_key_values if cache is None else cache
        if use_cache is None:  # MoSA under expert choice (training, scoring) has no cache: generate() switches it
            use_cache = self.config.use_cache and labels is None and all(
                layer.selection == "threshold" for layer in mosa_layers(self.model).values())
        state = None
        if cache is not None:
            check_cache(cache)
            state = cache.state
        elif use_cache:
            cache = HeadmixCache(self.config.num_hidden_layers)
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
            raise ValueError(f"input_ids must be a (batch, time) tensor of token ids, got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        if input_ids.numel() and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < self.config.vocab_size:
            raise ValueError(f"input_ids must be token ids in [0, vocab_size={self.config.vocab_size}), got ids from "
                             f"{int(input_ids.min())} to {int(input_ids.max())}")
        if labels is not None:  # the plain model's check: pre-shifted labels (x[:, 1:] for x[:, :-1]) refused
            check_labels(input_ids, labels)
        batch, time = input_ids.shape
        past = 0 if state is None else int(state.length)
        if attention_mask is None:
            key_padding_mask = torch.zeros(batch, past + time, dtype=torch.bool, device=input_ids.device)
        else:
            if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, past + time):
                raise ValueError(f"attention_mask must have shape (batch, past + time) = ({batch}, {past + time}), "
                                 f"got {tuple(attention_mask.shape)}")
            key_padding_mask = ~attention_mask.to(device=input_ids.device).bool()
        positions = self._positions(position_ids, key_padding_mask[:, past:], input_ids)
        decoder_out = self.model.decoder(input_ids, state=state, use_cache=use_cache,
                                         key_padding_mask=key_padding_mask, positions=positions)
        if use_cache:
            cache.state = decoder_out.state
        hidden = decoder_out.hidden
        if labels is None and logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.model.compute_logits(hidden)
        lm_loss = loss = None
        if labels is not None:
            lm_loss = next_token_loss(logits, labels, self.model.config.label_smoothing)
            loss = lm_loss + decoder_out.aux_loss
        return HeadmixCausalLMOutput(loss=loss, logits=logits, **{CACHE_NAME: cache if use_cache else None}, lm_loss=lm_loss,
                                     aux_loss=decoder_out.aux_loss,
                                     routing=decoder_out.routing if output_routing else None)

    def _positions(self, position_ids: Tensor | None, query_padding: Tensor, input_ids: Tensor) -> Tensor | None:
        """The ``(batch, time)`` positions for the absolute position embeddings, or ``None`` (``past + t``).
        With rotary positions, ``position_ids`` must step by one over each row's tokens (module docstring)."""
        if position_ids is None:
            return None
        position_ids = position_ids.to(input_ids.device)
        if tuple(position_ids.shape) != tuple(input_ids.shape):
            if position_ids.dim() == 2 and position_ids.shape[0] == 1 and position_ids.shape[1] == input_ids.shape[1]:
                position_ids = position_ids.expand_as(input_ids)
            else:
                raise ValueError(f"position_ids must have the shape of input_ids {tuple(input_ids.shape)}, "
                                 f"got {tuple(position_ids.shape)}")
        if self.model.config.positions != "rotary":
            return position_ids
        shift = position_ids - torch.arange(input_ids.shape[1], device=input_ids.device)
        first = shift.masked_fill(query_padding, torch.iinfo(shift.dtype).max).amin(dim=1, keepdim=True)
        if bool((shift.ne(first) & ~query_padding).any()):
            raise ValueError("position_ids must grow by one from token to token in each row (left padding aside): "
                             "rotary positions come from the cache, which cannot restart them")
        return None


def check_cache(cache: Any) -> None:
    """A ``ValueError`` unless ``cache`` is a :class:`HeadmixCache` (the layers' own caches, not ``DynamicCache``)."""
    if not isinstance(cache, HeadmixCache):
        raise ValueError(f"cache must be a HeadmixCache (headmix layers keep their own caches), got {type(cache).__name__}")


def next_token_loss(logits: Tensor, labels: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """The mean cross-entropy of ``logits[:, t]`` against ``labels[:, t + 1]`` over the labels that are not
    ``-100`` (Hugging Face's causal LM loss), in float32, with ``label_smoothing`` spread over the vocabulary."""
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels must have shape (batch, time) = {tuple(logits.shape[:2])}, got {tuple(labels.shape)}")
    target = labels[:, 1:].to(logits.device).reshape(-1)
    flat = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    total = F.cross_entropy(flat, target, ignore_index=-100, label_smoothing=label_smoothing, reduction="sum")
    return total / target.ne(-100).sum().clamp(min=1)
