"""`python -m trainers train RUN.yaml [--set k=v ...]`: the trainer without Ray (torchrun-friendly)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import record

from trainers._base import ConfigError, NonFiniteLossError
from trainers.checkpoint import CheckpointError
from trainers.config import load_config
from trainers.launch import run_local


@record  # torchrun's convention: an unexpected exception's traceback goes to its failure summary
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
    except (ConfigError, NonFiniteLossError) as e:  # the same on every rank: a node's local rank 0 says it
        _say(e, every_rank=False)
        return 2 if isinstance(e, ConfigError) else 1
    except CheckpointError as e:  # may be one rank's own files
        _say(e, every_rank=True)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"results in {result.run_dir}")
    return 0


def _say(e: BaseException, every_rank: bool) -> None:
    """One line on stderr, in one write (torchrun's ranks share the terminal; print's two writes interleave),
    by each node's local rank 0, or by every rank naming itself when `every_rank`. Every rank also writes it
    to torchrun's error file (the one `@record` writes), which torchrun's failure summary shows."""
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    line = f"error: {e}"
    if every_rank and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        line = f"error (rank {rank}): {e}"
    if every_rank or local_rank == 0:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(OSError):  # the summary's detail: the line above is what matters
            with open(error_file, "w") as f:
                json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                      "timestamp": str(int(time.time()))}}}, f)


if __name__ == "__main__":
    sys.exit(main())
