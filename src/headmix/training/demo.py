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
from typing import Any

from ..models import analytic_macs, get_config
from .evaluate import evaluate_translation
from .metrics import read_metrics
from .trainer import TrainConfig, prepare_data, train

DEMO_MODELS = {"moa": "mini-moa", "mha": "mini-mha"}
LABELS = {"moa": "MoA", "mha": "MHA"}


def run_demo(out: str | os.PathLike = "runs/demo", *, train_seconds: float = 260.0, eval_sentences: int = 400,
             beam_size: int = 4, seed: int = 1, progress: bool = True) -> dict[str, Any]:
    """Train ``mini-moa`` for ``train_seconds`` and ``mini-mha`` for as many steps (same data, tokenizer,
    batches and schedule), evaluate both on the held-out test split, write the report and plots."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # One tokenizer for both models, trained on the shared train split.
    shared = TrainConfig(task="translation", out=str(out / "shared"), seed=seed)
    prepare_data(shared, out / "shared", lambda m: print(f"[headmix] {m}", flush=True))
    report: dict[str, Any] = {"setup": {
        "corpus": "LibreOffice help En-De (embedded, MPL-2.0)", "moa_train_seconds": train_seconds,
        "eval_sentences": eval_sentences, "beam_size": beam_size, "seed": seed,
        "machine": f"{os.cpu_count()} CPU threads" + _torch_threads(),
    }}
    steps = None
    for name, preset in DEMO_MODELS.items():
        budget = f"for {train_seconds:.0f}s" if steps is None else f"for {steps} steps"
        print(f"[headmix] training {name} ({preset}) {budget}", flush=True)
        cfg = TrainConfig(task="translation", preset=preset, out=str(out / name), tokenizer=str(out / "shared" / "tokenizer"),
                          seed=seed, max_steps=steps or 100_000, max_time=None if steps else train_seconds,
                          max_tokens=2000, warmup_steps=100, lr=2e-3, log_every=10, eval_every=10**9, save_every=25,
                          keep_checkpoints=5, average_last=5, progress=progress)
        summary = train(cfg)
        steps = summary["steps"]
        t0 = time.time()
        scores = evaluate_translation(out / name, split="test", beam_size=beam_size, limit=eval_sentences)
        mcfg = get_config(out / name / "config.json")
        macs = analytic_macs(mcfg)
        report[name] = {
            "preset": preset, "bleu": scores["bleu"], "chrf": scores["chrf"], "valid_loss": summary["valid"]["loss"],
            "valid_ppl": summary["valid"]["ppl"], "macs": macs.total, "macs_paper_formula": macs.paper_total,
            "parameters": summary["parameters"], "train_seconds": summary["train_seconds"], "steps": summary["steps"],
            "train_tokens": summary["tokens"], "eval_seconds": time.time() - t0, "examples": scores["examples"],
            "expert_load": summary["valid"].get("expert_load", {}),
        }
    report["bleu_signature"] = scores["bleu_signature"]
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, ensure_ascii=False))
    os.replace(tmp, out / "report.json")
    plot_loss_curves({n: read_metrics(out / n) for n in DEMO_MODELS}, out / "loss_curves.png")
    if report["moa"]["expert_load"]:
        plot_expert_load(report["moa"]["expert_load"], out / "expert_load.png")
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


def plot_loss_curves(metrics: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
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
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_expert_load(load: dict[str, list[float]], path: Path) -> None:
    """One bar chart per routed layer: the share of routing slots each expert received."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(load)
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.6 * rows), squeeze=False)
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
    fig.savefig(path, dpi=100)
    plt.close(fig)
