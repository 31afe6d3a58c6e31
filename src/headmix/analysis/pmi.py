"""Token-expert specialisation by pointwise mutual information (MoA paper, Table 4).

The MoA paper (Zhang et al. 2022, Section 5 and Table 4) asks which tokens each attention expert of the
first encoder layer prefers, and ranks tokens by

    PMI(token, expert) = p(token, expert) / (p(token) p(expert))

finding experts tied to locations, names, technology, adverbs and so on. Over the real (non-padding)
query tokens of one routed layer on a dataset, with ``c[v, e]`` the slots of token ``v`` routed to
expert ``e`` (each token occurrence fills ``k`` slots, one per selected expert), ``S = sum c`` the
slots, ``n_v`` the occurrences of ``v`` and ``N = sum n_v`` the tokens:

- ``p(token, expert) = c[v, e] / S`` (each (occurrence, selected expert) slot counts once);
- ``p(expert) = sum_v c[v, e] / S`` (the expert's share of the slots);
- ``p(token) = n_v / N`` (the token's share of the occurrences; equal to ``sum_e c[v, e] / S``
  because every occurrence fills exactly ``k`` slots).

So ``PMI = c[v, e] N / (n_v sum_v c[v, e])``. PMI is 1 for a token routed like the average token, above 1
for a token the expert prefers; ``log PMI`` is reported next to it (0 = independence). Rare tokens
get extreme ratios from few observations, so tokens seen fewer than ``min_count`` times are not
ranked. Ranking: PMI descending, then the joint count, then the token id.

Layers with routing groups (SwitchHead's heads, MoH routed per K/V group, GQE's K/V groups;
:mod:`headmix.analysis.layers`)
fill ``k`` slots in each group, so an expert's PMI is the same whether ``p`` is taken over all slots or over
its group's: ``c[v, e] N / (n_v c_e)`` either way. What differs is ``p(expert)``: ``share`` is then the
expert's share of its group's slots, and the tables and the figure name each expert's group.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from torch import Tensor, nn

from . import plotting
from .counts import LayerCounts, collect_routing
from .data import write_json
from .layers import KIND_NAMES, RoutedLayer, select_layer

SPACE_MARK = "\u2581"  # "▁": the token starts with a space (a word start), as SentencePiece shows it


def pmi_matrix(cooc: Tensor, token_counts: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(pmi, log_pmi)``, both ``(V, E)`` float64, from the token x expert slot counts ``cooc``
    ``(V, E)`` and the token occurrence counts ``token_counts`` ``(V,)`` (default: the row sums of
    ``cooc``, which give the same ``p(token)`` when every token has the same number of slots).
    Where ``c[v, e] = 0`` the PMI is 0 and its log ``-inf``; rows of unseen tokens are 0 / ``-inf``."""
    c = cooc.double()
    slots = c.sum()
    n = c.sum(1) if token_counts is None else token_counts.double()
    tokens = n.sum()
    if slots <= 0 or tokens <= 0:
        return torch.zeros_like(c), torch.full_like(c, -math.inf)
    # p(v, e) / (p(v) p(e)) = (c / S) / ((n_v / N) (c_e / S)) = c N / (n_v c_e): one division of
    # exact integer products, so equal ratios give bit-equal PMIs (ties stay ties).
    expert = c.sum(0)
    denom = n[:, None] * expert[None, :]
    ok = (denom > 0) & (c > 0)
    pmi = torch.where(ok, c * tokens / denom.clamp(min=1.0), torch.zeros_like(c))
    log_pmi = torch.where(ok, pmi.clamp(min=torch.finfo(torch.float64).tiny).log(), torch.full_like(c, -math.inf))
    return pmi, log_pmi


def token_text(tokenizer: Any, token_id: int) -> str:
    """How a token is shown: its decoded text, stripped, with ``▁`` in front when it starts with a
    space (a word start; ``▁Berlin`` vs ``berg`` inside a word); whitespace tokens with ``▁`` for each
    space and escapes for the rest (``▁▁``, ``\\n``); special tokens by name (``</s>``);
    byte pieces that are not valid UTF-8 on their own by their byte-level symbol; ``#id`` without a
    tokenizer."""
    if tokenizer is None:
        return f"#{token_id}"
    specials = getattr(tokenizer, "special_ids", ())
    if token_id in specials and hasattr(tokenizer, "id_to_token"):
        return tokenizer.id_to_token(token_id) or f"#{token_id}"
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" in text and hasattr(tokenizer, "id_to_token"):
        return tokenizer.id_to_token(token_id) or f"#{token_id}"
    stripped = text.strip()
    if not stripped:  # a whitespace token: spaces as the marker, other whitespace escaped
        return text.replace(" ", SPACE_MARK).encode("unicode_escape").decode("ascii").replace(
            "\\u2581", SPACE_MARK)
    return (SPACE_MARK if text[:1].isspace() else "") + stripped


@dataclass
class TokenPMI:
    """One ranked token: ``id``, shown ``token``, ``pmi`` and ``log_pmi``, ``joint`` (its slots routed
    to the expert), ``count`` (its occurrences) and ``p_expert_given_token`` (= joint / count: how
    often an occurrence selected the expert; at most 1)."""

    id: int
    token: str
    pmi: float
    log_pmi: float
    joint: int
    count: int
    p_expert_given_token: float


