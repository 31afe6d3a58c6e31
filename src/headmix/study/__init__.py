"""``headmix study``: which attention variant wins at equal compute.

A study (:class:`StudySpec`) is a baseline model and rows of attention variants; every row is sized to the
baseline's attention MACs (:func:`match_attention`), trained for the same steps on the same data with
several seeds (:func:`run_study`, each run a resumable run folder), and reported with the mean ± standard
deviation over seeds and the difference from the baseline paired by seed with a 95% interval
(:func:`write_report`), beside the equal-time comparison: each row's step time measured against the
baseline's side by side (:mod:`headmix.study.timing`) and both validation curves read at equal time
(:func:`equal_time_interleaved`), with the older wall-clock reading (:func:`equal_time`) as a secondary table.
Several processes may work on one study folder (each claims the next run; :func:`update_report`). The corpus is split and tokenised once
per study (``OUT/shared/``). Built-in studies: :data:`BUILTIN` (``lm-en-gpu`` and ``lm-en-gpu-large`` want a
GPU).
"""

from .builtin import BUILTIN, get_study
from .matching import Match, attention_macs_of, match_attention
from .comparison import aggregate, equal_time, equal_time_interleaved, nll_at_time
from .markdown import to_markdown
from .report import update_report, write_report
from .checkpoints import drop_checkpoints
from .plan import PlannedRow, plan
from .results import RunResult, finished_results
from .runner import run_study
from .spec import RowSpec, StudySpec
from .stats import PairedDifference, paired_difference, summarize, t_quantile

__all__ = [
    "StudySpec", "RowSpec", "BUILTIN", "get_study",
    "match_attention", "attention_macs_of", "Match",
    "plan", "run_study", "finished_results", "drop_checkpoints", "PlannedRow", "RunResult",
    "aggregate", "equal_time", "equal_time_interleaved", "nll_at_time", "to_markdown", "update_report", "write_report",
    "paired_difference", "PairedDifference", "summarize", "t_quantile",
]
