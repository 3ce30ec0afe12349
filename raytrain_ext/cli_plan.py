"""`raytrain plan` and `raytrain cluster check`: memory and layout, before any worker starts.

    raytrain plan RUN.yaml --world-size N [--device-memory 80GiB] [--gpus-per-node 8] [--json] [--set k=v ...]
    raytrain cluster check CLUSTER.yaml [--run RUN.yaml] [--device-memory 80GiB] [--set k=v ...]

`plan` exits 0 with its verdict in the output; `cluster check` exits 1 when the run does not fit. Bad input
exits 2 with one line (the CLI's ConfigError handling).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trainers._base import ConfigError
from trainers.config import load_config
from trainers.plan import GPUS_PER_NODE, KINDS, USABLE_FRACTION, RunPlan, format_bytes, parse_bytes, plan_run

__all__ = ["add_commands"]


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add `plan` and `cluster check` to the `raytrain` parser's subcommands."""
    plan = sub.add_parser("plan", help="memory per rank of a run, and whether it fits a GPU",
                          description=_cmd_plan.__doc__)
    plan.add_argument("config", help="run YAML")
    plan.add_argument("--world-size", type=int, required=True, help="ranks (processes / GPUs) of the run")
    plan.add_argument("--device-memory", default="80GiB", help="memory of one device (default 80GiB, an H100)")
    plan.add_argument("--device-type", choices=("cuda", "cpu"), default="cuda",
                      help="the optimizer step's temporaries follow torch's foreach (cuda) or per-tensor (cpu) code")
    plan.add_argument("--gpus-per-node", type=int, default=GPUS_PER_NODE,
                      help=f"GPUs of a node (default {GPUS_PER_NODE}): a suggested parallel.tp divides it, so a "
                      f"tensor-parallel group stays inside a node")
    plan.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    _overrides(plan)
    plan.set_defaults(func=_cmd_plan)

    cluster = sub.add_parser("cluster", help="cluster files (ray up / KubeRay)")
    commands = cluster.add_subparsers(dest="cluster_command", required=True, metavar="COMMAND")
    check = commands.add_parser("check", help="validate a cluster file with Ray's own validator; with --run, "
                                "check that the run's layout and memory fit it", description=_cmd_check.__doc__)
    check.add_argument("cluster", help="a `ray up` YAML or a KubeRay RayCluster manifest (clusters/)")
    check.add_argument("--run", help="run YAML whose layout must fit the cluster")
    check.add_argument("--device-memory", default=None,
                       help="memory per GPU (default: from the node types' accelerator_type)")
    _overrides(check)
    check.set_defaults(func=_cmd_check)


def _overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a run config key, e.g. --set train.micro_batch_size=4 (repeatable)")


# --------------------------------------------------------------------------------------------- plan


def _cmd_plan(args: argparse.Namespace) -> int:
    """Peak memory per rank (parameters, gradients, optimizer state, activations, buffers), a verdict
    against the device's memory, and the cheapest change that makes the run fit. Exit 0 when the run
    fits, 1 when it does not, 2 on bad input."""
    memory = parse_bytes(args.device_memory, "--device-memory")
    if args.world_size < 1:
        raise ConfigError(f"--world-size {args.world_size} must be at least 1; fix: the number of ranks, e.g. 8")
    if args.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node {args.gpus_per_node} must be at least 1; fix: the GPUs of one node, e.g. 8")
    cfg = load_config(args.config, args.overrides)
    result = plan_run(cfg, args.world_size, memory, args.device_type, gpus_per_node=args.gpus_per_node)
    if args.json:
        print(json.dumps({"config": str(args.config), "overrides": args.overrides, **result.to_dict()}, indent=1))
    else:
        print("\n".join(plan_lines(result, str(args.config))))
    return 0 if result.fits else 1  # as `cluster check --run`: a script can act on the verdict


