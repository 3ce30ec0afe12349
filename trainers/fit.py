"""`memory.fit: auto`: the trainer fits itself to its device's memory before it builds the model.

The planner (`trainers.plan.plan_memory`) predicts the step's peak for the layout the run will have; when the
config as written does not fit the device's usable memory (`plan.USABLE_FRACTION` of `memory.device_memory`,
or of the device's own figure), the cheapest of these changes that fits is taken, each step adding to the
ones before it (the global batch never changes; a smaller micro-batch means more accumulation):

  1. the chunked loss (`memory.loss_chunk`): no (tokens x vocab) logits; the same math at about the same speed
  2. selective activation checkpointing: recompute only the cheap ops of each block (norms, SwiGLU, RoPE)
  3. halve the micro-batch while it keeps at least `MIN_TOKENS` tokens (large matmuls keep their efficiency)
  4. activation checkpointing of every block (about 1/3 more block FLOPs)
  5. halve the micro-batch down to one sequence

What was chosen and why is one line (`FitChoice.line`); a run that fits nowhere stops with a ConfigError that
names the smallest plan and the next things to change (`raytrain plan` for the sharding side).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from trainers._base import ConfigError
from trainers.config import RunConfig, apply_overrides, parse_config
from trainers.loss import chunk_tokens
from trainers.plan import USABLE_FRACTION, format_bytes, parse_bytes, plan_memory

__all__ = ["FitChoice", "device_memory_bytes", "fit_for_this_rank", "fit_memory"]

MIN_TOKENS = 4096  # a micro-batch is halved before full checkpointing only while it keeps this many tokens


@dataclass
class FitChoice:
    cfg: RunConfig
    changes: dict[str, Any] = field(default_factory=dict)  # key -> new value (empty: as written)
    planned_bytes: int = 0
    device_bytes: int = 0
    source: str = ""  # where device_bytes came from
    written: dict[str, Any] = field(default_factory=dict)  # the config as written (for the line)

    @property
    def line(self) -> str:
        usable = int(self.device_bytes * USABLE_FRACTION)
        budget = f"{format_bytes(self.planned_bytes)} of {format_bytes(usable)} usable ({self.source})"
        if not self.changes:
            return f"memory.fit=auto: the run fits as written: planned peak {budget}"
        parts = [f"{k.split('.')[-1]} {_get(self.written, k)} -> {v}" for k, v in self.changes.items()]
        return (f"memory.fit=auto: {', '.join(parts)}: planned peak {budget}; global batch "
                f"{self.cfg.train.global_batch_size} kept")


def _get(raw: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        raw = raw[key]
    return raw


def device_memory_bytes(cfg: RunConfig, device: torch.device, local_ranks: int = 1) -> tuple[int, str]:
    """Bytes one rank may plan for, and where the figure came from."""
    if cfg.memory.device_memory is not None:
        return parse_bytes(cfg.memory.device_memory, "memory.device_memory"), "memory.device_memory"
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


def _steps(cfg: RunConfig, world_size: int) -> list[dict[str, Any]]:
    """The changes in the module docstring's order, each holding the ones before it."""
    sets: dict[str, Any] = {}
    out: list[dict[str, Any]] = []

    def add(**kv: Any) -> None:
        sets.update({k.replace("__", "."): v for k, v in kv.items()})
        out.append(dict(sets))

    seq, mb = cfg.data.seq_len, cfg.train.micro_batch_size
    if not cfg.memory.loss_chunk:
        add(memory__loss_chunk=chunk_tokens(cfg.model.vocab_size))
    if cfg.memory.activation_checkpointing == "off":
        add(memory__activation_checkpointing="selective")
    while mb > 1 and mb % 2 == 0 and mb // 2 * seq >= MIN_TOKENS:
        mb //= 2
        add(train__micro_batch_size=mb)
    if cfg.memory.ac_every != 1:
        add(memory__activation_checkpointing="every")
    while mb > 1 and mb % 2 == 0:
        mb //= 2
        add(train__micro_batch_size=mb)
    return out


def fit_memory(cfg: RunConfig, world_size: int, device_type: str, device_bytes: int, source: str) -> FitChoice:
    """The config to run (`cfg` itself when it fits as written) and the line that says why."""
    raw = json.loads(cfg.model_dump_json())
    usable = int(device_bytes * USABLE_FRACTION)
    planned = plan_memory(cfg, world_size, device_type).peak_bytes
    choice = FitChoice(cfg, {}, planned, device_bytes, source, raw)
    if planned <= usable:
        return choice
    best: tuple[int, dict[str, Any]] = (planned, {})
    for sets in _steps(cfg, world_size):
        try:
            trial = parse_config(apply_overrides(raw, [f"{k}={v}" for k, v in sets.items()]))
            peak = plan_memory(trial, world_size, device_type).peak_bytes
        except ConfigError:  # e.g. a micro-batch the layout refuses (pipeline microbatches)
            continue
        if peak < best[0]:
            best = (peak, sets)
        if peak <= usable:
            return FitChoice(trial, sets, peak, device_bytes, source, raw)
    tried = ", ".join(f"{k}={v}" for k, v in best[1].items()) or "nothing smaller"
    raise ConfigError(
        f"memory.fit=auto: no micro-batch, checkpointing or loss chunking fits this run in "
        f"{format_bytes(usable)} usable of {format_bytes(device_bytes)} ({source}); the smallest plan "
        f"({tried}) peaks at {format_bytes(best[0])}; fix: shard the model states (parallel.engine=fsdp, "
        f"more ranks, parallel.tp/pp; see `raytrain plan`) or give more memory.device_memory"
    )


def fit_for_this_rank(cfg: RunConfig) -> FitChoice:
    """`fit_memory` for the running process group (or this process alone), on this rank's device."""
    import torch.distributed as dist

    from trainers.parallel.distributed import device_for_rank

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    device = device_for_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device_bytes, source = device_memory_bytes(cfg, device, local)
    return fit_memory(cfg, world, device.type, device_bytes, source)
