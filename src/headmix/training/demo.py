"""``headmix demo``: MoA against a standard Transformer of about the same MACs, trained and evaluated
on the embedded English-German corpus, on CPU, in about ten minutes.

The comparison is the paper's: the same data, tokenizer, batches, schedule and number of updates, at
about equal MACs per token (``mini-moa`` = 6K8E32D against ``mini-mha``, 4 heads of 32: MoA's shared
key/value head makes it cheaper at equal ``k * head_dim``, so it gets 6 heads). MoA trains for
``train_seconds``; MHA then trains for exactly as many steps, and both wall times are reported.

It writes ``OUT/report.json``, ``OUT/loss_curves.png`` and ``OUT/expert_load.png`` and the two runs
(``OUT/moa``, ``OUT/mha``), which the ``headmix evaluate`` / ``headmix analyze`` commands accept.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from ..evaluation import evaluate_run
from ..models import analytic_macs, get_config
from ..runs.files import atomic_write
from .config import TrainConfig
from .metrics import read_metrics
from .trainer import train

DEMO_MODELS = {"moa": "mini-moa", "mha": "mini-mha"}
LABELS = {"moa": "MoA", "mha": "MHA"}


def run_demo(out: str | os.PathLike = "runs/demo", *, train_seconds: float = 260.0, eval_sentences: int = 400,
             beam_size: int = 4, seed: int = 1, progress: bool = True,
             stop: Callable[[], str | None] | None = None) -> dict[str, Any]:
    """Train ``mini-moa`` for ``train_seconds`` and ``mini-mha`` for as many steps (same data, tokenizer,
    batches and schedule), evaluate both on the held-out test split, write the report and plots.
    ``stop``: as for :func:`headmix.training.train`; a stopped demo returns ``{"stopped_by": reason}``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"setup": {
        "corpus": "LibreOffice help En-De (embedded, MPL-2.0)", "moa_train_seconds": train_seconds,
        "eval_sentences": eval_sentences, "beam_size": beam_size, "seed": seed,
        "machine": f"{os.cpu_count()} CPU threads" + _torch_threads(),
    }}
    steps = None
    for name, preset in DEMO_MODELS.items():
        budget = f"for {train_seconds:.0f}s" if steps is None else f"for {steps} steps"
        print(f"[headmix] training {name} ({preset}) {budget}", flush=True)
        # The same split (same corpus and seed) for both; MHA reuses the tokenizer MoA's run trained.
        tokenizer = None if steps is None else str(out / "moa" / "tokenizer")
        cfg = TrainConfig(task="translation", preset=preset, out=str(out / name), tokenizer=tokenizer,
                          seed=seed, max_steps=steps or 100_000, max_time=None if steps else train_seconds,
                          max_tokens=2000, warmup_steps=100, lr=2e-3, log_every=10, eval_every=10**9, save_every=25,
                          keep_checkpoints=5, average_last=5, progress=progress)
        summary = train(cfg, stop=stop)
        if "valid" not in summary:  # stopped before the end
            return {"stopped_by": summary["stopped_by"]}
        steps = summary["steps"]
        t0 = time.time()
        scores = evaluate_run(out / name, split="test", beam_size=beam_size, limit=eval_sentences)
        macs = analytic_macs(get_config(out / name / "config.json"))
        report[name] = {
            "preset": preset, "bleu": scores["bleu"], "chrf": scores["chrf"], "valid_loss": summary["valid"]["loss"],
            "valid_ppl": summary["valid"]["ppl"], "macs": macs.total, "macs_paper_formula": macs.paper_total,
            "parameters": summary["parameters"], "train_seconds": summary["train_seconds"], "steps": summary["steps"],
            "train_tokens": summary["tokens"], "eval_seconds": time.time() - t0, "examples": scores["examples"],
            "expert_load": summary["valid"].get("expert_load", {}),
        }
    report["bleu_signature"] = scores["bleu_signature"]
    atomic_write(out / "report.json", json.dumps(report, indent=2, ensure_ascii=False))
    loss_curves_figure({n: read_metrics(out / n) for n in DEMO_MODELS}).savefig(out / "loss_curves.png", dpi=100)
    if report["moa"]["expert_load"]:
        expert_load_figure(report["moa"]["expert_load"]).savefig(out / "expert_load.png", dpi=100)
    print(format_comparison(report))
    return report


def _torch_threads() -> str:
    import torch
    return f", torch {torch.__version__} with {torch.get_num_threads()} threads"


def format_comparison(report: dict[str, Any]) -> str:
    rows = [("", "MoA", "MHA")]
    for key, label, fmt in (("bleu", "BLEU", "{:.2f}"), ("chrf", "chrF", "{:.2f}"), ("valid_ppl", "valid ppl", "{:.2f}"),
                            ("macs", "MACs (10+10 tokens)", "{:,}"), ("parameters", "parameters", "{:,}"),
                            ("steps", "steps", "{}"), ("train_seconds", "train seconds", "{:.0f}")):
        rows.append((label, fmt.format(report["moa"][key]), fmt.format(report["mha"][key])))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([f"headmix demo: {report['moa']['preset']} vs {report['mha']['preset']}"] + lines)


def loss_curves_figure(metrics: dict[str, list[dict[str, Any]]]):
    """Training loss against steps and against seconds, one line per run (``metrics``: run name -> its
    ``metrics.jsonl`` records). A ``matplotlib.figure.Figure``, made without pyplot or a global backend."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    ax = fig.subplots(1, 2)
    for name, records in metrics.items():
        train_rec = [r for r in records if r.get("split") == "train"]
        ax[0].plot([r["step"] for r in train_rec], [r["loss"] for r in train_rec], label=LABELS.get(name, name))
        ax[1].plot([r["time"] for r in train_rec], [r["loss"] for r in train_rec], label=LABELS.get(name, name))
    ax[0].set_xlabel("step")
    ax[1].set_xlabel("training seconds")
    for a in ax:
        a.set_ylabel("training loss (label-smoothed)")
        a.legend()
        a.grid(alpha=0.3)
    fig.suptitle("headmix demo: MoA vs MHA at about equal MACs")
    fig.tight_layout()
    return fig


def expert_load_figure(load: dict[str, list[float]]):
    """One bar chart per routed layer: the percentage of routing slots each expert received, with the
    uniform share dashed. A ``matplotlib.figure.Figure``, made without pyplot or a global backend."""
    from matplotlib.figure import Figure

    names = list(load)
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig = Figure(figsize=(4 * cols, 2.6 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, name in zip(axes.flat, names):
        shares = load[name]
        ax.bar(range(len(shares)), [100 * s for s in shares])
        ax.axhline(100 / len(shares), color="k", lw=0.8, ls="--")
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("expert", fontsize=8)
        ax.set_ylabel("% of slots", fontsize=8)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle("MoA expert load on the validation split (dashed: uniform)")
    fig.tight_layout()
    return fig
