"""Cluster files: validation with Ray's own schema and code, and whether a run's layout fits the cluster.

`load_cluster(path)` reads a `ray up` YAML or a KubeRay RayCluster manifest:
- `ray up` YAMLs go through Ray's schema (`ray/autoscaler/ray-schema.json`, rejects unknown keys), then
  `prepare_config` (merges the provider's defaults; the local provider builds its node type) and
  `validate_config`, exactly as `ray up` does;
- a RayCluster manifest goes through Ray's own translation into an autoscaler config
  (`_derive_autoscaling_config_from_ray_cr`, what the autoscaler on KubeRay runs; it ends in
  `validate_config`), after its RayCluster fields are checked against the names in KubeRay's API types.
  The pod templates are standard Kubernetes and are not checked here (`kubectl apply --dry-run=server` is).

`check_run(cluster, cfg)` returns a verdict with one line per check: every world size the run may take
against the layout rules (`trainers.layout`, the one authority `raytrain train` and the workers also ask),
GPUs per node against pp x dp x tp (a tensor-parallel group inside one node), the run's worker counts
(elastic min/max) against the node types' min/max workers, and memory per GPU from the planner
(`trainers.plan`).
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raytrain_ext import ray_compat
from raytrain_ext.worker_logs import quiet_logger
from trainers._base import ConfigError
from trainers.config import RunConfig
from trainers.layout import check_world_sizes
from trainers.plan import format_bytes, parse_bytes, plan_run

__all__ = ["Check", "ClusterSpec", "NodeType", "Verdict", "check_run", "load_cluster", "policy_findings"]

GiB = 2**30
# Memory per GPU as the driver reports it, by Ray's accelerator_type names (ray.util.accelerators).
GPU_MEMORY = {
    "H100": 80 * GiB, "H200": 140 * GiB, "B200": 179 * GiB, "A100": 80 * GiB, "A100-80G": 80 * GiB,
    "A100-40G": 40 * GiB, "L40S": 45 * GiB, "L4": 22 * GiB, "A10G": 22 * GiB, "T4": 15 * GiB, "V100": 16 * GiB,
}

# RayCluster fields, from KubeRay's API types (ray-operator/apis/ray/v1/raycluster_types.go).
_RAYCLUSTER_FIELDS = {
    "": {"apiVersion", "kind", "metadata", "spec", "status"},
    "spec": {"headGroupSpec", "workerGroupSpecs", "rayVersion", "enableInTreeAutoscaling", "autoscalerOptions",
             "headServiceAnnotations", "suspend", "managedBy", "authOptions", "upgradeStrategy",
             "gcsFaultToleranceOptions", "historyServerOptions", "networkPolicy", "tlsOptions"},
    "spec.headGroupSpec": {"template", "headService", "enableIngress", "ingressOptions", "resources", "labels",
                           "rayStartParams", "serviceType"},
    "spec.workerGroupSpecs[]": {"suspend", "groupName", "replicas", "minReplicas", "maxReplicas",
                                "idleTimeoutSeconds", "priority", "resources", "labels", "rayStartParams",
                                "template", "scaleStrategy", "numOfHosts"},
    "spec.authOptions": {"mode", "secretName", "enableK8sTokenAuth"},
    "spec.autoscalerOptions": {"resources", "image", "imagePullPolicy", "securityContext", "idleTimeoutSeconds",
                               "upscalingMode", "version", "env", "envFrom", "volumeMounts", "command", "args"},
}


class ClusterError(ConfigError):
    """A cluster file that Ray (or the RayCluster API) rejects: one line naming the key and the fix."""


@dataclass(frozen=True)
class NodeType:
    name: str
    head: bool
    min_workers: int
    max_workers: int
    gpus: int
    accelerator: str | None  # Ray's accelerator_type (H100, L4, ...) when declared


@dataclass
class ClusterSpec:
    path: Path
    kind: str  # the provider type (aws, gcp, local, ...) or "kuberay"
    max_workers: int
    node_types: list[NodeType]
    config: dict[str, Any]  # the config as Ray's autoscaler reads it (after prepare_config / derivation)

    @property
    def gpu_types(self) -> list[NodeType]:
        return [t for t in self.node_types if t.gpus > 0 and t.max_workers > 0]


# ------------------------------------------------------------------------------------------ loading


def load_cluster(path: str | Path) -> ClusterSpec:
    path = Path(path)
    if not path.is_file():
        raise ClusterError(f"cluster file {path} not found; fix: pass e.g. clusters/aws-gpu.yaml")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ClusterError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ClusterError(f"{path} must hold a mapping (a `ray up` config or a RayCluster manifest)")
    if raw.get("kind") == "RayCluster":
        return _load_kuberay(path, raw)
    return _load_ray_up(path, raw)


def _load_ray_up(path: Path, raw: dict[str, Any]) -> ClusterSpec:
    import click
    import jsonschema

    _schema_check(path, raw)  # names a misspelt key before prepare_config trips over it
    try:
        with quiet_logger("ray", logging.CRITICAL):  # config helpers log INFO, print PANIC, then raise
            prepared = ray_compat.prepare_ray_up_config(copy.deepcopy(raw))
    except jsonschema.ValidationError as e:
        raise ClusterError(_schema_message(path, e)) from None
    except (click.ClickException, ValueError, RuntimeError, KeyError) as e:
        text = e.format_message() if isinstance(e, click.ClickException) else str(e)
        raise ClusterError(f"{path}: Ray rejects it: {_plain(text)}") from None
    kind = prepared["provider"]["type"]
    if kind == "local":  # one node type for the worker hosts; the head is head_ip
        (name, spec), = prepared["available_node_types"].items()
        head = _start_command_resources(prepared.get("head_start_ray_commands", []))
        workers = _start_command_resources(prepared.get("worker_start_ray_commands", []))
        types = [NodeType("head", True, 0, 0, int(head.get("GPU", 0)), _accelerator(head)),
                 _node_type(name, {**spec, "resources": spec.get("resources") or workers}, False)]
    else:
        types = [_node_type(name, spec, name == prepared["head_node_type"])
                 for name, spec in prepared["available_node_types"].items()]
    return ClusterSpec(path, kind, int(prepared.get("max_workers", 0)), types, prepared)


def _schema_check(path: Path, raw: dict[str, Any]) -> None:
    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    error = jsonschema.exceptions.best_match(jsonschema.Draft7Validator(schema).iter_errors(raw))
    if error is not None:
        raise ClusterError(_schema_message(path, error))


def _schema_message(path: Path, e: Any) -> str:
    where = ".".join(str(p) for p in e.absolute_path)
    if e.validator == "additionalProperties" and isinstance(e.instance, dict):
        allowed = set(e.schema.get("properties", {}))
        unknown = sorted(k for k in e.instance if k not in allowed)
        if unknown:
            key = unknown[0]
            return _unknown_key(path, f"{where}.{key}" if where else key, key, sorted(allowed),
                                "Ray's cluster schema")
    return f"{path}: {where or '<top level>'}: {e.message} (Ray's cluster schema)"


def _unknown_key(path: Path, full: str, key: str, valid: list[str], source: str) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    fix = f"did you mean '{close[0]}'?" if close else f"valid keys there: {', '.join(valid)}"
    return f"{path}: unknown key '{full}' ({source}); fix: {fix}"


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text).strip().splitlines()[0]


def _node_type(name: str, spec: dict[str, Any], head: bool) -> NodeType:
    resources = dict(spec.get("resources") or {})
    return NodeType(name, head, int(spec.get("min_workers", 0)), int(spec.get("max_workers", 0)),
                    int(resources.get("GPU", 0)), _accelerator(resources))


def _accelerator(resources: dict[str, Any]) -> str | None:
    return next((k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")), None)


def _start_command_resources(commands: list[str]) -> dict[str, Any]:
    """--num-gpus and --resources of a `ray start` line (the local provider's node type declares none)."""
    out: dict[str, Any] = {}
    for command in commands:
        for part in command.split(";"):
            words = shlex.split(part) if "ray" in part else []
            for i, word in enumerate(words):
                key, _, value = word.partition("=")
                value = value or (words[i + 1] if i + 1 < len(words) else "")
                if key == "--num-gpus":
                    out["GPU"] = int(value)
                elif key == "--resources":
                    out.update(json.loads(value))
    return out


def _load_kuberay(path: Path, raw: dict[str, Any]) -> ClusterSpec:
    if raw.get("apiVersion") != "ray.io/v1":
        raise ClusterError(f"{path}: apiVersion={raw.get('apiVersion')!r}; fix: use ray.io/v1 (KubeRay >= 1.0)")
    _raycluster_fields(path, raw)
    cr = copy.deepcopy(raw)
    cr.setdefault("metadata", {}).setdefault("namespace", "default")
    cr["spec"].setdefault("workerGroupSpecs", [])
    try:
        with quiet_logger("ray", logging.CRITICAL):  # config helpers log INFO, print PANIC, then raise
            derived = ray_compat.kuberay_autoscaling_config(cr)
    except KeyError as e:
        raise ClusterError(f"{path}: missing key {e} in the RayCluster (Ray's KubeRay autoscaler needs it); "
                           f"fix: add it") from None
    except Exception as e:  # noqa: BLE001 - Ray's translation raises plain errors (bad quantities, ...)
        raise ClusterError(f"{path}: Ray's KubeRay autoscaler rejects it: {_plain(str(e))}") from None
    types = [_node_type(name, spec, name == derived["head_node_type"])
             for name, spec in derived["available_node_types"].items()]
    return ClusterSpec(path, "kuberay", int(derived["max_workers"]), types, derived)


def _raycluster_fields(path: Path, raw: dict[str, Any]) -> None:
    spec = raw.get("spec")
    if not isinstance(spec, dict) or "headGroupSpec" not in spec:
        raise ClusterError(f"{path}: a RayCluster needs spec.headGroupSpec; fix: add it")
    nodes: list[tuple[str, str, Any]] = [("", "", raw), ("spec", "spec", spec)]
    nodes += [(f"spec.{k}", f"spec.{k}", spec[k]) for k in ("headGroupSpec", "authOptions", "autoscalerOptions")
              if k in spec]
    nodes += [("spec.workerGroupSpecs[]", f"spec.workerGroupSpecs[{i}]", g)
              for i, g in enumerate(spec.get("workerGroupSpecs") or [])]
    for kind, where, node in nodes:
        if not isinstance(node, dict):
            raise ClusterError(f"{path}: {where} must be a mapping")
        valid = sorted(_RAYCLUSTER_FIELDS[kind])
        for key in node:
            if key not in _RAYCLUSTER_FIELDS[kind]:
                raise ClusterError(_unknown_key(path, f"{where}.{key}" if where else key, key, valid,
                                                "KubeRay RayCluster API"))


# ------------------------------------------------------------------------------------------- policy


# The GCS's health checks of every node, set on the head (its GCS reads them from the environment): a host
# whose raylet refuses connections is declared dead after threshold x period (~10 s), one that does not
# answer (cut off, powered off) after threshold x (timeout + period) (~25 s); Ray's defaults (3 s, 10 s, 5)
# take ~15 s and ~65 s. Lower would risk declaring a busy node dead (a raylet starved for 10 s).
HEALTH_CHECKS = {"RAY_health_check_period_ms": "2000", "RAY_health_check_timeout_ms": "3000",
                 "RAY_health_check_failure_threshold": "5"}

_SECRET_PATTERNS = [
    (re.compile(r"AKIA[0-9A-Z]{16}"), "an AWS access key id"),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"), "a private key"),
    (re.compile(r"(?i)(secret_access_key|password|api_key)\s*[:=]\s*\S+"), "a credential"),
    (re.compile(r"RAY_AUTH_TOKEN\s*=\s*[^\s;$]"), "a literal Ray token"),
]


def policy_findings(path: str | Path) -> list[str]:
    """What our cluster files promise, checked on the text and the config: token authentication, the
    dashboard on loopback or inside the cluster, pinned versions, no secret. Empty when all hold."""
    path = Path(path)
    text = path.read_text()
    raw = yaml.safe_load(text)
    found = [f"{path}: holds {what}" for pattern, what in _SECRET_PATTERNS if pattern.search(text)]
    if raw.get("kind") == "RayCluster":
        return found + _kuberay_policy(path, raw)
    starts = raw.get("head_start_ray_commands", []) + raw.get("worker_start_ray_commands", [])
    if not all("RAY_AUTH_MODE=token" in c for c in starts if "ray start" in c):
        found.append(f"{path}: a `ray start` without RAY_AUTH_MODE=token")
    head = " ".join(raw.get("head_start_ray_commands", []))
    missing = [k for k in HEALTH_CHECKS if f"{k}={HEALTH_CHECKS[k]}" not in head]
    if missing:
        found.append(f"{path}: the head's start command does not export {', '.join(missing)} (a lost host is "
                     f"declared dead in ~10-25 s with them, 15-65 s without)")
    if not re.search(r"--dashboard-host[= ](127\.0\.0\.1|localhost)\b", head):
        found.append(f"{path}: the head's dashboard is not bound to 127.0.0.1")
    setup = " ".join(raw.get("setup_commands", []))
    if "torch==2.13.0" not in setup or "constraints.txt" not in setup:
        found.append(f"{path}: setup_commands do not install torch==2.13.0 and the package under constraints.txt")
    image = (raw.get("docker") or {}).get("image")
    if image is not None and "2.60.0" not in image:
        found.append(f"{path}: docker image {image} is not Ray 2.60.0")
    return found + _storage_policy(path, raw)


def _storage_policy(path: Path, raw: dict[str, Any]) -> list[str]:
    """A cloud cluster keeps runs in its bucket by default (RAYTRAIN_STORAGE in every container) and reaches it
    through each node's instance role / service account, never a key in a file."""
    provider = (raw.get("provider") or {}).get("type")
    scheme = {"aws": "s3://", "gcp": "gs://"}.get(provider)
    if scheme is None:
        return []
    found = []
    options = " ".join((raw.get("docker") or {}).get("run_options", []))
    if f"RAYTRAIN_STORAGE={scheme}" not in options:
        found.append(f"{path}: no default bucket (docker run_options: --env RAYTRAIN_STORAGE={scheme}BUCKET)")
    key = "IamInstanceProfile" if provider == "aws" else "serviceAccounts"
    for name, node_type in (raw.get("available_node_types") or {}).items():
        if key not in (node_type.get("node_config") or {}):
            found.append(f"{path}: node type {name} has no {key} (its way to the bucket without a key)")
    return found


def _kuberay_policy(path: Path, raw: dict[str, Any]) -> list[str]:
    spec, found = raw["spec"], []
    head_env = {e.get("name"): str(e.get("value")) for c in spec["headGroupSpec"]["template"]["spec"]["containers"]
                for e in c.get("env") or []}
    if any(head_env.get(k) != v for k, v in HEALTH_CHECKS.items()):
        found.append(f"{path}: the head container's env does not set {', '.join(HEALTH_CHECKS)}")
    if spec.get("rayVersion") != "2.60.0":
        found.append(f"{path}: spec.rayVersion is not 2.60.0")
    if (spec.get("authOptions") or {}).get("mode", "token" if "authOptions" in spec else None) != "token":
        found.append(f"{path}: spec.authOptions.mode is not token")
    head = spec["headGroupSpec"]
    if head.get("serviceType", "ClusterIP") != "ClusterIP" or head.get("enableIngress"):
        found.append(f"{path}: the head service is exposed outside the cluster (serviceType/enableIngress)")
    groups = [head] + list(spec.get("workerGroupSpecs") or [])
    images = {c.get("image", "") for g in groups for c in g["template"]["spec"]["containers"]}
    if any(not re.search(r":[\w.-]+$", i) or i.endswith(":latest") for i in images):
        found.append(f"{path}: an image without a pinned tag: {sorted(images)}")
    return found


# ---------------------------------------------------------------------------------------- run check


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    message: str


@dataclass
class Verdict:
    cluster: str
    run: str | None
    checks: list[Check] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(c.ok for c in self.checks)

    def add(self, name: str, ok: bool, message: str) -> None:
        self.checks.append(Check(name, ok, message))


def check_run(cluster: ClusterSpec, cfg: RunConfig, run_name: str = "run",
              device_memory: int | str | None = None) -> Verdict:
    """Does the run's layout fit the cluster? One check per line; `fits` when all pass.

    Ray places a run's workers (one GPU each) on nodes the autoscaler launches; an elastic run takes as
    many workers as the free GPUs allow, so with whole nodes of a type (g GPUs, up to max_workers of
    them) its sizes are k * g clamped to [min_workers, max_workers]: those are the sizes checked."""
    verdict = Verdict(str(cluster.path), run_name)
    scaling = getattr(cfg, "scaling", None)
    sizes = list(scaling.sizes) if scaling is not None else [1]
    lo, hi = min(sizes), max(sizes)
    pp, tp = cfg.parallel.pp, cfg.parallel.tp
    if not bool(getattr(scaling, "use_gpu", False)):
        verdict.add("accelerator", False, "scaling.use_gpu is false: the run would train on CPUs of a GPU cluster; "
                    "fix: --set scaling.use_gpu=true")
        return verdict
    types = cluster.gpu_types
    if not types:
        verdict.add("gpus", False, f"no node type of {cluster.path} declares GPUs; fix: add resources: {{GPU: N}} "
                    f"to the GPU node types (or --num-gpus to the local provider's start commands)")
        return verdict
    capacity = sum(t.gpus * t.max_workers for t in types)
    verdict.add("cluster size", lo <= capacity,
                f"{_world_text(lo, pp, tp)} {'is within' if lo <= capacity else 'is larger than'} the cluster's maximum "
                f"of {capacity} GPUs ({_capacity_text(types)})"
                + ("" if lo <= capacity else "; fix: lower the run's workers or raise max_workers of a GPU type")
                + (f"; it never grows past {capacity} of its max_workers={hi}" if lo <= capacity < hi else ""))
    reachable = {t.name: _reachable(t, lo, hi) for t in types}
    _check_layouts(verdict, cfg, sizes)
    if tp > 1:
        _check_tensor_parallel(verdict, [t for t in types if reachable[t.name]] or types, tp)
    hosts = _check_nodes(verdict, types, reachable, pp, tp)
    _check_elastic(verdict, types, lo, hi)
    if hosts and all(c.ok for c in verdict.checks if c.name in ("layout", "tp within a node")):
        _check_memory(verdict, cfg, hosts, min(min(reachable[t.name]) for t in hosts), device_memory)
    return verdict


def _reachable(t: NodeType, lo: int, hi: int) -> list[int]:
    """World sizes the run takes on whole nodes of type t."""
    return sorted({min(k * t.gpus, hi) for k in range(1, t.max_workers + 1) if min(k * t.gpus, hi) >= lo})


def _world_text(size: int, pp: int, tp: int = 1) -> str:
    dp = size // (pp * tp) if size % (pp * tp) == 0 else "?"
    return f"world size {size} (pp={pp} x dp={dp}" + (f" x tp={tp})" if tp > 1 else ")")


def _capacity_text(types: list[NodeType]) -> str:
    return ", ".join(f"{t.name}: {t.max_workers} x {t.gpus}" for t in types)


def _check_layouts(verdict: Verdict, cfg: RunConfig, sizes: list[int]) -> None:
    """Every size the run may take must be a valid layout (pp and tp divide the world, ep the data-parallel
    size, the global batch and the pipeline's microbatches divide): Ray may pick any of them when other
    jobs hold some GPUs. `trainers.layout.check_world_sizes` decides, as for `raytrain train`, so the line
    is the one `raytrain train` and the workers would give."""
    try:
        check_world_sizes(cfg, sizes)
    except ConfigError as e:
        verdict.add("layout", False, str(e))
        return
    verdict.add("layout", True, f"world sizes {_sizes_text(sizes)} are valid layouts (pp, tp, ep, global batch)")


def _check_tensor_parallel(verdict: Verdict, types: list[NodeType], tp: int) -> None:
    """A tensor-parallel group (tp consecutive ranks: `trainers.layout`) runs collectives in every block,
    so it must sit inside one node: tp must divide the GPUs of every GPU node type the run may land on
    (those whose whole nodes reach one of its world sizes)."""
    bad = [t for t in types if t.gpus % tp]
    if bad:
        where = ", ".join(f"{t.name} ({t.gpus} GPU{'s' if t.gpus != 1 else ''}/node)" for t in bad)
        fits = sorted({d for d in range(1, max(t.gpus for t in types) + 1) if all(t.gpus % d == 0 for t in types)})
        verdict.add("tp within a node", False, f"parallel.tp={tp} does not divide the GPUs per node of {where}: a "
                    f"tensor-parallel group would span nodes; fix: use parallel.tp in {fits} or nodes with a "
                    f"multiple of {tp} GPUs")
        return
    verdict.add("tp within a node", True, f"parallel.tp={tp} groups fit in one node of "
                + ", ".join(f"{t.name} ({t.gpus} GPUs)" for t in types))


def _sizes_text(sizes: list[int]) -> str:
    return str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}..{sizes[-1]}"


