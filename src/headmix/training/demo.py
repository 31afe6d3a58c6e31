"""``headmix demo``: MoA with more experts than it chooses against a standard Transformer of the same
attention MACs, trained and evaluated on the embedded English-German corpus in under ten minutes.

Two sizes (:class:`DemoSize`), picked by the device: :data:`CPU_DEMO` (``mini-mha`` vs MoA 4K16E, 450
steps, sized for two CPU cores) and :data:`GPU_DEMO` (the paper's ``transformer-base`` vs MoA with
``moa-base``'s ``K = 8`` choosing from 16 experts, bf16, sized for one H100-class GPU).

The comparison is the paper's: the same data, tokenizer, batches, schedule and number of updates
(``steps``, not seconds, so a seed gives the same numbers on any machine of the same software), at equal
attention MACs. On the CPU the baseline is ``mini-mha`` (4 heads of 32) and the MoA model chooses ``k = 4``
of 16 experts per token; on a GPU the baseline is ``transformer-base`` (8 heads of 64) and MoA chooses
``k = 8`` of 16. Each MoA head size is solved by :func:`headmix.models.matching.match_attention` so that its attention
costs the baseline's MACs within 2% (the ``lm-en`` / ``translation-en-de`` studies' MoA rows, see
``docs/study.md``). Both are evaluated on the same test sentences with beam search and sacrebleu; a
paired bootstrap over those sentences (sacrebleu's ``PairedTest``) says whether the two BLEU scores can
be told apart at this budget, and the printout says so rather than implying a winner.

It writes ``OUT/report.json``, ``OUT/loss_curves.png`` and ``OUT/expert_load.png`` and the two runs
(``OUT/moa``, ``OUT/mha``), which the ``headmix evaluate`` / ``headmix analyze`` commands accept.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..tasks import evaluate_run, get_task
from ..models import analytic_macs, get_config
from ..models.matching import match_attention, with_attention
from ..storage.files import atomic_write
from ..devices import pick_device
from .config import TrainConfig
from ..provenance import load_average
from .metrics import read_metrics
from .setup import prepare_shared_data
from .trainer import train

LABELS = {"moa": "MoA", "mha": "MHA"}
#: the full comparison, with seeds and confidence intervals
STUDY_DOC = "docs/study.md"


@dataclass(frozen=True)
class DemoSize:
    """What the demo trains and how: the baseline preset, the MoA model's fixed attention fields (its head
    size is solved to the baseline's attention MACs, preferring ``prefer_head_dim``) and the training and
    evaluation budget, the same for both models."""

    name: str
    baseline: str
    moa: dict[str, Any] = field(default_factory=dict)
    prefer_head_dim: int = 32
    steps: int = 450
    max_tokens: int = 2000
    warmup_steps: int = 100
    lr: float = 2e-3
    save_every: int = 25
    average_last: int = 5
    eval_sentences: int = 400
    beam_size: int = 4
    bf16: str = "auto"
    description: str = ""
    #: the corpus files (empty: the embedded corpus) and the BPE vocabulary; other values are for tests
    data: tuple[str, ...] = ()
    vocab_size: int = 8000


#: two CPU cores, about 7 minutes (measured): shows that the models learn, not that they translate
CPU_DEMO = DemoSize("cpu", "mini-mha", {"kind": "moa", "num_experts": 16, "top_k": 4}, prefer_head_dim=32,
                    description="mini-mha vs MoA 4K16E, sized for 2 CPU cores")
#: one H100-class GPU: the paper's base Transformer (d 512, FFN 2048, 6+6 layers, 8 heads of 64) against MoA
#: with moa-base's k = 8, choosing from 16 experts (moa-base itself, 8K8E128D, costs 14% more attention MACs
#: than the baseline), bf16 autocast, every test sentence. ESTIMATED, to be confirmed on a GPU: 1200 steps of
#: 8192 tokens each per model are meant to fit ten minutes on one H100, evaluation included; the estimate and
#: the measured facts it rests on are in README.md ("The GPU demo"). The numbers a seed gives do not depend
#: on the GPU's speed, only the time does.
GPU_DEMO = DemoSize("gpu", "transformer-base", {"kind": "moa", "num_experts": 16, "top_k": 8}, prefer_head_dim=128,
                    steps=1200, max_tokens=8192, warmup_steps=400, lr=7e-4, save_every=100, average_last=5,
                    eval_sentences=10**6, beam_size=4, bf16="on",
                    description="transformer-base vs MoA 8K16E, bf16, sized for one H100-class GPU")
SIZES = {"cpu": CPU_DEMO, "gpu": GPU_DEMO}
#: the CPU demo's names, kept for callers
BASELINE = CPU_DEMO.baseline
MOA = CPU_DEMO.moa


def demo_size(device: str = "auto") -> tuple[DemoSize, Any]:
    """The demo size for ``device`` (``auto``: CUDA when available) and the resolved ``torch.device``:
    :data:`GPU_DEMO` on a CUDA device, :data:`CPU_DEMO` otherwise."""
    resolved = pick_device(device)
    if resolved.type == "cuda" and resolved.index is None:  # "cuda": the trainer's set_device wants an index
        resolved = torch.device("cuda", torch.cuda.current_device())
    return (GPU_DEMO if resolved.type == "cuda" else CPU_DEMO), resolved


def demo_models(tolerance: float = 0.02, size: DemoSize = CPU_DEMO) -> dict[str, Any]:
    """The demo's two model configs (translation): ``mha`` = the size's baseline preset and ``moa`` with the
    size's MoA attention sized to the baseline's attention MACs (default: the CPU demo's pair)."""
    base = get_config(size.baseline, task="translation")
    match = match_attention(base, size.moa, ["head_dim"], prefer={"head_dim": size.prefer_head_dim},
                            tolerance=tolerance)
    return {"moa": with_attention(base, match.attention), "mha": base}


def run_demo(out: str | os.PathLike = "runs/demo", *, steps: int | None = None, eval_sentences: int | None = None,
             beam_size: int | None = None, seed: int = 1, progress: bool = True, device: str = "auto",
             size: DemoSize | None = None, stop: Callable[[], str | None] | None = None,
             compile: bool = False) -> dict[str, Any]:
    """Train both models for ``steps`` updates (same split, tokenizer, batches and schedule), evaluate both on
    the first ``eval_sentences`` test sentences, compare them with a paired bootstrap, write the report and
    plots. ``size``: the :class:`DemoSize` (default: :func:`demo_size` of ``device``); ``steps``,
    ``eval_sentences`` and ``beam_size`` override the size's. ``stop``: as for
    :func:`headmix.training.train`; a stopped demo returns ``{"stopped_by": reason}`` and resumes when
    called again. ``device`` (``cpu``, ``cuda``, ``cuda:N``, ``auto``) and ``compile`` as
    :class:`~headmix.training.TrainConfig`'s; the evaluation runs on the same device."""
    start = time.time()
    auto_size, resolved = demo_size(device)
    size = size or auto_size
    overrides = {k: v for k, v in (("steps", steps), ("eval_sentences", eval_sentences), ("beam_size", beam_size))
                 if v is not None}
    size = dataclasses.replace(size, **overrides)
    steps, eval_sentences, beam_size = size.steps, size.eval_sentences, size.beam_size
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"setup": {
        "corpus": "LibreOffice help En-De (embedded, MPL-2.0)", "steps": steps, "eval_sentences": eval_sentences,
        "beam_size": beam_size, "seed": seed, "machine": f"{os.cpu_count()} CPU threads" + _torch_threads(),
        "size": size.name, "configuration": size.description, "device": describe_device(resolved),
        "max_tokens": size.max_tokens, "bf16": size.bf16, "cpu_count": os.cpu_count(),
    }}
    options = dict(task="translation", seed=seed, split_seed=seed, max_tokens=size.max_tokens, max_len=128,
                   data=list(size.data), vocab_size=size.vocab_size)
    tokenizer = prepare_shared_data(TrainConfig(out=str(out / "shared"), **options), _log)
    hypotheses: dict[str, list[str]] = {}
    task = get_task("translation")
    _log(f"demo size {size.name} ({size.description}) on {report['setup']['device']}")
    for name, config in demo_models(size=size).items():
        config_path = out / f"{name}_config.json"
        atomic_write(config_path, config.to_json())
        _log(f"training {name} ({describe_attention(config)}) for {steps} steps")
        cfg = TrainConfig(preset=str(config_path), out=str(out / name), tokenizer=str(tokenizer), max_steps=steps,
                          warmup_steps=size.warmup_steps, lr=size.lr, log_every=10, eval_every=10**9,
                          save_every=size.save_every, keep_checkpoints=size.average_last,
                          average_last=size.average_last, progress=progress, device=str(resolved),
                          bf16=size.bf16, compile=compile, **options)
        load_before = load_average()
        summary = train(cfg, stop=stop)
        if "valid" not in summary:  # stopped before the end
            return {"stopped_by": summary["stopped_by"]}
        load_after = load_average()
        t0 = time.time()
        tests = task.read_items(task.split_path(out / name / "data", "test"))
        _log(f"evaluating {name} on {min(eval_sentences, len(tests))} test sentences (beam {beam_size})")
        hyp_path = out / name / "test_hypotheses.txt"
        scores = evaluate_run(out / name, split="test", beam_size=beam_size, limit=eval_sentences, output=hyp_path,
                              device=str(resolved))
        hypotheses[name] = hyp_path.read_text(encoding="utf-8").splitlines()
        macs = analytic_macs(config)
        report[name] = {
            "model": describe_attention(config), "bleu": scores["bleu"], "chrf": scores["chrf"],
            "valid_loss": summary["valid"]["loss"], "valid_ppl": summary["valid"]["ppl"], "macs": macs.total,
            "attention_macs": sum(v for k, v in macs.full.items() if k.endswith("attention")),
            "macs_paper_formula": macs.paper_total, "parameters": summary["parameters"],
            "train_seconds": summary["train_seconds"], "load_average": [load_before, load_after],
            "steps": summary["steps"], "train_tokens": summary["tokens"],
            "eval_seconds": time.time() - t0, "examples": scores["examples"],
            "expert_load": summary["valid"].get("expert_load", {}),
        }
    report["bleu_signature"] = scores["bleu_signature"]
    references = [p.tgt for p in tests[:eval_sentences]]  # the same split for both runs
    report["comparison"] = paired_bleu(hypotheses["moa"], hypotheses["mha"], references)
    report["study"] = STUDY_DOC
    report["total_seconds"] = time.time() - start
    atomic_write(out / "report.json", json.dumps(report, indent=2, ensure_ascii=False))
    loss_curves_figure({n: read_metrics(out / n) for n in ("moa", "mha")}).savefig(out / "loss_curves.png", dpi=100)
    if report["moa"]["expert_load"]:
        expert_load_figure(report["moa"]["expert_load"]).savefig(out / "expert_load.png", dpi=100)
    print(format_comparison(report))
    return report


def paired_bleu(system: list[str], baseline: list[str], references: list[str], samples: int = 1000) -> dict[str, Any]:
    """BLEU of ``system`` minus ``baseline`` on the same sentences, with sacrebleu's paired bootstrap
    resampling (Koehn 2004; ``samples`` resamples, sacrebleu's fixed seed): the 95% interval of the system's
    BLEU and the p-value of the difference. ``distinguishable`` is True when p < 0.05 and the difference is
    not zero (sacrebleu's p-value is ``1 / (samples + 1)`` for two identical systems, whose every resample
    differs by zero; a zero difference favours neither)."""
    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest

    if not len(system) == len(baseline) == len(references):
        raise ValueError(f"system, baseline and references must have the same length, got {len(system)}, "
                         f"{len(baseline)} and {len(references)}")
    test = PairedTest([("baseline", baseline), ("system", system)], {"BLEU": BLEU()}, [references],
                      test_type="bs", n_samples=samples)
    _, scores = test()
    base, sys_ = scores["BLEU"]
    return {"bleu_difference": sys_.score - base.score, "system_bleu": sys_.score, "baseline_bleu": base.score,
            "system_interval": [float(sys_.mean - sys_.ci), float(sys_.mean + sys_.ci)],
            "baseline_interval": [float(base.mean - base.ci), float(base.mean + base.ci)],
            "p_value": float(sys_.p_value), "distinguishable": bool(sys_.p_value < 0.05 and sys_.score != base.score), "samples": samples,
            "sentences": len(references)}


