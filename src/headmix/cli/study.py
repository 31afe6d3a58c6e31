"""``headmix study``: which attention variant wins at equal compute, with seeds and confidence intervals.

    headmix study lm-en --out runs/study-lm                 # a built-in study (see --list)
    headmix study my_study.toml --out runs/mine             # your own spec (TOML or JSON)
    headmix study lm-en --out runs/s --plan                 # the matched rows (MACs, parameters) only
    headmix study lm-en --out runs/s --seeds 1 2            # fewer (or more) seeds
    headmix study lm-en-gpu --out runs/g --device cuda      # on a GPU (--bf16, --compile pass through too)
    headmix study lm-en --out studies/lm-en --report        # rewrite the report from the finished runs

Every row is sized to the baseline's attention MACs within 2% (``headmix macs`` counting) and trained for
the same number of steps on the same split, tokenizer, batch order and schedule, once per seed. Each
(row, seed) is a run folder under OUT/runs/, so running the same command again continues where the study
stopped and skips finished runs. OUT/results.json, OUT/results.md and the plots are rewritten after every
finished run: the mean ± standard deviation over seeds and the difference from the baseline paired by
seed with a 95% interval ("no significant difference" when it contains zero), and beside it the equal-time
comparison (tokens/s relative to the baseline, validation NLL at the baseline's training time). The corpus is
read, split and tokenised once per study, into OUT/shared/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .main import device_name_option


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("study", help="compare attention variants at equal MACs over several seeds",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", nargs="?", help="a built-in study name (see --list) or a .toml/.json spec file")
    p.add_argument("--out", help="the study folder (created, or continued when it holds this study)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="override the spec's seeds")
    p.add_argument("--max-steps", type=int, default=None, help="override the spec's steps per run")
    p.add_argument("--data", nargs="+", default=None, metavar="FILE", help="override the spec's corpus files")
    p.add_argument("--device", type=device_name_option, default=None,
                   help="cpu, cuda, cuda:N or auto, for every run (the spec's training.device, else auto)")
    p.add_argument("--bf16", choices=("auto", "on", "off"), default=None, help="bf16 autocast of every run")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile every run's model")
    p.add_argument("--drop-checkpoints", action=argparse.BooleanOptionalAction, default=None,
                   help="remove each run's checkpoints once it has finished (its final model and summary stay)")
    p.add_argument("--plan", action="store_true", help="print the matched rows and exit without training")
    p.add_argument("--report", action="store_true", help="rewrite the report from the finished runs in --out, "
                                                        "training nothing")
    p.add_argument("--list", action="store_true", help="list the built-in studies")
    p.add_argument("--no-progress", action="store_true")
    return p


def apply_overrides(spec, args) -> None:
    """The command line's overrides of the spec (seeds, steps, data, device, bf16, compile, checkpoints)."""
    if args.seeds is not None:
        spec.seeds = list(args.seeds)
    if args.max_steps is not None:
        spec.max_steps = args.max_steps
    if args.data is not None:
        spec.data = [os.path.abspath(p) for p in args.data]
    for name in ("device", "bf16", "compile"):
        value = getattr(args, name)
        if value is not None:
            spec.training[name] = value
    if args.drop_checkpoints is not None:
        spec.drop_checkpoints = args.drop_checkpoints


def list_studies() -> None:
    from ..study import BUILTIN

    for name, make in BUILTIN.items():
        spec = make()
        where = f"wants a GPU: {spec.gpu}" if spec.gpu else "sized for the CPU"
        print(f"{name}: {spec.task}, {len(spec.rows)} rows x {len(spec.seeds)} seeds, {spec.max_steps} steps: "
              f"{', '.join(r.name for r in spec.rows)}; {where}")


def run(args) -> int:
    from ..study import finished_results, get_study, plan, run_study, write_report

    if args.list:
        list_studies()
        return 0
    if not args.study:
        raise ValueError("study: give a built-in study name (see --list) or a spec file")
    spec = get_study(args.study)
    apply_overrides(spec, args)
    spec.validate()
    planned = plan(spec)
    if args.plan:
        print(json.dumps([r.to_dict() for r in planned], indent=2))
        return 0
    if not args.out:
        raise ValueError("--out is required to run a study (the study folder)")
    log = lambda m: print(f"[headmix] {m}", file=sys.stderr, flush=True)  # noqa: E731
    if args.report:
        results = finished_results(spec, args.out, log)
    else:
        from ..training.config import pick_device
        from .main import stop_on_signals

        pick_device(spec.training.get("device", "auto"))  # a one-line error for a bad --device, before any work

        def report(results):
            write_report(spec, planned, results, args.out)

        with stop_on_signals() as stop:
            results = run_study(spec, args.out, progress=not args.no_progress, stop=stop, on_result=report, log=log)
    table = write_report(spec, planned, results, args.out)
    done = len(results)
    total = len(spec.rows) * len(spec.seeds)
    print(open(os.path.join(args.out, "results.md")).read())
    if done < total:
        print(f"headmix study: {done} of {total} runs finished; run the same command to continue", file=sys.stderr)
        return 1
    print(f"headmix study: {table['name']} finished; {args.out}/results.json, results.md and the plots")
    return 0