def _list_text(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes[:8])) + (", ..." if len(sizes) > 8 else "")


def _node_fit(t: NodeType, size: int) -> str | None:
    """Why `size` workers do not sit on nodes of `t`, or None when they fill whole nodes (or fit in one)."""
    if size > t.gpus and size % t.gpus:
        return f"{size} is not a multiple of its {t.gpus} GPUs per node (a node is left part-empty)"
    return None


def _straddling(t: NodeType, size: int, pp: int) -> str | None:
    """A pipeline stage's data-parallel group that shares a node with another stage's: it works, but the
    stage's all-gathers and the pipeline's sends cross the same network links."""
    dp = size // pp
    if pp > 1 and size > t.gpus and dp % t.gpus and t.gpus % dp:
        return f"at {size}, pipeline stages of {dp} GPUs share {t.gpus}-GPU nodes"
    return None


def _check_nodes(verdict: Verdict, types: list[NodeType], reachable: dict[str, list[int]],
                 pp: int, tp: int = 1) -> list[NodeType]:
    """GPUs per node against pp x dp x tp. Returns the node types that can host the run."""
    hosts, why = [], []
    for t in types:
        if not reachable[t.name]:
            why.append(f"{t.name}: at most {t.gpus * t.max_workers} GPUs")
            continue
        problems = [r for r in (_node_fit(t, s) for s in reachable[t.name]) if r]
        if problems:
            why.append(f"{t.name}: {problems[0]}")
        else:
            hosts.append(t)
    if hosts:
        notes = [n for t in hosts for n in (_straddling(t, s, pp) for s in reachable[t.name]) if n]
        verdict.add("gpus per node", True, "; ".join(
            f"{t.name} ({t.gpus} GPUs/node): world sizes {_list_text(reachable[t.name])}" for t in hosts)
            + (f" (note: {notes[0]})" if notes else ""))
    else:
        fits = sorted({t.gpus * k for t in types for k in range(1, t.max_workers + 1) if t.gpus * k % (pp * tp) == 0})
        verdict.add("gpus per node", False, f"no GPU node type hosts the run: {'; '.join(why)}; fix: use a "
                    f"world size (pp x dp x tp) in {_list_text(fits)}")
    return hosts


