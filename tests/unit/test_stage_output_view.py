"""A pipeline stage under tensor parallelism returns its output as a view (`DTensor.to_local()`), and torch's
FSDP2 warns of a view returned by a module it wraps; the schedule never changes stage outputs in place, so
`trainers.parallel.parallelize` filters that warning, and only that one, out of the user's console."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainers.parallel.distributed import group_of_one
from trainers.parallel.parallelize import STAGE_OUTPUT_VIEW_WARNING

ROOT = Path(__file__).resolve().parents[2]


class _ReturnsAView(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).view(-1)  # a view of the output, as to_local() gives


def _messages_of_a_forward(ignored: list[str]) -> list[str]:
    """What one forward of an FSDP2-wrapped module returning a view warns, with only `ignored` filtered."""
    with group_of_one():
        module = fully_shard(_ReturnsAView(), mesh=init_device_mesh("cpu", (1,)))
        with warnings.catch_warnings(record=True) as seen:
            warnings.resetwarnings()
            warnings.simplefilter("always")
            for pattern in ignored:
                warnings.filterwarnings("ignore", message=pattern)
            module(torch.ones(2, 4))
    return [str(w.message) for w in seen]


def test_fsdps_warning_of_a_returned_view_is_what_the_filter_takes_out():
    assert any("returned a view tensor" in m for m in _messages_of_a_forward([]))
    assert not any("returned a view tensor" in m for m in _messages_of_a_forward([STAGE_OUTPUT_VIEW_WARNING]))


def test_the_filter_is_installed_when_parallelize_is_imported():
    # In a fresh interpreter: pytest drops filters that modules install while it collects tests.
    probe = (
        "import warnings, trainers.parallel.parallelize as p; "
        "print(any(f[0] == 'ignore' and f[1] is not None and f[1].pattern == p.STAGE_OUTPUT_VIEW_WARNING "
        "for f in warnings.filters))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr
