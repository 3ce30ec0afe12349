"""`raytrain tune ...`: population-based training and its reports (found by `raytrain_ext.cli` at run time).

raytrain tune EXP.yaml [--set key=value ...] [--resume] [--address auto]
raytrain tune report EXP_DIR
raytrain tune replay EXP_DIR [--trial best|TRIAL_ID]
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_commands"]

USAGE = """raytrain tune EXP.yaml [--set KEY=VALUE] [--resume] [--address ADDR]
       raytrain tune report EXP_DIR
       raytrain tune replay EXP_DIR [--trial best|TRIAL_ID] [--address ADDR]"""


def add_commands(sub: argparse._SubParsersAction) -> None:
    tune = sub.add_parser(
        "tune",
        help="population-based training (PBT, PB2, ASHA) of a run YAML; report and replay",
        usage=USAGE,
        description=__doc__.split("\n\n")[0],
    )
    tune.add_argument("target", metavar="EXP.yaml|report|replay", help="an experiment YAML, or a subcommand")
    tune.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    tune.set_defaults(func=_dispatch)


def _dispatch(args: argparse.Namespace) -> int:
    commands = {"report": (_report_parser, _cmd_report), "replay": (_replay_parser, _cmd_replay)}
    build, run = commands.get(args.target, (_run_parser, _cmd_run))
    argv = args.rest if args.target in commands else [args.target, *args.rest]
    return run(build().parse_args(argv))


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raytrain tune", usage=USAGE)
    p.add_argument("experiment", help="experiment YAML (see examples/pbt-*.yaml)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an experiment key, e.g. --set population=8 (repeatable)",
    )
    p.add_argument("--resume", action="store_true", help="continue the interrupted experiment in its folder")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: start a local Ray)")
    p.add_argument("--quiet", action="store_true", help="no Tune progress table")
    return p


def _report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raytrain tune report", usage=USAGE)
    p.add_argument("exp_dir", help="the experiment folder (storage/name)")
    return p


def _replay_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raytrain tune replay", usage=USAGE)
    p.add_argument("exp_dir", help="the experiment folder (storage/name)")
    p.add_argument("--trial", default="best", help="trial id whose schedule to replay (default: the best)")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: start a local Ray)")
    return p


def _cmd_run(args: argparse.Namespace) -> int:
    from search.config import load_experiment, save

    exp = load_experiment(args.experiment, args.overrides)  # fails here, before Ray starts
    from raytrain_ext.launcher import ensure_ray
    from search.driver import run_experiment

    started = ensure_ray(args.address)
    try:
        save(exp)
        result = run_experiment(exp, resume=args.resume, verbose=0 if args.quiet else 1)
    finally:
        if started:
            import ray

            ray.shutdown()
    print(
        f"done: best trial {result.best_trial}, {exp.metric} {result.best_metric:.4f}; {len(result.events)} "
        f"exploits; results in {result.exp_dir}\nnext: raytrain tune report {result.exp_dir}"
    )
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from search.report import write_report

    out = write_report(Path(args.exp_dir))
    print(out.summary)
    print(f"plots: {', '.join(str(p) for p in out.plots)}")
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from raytrain_ext.launcher import ensure_ray
    from search.replay import replay

    started = ensure_ray(args.address)
    try:
        out = replay(Path(args.exp_dir), args.trial)
    finally:
        if started:
            import ray

            ray.shutdown()
    print(out.describe())
    return 0
