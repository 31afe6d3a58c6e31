"""Greedy decoding and beam search for :class:`EncoderDecoderModel` (translation) and
:class:`CausalLanguageModel` (prompt continuation).

With ``use_cache=True`` (default) the encoder output is computed once, every cross-attention layer
projects it once into a static :class:`~headmix.attention.KVCache`, and the self-attention caches grow
by one token per step; beams are reordered with ``KVCache.reorder``. With ``use_cache=False`` the whole
prefix is run through the decoder at every step (the encoder still runs once). Both give the same tokens.

Beam search follows fairseq's ``SequenceGenerator``: each step keeps the ``2 * beam_size`` best
candidates; those ending in ``eos`` (here and below: any of the model's stop ids, ``ModelConfig.stop_token_ids``)
among the top ``beam_size`` are finished with score ``sum log p / length ** length_penalty`` (length counts the
``eos``); the best ``beam_size`` others go on.
A sentence is done once it has ``beam_size`` finished hypotheses; when ``max_len`` tokens are reached the
live beams (without ``eos``) join its hypotheses. With ``beam_size=1`` this is greedy decoding.

``static_cache=True`` (with the cache): after the first step (the prompt, or ``bos``) the self-attention
caches move into buffers preallocated for all ``max_len`` steps (:meth:`DecoderState.preallocate`), written
in place; every later step then has the same shapes and keeps its state on the device, so it compiles once
(``torch.compile(fullgraph=True)``) and can be captured as a CUDA graph: pass ``static_step``, e.g.
``torch.compile(model.decoder, mode="reduce-overhead", fullgraph=True)``, to run those steps. The tokens
are those of the growing cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ..attention.base import check_positive
from .config import sequence_prefix
from .transformer import CausalLanguageModel, DecoderState, EncoderDecoderModel, PreTrainedModel


# ------------------------------------------------------------------------------------ MoSA thresholds

def mosa_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's :class:`~headmix.attention.MixtureOfSparseAttention` layers by name (``{}`` without)."""
    from ..attention.mosa import MixtureOfSparseAttention

    return {name: m for name, m in model.named_modules() if isinstance(m, MixtureOfSparseAttention)}


def calibrate_mosa(model: CausalLanguageModel, batches: Iterable[Tensor]) -> dict[str, list[float]]:
    """Set the ``score_threshold`` of every MoSA layer of a causal LM from its top-k routings of ``batches``
    (``(batch, time)`` token ids, e.g. training blocks; padding by ``pad_id``), as
    :meth:`~headmix.attention.MixtureOfSparseAttention.calibrate_thresholds` defines them; the thresholds are
    buffers, saved with the model. Returns them by layer. Generation (:func:`greedy_decode`, ``headmix
    generate``, Hugging Face ``generate``) needs them: it runs MoSA under the causal threshold rule."""
    if not isinstance(model, CausalLanguageModel):
        raise ValueError(f"model must be a causal language model (task 'lm'), got {type(model).__name__}")
    layers = mosa_layers(model)
    if not layers:
        raise ValueError("the model has no MoSA layer (attention kind 'mosa'): nothing to calibrate")
    routings: dict[str, list] = {name: [] for name in layers}
    selections = {name: layer.selection for name, layer in layers.items()}
    with _eval_mode(model):
        try:
            for layer in layers.values():
                layer.selection = "topk"
            for ids in batches:
                for name, routing in model.decoder(ids).routing:
                    if name in routings:
                        routings[name].append(routing)
        finally:
            for name, layer in layers.items():
                layer.selection = selections[name]
    if not any(routings.values()):
        raise ValueError("batches is empty: calibrating MoSA thresholds needs at least one batch of token ids")
    return {name: layer.calibrate_thresholds(routings[name]).tolist() for name, layer in layers.items()}


