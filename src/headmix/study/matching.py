"""Sizing a study's rows to the baseline's compute: every row's attention must cost the baseline's attention MACs
within the spec's tolerance (2% by default). The solver lives below the study, in
:mod:`headmix.models.matching` (``headmix demo`` sizes its MoA model with it too); its names are here for
the study's modules and for callers.
"""

from ..models.matching import (INHERITED, INHERITED_WHERE_SUPPORTED, MOH_COUNTS, ROLES, SOLVABLE, Match,
                               attention_macs_of, conventions_for, inherited_options, match_attention,
                               with_attention)

__all__ = ["SOLVABLE", "INHERITED", "INHERITED_WHERE_SUPPORTED", "ROLES", "MOH_COUNTS", "Match",
           "attention_macs_of", "conventions_for", "inherited_options", "match_attention", "with_attention"]
