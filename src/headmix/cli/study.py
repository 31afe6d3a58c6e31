"""``headmix study``: which attention variant wins at equal compute, with seeds and confidence intervals.

    headmix study lm-en --out runs/study-lm                 # a built-in study (see --list)
    headmix study my_study.toml --out runs/mine             # your own spec (TOML or JSON)
    headmix study lm-en --plan                              # the matched rows (MACs, parameters) only
    headmix study lm-en --plan --json                       # the same, every field, as JSON
    headmix study lm-en --out runs/s --seeds 1 2            # fewer (or more) seeds
    headmix study lm-en-gpu --out runs/g --device cuda      # on a GPU (--bf16, --compile pass through too)
    headmix study lm-en --out studies/lm-en --report        # rewrite the report from the finished runs
    headmix study lm-en-gpu --out runs/g --device cuda:1    # one of several workers on one folder
    headmix study lm-en --out runs/s --time-budget 540      # stop cleanly within 9 minutes (exit 75), rerun
    headmix study lm-en-gpu-contenders --out studies/lm-en-gpu-contenders --max-runs 3   # 3 runs, then exit 75
    headmix study lm-en --out runs/s --keep-checkpoints all # keep every checkpoint of finished runs (default 1)

Every row is sized to the baseline's attention MACs within 2% (``headmix macs`` counting) and trained for
the same number of steps on the same split, tokenizer, batch order and schedule, once per seed. Each
(row, seed) is a run folder under OUT/runs/, so running the same command again continues where the study
stopped and skips finished runs. OUT/results.json, OUT/results.md and the plots are rewritten after every
finished run: the mean ± standard deviation over seeds and the difference from the baseline paired by
seed with a 95% interval ("no significant difference" when it contains zero), and beside it the equal-time
comparison (each row's step time measured against the baseline's side by side, once per row, and both
validation curves read at equal time; the older wall-clock reading as a secondary table). The corpus is
read, split and tokenised once per study, into OUT/shared/. Several processes may run the same command on one
folder (one per GPU, or a job array): each takes the next run no other holds, a row is timed while no other
worker of the study trains or times, and the last to finish writes the report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .main import device_name_option


def _kept_checkpoints(text: str) -> int | None:
    """``--keep-checkpoints``: an integer >= 0, or ``all`` (``None``)."""
    if text == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 or 'all', got {text!r}")
    return value


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
    p.add_argument("--keep-checkpoints", type=_kept_checkpoints, default=argparse.SUPPRESS, metavar="N|all",
                   help="checkpoints each run keeps once it has finished: its newest N (the spec's keep_checkpoints, "
                        "default 1), or all")
    p.add_argument("--drop-checkpoints", action=argparse.BooleanOptionalAction, default=None,
                   help="remove each run's checkpoints once it has finished (its final model and summary stay; "
                        "--keep-checkpoints 0)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop cleanly (checkpoint saved) so that this command ends within SECONDS of starting its "
                        "work; the same command continues the study (exit status 75 when stopped by the budget)")
    p.add_argument("--time-reserve", type=float, default=60.0, metavar="SECONDS",
                   help="with --time-budget: stop starting new steps this long before the budget ends, for what "
                        "cannot be cut (a run's final validation and summary, the report; default 60)")
    p.add_argument("--max-runs", type=int, default=None, metavar="N",
                   help="train at most N runs to their end, then stop before starting another (exit status 75 while "
                        "runs remain): a command that must end between runs, e.g. on a machine that keeps nothing")
    p.add_argument("--retrain-parent", action="store_true",
                   help="a continuation study whose parent has finished but whose weights are not here (a clone of "
                        "the committed records): train the parent again as the spec says and keep it if its "
                        "weights' sha256 is the recorded one (else refused, nothing changed)")
    p.add_argument("--retime", action="store_true",
                   help="time every row again whose step-time record other code measured (another commit): the runs "
                        "stay, the report is rewritten with the new ratios, each record keeps the old one under "
                        "'previous'; needs a git checkout without local changes")
    p.add_argument("--plan", action="store_true", help="print the matched rows (a table) and exit without training")
    p.add_argument("--json", action="store_true", help="with --plan: print the matched rows as JSON (every field)")
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
    keep_given = "keep_checkpoints" in vars(args)  # absent unless given ("all" is None)
    if args.drop_checkpoints and keep_given:
        raise ValueError("give --drop-checkpoints or --keep-checkpoints, not both")
    if args.drop_checkpoints is not None:
        spec.drop_checkpoints = args.drop_checkpoints
    if keep_given:  # what the command line asks overrides the spec's drop_checkpoints
        spec.keep_checkpoints, spec.drop_checkpoints = args.keep_checkpoints, False


def format_plan(spec, planned) -> str:
    """The matched rows of ``spec`` as a table: each row's attention, its attention MACs against the baseline's,
    the model's MACs and parameters, and the fields solved for it with the values found."""
    from ..models.counting import resolve_lengths
    from ..study.report import _attention_text
    from ..study.plan import macs_lengths

    baseline = spec.baseline_config()
    src, tgt = resolve_lengths(baseline, *macs_lengths(spec, baseline))
    lengths = " + ".join(f"{v} {n}" for n, v in (("source", src), ("target", tgt)) if v is not None)
    solve = {row.name: row.solve for row in spec.rows}
    table = [("row", "attention", "attention MACs", "vs baseline", "MACs", "parameters", "solved")]
    for row in planned:
        attention = row.to_dict()["attention"]
        solved = ", ".join(f"{f}={attention[f]}" for f in solve.get(row.name, [])) or "–"
        table.append((row.name, _attention_text(attention), f"{row.attention_macs:,}", f"{row.macs_ratio:.3f}x",
                      f"{row.macs:,}", f"{row.parameters:,}", solved))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    right = {2, 3, 4, 5}
    lines = ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in table]
    sizing = (f"every row's attention MACs within {spec.tolerance:.0%} of the baseline's" if spec.matching == "macs"
              else "rows not matched to the baseline's MACs (matching none): each keeps its shape")
    parent = (f"; every run continues one parent (the baseline trained {spec.parent.max_steps} steps, seed "
              f"{spec.parent.seed}) for {spec.max_steps} steps, converted as its row says" if spec.parent else "")
    return "\n".join([f"study {spec.name}: {spec.task}, baseline {spec.baseline_name}; {sizing}, counted at "
                      f"{lengths} tokens{parent}"] + lines)


