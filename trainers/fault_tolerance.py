"""Per-step fault tolerance (`scaling.fault_tolerance: per_step`): the rules a run must meet, checked before any
worker starts, and the numbers the replica groups run on.

The workers form torchft replica groups of `scaling.workers_per_group` (default 1): a group of one worker holds
the whole model (`parallel.engine: ddp`); a group of several shards it with FSDP2 over its own process group
(`parallel.engine: fsdp`), as a run of that many workers would. torchft averages the groups' gradients every step
(each worker's shards with the same worker of every other group) and commits the step only where every live group
says so (`Manager.should_commit`). A lost worker takes its group down, and Ray replaces the group whole (Ray 2.60
ranks groups of one: `raytrain_ext.ray_compat.replica_groups_of` gives its worker group the run's size). What that
means for a run:

- **Batch.** The global batch is kept whatever the number of live groups: step `t` trains samples
  `[tB, (t+1)B)` of the run's order, split evenly over the workers of the groups in that step's quorum, each
  taking more micro-batches when there are fewer of them. So `train.global_batch_size` must split over the
  workers of any count of groups from 1 to all (`check_fault_tolerance`).
- **Data order.** A step that does not commit (a group was lost inside it) is trained again, with the same
  samples, by the groups of the next quorum: no sample is skipped or trained twice in a committed step.
- **Healing.** A group Ray starts in place of a lost one joins the quorum before it reads a checkpoint; when
  the others are ahead it takes weights, optimizer state, step, RNG and loss scale from a live group's memory
  (torchft's transport over its process group; each worker its shards, from the same rank), else (the whole run starting) every group restores the run's
  newest committed checkpoint, as a resumed run does.
- **Records.** The live group with the lowest index writes metrics.jsonl (its first worker: each committed step
  once, with `replicas`, the groups that trained it) and the checkpoints (all its workers: a sharded save); disk checkpoints stay the record of the run.
"""

from __future__ import annotations

import http.client
import importlib.util
import os
import re
import urllib.request

from trainers._base import ConfigError

__all__ = [
    "FT_EXTRA",
    "GROUP_ENV",
    "HOST_ENV",
    "LIGHTHOUSE",
    "LIGHTHOUSE_ENV",
    "SUPPORTED_ENGINES",
    "check_fault_tolerance",
    "group_world_sizes",
    "per_step",
    "refuse_without_ray",
    "silent_groups",
]

FT_EXTRA = "pip install 'raytrain-ext[ft]'"
GROUP_ENV = "RAYTRAIN_REPLICA_GROUP"  # this worker's replica group index (set by the Ray worker)
HOST_ENV = "RAYTRAIN_NODE_ADDRESS"  # the address its peers reach it at (Ray's node address), for torchft

# torchft's lighthouse (Ray starts it on the driver's node). A group that stops heartbeating for
# `heartbeat_timeout_ms` is out of the next quorum; a quorum forms once every live group has joined, or
# `join_timeout_ms` after the first did (a group still starting does not hold the others up for longer).
# A straggler (a busy host) is left out of a step after `join_timeout_ms` (1 s), and heals at the next.
# A live group held in a failed step's collective by another live group holds every quorum (more than half the
# heartbeating groups must join): `ReplicaGroupEngine.forward_backward` closes a failed group's side at once.
LIGHTHOUSE = {"min_replicas": 1, "join_timeout_ms": 1000, "heartbeat_timeout_ms": 1500, "quorum_tick_ms": 50}
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's: the lighthouse's address (Ray sets it in every worker)
TIMEOUT_S = 30.0  # torchft's quorums, commit votes and state transfers (a step's all-reduce: scaling.allreduce_timeout_s)


SUPPORTED_ENGINES = ("ddp", "fsdp")  # inside a replica group: the whole model, or FSDP2 over the group's workers


def per_step(scaling) -> bool:
    """Whether a run's `scaling` section asks for per-step fault tolerance (torchft replica groups)."""
    return scaling.fault_tolerance == "per_step"


