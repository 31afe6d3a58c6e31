"""``headmix study``: which attention variant wins at equal compute, with seeds and confidence intervals.

    headmix study lm-en --out runs/study-lm                 # a built-in study (see --list)
    headmix study my_study.toml --out runs/mine             # your own spec (TOML or JSON)
    headmix study lm-en --out runs/s --plan                 # the matched rows (MACs, parameters) only
    headmix study lm-en --out runs/s --seeds 1 2            # fewer (or more) seeds

Every row is sized to the baseline's attention MACs within 2% (``headmix macs`` counting) and trained for
the same number of steps on the same split, tokenizer, batch order and schedule, once per seed. Each
(row, seed) is a run folder under OUT/runs/, so running the same command again continues where the study
stopped and skips finished runs. OUT/results.json, OUT/results.md and the plots are rewritten after every
finished run: the mean ± standard deviation over seeds and the difference from the baseline paired by
seed with a 95% interval ("no significant difference" when it contains zero).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

from .main import device_option


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("study", help="compare attention variants at equal MACs over several seeds",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", nargs="?", help="a built-in study name (see --list) or a .toml/.json spec file")
    p.add_argument("--out", help="the study folder (created, or continued when it holds this study)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="override the spec's seeds")
    p.add_argument("--max-steps", type=int, default=None, help="override the spec's steps per run")
    p.add_argument("--plan", action="store_true", help="print the matched rows and exit without training")
    p.add_argument("--list", action="store_true", help="list the built-in studies")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--device", type=device_option, default=None,
                   help="cpu, cuda, cuda:N or auto for every run (default: the spec's training.device, else auto)")
    p.add_argument("--compile", action="store_true", help="torch.compile every run's model for training")
    return p


def machine_description() -> str:
    import torch

    threads = torch.get_num_threads()
    return (f"{platform.machine()}, {os.cpu_count()} CPU threads, torch {torch.__version__} "
            f"(using {threads} thread{'s' if threads != 1 else ''})")


def run(args) -> int:
    from ..study import BUILTIN, get_study, plan, run_study, write_report

    if args.list:
        for name, make in BUILTIN.items():
            spec = make()
            print(f"{name}: {spec.task}, baseline {spec.baseline}, {len(spec.rows)} rows x {len(spec.seeds)} seeds, "
                  f"{spec.max_steps} steps: {', '.join(r.name for r in spec.rows)}")
        return 0
    if not args.study:
        raise ValueError("study: give a built-in study name (see --list) or a spec file")
    spec = get_study(args.study)
    if args.seeds is not None:
        spec.seeds = list(args.seeds)
    if args.max_steps is not None:
        spec.max_steps = args.max_steps
    if args.device is not None:
        spec.training["device"] = args.device
    if args.compile:
        spec.training["compile"] = True
    spec.validate()
    planned = plan(spec)
    if args.plan:
        print(json.dumps([r.to_dict() for r in planned], indent=2))
        return 0
    if not args.out:
        raise ValueError("--out is required to run a study (the study folder)")
    from .main import stop_on_signals

    machine = machine_description()

    def report(results):
        write_report(spec, planned, results, args.out, machine)

    with stop_on_signals() as stop:
        results = run_study(spec, args.out, progress=not args.no_progress, stop=stop, on_result=report,
                            log=lambda m: print(f"[headmix] {m}", file=sys.stderr, flush=True))
    table = write_report(spec, planned, results, args.out, machine)
    done = len(results)
    total = len(spec.rows) * len(spec.seeds)
    print(open(os.path.join(args.out, "results.md")).read())
    if done < total:
        print(f"headmix study: {done} of {total} runs finished; run the same command to continue", file=sys.stderr)
        return 1
    print(f"headmix study: {table['name']} finished; {args.out}/results.json, results.md and the plots")
    return 0
