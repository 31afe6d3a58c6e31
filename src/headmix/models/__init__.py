"""Transformer models, the MoA paper's presets, and parameter / MACs accounting."""

from .config import AttentionConfig, ModelConfig
from .counting import Count, analytic_macs, analytic_parameters, count_parameters, measure_macs
from .generation import (GenerationOutput, beam_search, cache_bytes_per_token, calibrate_mosa, filter_logits,
                         generate_text, greedy_decode, sample_decode, threshold_selection)
from .presets import PRESETS, get_config, list_presets, parse_moa_name
from .transformer import (
    CausalLanguageModel,
    DecoderState,
    EncoderDecoderModel,
    EncoderOutput,
    MaskedLanguageModel,
    ModelOutput,
    PreTrainedModel,
    TransformerDecoder,
    TransformerEncoder,
    build_model,
    load_pretrained,
)

__all__ = [
    "AttentionConfig", "ModelConfig",
    "EncoderDecoderModel", "MaskedLanguageModel", "CausalLanguageModel", "PreTrainedModel",
    "TransformerEncoder", "TransformerDecoder", "EncoderOutput", "DecoderState", "ModelOutput",
    "build_model", "load_pretrained",
    "greedy_decode", "beam_search", "GenerationOutput", "cache_bytes_per_token",
    "sample_decode", "filter_logits", "generate_text", "calibrate_mosa", "threshold_selection",
    "PRESETS", "get_config", "list_presets", "parse_moa_name",
    "Count", "count_parameters", "analytic_parameters", "analytic_macs", "measure_macs",
]