@dataclass
class ExpertTokens:
    """The top tokens of one expert, with the expert's ``share`` of the slots of its routing ``group``
    (``p(expert)``; of all the layer's slots without groups)."""

    expert: int
    label: str
    share: float
    slots: int
    tokens: list[TokenPMI]
    group: int = 0


@dataclass
class PMIReport:
    """Top tokens per expert of one routed layer by PMI (MoA paper Table 4).

    ``to_json()``, ``to_markdown()`` (a Table-4-like summary plus the per-token numbers) and
    ``plot(path)`` (a bar chart of log PMI per expert)."""

    layer: dict[str, Any]
    experts: list[ExpertTokens]
    num_tokens: int
    num_slots: int
    vocab_seen: int
    ranked_vocab: int
    top: int
    min_count: int
    include_special: bool = False
    num_batches: int = 0
    source: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_counts(cls, counts: LayerCounts, layer: RoutedLayer | None = None, *, tokenizer: Any = None,
                    top: int = 10, min_count: int = 5, exclude_ids: Iterable[int] = (), num_batches: int = 0,
                    source: str | None = None, include_special: bool = False) -> PMIReport:
        """Rank tokens from a layer's co-occurrence counts (``counts.cooc`` must be set)."""
        if counts.cooc is None:
            raise ValueError(f"{counts.name}: no token x expert counts (build LayerCounts with vocab_size)")
        if top < 1:
            raise ValueError(f"top must be >= 1, got {top}")
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        cooc, n = counts.cooc, counts.token_counts
        pmi, log_pmi = pmi_matrix(cooc, n)
        eligible = n >= min_count
        excluded = [i for i in exclude_ids if 0 <= i < len(n)]
        if excluded:
            eligible[torch.tensor(excluded, dtype=torch.long)] = False
        slots = cooc.sum(0)
        total = int(slots.sum())
        labels = layer.expert_labels if layer is not None else [f"E{i}" for i in range(counts.num_experts)]
        num_groups = layer.num_groups if layer is not None else 1
        group_slots = slots.view(num_groups, -1).sum(1)  # each expert's share is of its own group's slots
        experts = []
        pmi_np, log_np, cooc_np, n_np = pmi.numpy(), log_pmi.numpy(), cooc.numpy(), n.numpy()
        for e in range(counts.num_experts):
            cand = np.flatnonzero(eligible.numpy() & (cooc_np[:, e] > 0))
            # PMI descending, then the joint count descending, then the id. Within one expert PMI is
            # (N / c_e) * (c[v, e] / n_v), so it ranks like p(expert | token) = c[v, e] / n_v: one exact
            # division per token, equal for equal ratios, so ties are real ties.
            ratio = cooc_np[cand, e] / n_np[cand].astype(np.float64)
            order = np.lexsort((cand, -cooc_np[cand, e], -ratio))
            tokens = [TokenPMI(int(v), token_text(tokenizer, int(v)), float(pmi_np[v, e]), float(log_np[v, e]),
                               int(cooc_np[v, e]), int(n_np[v]), float(cooc_np[v, e]) / float(n_np[v]))
                      for v in cand[order[:top]]]
            group = e * num_groups // counts.num_experts
            in_group = int(group_slots[group])
            experts.append(ExpertTokens(e, labels[e], float(slots[e]) / in_group if in_group else 0.0, int(slots[e]),
                                        tokens, group))
        info = layer.describe() if layer is not None else {"name": counts.name, "num_experts": counts.num_experts,
                                                            "top_k": counts.top_k}
        return cls(info, experts, counts.num_tokens, total, int((n > 0).sum()), int(eligible.sum()), top, min_count,
                   include_special, num_batches, source)

    @property
    def name(self) -> str:
        return self.layer["name"]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        meta = d.pop("meta")
        return {"analysis": "token_expert_pmi", "definition": "PMI(token, expert) = p(token, expert) / "
                "(p(token) p(expert)); p over routing slots (token occurrence x selected expert)", **meta, **d}

    def to_json(self, path: str | os.PathLike | None = None, indent: int = 2) -> str:
        """The report as JSON (written to ``path`` when given)."""
        return write_json(self.to_dict(), path, indent)

    def to_markdown(self, details: bool = True) -> str:
        """A table like the MoA paper's Table 4 (one row per expert: its share and its top tokens by PMI)
        and, with ``details``, each ranked token's PMI, log PMI and counts."""
        kind = KIND_NAMES.get(self.layer.get("kind", ""), "")
        unit = "routed head" if self.layer.get("kind") == "moh" else "expert"
        groups = self.layer.get("num_groups", 1)
        where = f" in each of {groups} {self.layer.get('group_kind')}s" if groups > 1 else ""
        share = "Share of its group" if groups > 1 else "Share"
        out = [f"### Top tokens per {unit} by PMI: `{self.name}`",
               "",
               f"{kind} layer with {self.layer.get('num_experts')} {unit}s, top-{self.layer.get('top_k')}{where}; "
               f"{self.num_tokens} tokens ({self.num_slots} routing slots){' from ' + self.source if self.source else ''}. "
               f"PMI(token, {unit}) = p(token, {unit}) / (p(token) p({unit})); tokens seen at least "
               f"{self.min_count} times ({self.ranked_vocab} of {self.vocab_seen} distinct tokens), ranked by PMI. "
               f"`{SPACE_MARK}` marks a token that starts a word.",
               "",
               f"| {unit.capitalize()} | {share} | Top {self.top} tokens by PMI |",
               "|---|---|---|"]
        for e in self.experts:
            toks = ", ".join(_code(t.token) for t in e.tokens) or "(none)"
            out.append(f"| {e.label} | {100 * e.share:.1f}% | {toks} |")
        if details:
            out += ["", f"| {unit.capitalize()} | rank | token | id | PMI | log PMI | joint | count | p({unit} \\| token) |",
                    "|---|---|---|---|---|---|---|---|---|"]
            for e in self.experts:
                for r, t in enumerate(e.tokens, 1):
                    out.append(f"| {e.label} | {r} | {_code(t.token)} | {t.id} | {t.pmi:.3f} | {t.log_pmi:.3f} | "
                               f"{t.joint} | {t.count} | {t.p_expert_given_token:.3f} |")
        return "\n".join(out) + "\n"

    def figure(self) -> Any:
        """A ``matplotlib.figure.Figure`` with one panel per expert: the log PMI of its top tokens, best
        at the top (longest bar = strongest preference), each labelled with the token's number of
        occurrences ``n``."""
        rows, cols = plotting.grid(len(self.experts), max_cols=4)
        height = max(2.0, 0.28 * self.top + 0.9)
        fig, axes = plotting.new_figure(rows, cols, figsize=(3.6 * cols, height * rows))
        for ax, e in zip(axes.flat, self.experts):
            toks = list(reversed(e.tokens))
            ax.barh(range(len(toks)), [t.log_pmi for t in toks], color="tab:blue")
            for i, t in enumerate(toks):  # how often the token occurred, at the end of its bar
                ax.text(max(t.log_pmi, 0.0), i, f" n={t.count}", va="center", fontsize=6)
            ax.margins(x=0.25)
            ax.set_yticks(range(len(toks)))
            ax.set_yticklabels([t.token for t in toks], fontsize=8)
            of = "of its group's slots" if self.layer.get("num_groups", 1) > 1 else "of slots"
            ax.set_title(f"{e.label} ({100 * e.share:.1f}% {of})", fontsize=9)
            ax.set_xlabel("log PMI", fontsize=8)
            ax.tick_params(axis="x", labelsize=7)
            ax.axvline(0, color="k", lw=0.6)
        for ax in list(axes.flat)[len(self.experts):]:
            ax.axis("off")
        fig.suptitle(f"Top tokens by PMI, {self.name} (tokens seen >= {self.min_count} times)", fontsize=10)
        fig.tight_layout()
        return fig

    def plot(self, path: str | os.PathLike) -> Path:
        """:meth:`figure` written as a PNG to ``path``."""
        return plotting.save(self.figure(), path)