@contextlib.contextmanager
def threshold_selection(model: torch.nn.Module) -> Iterator[None]:
    """Run the model's MoSA layers under the causal threshold rule (what generation needs: expert choice
    top-k looks at later tokens), restoring each layer's ``selection`` afterwards; a one-line error when
    the thresholds were never calibrated. Nothing happens for a model without MoSA layers."""
    layers = mosa_layers(model)
    if any(bool(torch.isnan(layer.score_threshold).any()) for layer in layers.values()):
        raise ValueError("the model's MoSA layers have no calibrated thresholds, which generation needs: run "
                         "`headmix calibrate RUN` (runs trained before thresholds were stored), or call "
                         "headmix.models.calibrate_mosa(model, batches)")
    selections = {name: layer.selection for name, layer in layers.items()}
    try:
        for layer in layers.values():
            layer.selection = "threshold"
        yield
    finally:
        for name, layer in layers.items():
            layer.selection = selections[name]


@dataclass
class GenerationOutput:
    """``tokens`` ``(B, L)``: the generated tokens (for a causal LM, the continuation without the
    prompt), ending with a stop id (``eos``) unless ``max_len`` was reached, padded with ``pad_id`` (``eos_id`` where the
    model has no ``pad_id``); ``scores`` ``(B,)``:
    the summed log-probabilities (greedy) or the length-normalised beam score of the returned hypothesis."""

    tokens: Tensor
    scores: Tensor


class _Prefix:
    """The decoder-side state of a batch of hypotheses: the token prefix, the encoder output
    (translation) and, with caching, the decoder's KV caches."""

    def __init__(self, model: PreTrainedModel, src: Tensor, use_cache: bool, max_len: int = 0,
                 static_cache: bool = False, static_step: Callable | None = None):
        cfg = model.config
        self.model, self.use_cache = model, use_cache
        self.state: DecoderState | None = None
        if static_cache and not use_cache:
            raise ValueError("static_cache needs use_cache=True")
        self.static_cache, self.max_len, self.static_step = static_cache, max_len, static_step
        self.seen = 0  # target positions in the decoder's caches (a Python int also with a static cache)
        if isinstance(model, EncoderDecoderModel):
            self.encoder_out = model.encode(src)
            self.tokens = torch.full((src.shape[0], 1), cfg.bos_id, dtype=torch.long, device=src.device)
        elif isinstance(model, CausalLanguageModel):
            if src.shape[1] == 0:
                raise ValueError("the prompt must hold at least one token (e.g. bos)")
            if cfg.pad_id is not None and bool(src.eq(cfg.pad_id).any()):
                raise ValueError(f"prompts must not contain padding (pad_id={cfg.pad_id}): decode prompts of "
                                 "different lengths separately")
            self.encoder_out = None
            self.tokens = src
        else:
            raise ValueError(f"generation needs an EncoderDecoderModel or a CausalLanguageModel, got {type(model).__name__}")

    def next_log_probs(self) -> Tensor:
        """``(batch, vocab)`` log-probabilities of the next token (float32), padding excluded."""
        decoder = self.model.decoder
        memory = mask = None
        if self.encoder_out is not None:
            memory, mask = self.encoder_out.hidden, self.encoder_out.padding_mask
        if self.use_cache:
            new = self.tokens[:, self.seen:]
            static = self.state is not None and isinstance(self.state.length, Tensor)
            if static:  # a copy of its own: a slice of the growing prefix has a new stride every step
                new = new.clone(memory_format=torch.contiguous_format)
            step = self.static_step if static and self.static_step is not None else decoder
            out = step(new, memory, mask, state=self.state, use_cache=True)
            self.seen += new.shape[1]
            self.state = out.state
            if self.static_cache and not static:  # room for every later step: max_len new tokens at most
                capacity = self.seen + self.max_len
                embed = decoder.embed
                if (embed.positions is not None or embed.sinusoids is not None) and capacity > embed.max_positions:
                    raise ValueError(f"static_cache: {self.seen} + max_len={self.max_len} positions exceed "
                                     f"max_positions={embed.max_positions}")
                self.state = self.state.preallocate(capacity)
        else:
            out = decoder(self.tokens, memory, mask)
        logits = self.model.compute_logits(out.hidden[:, -1:])
        log_probs = logits[:, 0].float().log_softmax(-1)
        if self.model.config.pad_id is not None:
            log_probs[:, self.model.config.pad_id] = float("-inf")  # never generate padding (as fairseq)
        return log_probs

    def reorder(self, index: Tensor) -> None:
        self.tokens = self.tokens.index_select(0, index)
        if self.encoder_out is not None:
            self.encoder_out = self.encoder_out.reorder(index)
        if self.state is not None:
            self.state = self.state.reorder(index)

    def append(self, tokens: Tensor) -> None:
        self.tokens = torch.cat([self.tokens, tokens[:, None]], dim=1)