def plan_lines(result: RunPlan, name: str) -> list[str]:
    plan, lay = result.plan, result.plan.layout
    acts = plan.activations
    per_block = max(acts["per_block_bytes"].values(), default=0)
    lines = [
        f"plan: {name} on {plan.world_size} rank{'s' if plan.world_size > 1 else ''} (pp={lay['pp']} x dp={lay['dp']}"
        + (f" x tp={lay['tp']}" if lay["tp"] > 1 else "") + f", ep={lay['ep']}), "
        f"{acts['micro_batch_tokens']:,} tokens per micro-batch, accumulation {lay['accumulation']}",
        f"peak per rank: {format_bytes(plan.peak_bytes)} at {plan.moment}"
        + (f" (pipeline rank {plan.rank})" if lay["pp"] > 1 else ""),
    ]
    details = {
        "activations": f"{acts['blocks']} blocks x {format_bytes(per_block)} per micro-batch; "
                       f"{acts['checkpointed_blocks']} checkpointed (keeping "
                       f"{format_bytes(acts['checkpointed_block_bytes'])} each); "
                       f"{acts['in_flight_microbatches']:g} micro-batch(es) in flight",
        "buffers": ", ".join(f"{k} {format_bytes(v)}" for k, v in plan.buffers.items()),
    }
    for kind in KINDS:
        lines.append(f"  {kind:<12} {format_bytes(plan.breakdown[kind]):>11}   {details.get(kind, '')}".rstrip())
    if plan.host_bytes:
        lines.append(f"  {'host (CPU)':<12} {format_bytes(sum(plan.host_bytes.values())):>11}   offloaded: "
                     + ", ".join(f"{k} {format_bytes(v)}" for k, v in plan.host_bytes.items()))
    if plan.moe:
        lines.append(f"  MoE: {plan.moe['experts_per_rank']} experts per rank, experts are "
                     f"{plan.moe['expert_share_of_parameters']:.0%} of the parameters")
    memory = f"{format_bytes(result.device_memory_bytes)} ({format_bytes(result.usable_bytes)} usable, " \
             f"{USABLE_FRACTION:.0%})"
    if result.fits:
        return lines + [f"verdict: fits in {memory}"]
    lines.append(f"verdict: does NOT fit in {memory}")
    if result.change:
        sets = " ".join(f"--set {k}={v}" for k, v in result.change["set"].items())
        lines.append(f"cheapest change that fits: {sets} -> {format_bytes(result.change['peak_bytes'])} "
                     f"({result.change['why']})")
    else:
        lines.append("no change found that fits; tried: " + "; ".join(
            f"{c['why']} -> {format_bytes(c['peak_bytes'])}" for c in result.candidates))
    return lines


# -------------------------------------------------------------------------------------------- check


def _cmd_check(args: argparse.Namespace) -> int:
    """Validate a cluster file with Ray's own schema and validator; with --run, check that the run fits:
    every world size a valid layout (the rules `raytrain train` and the workers apply), a tensor-parallel
    group inside a node, GPUs per node against pp x dp x tp, elastic min/max against the node types, memory
    per GPU (planner)."""
    from raytrain_ext.cluster import check_run, load_cluster, policy_findings

    memory = None if args.device_memory is None else parse_bytes(args.device_memory, "--device-memory")
    cluster = load_cluster(args.cluster)
    types = ", ".join(f"{t.name} ({t.gpus} GPU{'s' if t.gpus != 1 else ''}"
                      f"{' ' + t.accelerator if t.accelerator else ''}, {t.min_workers}..{t.max_workers} nodes"
                      f"{', head' if t.head else ''})" for t in cluster.node_types)
    print(f"{args.cluster}: valid ({cluster.kind}; Ray's validator): {types}")
    for finding in policy_findings(args.cluster):
        print(f"warning: {finding}")
    if not args.run:
        return 0
    cfg = load_config(args.run, args.overrides)
    verdict = check_run(cluster, cfg, Path(args.run).name, memory)
    for c in verdict.checks:
        print(f"  [{'ok' if c.ok else 'NO'}] {c.name}: {c.message}")
    print(f"verdict: {args.run} {'fits' if verdict.fits else 'does NOT fit'} {args.cluster}")
    return 0 if verdict.fits else 1