def _log(message: str) -> None:
    print(f"[headmix] {message}", flush=True)


def describe_attention(config) -> str:
    """``MoA 4K16E48D`` or ``MHA 4 heads of 32``: the attention of a demo model, for logs and reports."""
    att = config.decoder_self_attention
    if att.kind == "moa":
        return f"MoA {att.top_k}K{att.num_experts}E{att.head_dim}D"
    return f"MHA {att.num_heads} heads of {att.resolved_head_dim(config.d_model)}"


def describe_device(device) -> str:
    """``cuda:0 (NVIDIA H100 80GB HBM3)`` or ``cpu``: the device a demo ran on, for logs and reports."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def _torch_threads() -> str:
    return f", torch {torch.__version__} with {torch.get_num_threads()} threads"


def format_comparison(report: dict[str, Any]) -> str:
    """The demo's printout: the configuration, the two models side by side, then :func:`verdict`."""
    rows = [("", "MoA", "MHA")]
    for key, label, fmt in (("model", "attention", "{}"), ("bleu", "BLEU", "{:.2f}"), ("chrf", "chrF", "{:.2f}"),
                            ("valid_ppl", "valid ppl", "{:.2f}"), ("attention_macs", "attention MACs (10+10 tokens)", "{:,}"),
                            ("macs", "MACs (10+10 tokens)", "{:,}"), ("parameters", "parameters", "{:,}"),
                            ("steps", "steps", "{}"), ("train_seconds", "train seconds", "{:.0f}")):
        rows.append((label, fmt.format(report["moa"][key]), fmt.format(report["mha"][key])))
    if all(report[n].get("load_average") for n in ("moa", "mha")):
        rows.append(("load average (start, end)", *(", ".join("?" if v is None else f"{v:.2f}" for v in
                                                               report[n]["load_average"]) for n in ("moa", "mha"))))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    setup = report["setup"]
    ran = (f"configuration {setup['size']} ({setup['configuration']}) on {setup['device']}, "
           f"{report['total_seconds'] / 60:.1f} minutes in all (training, evaluation and set-up)"
           if "size" in setup and "total_seconds" in report else None)
    loaded = under_load(report)
    return "\n".join([f"headmix demo: {report['moa']['model']} vs {report['mha']['model']}, equal attention MACs"]
                     + ([ran] if ran else []) + lines + ([loaded] if loaded else []) + verdict(report))


