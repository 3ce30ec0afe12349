"""Per-rank model-state bytes: where each engine keeps parameters, gradients and optimizer state, and the
ZeRO paper's formula for them.

`held_tensors(engine)` names the tensors an engine holds, by category, from the places its source keeps
them (torch 2.13 FSDP2/DDP, DeepSpeed 0.19.8); `count` sums their storages (a storage shared by several
tensors, e.g. DeepSpeed's flat buffers and their per-parameter views, counts once, in the first category
that holds it). `unaccounted` walks the engine's whole object graph for tensors the categories missed, so
nothing is silently left out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

__all__ = [
    "CATEGORIES",
    "MODEL_STATE",
    "count",
    "ddp_bucket_bytes",
    "deepspeed_layout",
    "held_tensors",
    "unaccounted",
    "zero_formula",
]

# In dedup order. "master" = fp32 master weights kept by the optimizer apart from the model's weights;
# the paper counts them in the optimizer state (its K). "comm_buffers" are not model state.
CATEGORIES = ("params", "grads", "master", "optim_states", "comm_buffers")
MODEL_STATE = ("params", "grads", "master", "optim_states")

Held = dict[str, list[tuple[str, torch.Tensor]]]


def zero_formula(n_params: int, world: int, stage: int, mixed_precision: bool) -> dict[str, float]:
    """Model-state bytes per rank from the ZeRO paper (Rajbhandari et al. 2020, section 5.1, figure 1):
    (2 + 2 + K) * P with K = 12 for mixed-precision Adam (fp32 master, momentum, variance); the pure fp32
    form is 4 + 4 + K with K = 8 (no master copy needed). Stage 1 divides the optimizer state by the world
    size N, stage 2 also the gradients, stage 3 also the parameters; stage 0 is plain data parallelism."""
    if stage not in (0, 1, 2, 3) or world < 1 or n_params < 0:
        raise ValueError(f"stage {stage}, world {world}, n_params {n_params}: need stage 0-3, world >= 1")
    weights, grads, k = (2, 2, 12) if mixed_precision else (4, 4, 8)

    def per_rank(bytes_per_param: int, sharded_from: int) -> float:
        total = bytes_per_param * n_params
        return total / world if stage >= sharded_from else float(total)

    return {"params": per_rank(weights, 3), "grads": per_rank(grads, 2), "optimizer": per_rank(k, 1)}


# ---------------------------------------------------------------------------------------------- census


def held_tensors(engine: Any) -> Held:
    """The tensors `engine` (a trainers.parallel Engine) holds now, by category."""
    held: Held = {c: [] for c in CATEGORIES}
    if engine.name == "deepspeed":
        _deepspeed(engine.ds, held)
    else:
        _native(engine.model, engine.optimizer, held)
    return held


def count(held: Held) -> tuple[dict[str, int], set[int]]:
    """Bytes per category (each storage once) and the storages counted (by data pointer)."""
    seen: set[int] = set()
    out = {}
    for category in CATEGORIES:
        out[category] = 0
        for _, t in held[category]:
            key, size = _storage(t)
            if size and key not in seen:
                seen.add(key)
                out[category] += size
    return out, seen


def unaccounted(engine: Any, counted: set[int], depth: int = 8) -> list[tuple[str, int]]:
    """Tensor storages reachable from the engine's objects that no category holds: (path, bytes)."""
    found: dict[int, tuple[str, int]] = {}
    roots: list[tuple[str, Any]] = [("model", engine.model), ("optimizer", engine.optimizer)]
    roots += [(f"fsdp_state[{i}]", s) for i, s in enumerate(_fsdp_states(engine.model))]
    seen: set[int] = set()
    for name, root in roots:
        _walk(root, name, found, seen, depth)
    return sorted(((p, n) for k, (p, n) in found.items() if k not in counted), key=lambda x: -x[1])


def _storage(t: torch.Tensor) -> tuple[int, int]:
    if isinstance(t, DTensor):
        t = t.to_local()
    if t.device.type == "meta":
        return 0, 0
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _walk(obj: Any, path: str, found: dict, seen: set[int], depth: int) -> None:
    if isinstance(obj, torch.Tensor):
        key, size = _storage(obj)
        if size and key not in found:
            found[key] = (path, size)
        for attr in ("grad", "ds_tensor", "grad_accum"):  # tensors hanging off a parameter
            t = getattr(obj, attr, None)
            if isinstance(t, torch.Tensor):
                _walk(t, f"{path}.{attr}", found, seen, depth)
        return
    if depth == 0 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        items: Iterable = ((f"[{_key(k)}]", v) for k, v in list(obj.items()))
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = ((f"[{i}]", v) for i, v in enumerate(obj))
    elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in (
        "torch",
        "deepspeed",
        "trainers",
    ):
        items = ((f".{k}", v) for k, v in list(vars(obj).items()))
    else:
        return
    for suffix, value in items:
        _walk(value, path + suffix, found, seen, depth - 1)


def _key(k: Any) -> str:
    return str(k) if isinstance(k, (str, int)) else type(k).__name__


# -------------------------------------------------------------------------------------- native engines


