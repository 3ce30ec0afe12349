"""Parallelism applied to a model from outside: layout, engines, activation checkpointing."""

from __future__ import annotations

from trainers.config import RunConfig
from trainers.fault_tolerance import per_step
from trainers.layout import ParallelLayout
from trainers.parallel.distributed import device_for_rank
from trainers.parallel.engine import Engine, LocalEngine
from trainers.preflight import check_engine_installed

__all__ = ["Engine", "LocalEngine", "ParallelLayout", "build_engine"]


def build_engine(cfg: RunConfig, layout: ParallelLayout | None = None) -> Engine:
    """The engine named by `parallel.engine`, over the running process group's layout."""
    layout = layout or ParallelLayout.from_process_group(cfg)  # every layout rule runs here
    device = device_for_rank()
    engine = cfg.parallel.engine
    if per_step(cfg.scaling):  # a worker of a torchft replica group (trainers.fault_tolerance)
        from trainers.parallel.replicas import ReplicaGroupEngine, ReplicaGroupFSDPEngine

        group_engine = ReplicaGroupFSDPEngine if engine == "fsdp" else ReplicaGroupEngine
        return group_engine(layout, device, allreduce_timeout_s=cfg.scaling.allreduce_timeout_s)
    if engine == "none":
        return LocalEngine(device, layout)
    if layout.pp > 1:
        from trainers.parallel.pipeline import PipelineEngine

        return PipelineEngine(layout, device)
    if engine in ("ddp", "fsdp"):
        from trainers.parallel.native import DDPEngine, FSDPEngine

        return (DDPEngine if engine == "ddp" else FSDPEngine)(layout, device)
    check_engine_installed(cfg)  # DeepSpeed is an optional extra; torchrun's ranks get its one line too
    from trainers.parallel.deepspeed_engine import DeepSpeedEngine

    return DeepSpeedEngine(layout, device)