def check_fault_tolerance(cfg) -> None:
    """The rules of a per-step fault-tolerant run, each refused in one line naming the field and the fix."""
    s = cfg.scaling
    if not per_step(s):
        if s.workers_per_group != 1:
            raise ConfigError(
                f"scaling.workers_per_group={s.workers_per_group} without scaling.fault_tolerance=per_step: only a "
                f"per-step fault-tolerant run has replica groups; fix: scaling.fault_tolerance=per_step, or drop "
                f"scaling.workers_per_group"
            )
        return
    key = "scaling.fault_tolerance=per_step"
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(f"{key} needs torchft, which is not installed; fix: {FT_EXTRA}")
    p, k = cfg.parallel, s.workers_per_group
    if p.engine not in SUPPORTED_ENGINES or max(p.pp, p.tp, p.ep) > 1:
        raise ConfigError(
            f"parallel.engine={p.engine} (pp {p.pp}, tp {p.tp}, ep {p.ep}) with {key}: a replica group holds the "
            f"whole model in one worker (ddp) or sharded over its workers by FSDP (fsdp); fix: parallel.engine=ddp "
            f"or fsdp with pp, tp and ep 1, or scaling.fault_tolerance=none"
        )
    if p.engine == "ddp" and k > 1:
        raise ConfigError(
            f"scaling.workers_per_group={k} with parallel.engine=ddp and {key}: {k} whole copies of the model in "
            f"one group train as {k} groups of one would, but a lost worker takes all {k} down; fix: "
            f"parallel.engine=fsdp to shard the model over a group's workers, or scaling.workers_per_group=1"
        )
    if s.elastic:
        raise ConfigError(
            f"scaling.min_workers/max_workers with {key}: a lost replica group is replaced in place, at the same "
            f"size; fix: scaling.num_workers=N, or scaling.fault_tolerance=none for an elastic run"
        )
    workers = s.sizes.start
    if workers % k:
        raise ConfigError(
            f"scaling.num_workers={workers} with scaling.workers_per_group={k}: the workers must fill whole replica "
            f"groups; fix: scaling.num_workers={max(2, workers // k) * k}"
        )
    groups = workers // k
    if groups < 2:
        raise ConfigError(
            f"scaling.num_workers={workers} with {key} (groups of {k}): one replica group has no peer to train on "
            f"through its loss or to heal from; fix: scaling.num_workers={2 * k} or more"
        )
    t = cfg.train
    for live in range(1, groups + 1):
        if t.global_batch_size % (t.micro_batch_size * live * k):
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} with {key}: the global batch is kept when groups "
                f"are lost, so it must split into micro-batches of {t.micro_batch_size} over the {k} worker(s) of "
                f"any {live} of the {groups} groups; fix: a global batch that is a multiple of "
                f"{t.micro_batch_size * k * _lcm(groups)}"
            )
    if cfg.tracking.mlflow is not None or cfg.tracking.wandb is not None:
        raise ConfigError(
            f"tracking with {key}: the writer of a run's records moves between groups as they are lost, and a "
            f"tracker's run lives in one process; fix: drop tracking.mlflow/wandb (metrics.jsonl has every step), "
            f"or scaling.fault_tolerance=none"
        )
    if "://" in str(cfg.out_dir):
        raise ConfigError(
            f"run_dir={cfg.out_dir} with {key}: the groups append to one metrics.jsonl, which needs a file system; "
            f"fix: a run_dir on a disk every node mounts (NFS, EFS), or scaling.fault_tolerance=none"
        )


def refuse_without_ray(cfg, how: str) -> None:
    """`--no-ray` and torchrun have no replica groups to lose."""
    if per_step(cfg.scaling):
        raise ConfigError(
            f"scaling.fault_tolerance=per_step runs replica groups on Ray Train, not {how}; fix: `raytrain train` "
            f"on Ray, or --set scaling.fault_tolerance=none"
        )


def replica_group() -> int:
    return int(os.environ.get(GROUP_ENV, "0"))


def group_world_sizes(scaling) -> range:
    """The process-group sizes a run's workers may see (from its `scaling` section): a per-step run's are its
    replica groups'."""
    return range(scaling.workers_per_group, scaling.workers_per_group + 1) if per_step(scaling) else scaling.sizes


def _lcm(n: int) -> int:
    import math

    out = 1
    for k in range(2, n + 1):
        out = out * k // math.gcd(out, k)
    return out


# torchft 0.2.0's lighthouse serves a status page beside its gRPC (src/templates/status.html): the previous
# quorum's members, each as `<b>REPLICA_ID</b>`, then under `<h2>Heartbeats</h2>` each replica's last heartbeat
# as "REPLICA_ID: seen 1.846684447s ago" (a Rust Duration: s, ms, µs or ns). It has no other way to be asked.
_MEMBER = re.compile(r"<b>([^<]+)</b>")
_SEEN = re.compile(r"^\s*(\S+): seen ([\d.]+)(ns|µs|ms|s) ago", re.MULTILINE)
_SECONDS = {"ns": 1e-9, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the lighthouse is in the cluster


def silent_groups(address: str, timeout_s: float = 0.5) -> list[str] | None:
    """The members of the lighthouse's quorum (replica ids) it has not heard from for longer than its
    `heartbeat_timeout_ms`: out of the next quorum. None when the lighthouse does not answer (this host may be the
    one cut off, or it has no address)."""
    if not address:
        return None
    try:
        with _DIRECT.open(address.rstrip("/") + "/status", timeout=timeout_s) as answer:
            page = answer.read().decode()
    except (OSError, http.client.HTTPException):
        return None
    quorum, _, beats = page.partition("<h2>Heartbeats</h2>")
    seen = {replica: float(n) * _SECONDS[unit] for replica, n, unit in _SEEN.findall(beats)}
    limit = LIGHTHOUSE["heartbeat_timeout_ms"] / 1000
    return [m for m in _MEMBER.findall(quorum) if seen.get(m, 0.0) > limit]
