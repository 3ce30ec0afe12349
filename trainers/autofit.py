"""`memory.fit: auto`: a run fits itself to its device's memory before its Trainer is built.

When the config as written does not fit the device's usable memory, every combination of the `activations`
rungs of the planner's memory ladder (`plan.memory_ladder`: the chunked loss, activation checkpointing, a
smaller micro-batch; never the layout or the global batch) is planned, and of those that fit the least
predicted step time (`plan.predicted_step_s`) wins. The launchers call `resolve_fit` once the process group
exists, before the engine and the Trainer (which plans nothing).
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from trainers._base import ConfigError
from trainers.config import MemoryConfig, RunConfig, with_values
from trainers.plan import (
    USABLE_FRACTION,
    MemoryChange,
    format_bytes,
    memory_ladder,
    parse_bytes,
    plan_memory,
    predicted_step_s,
    replan,
)

__all__ = ["FitChoice", "device_memory_bytes", "fit_memory", "resolve_fit"]

@dataclass
class FitChoice:
    cfg: RunConfig
    changes: dict[str, Any] = field(default_factory=dict)  # key -> new value (empty: as written)
    planned_bytes: int = 0
    device_bytes: int = 0
    source: str = ""  # where device_bytes came from
    written: dict[str, Any] = field(default_factory=dict)  # the config as written (for the line)
    why: str = ""  # the time the choice is predicted to take, against the next-best plan that fits

    @property
    def line(self) -> str:
        usable = int(self.device_bytes * USABLE_FRACTION)
        budget = f"{format_bytes(self.planned_bytes)} of {format_bytes(usable)} usable ({self.source})"
        if not self.changes:
            return f"memory.fit=auto: the run fits as written: planned peak {budget}"
        parts = [f"{k.split('.')[-1]} {_get(self.written, k)} -> {v}" for k, v in self.changes.items()]
        return (f"memory.fit=auto: {', '.join(parts)}: planned peak {budget}; {self.why}; global batch "
                f"{self.cfg.train.global_batch_size} kept")


def _get(raw: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        raw = raw[key]
    return raw


def device_memory_bytes(memory: MemoryConfig, device: torch.device, local_ranks: int = 1) -> tuple[int, str]:
    """Bytes one rank may plan for (`memory.device_memory`, else the device's), and where the figure came from."""
    if memory.device_memory is not None:
        return parse_bytes(memory.device_memory, "memory.device_memory"), "memory.device_memory"
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory), f"{device}'s total memory"
    available = _mem_available()
    return available // max(local_ranks, 1), f"this node's available memory / {local_ranks} local ranks"


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _combinations(ladder: list[MemoryChange]) -> list[dict[str, Any]]:
    """Every combination of the ladder's `activations` rungs, at most one setting per key (e.g. one
    micro-batch), the settings of each key in the ladder's order."""
    options: dict[str, list[Any]] = {}
    for change in ladder:
        for key, value in change.sets.items() if change.activations else ():
            options.setdefault(key, []).append(value)
    combos = itertools.product(*((None, *values) for values in options.values()))
    return [{k: v for k, v in zip(options, c) if v is not None} for c in combos][1:]


def fit_memory(cfg: RunConfig, world_size: int, device_type: str, device_bytes: int, source: str) -> FitChoice:
    """The config to run (`cfg` itself when it fits as written) and the line that says why."""
    raw = json.loads(cfg.model_dump_json())
    usable = int(device_bytes * USABLE_FRACTION)
    planned = plan_memory(cfg, world_size, device_type).peak_bytes
    if planned <= usable:
        return FitChoice(cfg, {}, planned, device_bytes, source, raw)
    fitting, smallest = [], (planned, {})
    for sets in _combinations(memory_ladder(cfg, world_size, device_type)):
        replanned = replan(raw, sets, world_size, device_type)
        if replanned is None:  # e.g. a micro-batch the layout refuses (pipeline microbatches)
            continue
        trial, peak = replanned
        smallest = min(smallest, (peak, sets), key=lambda p: p[0])
        if peak <= usable:
            fitting.append((predicted_step_s(trial, world_size, device_type), peak, len(sets), trial, sets))
    if not fitting:
        tried = ", ".join(f"{k}={v}" for k, v in smallest[1].items()) or "nothing smaller"
        raise ConfigError(
            f"memory.fit=auto: no micro-batch, checkpointing or loss chunking fits this run in "
            f"{format_bytes(usable)} usable of {format_bytes(device_bytes)} ({source}); the smallest plan "
            f"({tried}) peaks at {format_bytes(smallest[0])}; fix: shard the model states (parallel.engine=fsdp, "
            f"more ranks, parallel.tp/pp; see `raytrain plan`) or give more memory.device_memory"
        )
    fitting.sort(key=lambda f: f[:3])  # the fastest; at equal time the smaller peak, then fewer changes
    seconds, peak, _, trial, sets = fitting[0]
    why = f"the fastest of {len(fitting)} plans that fit ({device_type}: predicted {seconds * 1e3:.3g} ms a step"
    if len(fitting) > 1:
        nxt = fitting[1]
        named = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in nxt[4].items())
        why += f"; next {named} at +{nxt[0] / seconds - 1:.0%}"
    return FitChoice(trial, sets, peak, device_bytes, source, raw, why + ")")


def resolve_fit(cfg: RunConfig) -> tuple[RunConfig, FitChoice | None]:
    """The final config of this rank's run: with `memory.fit: auto`, the one `fit_memory` chose for the running
    process group (or this process alone) on this rank's device, marked `memory.fit: off` (it is what runs:
    resolving it again changes nothing), and the choice; `cfg` itself and None otherwise."""
    if cfg.memory.fit != "auto":
        return cfg, None
    import torch.distributed as dist

    from trainers.parallel.distributed import device_for_rank

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    device, local = device_for_rank(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    choice = fit_memory(cfg, world, device.type, *device_memory_bytes(cfg.memory, device, local))
    return with_values(choice.cfg, {"memory.fit": "off"}), choice