def list_studies() -> None:
    from ..study import BUILTIN

    for name, make in BUILTIN.items():
        spec = make()
        where = f"wants a GPU: {spec.gpu}" if spec.gpu else "sized for the CPU"
        print(f"{name}: {spec.task}, {len(spec.rows)} rows x {len(spec.seeds)} seeds, {spec.max_steps} steps: "
              f"{', '.join(r.name for r in spec.rows)}; {where}")


#: The exit status of a study stopped by its time budget: run the same command again to continue.
EXIT_CONTINUE = 75


def run(args) -> int:
    from ..study import finished_results, get_study, plan, run_study, write_report
    from ..study.report import update_report
    from ..study.results import study_complete
    from ..study.runner import TIME_BUDGET, with_time_budget

    if args.list:
        list_studies()
        return 0
    if not args.study:
        raise ValueError("study: give a built-in study name (see --list) or a spec file")
    spec = get_study(args.study)
    apply_overrides(spec, args)
    spec.validate()
    if args.json and not args.plan:
        raise ValueError("--json goes with --plan (the matched rows as JSON)")
    planned = plan(spec)
    if args.plan:
        print(json.dumps([r.to_dict() for r in planned], indent=2) if args.json else format_plan(spec, planned))
        return 0
    if not args.out:
        raise ValueError("--out is required to run a study (the study folder)")
    log = lambda m: print(f"[headmix] {m}", file=sys.stderr, flush=True)  # noqa: E731
    if args.report:
        from ..study.claims import study_lock

        if not (Path(args.out) / "study.json").is_file():
            raise FileNotFoundError(f"{args.out} holds no study (no study.json)")
        with study_lock(Path(args.out)):  # not while a worker writes it
            results = finished_results(spec, args.out, log)
            write_report(spec, planned, results, args.out)
        print(open(os.path.join(args.out, "results.md")).read())
        return 0
    from ..devices import pick_device
    from .main import stop_on_signals

    pick_device(spec.training.get("device", "auto"))  # a one-line error for a bad --device, before any work
    reasons: list[str] = []

    def report(results):
        update_report(spec, planned, args.out, log=log)

    with stop_on_signals() as on_signal:
        budget = with_time_budget(on_signal, args.time_budget, args.time_reserve)

        def stop():
            reason = budget()
            if reason is not None and not reasons:
                reasons.append(reason)
            return reason

        results = run_study(spec, args.out, progress=not args.no_progress, stop=stop, on_result=report, log=log,
                            max_runs=args.max_runs, retrain_parent=args.retrain_parent, retime=args.retime)
    done, total = len(results), len(spec.rows) * len(spec.seeds)
    if reasons:
        print(f"headmix study: stopped ({reasons[0]}); {done} of {total} runs finished; run the same command to "
              f"continue", file=sys.stderr)
        return EXIT_CONTINUE if reasons[0] == TIME_BUDGET else 1
    complete = study_complete(spec, planned, Path(args.out), results)
    if not complete and args.max_runs is not None and done < total:
        print(f"headmix study: stopped between runs (--max-runs {args.max_runs}); {done} of {total} runs finished; "
              f"run the same command to continue", file=sys.stderr)
        return EXIT_CONTINUE
    if not complete:
        print(f"headmix study: {done} of {total} runs finished; the others are being timed or trained by other "
              f"workers on {args.out}, and the last to finish writes the report", file=sys.stderr)
        return 0
    print(open(os.path.join(args.out, "results.md")).read())
    print(f"headmix study: {spec.name} finished; {args.out}/results.json, results.md and the plots")
    return 0
