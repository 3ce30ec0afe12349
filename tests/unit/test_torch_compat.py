"""trainers.torch_compat holds every private name of torch that trainers/ uses. These tests fail when the
installed torch moved one or changed its shape (torch 2.11 on the GPU machine, 2.13 here, 2.14 in `make
test-compat-torch`), and when a module of ours names a private part of torch outside it."""

from __future__ import annotations

import inspect
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed import AllreduceOptions, TCPStore

from trainers import torch_compat

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_torch_is_one_the_names_were_read_from():
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert version in torch_compat.TORCH_VERSIONS, (
        f"torch {torch.__version__}: trainers/torch_compat.py was read from {torch_compat.TORCH_VERSIONS}; check "
        "each entry there against the new version, then add it"
    )


def test_each_lazily_imported_name_is_there():
    for name in torch_compat._LAZY:
        assert getattr(torch_compat, name) is not None, name
    assert inspect.isclass(torch_compat.TorchDispatchMode) and inspect.isclass(torch_compat.StateDictStager)
    assert {"pin_memory", "share_memory"} <= set(inspect.signature(torch_compat.StateDictStager).parameters)
    assert "thread_count" in inspect.signature(torch_compat.FsspecWriter).parameters
    # (tensor, output splits, input splits, group), as parallel/expert.py calls it
    assert list(inspect.signature(torch_compat.all_to_all_single_autograd).parameters)[1:4] == [
        "output_split_sizes",
        "input_split_sizes",
        "group",
    ]


def test_grouped_mm_equals_a_matmul_per_group():
    torch.manual_seed(0)
    x, w = torch.randn(7, 4), torch.randn(3, 5, 4)  # 3 experts: rows [0, 2), [2, 3), [3, 7)
    offsets = torch.tensor([2, 3, 7], dtype=torch.int32)
    out = torch_compat.grouped_mm(x, w.mT, offs=offsets)
    expected = torch.cat([F.linear(x[a:b], w[e]) for e, (a, b) in enumerate(((0, 2), (2, 3), (3, 7)))])
    torch.testing.assert_close(out, expected)


def test_the_graph_task_id_tells_a_backward_from_a_forward():
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = (x * 2).sum()
    x.register_hook(lambda grad: seen.append(torch_compat.current_graph_task_id()))
    assert torch_compat.current_graph_task_id() == -1, "outside a backward"
    y.backward()
    assert seen and seen[0] != -1, "inside autograd's backward"


def test_the_dynamo_flag_and_the_logger_exist():
    import torch._dynamo

    assert hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint")
    assert Path(inspect.getsourcefile(torch._higher_order_ops.wrap)).stem == "wrap"
    assert torch_compat.HOP_WRAP_LOGGER == torch._higher_order_ops.wrap.__name__
    assert callable(torch.cuda.memory._record_memory_history) and callable(torch.cuda.memory._dump_snapshot)


def test_no_other_module_of_trainers_names_a_private_part_of_torch():
    private = re.compile(r"\btorch(\.\w+)*\._(?!_)\w+")  # not a dunder (`torch.__version__`)
    found = []
    for path in sorted((ROOT / "trainers").rglob("*.py")):
        if path.name == "torch_compat.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if private.search(code) and "`" not in code:  # names in docstrings are quoted
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == [], "\n".join(found)


def test_the_mesh_flatten_takes_a_name_and_grouped_mm_is_there():
    """flatten_mesh(mesh, name) is DeviceMesh._flatten(mesh_dim_name); moe.py falls back to a loop only
    where torch has no _grouped_mm, which none of TORCH_VERSIONS lacks."""
    from torch.distributed.device_mesh import DeviceMesh

    assert list(inspect.signature(DeviceMesh._flatten).parameters)[:2] == ["self", "mesh_dim_name"]
    assert torch_compat.grouped_mm is torch._grouped_mm


def _silent_peer_rank(rank: int, port: int, out: Any) -> None:
    """One of two ranks of torchft's gloo groups A and B (a 2 s timeout); rank 1 falls silent after a first
    all-reduce in each (alive, its sockets open). Rank 0 starts one more all-reduce in each and, 0.3 s later,
    configures the group alone: A set aside first, B as it is."""
    from torchft.process_group import ProcessGroupGloo

    groups = {name: ProcessGroupGloo(timeout=timedelta(seconds=2)) for name in "AB"}
    for name, pg in groups.items():
        pg.configure(f"localhost:{port}/{name}2", f"r{rank}", rank, 2)
        pg.allreduce([torch.ones(8)], AllreduceOptions()).wait()
    if rank == 1:
        time.sleep(8)
        return
    for name, pg in groups.items():
        future = pg.allreduce([torch.ones(8)], AllreduceOptions()).get_future()
        time.sleep(0.3)
        aside = torch_compat.set_aside(pg) if name == "A" else None
        began = time.perf_counter()
        pg.configure(f"localhost:{port}/{name}1", "r0", 0, 1)
        out.put((name, time.perf_counter() - began, future.done()))
        del aside


def test_a_torchft_group_set_aside_reconfigures_without_waiting_for_a_silent_peer():
    """parallel/replicas.py's premise (torchft 0.2.0): reconfiguring a gloo group whose all-reduce waits on a
    silent peer waits for that all-reduce's timeout, unless the process group was set aside first."""
    pytest.importorskip("torchft")
    ctx = torch.multiprocessing.get_context("spawn")
    store = TCPStore("localhost", 0, 2, True, wait_for_workers=False)
    out = ctx.Queue()
    ranks = [ctx.Process(target=_silent_peer_rank, args=(r, store.port, out)) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        took = {name: (seconds, done) for name, seconds, done in (out.get(timeout=60) for _ in "AB")}
    finally:
        for p in ranks:
            p.kill()
            p.join()
    assert took["A"][0] < 0.5 and not took["A"][1], took  # at once, the all-reduce still in flight
    assert took["B"][0] > 1.0, took  # the premise: configure waits for the silent peer's all-reduce
