"""`raytrain tune ...`: population-based training and its reports.

`raytrain` (raytrain_ext.cli) finds `add_commands` through the `raytrain.commands` entry point that
pyproject.toml registers: the layer below never imports this one.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from search.space import EXPLORE_RULES

__all__ = ["add_commands"]

USAGE = """raytrain tune EXP.yaml [--set KEY=VALUE] [--resume] [--address ADDR]
       raytrain tune report EXP_DIR [--output DIR]
       raytrain tune replay EXP_DIR [--trial best|TRIAL_ID] [--address ADDR]"""


def add_commands(sub: argparse._SubParsersAction) -> None:
    tune = sub.add_parser(
        "tune",
        help="population-based training (PBT, PB2, ASHA) of a run YAML; report and replay",
        usage=USAGE,
        description=__doc__.split("\n\n")[0],
        epilog=EXPLORE_RULES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tune.add_argument("target", metavar="EXP.yaml|report|replay", help="an experiment YAML, or a subcommand")
    tune.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    tune.set_defaults(func=_dispatch)


def _dispatch(args: argparse.Namespace) -> int:
    if args.target in ("report", "replay"):
        run = _cmd_report if args.target == "report" else _cmd_replay
        return run(_exp_dir_parser(args.target).parse_args(args.rest))
    return _cmd_run(_run_parser().parse_args([args.target, *args.rest]))


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="raytrain tune", usage=USAGE, epilog=EXPLORE_RULES, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("experiment", help="experiment YAML (see examples/pbt-*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override an experiment key, e.g. --set population=8 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue the interrupted experiment in its folder")
    _add_address(p)
    p.add_argument("--quiet", action="store_true", help="no Tune progress table")
    return p


def _exp_dir_parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"raytrain tune {command}", usage=USAGE)
    p.add_argument("exp_dir", help="the experiment folder (storage/name; a bucket URI too)")
    if command == "report":
        p.add_argument("--output", help="folder for the plots and summary (default: EXP_DIR/report)")
        return p
    p.add_argument("--trial", default="best", help="trial id whose schedule to replay (default: the best)")
    _add_address(p)
    return p


def _add_address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None, help="Ray cluster to join (default: start a local Ray)")


def _cmd_run(args: argparse.Namespace) -> int:
    from search.config import load_experiment

    exp = None
    try:
        exp = load_experiment(args.experiment, args.overrides)  # fails here, before Ray starts
        return _run(args, exp)
    except KeyboardInterrupt:  # outside Tune's loop (starting, a second Ctrl-C while Tune stops its trials)
        return _interrupted(args, exp)


def _run(args: argparse.Namespace, exp: Any) -> int:
    from search.api import tune

    result = tune(exp, address=args.address, resume=args.resume, progress=not args.quiet, release_stranded=False)
    if not result.finished:  # Tune caught the Ctrl-C, stopped the trials and saved its state
        return _interrupted(args, exp)
    if result.best_trial is not None:
        print(f"done: best trial {result.best_trial}, {exp.metric} {result.best_metric:.4f}; "
              f"{len(result.events)} exploits; results in {result.exp_dir}\n"
              f"next: raytrain tune report {result.exp_dir}")
    elif not result.failed:
        print(f"raytrain: error: no trial reported a finite {exp.metric} (all failed); "
              f"fix: see why in `raytrain tune report {result.exp_dir}`", file=sys.stderr)
        return 1
    if result.failed:  # short of the budget: the experiment did not do what was asked
        print(_failed_line(args, exp, result), file=sys.stderr)
        return 1
    return 0


def _failed_line(args: argparse.Namespace, exp: Any, result: Any) -> str:
    """One line naming the trials that ended failed, each with its error, and how to go on: a run's failure
    ends its trial for good; --resume continues a trial Tune ended in ERROR (its actor failed, e.g. with
    its node)."""
    from search.lineage import latest_reports

    last = latest_reports(result.reports)
    whys, resumable = [], False
    for trial in result.failed:
        report = last.get(trial) or {}
        if report.get("failed"):
            why = (report.get("error") or "failed").strip().splitlines()[0][:200]
        else:
            why, resumable = "its trial failed: Tune's table above names the error file", True
        whys.append(f"{trial} ({why})")
    again = f"; `{shlex.join([*_same_command(args), '--resume'])}` continues those Tune ended" if resumable else ""
    return (
        f"raytrain: error: {len(result.failed)} of {exp.population} trials ended failed, short of the budget: "
        f"{'; '.join(whys)}; fix: see the tracebacks in {result.exp_dir}/workers.log{again}"
    )


def _same_command(args: argparse.Namespace) -> list[str]:
    """The command line that ran this experiment, without --resume."""
    again = ["raytrain", "tune", args.experiment, *(x for kv in args.overrides for x in ("--set", kv))]
    return again + (["--address", args.address] if args.address else [])


def _interrupted(args: argparse.Namespace, exp: Any) -> int:
    """One line on how to go on, and the shell's exit status for SIGINT (128 + 2)."""
    from search.state import has_tune_state

    again = _same_command(args)
    if args.resume or (exp is not None and has_tune_state(exp.exp_dir)):
        print(f"raytrain: interrupted; resume with: {shlex.join([*again, '--resume'])}", file=sys.stderr)
    else:  # stopped before Tune saved anything: there is nothing to resume yet
        print(f"raytrain: interrupted before the experiment started; run again: {shlex.join(again)}",
              file=sys.stderr)
    return 130


def _cmd_report(args: argparse.Namespace) -> int:
    from search.report import write_report
    from trainers.storage import location

    out = write_report(location(args.exp_dir), location(args.output) if args.output else None)
    print(out.summary)
    print(f"plots: {', '.join(str(p) for p in out.plots)}")
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from raytrain_ext.launcher import ensure_ray, stop_ray
    from search.replay import replay
    from search.state import load_experiment_dir
    from trainers.storage import location

    load_experiment_dir(args.exp_dir)  # a damaged experiment.json is one line, before Ray starts
    started = ensure_ray(args.address)
    try:
        out = replay(location(args.exp_dir), args.trial)
    finally:
        if started:
            stop_ray()
    print(out.describe())
    return 0