def _native(model: nn.Module, optimizer: torch.optim.Optimizer, held: Held) -> None:
    """DDP: whole tensors. FSDP2: DTensor parameters, gradients and Adam state whose local shards are the
    rank's bytes, plus the unsharded copies it holds between all-gather and reshard (and, while gradient
    sync is off for accumulation, the unsharded gradients it accumulates into)."""
    for name, p in model.named_parameters():
        held["params"].append((name, p))
        if p.grad is not None:
            held["grads"].append((f"{name}.grad", p.grad))
    for name, fp in _fsdp_params(model):
        # While unsharded, the module holds the unsharded parameter and FSDP2 keeps the shard aside.
        held["params"].append((f"{name} (shard)", fp.sharded_param))
        unsharded = getattr(fp, "_unsharded_param", None)  # storage resized to 0 when resharded
        if unsharded is not None:
            held["params"].append((f"{name} (unsharded)", unsharded))
            if unsharded.grad is not None:
                held["grads"].append((f"{name} (unsharded).grad", unsharded.grad))
        for i, t in enumerate(getattr(fp, "all_gather_outputs", None) or []):
            held["params"].append((f"{name}.all_gather_outputs[{i}]", t))
        if getattr(fp, "unsharded_accumulated_grad", None) is not None:
            held["grads"].append((f"{name}.unsharded_accumulated_grad", fp.unsharded_accumulated_grad))
    _optimizer_state(optimizer, held)


def _fsdp_states(model: nn.Module) -> list[Any]:
    return [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]


def _fsdp_params(model: nn.Module) -> Iterator[tuple[str, Any]]:
    for state in _fsdp_states(model):
        # torch 2.13 keeps a list of groups per state; 2.11 and 2.12 one group or None
        groups = getattr(state, "_fsdp_param_groups", None)
        groups = groups if groups is not None else [g for g in [state._fsdp_param_group] if g is not None]
        for group in groups:
            for fp in group.fsdp_params:
                yield f"{group._module_fqn or 'root'}.{fp._param_fqn}", fp


def _optimizer_state(optimizer: torch.optim.Optimizer, held: Held) -> None:
    for i, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                held["optim_states"].append((f"optimizer.state[{i}][{key}]", value))


def ddp_bucket_bytes(model: nn.Module) -> int:
    """DDP's reducer keeps its all-reduce buckets (a second copy of the gradients unless
    gradient_as_bucket_view) in C++, out of Python's sight; its logging data has their sizes."""
    sizes = model._get_ddp_logging_data().get("bucket_sizes", "")
    return sum(int(n) for n in re.findall(r"\d+", str(sizes)))


# ------------------------------------------------------------------------------------------- deepspeed


def _deepspeed(ds: Any, held: Held) -> None:
    """DeepSpeed 0.19.8 (runtime/zero/stage_1_and_2.py, stage3.py): the model's weights (stage 1-2: views
    into the flat `bit16_groups_flat`; stage 3: the partition `ds_tensor`, plus the whole `data` of
    persistent and currently gathered parameters), the fp32 master partition, gradient partitions, the
    torch optimizer's state, and the reduce buckets."""
    zero = ds.optimizer
    for name, p in ds.module.named_parameters():
        held["params"].append((name, p.data))
        if getattr(p, "ds_tensor", None) is not None:
            held["params"].append((f"{name}.ds_tensor", p.ds_tensor))
        for attr in ("grad", "grad_accum"):  # grad_accum: stage 1's accumulator when it differs in dtype
            if getattr(p, attr, None) is not None:
                held["grads"].append((f"{name}.{attr}", getattr(p, attr)))
    stage = int(ds.zero_optimization_stage())
    if stage in (1, 2):
        held["params"] += _named("bit16_groups_flat", zero.bit16_groups_flat)
        master = zero.single_partition_of_fp32_groups
        for i, grads in zero.averaged_gradients.items():
            held["grads"] += _named(f"averaged_gradients[{i}]", _as_list(grads))
        for i, grads in zero.all_grad_tensors.items():  # accumulated across micro-batches
            held["grads"] += _named(f"all_grad_tensors[{i}]", _as_list(grads))
        if getattr(zero, "grads_in_partition", None) is not None:
            held["grads"].append(("grads_in_partition", zero.grads_in_partition))
        buffers = [t for bucket in zero.ipg_buckets.values() for t in bucket.buffer]
    elif stage == 3:
        held["params"] += _named("fp16_partitioned_groups_flat", zero.fp16_partitioned_groups_flat)
        master = zero.fp32_partitioned_groups_flat
        if zero.grad_partitions_flat_buffer is not None:
            held["grads"].append(("grad_partitions_flat_buffer", zero.grad_partitions_flat_buffer))
        buffers = [b.buffer for b in zero.ipg_buckets.values() if isinstance(b.buffer, torch.Tensor)]
    else:
        raise ValueError(f"ZeRO stage {stage}: the benchmark covers stages 1-3")
    held["master"] += _named("master", master)
    held["grads"] += [(f"master[{i}].grad", m.grad) for i, m in enumerate(master) if m.grad is not None]
    held["comm_buffers"] += _named("ipg_bucket", buffers)
    _optimizer_state(zero.optimizer, held)


def _as_list(x: Any) -> list:
    return [x] if isinstance(x, torch.Tensor) else list(x or [])


def _named(prefix: str, tensors: Iterable[torch.Tensor | None]) -> list[tuple[str, torch.Tensor]]:
    return [(f"{prefix}[{i}]", t) for i, t in enumerate(tensors) if isinstance(t, torch.Tensor)]


def deepspeed_layout(engine: Any) -> dict[str, int]:
    """Element counts that explain DeepSpeed's deviations from the formula (empty for other engines):
    stage 3's persistent parameters (kept whole on every rank), stages 1-2's gradient partition (every
    parameter overlapping the rank's partition, whole) against the partition itself."""
    if engine.name != "deepspeed":
        return {}
    ds, zero = engine.ds, engine.ds.optimizer
    if int(ds.zero_optimization_stage()) == 3:
        params = list(ds.module.parameters())
        return {
            "persistent_param_elements": sum(p.ds_numel for p in params if getattr(p, "ds_persist", False))
        }
    return {
        "partition_elements": sum(int(n) for n in zero.partition_size),
        "params_in_partition_elements": sum(p.numel() for group in zero.params_in_partition for p in group),
    }
