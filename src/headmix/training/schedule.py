"""Learning-rate schedules, as multipliers of the peak learning rate for ``LambdaLR``."""

from __future__ import annotations

import math

SCHEDULES = ("inverse_sqrt", "linear", "constant")


def lr_multiplier(step: int, *, schedule: str, warmup_steps: int, max_steps: int) -> float:
    """The factor applied to the peak learning rate after ``step`` optimizer steps.

    - ``inverse_sqrt`` (Vaswani et al. 2017, the MoA translation setup): linear warm-up to 1 over
      ``warmup_steps``, then ``sqrt(warmup_steps / step)``;
    - ``linear`` (RoBERTa, the MoA masked-LM setup): linear warm-up, then linear decay to 0 at ``max_steps``;
    - ``constant``: linear warm-up, then 1.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    step = step + 1  # the first update uses a non-zero learning rate
    if warmup_steps > 0 and step <= warmup_steps:
        return step / warmup_steps
    if schedule == "inverse_sqrt":
        return math.sqrt(max(warmup_steps, 1) / step)
    if schedule == "linear":
        return max(0.0, (max_steps - step) / max(1, max_steps - warmup_steps))
    return 1.0
