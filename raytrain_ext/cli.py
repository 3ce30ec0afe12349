"""The `raytrain` command line. Every subcommand also works as a `ray job submit -- raytrain ...` entry.

Usage errors (bad config, missing files) print one line naming the field and the fix, and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points
from pathlib import Path

from raytrain_ext._version import __version__
from trainers._base import CheckpointError, ConfigError, NonFiniteLossError
from trainers.config import RunConfig, load_config
from trainers.tracking import with_trackers

__all__ = ["COMMANDS", "main"]

COMMANDS = "raytrain.commands"  # the entry point group of commands added by other packages: NAME = "module:fn(sub)"


def _cmd_train(args: argparse.Namespace) -> int:
    """Train one run from a run YAML: on Ray (a local Ray started in this process unless --address
    names a cluster), or in this process alone with --no-ray."""
    from raytrain_ext.api import train

    result = train(
        train_config(args),
        address=args.address,
        no_ray=args.no_ray,
        progress=not args.no_progress,
        callbacks=args.callbacks,
        ray_log_level=args.ray_log_level,
    )
    per_step = any("replicas" in r for r in result.metrics if r.get("kind") == "train")
    sizes = "" if args.no_ray else f", workers per attempt {result.world_sizes}"
    if per_step and result.goodput is not None:  # replica groups come and go within one attempt
        sizes = f", goodput {result.goodput:.2f}"
    val = f"{result.val_loss:.4f}" if result.val_loss is not None else "n/a"
    print(f"done: step {result.step}, val_loss {val}{sizes}; results in {result.run_dir}")
    return 0


def train_config(args: argparse.Namespace) -> RunConfig:
    """The run YAML with --set, then --profile/--memory-snapshot and --mlflow/--wandb applied."""
    overrides = list(args.overrides)
    if getattr(args, "fit", None) is not None:
        overrides.append(f"memory.fit={args.fit}")
    if args.profile is not None:
        step, sep, count = args.profile.partition(":")
        if not (sep and step.strip().isdigit() and count.strip().isdigit()):
            raise ConfigError(f"--profile {args.profile} is not STEP:COUNT; fix: e.g. --profile 10:3")
        overrides += [f"profile.start_step={step.strip()}", f"profile.steps={count.strip()}"]
    if args.memory_snapshot:
        overrides.append("profile.memory_snapshot=true")
    return with_trackers(load_config(args.config, overrides), mlflow=args.mlflow, wandb=args.wandb)


def _cmd_report(args: argparse.Namespace) -> int:
    from trainers.report import write_run_report

    out = write_run_report(Path(args.run_dir), Path(args.out) if args.out else None)
    print(f"wrote {len(out.plots)} plots and {out.summary_path}")
    return 0


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    from trainers.data.prepare import default_corpus, prepare_corpus
    from trainers.storage import check_location, is_uri, location, upload_folder

    inputs = [Path(p) for p in args.input] if args.input else default_corpus()
    remote = location(args.output) if is_uri(args.output) else None
    if remote is not None:  # prepared in a local folder, then uploaded (manifest last)
        import tempfile

        check_location(remote, "--output", write=True)
        staging = tempfile.TemporaryDirectory(prefix="raytrain-prepare-")
    output = Path(staging.name) / "out" if remote is not None else Path(args.output)
    manifest = prepare_corpus(
        inputs,
        output,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        **({"include": args.include} if args.include else {}),
        max_bytes=args.max_bytes,
        seed=args.seed,
        progress=not args.no_progress,
        text_field=args.text_field,
        workers=args.workers,
    )
    if remote is not None:
        upload_folder(output, remote)
        staging.cleanup()
    splits, source = manifest["splits"], manifest["source"]
    print(
        f"wrote {args.output}: {splits['train']['tokens']:,} train / {splits['val']['tokens']:,} val tokens, "
        f"vocab {manifest['tokenizer']['vocab_size']}, unigram entropy {manifest['unigram_entropy_nats']:.3f} nats; "
        f"{source['tokens_per_s'] or 0:,} tokens/s on {source['workers']} process(es)"
    )
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    """Write a run's newest checkpoint (or the given one) as a Hugging Face folder that
    transformers.AutoModelForCausalLM loads: LlamaForCausalLM, or MixtralForCausalLM for MoE models."""
    from trainers.hf.export import export, parse_size

    result = export(
        args.source,
        args.out_dir,
        dtype=args.dtype,
        max_shard_size=parse_size(args.max_shard_size),
        allow_inexact=args.allow_inexact,
    )
    for note in result.notes:
        print(f"raytrain export: note: {note}", file=sys.stderr)
    print(
        f"wrote {result.out_dir}: {result.architecture}, {result.tensors} tensors in {len(result.files)} "
        f"safetensors file(s), {result.bytes / 2**20:.1f} MiB, from {result.checkpoint}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytrain", description="Sharded, elastic LM training on Ray.")
    parser.add_argument("--version", action="version", version=f"raytrain-ext {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="train one run from a run YAML", description=_cmd_train.__doc__)
    train.add_argument("config", help="run YAML (see examples/)")
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set optimizer.lr=1e-3 (repeatable)",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument(
        "--fit",
        choices=["off", "auto"],
        default=None,
        help="auto: choose micro-batch size, activation checkpointing and loss chunking so the step fits the "
        "device's memory (memory.fit; memory.device_memory sets the budget)",
    )
    train.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join: auto, ray://host:10001 or host:6379 (default: start a local Ray)",
    )
    train.add_argument("--no-ray", action="store_true", help="run in this process only, without Ray")
    train.add_argument(
        "--ray-log-level",
        default="WARNING",  # raytrain_ext.worker.RAY_LOG_LEVEL, not imported here: it imports Ray
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="Ray Train's own console lines (INFO: each report and checkpoint it registers; default WARNING)",
    )
    train.add_argument(
        "--callback",
        dest="callbacks",
        action="append",
        default=[],
        metavar="MODULE:NAME",
        help="a TrainerCallback built in every worker, e.g. mypkg.hooks:Notify(every=10) (repeatable)",
    )
    train.add_argument(
        "--mlflow",
        nargs="?",
        const="",
        default=None,
        metavar="URI",
        help="log to MLflow (tracking.mlflow): a tracking URI, or none for a local store in RUN_DIR/mlflow/",
    )
    train.add_argument(
        "--wandb",
        nargs="?",
        const="",
        default=None,
        metavar="PROJECT",
        help="log to Weights & Biases (tracking.wandb; --set tracking.wandb.mode=offline without network)",
    )
    train.add_argument(
        "--profile",
        default=None,
        metavar="STEP:COUNT",
        help="a torch.profiler Chrome trace per rank of COUNT steps from STEP, in RUN_DIR/profile/",
    )
    train.add_argument(
        "--memory-snapshot",
        action="store_true",
        help="with --profile: a CUDA allocator snapshot of the same steps (CUDA only)",
    )
    train.set_defaults(func=_cmd_train)

    report = sub.add_parser(
        "report",
        help="plots and a one-page summary.md of a run",
        description="Plots of a run's metrics.jsonl (loss, lr, tokens/s and MFU, memory, grad norm, MoE load; "
        "resizes and resumes marked) and a one-page summary.md.",
    )
    report.add_argument("run_dir", help="the run folder (holds metrics.jsonl)")
    report.add_argument("--out", default=None, help="folder to write (default: RUN_DIR/report)")
    report.set_defaults(func=_cmd_report)

    data = sub.add_parser("data", help="data preparation").add_subparsers(dest="data_command", required=True)
    prep = data.add_parser(
        "prepare",
        help="text, JSONL, Parquet, Arrow, CSV/TSV (gzip/zstd too) or a datasets folder to token shards",
    )
    prep.add_argument(
        "--input",
        nargs="+",
        help="files or folders: plain text (a file is a document), .jsonl/.json, .parquet, .arrow, .csv, .tsv "
        "(a record is a document), any of them .gz/.zst, or a `datasets` save_to_disk folder "
        "(default: the Python standard library)",
    )
    prep.add_argument("--output", required=True, help="folder to write (manifest.json + shards)")
    prep.add_argument(
        "--tokenizer",
        default="byte",
        metavar="byte|bpe|HF_DIR",
        help="byte, bpe (trained here), or a Hugging Face model folder whose tokenizer.json to use",
    )
    prep.add_argument("--vocab-size", type=int, default=4096, help="bpe vocabulary size")
    prep.add_argument("--val-fraction", type=float, default=0.05)
    prep.add_argument(
        "--include",
        default=None,
        help="comma-separated globs choosing the files of a folder, a .gz/.zst suffix looked through (default: "
        "*.py,*.txt,*.md,*.rst and every record format above)",
    )
    prep.add_argument("--text-field", default="text", help="the field or column of records that holds the text")
    prep.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: one per core)")
    prep.add_argument("--max-bytes", type=int, default=None, help="stop after this much text")
    prep.add_argument("--seed", type=int, default=0)
    prep.add_argument("--no-progress", action="store_true")
    prep.set_defaults(func=_cmd_data_prepare)

    exp = sub.add_parser("export", help="a checkpoint as a Hugging Face folder", description=_cmd_export.__doc__)
    exp.add_argument("source", metavar="RUN_DIR_OR_CHECKPOINT", help="a run dir (newest checkpoint) or step_* folder")
    exp.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (must not exist, or be empty)")
    exp.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="weights' dtype (fp32: exact)")
    exp.add_argument("--max-shard-size", default="5GB", help="weights in files of at most this (default 5GB)")
    exp.add_argument("--allow-inexact", action="store_true", help="write a model the HF class computes differently")
    exp.set_defaults(func=_cmd_export)
    from raytrain_ext.cli_plan import add_commands as add_plan_commands  # plan, cluster check

    add_plan_commands(sub)
    # Commands of the layers above (`tune`: search/), which this one never imports: each package registers
    # its own under the `raytrain.commands` entry point group (pyproject.toml), read from the install.
    for command in sorted(entry_points(group=COMMANDS), key=lambda e: e.name):
        command.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"raytrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: what was committed stays; the same command continues
        hint = str(e) or "interrupted; run the same command again to continue from the newest checkpoint"
        print(f"raytrain: {hint}", file=sys.stderr)
        return 130
    except (NonFiniteLossError, CheckpointError) as e:
        print(f"raytrain: error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        from raytrain_ext.launcher import RunFailedError

        if not isinstance(e, RunFailedError):
            raise
        print(f"raytrain: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