def verdict(report: dict[str, Any]) -> list[str]:
    """What the demo measured, BLEU (with the paired bootstrap) and validation perplexity together, then one
    sentence on what one seed can and cannot conclude: when both favour one model, that these two trained
    models differ on these sentences, not which attention is better; when they disagree, no ranking; when BLEU
    cannot tell them apart, that both learn."""
    c, moa, mha = report["comparison"], report["moa"], report["mha"]
    low, high = c["system_interval"]
    measured = (f"BLEU: MoA {moa['bleu']:.2f}, MHA {mha['bleu']:.2f}, difference {c['bleu_difference']:+.2f} (paired "
                f"bootstrap p = {c['p_value']:.3f} over {c['sentences']} sentences; MoA's 95% interval [{low:.2f}, "
                f"{high:.2f}]); validation perplexity (lower is better): MoA {moa['valid_ppl']:.2f}, MHA "
                f"{mha['valid_ppl']:.2f}.")
    steps, study = report["setup"]["steps"], report["study"]
    later = f"the comparison over seeds, with intervals, is in {study} (headmix study --list)"
    bleu_winner = "MoA" if c["bleu_difference"] > 0 else "MHA"
    ppl_winner = "MoA" if moa["valid_ppl"] < mha["valid_ppl"] else "MHA" if mha["valid_ppl"] < moa["valid_ppl"] else None
    if not c["distinguishable"]:
        concluded = (f"BLEU cannot tell the two apart at this budget and one seed's perplexity gap ranks nothing: "
                     f"this run shows that both models learn, not which attention is better; {later}.")
    elif bleu_winner == ppl_winner:
        concluded = (f"Both favour this {bleu_winner} model, a real difference between these two trained models "
                     f"on these sentences, but one seed and {steps} steps cannot say whether the attention or the "
                     f"training noise of the seed made it; {later}.")
    else:
        concluded = (f"This {bleu_winner} model is ahead on BLEU (a real difference on these sentences) but not on "
                     f"validation perplexity, so this run does not rank the two attentions, and one seed and "
                     f"{steps} steps could not; {later}.")
    return [measured, concluded]


def under_load(report: dict[str, Any]) -> str | None:
    """A caveat for the train seconds when a load average recorded at the start or end of a model's training
    exceeds the machine's CPUs (more processes ready to run than CPUs: others competed with the training);
    ``None`` otherwise or when not recorded."""
    cpus = report["setup"].get("cpu_count")
    loads = [v for n in ("moa", "mha") for v in report[n].get("load_average") or [] if v is not None]
    if not cpus or not loads or max(loads) <= cpus:
        return None
    return (f"Train seconds measured under load (load average up to {max(loads):.2f} on {cpus} CPUs: other "
            f"processes competed with the training), so they do not compare the two models' speed; "
            f"`headmix bench models` times them side by side.")


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
    fig.suptitle("headmix demo: MoA vs MHA at equal attention MACs, the same batches")
    fig.tight_layout()
    return fig


def expert_load_figure(load: dict[str, list[float]]):
    """One bar chart per routed layer: the percentage of routing slots each expert received, with the
    uniform share dashed. A ``matplotlib.figure.Figure``, made without pyplot or a global backend."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

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
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("% of slots", fontsize=8)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle("MoA expert load on the validation split (dashed: uniform)")
    fig.tight_layout()
    return fig