def cache_bytes_per_token(model: CausalLanguageModel, input_ids: Tensor) -> float:
    """Bytes the KV caches of a causal LM hold per token (all layers together), measured from the real
    caches (:attr:`KVCache.nbytes <headmix.attention.KVCache.nbytes>`) after one forward pass of
    ``input_ids`` ``(batch, time)`` with ``use_cache=True``."""
    if not isinstance(model, CausalLanguageModel):
        raise ValueError(f"model must be a CausalLanguageModel, got {type(model).__name__}")
    _check(model, input_ids, 1)
    with _eval_mode(model):
        state = model(input_ids, use_cache=True).state
    return state.nbytes / input_ids.numel()


def _check(model: PreTrainedModel, src: Tensor, max_len: int) -> None:
    if not isinstance(src, Tensor) or src.dim() != 2 or src.dtype != torch.long:
        raise ValueError(f"src must be a (batch, length) long tensor of token ids, got "
                         f"{tuple(src.shape) if isinstance(src, Tensor) else type(src).__name__}")
    if not isinstance(max_len, int) or max_len <= 0:
        raise ValueError(f"max_len must be a positive integer, got {max_len!r}")


class _eval_mode:
    """Run in eval mode without gradients, restoring the model's mode afterwards."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.was_training = model, model.training

    def __enter__(self):
        self.model.eval()
        self.no_grad = torch.no_grad()
        self.no_grad.__enter__()

    def __exit__(self, *exc):
        self.no_grad.__exit__(*exc)
        self.model.train(self.was_training)


def greedy_decode(model: PreTrainedModel, src: Tensor, max_len: int, *, use_cache: bool = True,
                  static_cache: bool = False, static_step: Callable | None = None) -> GenerationOutput:
    """Pick the most likely token at each step, for at most ``max_len`` new tokens.

    ``src``: the source sentences ``(B, S)`` (translation, padding allowed) or the prompts ``(B, T)``
    (causal LM, no padding). ``static_cache``, ``static_step``: see the module docstring."""
    _check(model, src, max_len)
    return _token_by_token(model, src, max_len, lambda log_probs: log_probs.argmax(-1), use_cache, static_cache,
                           static_step)


def stop_tensor(config, device: torch.device) -> Tensor:
    """The ids that end a sequence (``config.stop_token_ids()``: ``eos_id`` and the source's other stop ids, such
    as Llama 3.1 Instruct's ``<|eot_id|>``), as a tensor for ``torch.isin``."""
    return torch.tensor(config.stop_token_ids(), dtype=torch.long, device=device)


def filler(config) -> int:
    """The token that fills a finished row: ``pad_id``, or ``eos_id`` for a model without a padding token."""
    return config.eos_id if config.pad_id is None else config.pad_id


def _token_by_token(model: PreTrainedModel, src: Tensor, max_len: int, pick: Callable[[Tensor], Tensor],
                    use_cache: bool, static_cache: bool = False, static_step: Callable | None = None) -> GenerationOutput:
    """One token per step, ``pick(log_probs)`` ``(B, vocab) -> (B,)``, for at most ``max_len`` steps: padding
    after a row's stop id (``eos`` or another of ``stop_ids``; scored 0), stopping once every row has ended."""
    cfg = model.config
    stops = stop_tensor(cfg, src.device)
    with _eval_mode(model), threshold_selection(model):
        prefix = _Prefix(model, src, use_cache, max_len, static_cache, static_step)
        batch = src.shape[0]
        finished = torch.zeros(batch, dtype=torch.bool, device=src.device)
        scores = torch.zeros(batch, device=src.device)
        out = []
        for _ in range(max_len):
            log_probs = prefix.next_log_probs()
            token = pick(log_probs)
            scores += log_probs.gather(1, token[:, None])[:, 0].masked_fill(finished, 0.0)
            token = token.masked_fill(finished, filler(cfg))
            finished |= torch.isin(token, stops)
            out.append(token)
            prefix.append(token)
            if bool(finished.all()):
                break
        return GenerationOutput(torch.stack(out, dim=1), scores)


def beam_search(model: PreTrainedModel, src: Tensor, beam_size: int, max_len: int, length_penalty: float = 1.0, *,
                use_cache: bool = True, static_cache: bool = False,
                static_step: Callable | None = None) -> GenerationOutput:
    """fairseq-style beam search (see the module docstring); returns the best hypothesis per input, scored
    ``sum log p / length ** length_penalty``. ``static_cache``, ``static_step``: see the module docstring
    (beams are reordered in the preallocated buffers, in place)."""
    _check(model, src, max_len)
    if not isinstance(beam_size, int) or beam_size <= 0:
        raise ValueError(f"beam_size must be a positive integer, got {beam_size!r}")
    cfg = model.config
    k, device = beam_size, src.device
    stops = stop_tensor(cfg, device)
    with _eval_mode(model), threshold_selection(model):
        prefix = _Prefix(model, src, use_cache, max_len, static_cache, static_step)
        batch = src.shape[0]
        prefix.reorder(torch.arange(batch, device=device).repeat_interleave(k))
        # Only beam 0 is live at first, so the first step expands one hypothesis per sentence.
        scores = torch.full((batch, k), float("-inf"), device=device)
        scores[:, 0] = 0.0
        generated = torch.empty(batch * k, 0, dtype=torch.long, device=device)
        finished: list[list[tuple[float, Tensor]]] = [[] for _ in range(batch)]
        done = torch.zeros(batch, dtype=torch.bool)
        for step in range(max_len):
            log_probs = prefix.next_log_probs()
            vocab = log_probs.shape[-1]
            candidates = (scores.view(-1, 1) + log_probs).view(batch, k * vocab)
            top_scores, top_index = candidates.topk(min(2 * k, k * vocab), dim=1)
            beam, token = top_index // vocab, top_index % vocab
            is_eos = torch.isin(token, stops)
            # Finish the eos candidates among the top k (fairseq), best first.
            finishing = (is_eos[:, :k] & torch.isfinite(top_scores[:, :k])).cpu()
            for b, j in finishing.nonzero().tolist():
                if done[b]:
                    continue
                seq = torch.cat([generated[b * k + int(beam[b, j])], token[b, j:j + 1]])
                finished[b].append((float(top_scores[b, j]) / (step + 1) ** length_penalty, seq))
                if len(finished[b]) == k:
                    done[b] = True
            if bool(done.all()):
                break
            # Continue with the k best candidates that did not end.
            keep_scores, keep = top_scores.masked_fill(is_eos, float("-inf")).topk(k, dim=1)
            index = (torch.arange(batch, device=device)[:, None] * k + beam.gather(1, keep)).view(-1)
            new_tokens = token.gather(1, keep).view(-1)
            scores = keep_scores
            generated = torch.cat([generated.index_select(0, index), new_tokens[:, None]], dim=1)
            prefix.reorder(index)
            prefix.append(new_tokens)
        else:  # max_len reached: unfinished beams (no eos) fill the sentences that are not done
            for b in (~done).nonzero()[:, 0].tolist():
                for j in range(k):
                    if len(finished[b]) < k and bool(torch.isfinite(scores[b, j])):
                        finished[b].append((float(scores[b, j]) / max_len ** length_penalty, generated[b * k + j]))
        best = [max(hyps, key=lambda h: h[0]) for hyps in finished]
        length = max(len(seq) for _, seq in best)
        tokens = torch.full((batch, length), filler(cfg), dtype=torch.long, device=device)
        for b, (_, seq) in enumerate(best):
            tokens[b, :len(seq)] = seq
        return GenerationOutput(tokens, torch.tensor([s for s, _ in best], device=device))


# ------------------------------------------------------------------------------------------ sampling

def _check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")


def filter_logits(logits: Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> Tensor:
    """``(B, V)`` logits divided by ``temperature`` (> 0), then ``-inf`` outside the ``top_k`` most likely
    tokens and outside the nucleus ``top_p`` (Holtzman et al. 2020, "The Curious Case of Neural Text
    Degeneration", eq. 3: the smallest set of most likely tokens whose probability sums to at least ``p``;
    the most likely token is always kept), in that order, as Hugging Face's ``TemperatureLogitsWarper``,
    ``TopKLogitsWarper`` and ``TopPLogitsWarper``. Tokens tied with the ``k``-th are kept."""
    _check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        raise ValueError("temperature must be > 0 to sample (0 means greedy: take the argmax)")
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        before = probs.cumsum(-1) - probs  # the mass of the more likely tokens
        drop = before >= top_p  # never the most likely token: nothing comes before it
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample_decode(model: PreTrainedModel, src: Tensor, max_len: int, *, temperature: float = 1.0,
                  top_k: int | None = None, top_p: float | None = None, generator: torch.Generator | None = None,
                  use_cache: bool = True) -> GenerationOutput:
    """Draw each next token from the model's distribution filtered by :func:`filter_logits` (``temperature``,
    ``top_k``, ``top_p``), for at most ``max_len`` new tokens; ``temperature=0`` takes the argmax
    (:func:`greedy_decode`). ``generator`` (a ``torch.Generator`` on ``src``'s device) makes the draws
    repeatable. ``src``: as :func:`greedy_decode`. ``scores``: the summed log-probabilities of the drawn
    tokens under the model (before the filtering)."""
    _check(model, src, max_len)
    _check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return greedy_decode(model, src, max_len, use_cache=use_cache)

    def draw(log_probs: Tensor) -> Tensor:
        probs = filter_logits(log_probs, temperature=temperature, top_k=top_k, top_p=top_p).softmax(-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    return _token_by_token(model, src, max_len, draw, use_cache)


def generate_text(model: CausalLanguageModel, tokenizer, prompts: list[str] | str, *, max_new_tokens: int = 64,
                  temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                  seed: int | None = None, batch_size: int = 32, device: str | torch.device = "cpu") -> list[str]:
    """Continue each prompt (text in, text out) with a causal LM and its tokenizer (a
    :class:`headmix.data.Tokenizer`, or anything with ``encode(text)``, ``decode(ids)``):
    greedy with ``temperature=0`` (the default), else sampled (:func:`sample_decode`, ``top_k``, ``top_p``),
    at most ``max_new_tokens`` tokens each, stopping at any of the model's stop ids (``eos_id``, ``stop_ids``).
    Each prompt starts as the model's documents started in training
    (:func:`~headmix.models.config.sequence_prefix` of its ``sequence_start``: ``bos``, ``eos`` for runs trained
    before the option, or nothing, where an empty prompt is refused), and prompts are batched by token length (a
    batch holds no padding); ``seed`` makes the
    draws repeatable for the same prompts. Returns the continuations (without the prompts)."""
    if not isinstance(model, CausalLanguageModel):
        raise ValueError(f"model must be a causal language model (task 'lm'), got {type(model).__name__}")
    if isinstance(prompts, str):
        prompts = [prompts]
    check_positive("max_new_tokens", max_new_tokens)
    check_positive("batch_size", batch_size)
    _check_sampling(temperature, top_k, top_p)
    device = torch.device(device)
    cfg = model.config
    encoded = [sequence_prefix(cfg) + tokenizer.encode(p) for p in prompts]
    if any(not e for e in encoded):
        raise ValueError("prompts: an empty prompt gives a model trained with sequence_start 'none' (no token "
                         "before a text) nothing to continue: give each prompt some text")
    longest = max((len(e) for e in encoded), default=0)  # every kind of positions has its max_positions
    if longest + max_new_tokens > cfg.max_positions:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) + the longest prompt ({longest} tokens) exceed the "
                         f"model's max_positions ({cfg.max_positions}): ask for fewer tokens or a shorter prompt")
    generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    out = [""] * len(prompts)
    for length in sorted(by_length):
        group = by_length[length]
        for start in range(0, len(group), batch_size):
            idx = group[start:start + batch_size]
            src = torch.tensor([encoded[i] for i in idx], dtype=torch.long, device=device)
            result = sample_decode(model, src, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                   generator=generator)
            for row, i in enumerate(idx):
                out[i] = tokenizer.decode(result.tokens[row].tolist())
    return out
