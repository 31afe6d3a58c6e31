"""MoSA evaluated both ways: the paper's top-k over the whole sequence, and the causal threshold rule.

MoSA's sparse heads choose their tokens by a top-k over the whole sequence (expert choice), which looks at
later tokens: the paper trains and evaluates that way. A model that generates cannot see later tokens, so
headmix generates with the causal threshold rule (``selection="threshold"``: a token is chosen by head ``h``
when its router score reaches the head's threshold ``tau_h``, calibrated on top-k routings of training
batches). :func:`causal_selection_eval` scores one finished run's final model on its validation split both
ways, on the same batches; the study reports the gap (threshold minus top-k) paired by seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: Training batches whose top-k routings calibrate the thresholds (the mean over their sequences of each
#: head's lowest chosen score, :meth:`~headmix.attention.MixtureOfSparseAttention.calibrate_thresholds`).
CALIBRATION_BATCHES = 8


def mosa_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's MoSA layers by module name."""
    from ..attention import MixtureOfSparseAttention

    return {name: m for name, m in model.named_modules() if isinstance(m, MixtureOfSparseAttention)}


def causal_selection_eval(folder: str | Path, calibration_batches: int = CALIBRATION_BATCHES) -> dict[str, Any]:
    """The validation NLL of the finished run ``folder`` with top-k selection (``valid_nll_topk``) and with
    the causal threshold rule (``valid_nll_threshold``), on the same batches of its validation split, after
    calibrating each MoSA layer's thresholds on the top-k routings of the first ``calibration_batches``
    batches of its training split (in order, no shuffling)."""
    from ..evaluation import validation_loss
    from ..runs.load import load_run
    from ..tasks import get_task

    run = load_run(folder)
    task = get_task(run.task)
    layers = mosa_layers(run.model)
    if not layers:
        raise ValueError(f"{folder}: the model has no MoSA layer to evaluate with causal selection")
    seed, max_len = run.train_config["seed"], run.train_config["max_len"]
    max_tokens = max(run.train_config.get("max_tokens", 2048), max_len + 2)

    def loader(split: str):
        docs = task.read_items(task.stored_split(run.path, split))
        dataset = task.dataset(docs, run.tokenizer, max_len, sequence_start=run.model.config.sequence_start)
        return task.loader(dataset, run.tokenizer, max_tokens=max_tokens,
                           train=False, seed=seed)

    valid = loader("valid")
    topk = validation_loss(run.model, valid, task, "cpu")
    routings: dict[str, list] = {}
    with torch.no_grad():
        for i, batch in enumerate(loader("train")):
            if i == calibration_batches:
                break
            for name, routing in run.model(**task.model_inputs(batch, "cpu")).routing:
                if name in layers:
                    routings.setdefault(name, []).append(routing)
    for name, layer in layers.items():
        layer.calibrate_thresholds(routings[name])
        layer.selection = "threshold"
    threshold = validation_loss(run.model, valid, task, "cpu")
    return {"valid_nll_topk": topk["nll"], "valid_nll_threshold": threshold["nll"], "tokens": topk["tokens"],
            "calibration_batches": calibration_batches}
