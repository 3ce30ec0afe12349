"""`python -m trainers train RUN.yaml [--set k=v ...]`: the trainer without Ray (torchrun-friendly)."""

from __future__ import annotations

import argparse
import os
import sys

from trainers._base import ConfigError, NonFiniteLossError
from trainers.checkpoint import CheckpointError
from trainers.config import load_config
from trainers.launch import run_local


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainers", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train one run from a run YAML")
    train.add_argument("config")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        result = run_local(load_config(args.config, args.overrides), progress=not args.no_progress)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (NonFiniteLossError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"results in {result.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
