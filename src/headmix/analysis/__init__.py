"""What routed attention learns: expert load, token-expert specialisation (PMI), head utilities.

The analyses of the MoA paper (Zhang et al. 2022, arXiv 2210.05144), for any headmix model:

- :func:`expert_load` -> :class:`LoadReport`: the share of routing slots each expert (MoA, SwitchHead, GQE's
  query-head experts per K/V group) or routed head (MoH) receives, per layer, with max/min share,
  coefficient of variation and entropy (Figure 3, Appendix A: on WMT14 the most used expert took about 5% of
  the tokens, the least about 1%).
- :func:`position_load` -> :class:`PositionLoadReport`: for Mixture of Sparse Attention (heads that choose
  their tokens), how often each sparse head chooses each token position.
- :func:`token_expert_pmi` -> :class:`PMIReport`: the top tokens per expert by
  ``PMI(token, expert) = p(token, expert) / (p(token) p(expert))`` (Table 4, first encoder layer).
- :func:`head_utilities` -> :class:`HeadUtilityReport`: MoH head weights, activation rates and the
  shared/routed balance (per K/V group for MoH routed per group: every analysis reports layers whose
  experts fall into groups group by group, see :mod:`headmix.analysis.layers`; GQE, ``kind="gqe"``, has no
  head weights and is refused here, its load and PMI are per K/V group); :func:`talking_heads_matrices` ->
  :class:`TalkingHeadsReport`: the learned
  Talking-Heads mixing matrices.

Every report has ``to_json()``, ``to_markdown()`` and ``plot(path)``. The data is streamed: per batch
the routing is reduced to count tensors (at most ``(vocab, E)`` per layer) and dropped. In a notebook::

    from headmix.analysis import expert_load, token_expert_pmi, load_analysis_run, run_batches
    model, tok = load_analysis_run("runs/demo/moa")
    load = expert_load(model, run_batches("runs/demo/moa", tok))          # the validation split
    load.plot("load.png"); print(load.to_markdown())
    pmi = token_expert_pmi(model, run_batches("runs/demo/moa", tok), tokenizer=tok, min_count=5)
    print(pmi.to_markdown())

``batches`` may be any iterable of ``{"src", "tgt_in"}`` / ``{"input_ids"}`` dicts (a headmix loader's
batches work as they are), ``(src, tgt_in)`` pairs or ``input_ids`` tensors. The command line is
``headmix analyze {load,pmi,heads} RUN_DIR --out DIR`` (see ``docs/analysis.md``).
"""

from .counts import HeadCounts, LayerCounts, RoutingStats, as_model_inputs, collect_routing
from .data import dataset_path, load_analysis_run, run_batches
from .heads import (
    HeadUtilityReport,
    MixingMatrix,
    MoHLayerHeads,
    TalkingHeadsLayer,
    TalkingHeadsReport,
    head_utilities,
    talking_heads_matrices,
)
from .layers import RoutedLayer, attention_layers, default_layer, routed_layers, select_layer
from .load import LayerLoad, LoadReport, expert_load
from .positions import PositionLoad, PositionLoadReport, position_load
from .pmi import ExpertTokens, PMIReport, TokenPMI, pmi_matrix, token_expert_pmi, token_text

__all__ = [
    "expert_load", "token_expert_pmi", "head_utilities", "talking_heads_matrices",
    "LoadReport", "LayerLoad", "PMIReport", "ExpertTokens", "TokenPMI", "HeadUtilityReport", "MoHLayerHeads",
    "TalkingHeadsReport", "TalkingHeadsLayer", "MixingMatrix",
    "LayerCounts", "HeadCounts", "RoutingStats", "collect_routing", "as_model_inputs", "pmi_matrix", "token_text",
    "RoutedLayer", "routed_layers", "attention_layers", "select_layer", "default_layer",
    "load_analysis_run", "run_batches", "dataset_path",
    "position_load", "PositionLoadReport", "PositionLoad",
]