def _check_elastic(verdict: Verdict, types: list[NodeType], lo: int, hi: int) -> None:
    """The run's min/max workers against the GPUs of the node types' min_workers and max_workers."""
    always_on = sum(t.gpus * t.min_workers for t in types)
    capacity = sum(t.gpus * t.max_workers for t in types)
    if lo > capacity:
        verdict.add("elastic range", False, f"workers {lo}..{hi}: min_workers={lo} can never be placed (the node "
                    f"types give at most {capacity} GPUs); fix: lower the run's min_workers")
        return
    start = (f"starts at once on the {always_on} GPUs of the types' min_workers" if lo <= always_on else
             f"starts once the autoscaler has launched nodes for {lo - always_on} more GPUs "
             f"(the types' min_workers keep {always_on} up)")
    verdict.add("elastic range", True, f"workers {lo}..{hi} against the node types' {always_on}..{capacity} "
                f"GPUs: {start}")


def _check_memory(verdict: Verdict, cfg: RunConfig, hosts: list[NodeType], size: int,
                  device_memory: int | str | None) -> None:
    """The planner at the smallest world size (largest shards per rank), on the smallest hosting GPU."""
    if device_memory is not None:
        memory, source = parse_bytes(device_memory), "--device-memory"
    else:
        known = [(GPU_MEMORY[t.accelerator], t.accelerator) for t in hosts if t.accelerator in GPU_MEMORY]
        if not known:
            verdict.add("memory per GPU", False, "no hosting node type declares a known accelerator_type; fix: "
                        "pass --device-memory 80GiB or declare resources {\"accelerator_type:H100\": 1}")
            return
        memory, source = min(known)
    try:
        result = plan_run(cfg, size, memory, gpus_per_node=math.gcd(*(t.gpus for t in hosts)))
    except ConfigError as e:
        verdict.add("memory per GPU", False, str(e))
        return
    peak, usable = format_bytes(result.plan.peak_bytes), format_bytes(result.usable_bytes)
    if result.fits:
        verdict.add("memory per GPU", True, f"{peak} per rank at world size {size} fits {source} "
                    f"({format_bytes(memory)}; {usable} usable)")
        return
    change = result.change
    fix = (f"fix: --set {' --set '.join(f'{k}={v}' for k, v in change['set'].items())} ({change['why']}: "
           f"{format_bytes(change['peak_bytes'])})" if change else "no change found that fits")
    verdict.add("memory per GPU", False, f"{peak} per rank at world size {size} does not fit {source} "
                f"({usable} usable); {fix}")