def _code(token: str) -> str:
    """A Markdown code span for a token, safe inside a table cell."""
    token = token.replace("|", "\\|")
    fence = "``" if "`" in token else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{token}{pad}{fence}"


def token_expert_pmi(model: nn.Module, batches: Iterable[Any], *, layer: int | str | None = None, top: int = 10,
                     min_count: int = 5, tokenizer: Any = None, include_special: bool = False,
                     pad_id: int | None = None, source: str | None = None) -> PMIReport:
    """Top ``top`` tokens per expert of one routed layer by PMI(token, expert) (MoA paper Table 4),
    streamed over ``batches`` (a ``(vocab, E)`` count matrix is all that is kept).

    ``layer``: an index into the model's routed layers, a layer name, or ``None`` for the first encoder
    self-attention layer (the paper's choice); an index out of range is a ``ValueError`` listing the
    routed layers. ``min_count``: tokens seen fewer times are not ranked. ``tokenizer`` turns ids into
    text (``#id`` without one). Special tokens (``<s>``, ``</s>``, ...) count in the probabilities but
    are not ranked unless ``include_special``. ``batches`` as for :func:`~headmix.analysis.expert_load`.
    """
    chosen = select_layer(model, layer)
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    stats = collect_routing(model, batches, layers=[chosen.name], cooccurrence=[chosen.name], pad_id=pad_id)
    exclude: set[int] = set()
    if not include_special:
        if tokenizer is not None and hasattr(tokenizer, "special_ids"):
            exclude = set(tokenizer.special_ids)
        else:
            cfg = getattr(model, "config", None)
            exclude = {getattr(cfg, a) for a in ("pad_id", "bos_id", "eos_id") if getattr(cfg, a, None) is not None}
    return PMIReport.from_counts(stats.counts[chosen.name], chosen, tokenizer=tokenizer, top=top, min_count=min_count,
                                 exclude_ids=sorted(exclude), num_batches=stats.num_batches, source=source,
                                 include_special=include_special)
