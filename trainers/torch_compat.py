"""Private names of PyTorch that trainers/ relies on, in one place, each with what it is for. Read from
torch 2.11 (the GPU machine's), 2.13 (the pinned CPU build) and 2.14 (`make test-compat-torch`);
tests/unit/test_torch_compat.py fails when one moves or changes shape. The classes and functions of private
modules load on first use, so that a light module that needs one pays for no other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from trainers._lazy import lazy_names

if TYPE_CHECKING:  # the names `_LAZY` imports on first use
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

TORCH_VERSIONS = ("2.11", "2.13", "2.14")

__all__ = [
    "HOP_WRAP_LOGGER",
    "TORCH_VERSIONS",
    "FsspecReader",
    "FsspecWriter",
    "StateDictStager",
    "TorchDispatchMode",
    "all_to_all_single_autograd",
    "checkpoint_wrapper",
    "current_graph_task_id",
    "dump_memory_snapshot",
    "flatten_mesh",
    "grouped_mm",
    "record_memory_history",
    "set_aside",
    "skip_side_effects_in_checkpoint_backward",
    "stop_memory_history",
    "tree_leaves",
]

# name -> the private module it is read from
_LAZY = {
    # metrics.LiveTensorBytes (the memory census): a dispatch mode that sees every op, and the tensors of
    # an op's output
    "TorchDispatchMode": "torch.utils._python_dispatch",
    "tree_leaves": "torch.utils._pytree",
    # parallel/expert.py: the autograd-aware all-to-all of expert parallelism (torchtitan's as well)
    "all_to_all_single_autograd": "torch.distributed._functional_collectives",
    # parallel/ac.py: the module wrapper of activation checkpointing (torchtitan's as well)
    "checkpoint_wrapper": "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
    # checkpoint.py: DCP's own stager, held for the process (its public DefaultStager closes it after each
    # stage on torch < 2.13), and DCP's fsspec writer and reader for a run dir in a bucket
    "StateDictStager": "torch.distributed.checkpoint._state_dict_stager",
    "FsspecWriter": "torch.distributed.checkpoint._fsspec_filesystem",
    "FsspecReader": "torch.distributed.checkpoint._fsspec_filesystem",
}

__getattr__, __dir__ = lazy_names(globals(), _LAZY)


# models/moe.py: one grouped matmul per projection over all experts (`offs`: where each group ends), on
# CPU and CUDA. The function itself, not a wrapper: compiled graphs see the same op. None on a torch that has
# none (moe.py then runs a loop over the experts).
grouped_mm = getattr(torch, "_grouped_mm", None)

# models/moe.py: -1 unless autograd's engine is running a backward (activation checkpointing re-running a
# forward inside it).
current_graph_task_id = torch._C._current_graph_task_id

# parallel/ac.py: the logger of the warning that selective checkpointing under torch.compile gives once per
# compiled block (nothing a user can act on).
HOP_WRAP_LOGGER = "torch._higher_order_ops.wrap"


def skip_side_effects_in_checkpoint_backward() -> None:
    """parallel/parallelize.py, before compiling: dynamo may skip replaying a forward's side effects (MoE's
    router statistics) when activation checkpointing recomputes it in backward, instead of breaking the
    graph there (torchtitan's `apply_compile` sets it too). A process-wide setting."""
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def flatten_mesh(mesh: Any, name: str | None = None) -> Any:
    """parallel/native.py, layout.py: a device mesh's dimensions as one (its process group spans them all),
    named `name` in the root mesh when given (torch/distributed/device_mesh.py `DeviceMesh._flatten`)."""
    return mesh._flatten(name)


def set_aside(pg: Any) -> Any:
    """parallel/replicas.py: the process group a torchft wrapper holds (`_pg`), taken out of it; the caller
    keeps it until its collectives end. torchft/process_group.py (0.2.0) `ProcessGroupWrapper.configure`
    aborts the held group at each new quorum, and gloo's abort waits up to the group's timeout for a
    collective in flight (a peer silent, not gone); set aside, the next configure starts a new one at once."""
    inner, pg._pg = pg._pg, None
    return inner


def record_memory_history(max_entries: int) -> None:
    """profiling.py (`--memory-snapshot`, CUDA): start recording the allocator's history."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def stop_memory_history() -> None:
    torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: str) -> None:
    """The allocator's recorded history, as a pickle for pytorch.org/memory_viz."""
    torch.cuda.memory._dump_snapshot(path)
