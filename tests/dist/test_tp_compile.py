"""`train.compile` under tensor parallelism (2 gloo processes): every compiled block takes the same kind of
input, so training steps and a later evaluation (a no-grad graph) run and give eager TP's losses. Before
`parallelize._settled`, block 0 took the embedding's DTensor over an `AsyncCollectiveTensor` and got a
graph of its own, and under torch 2.13 the first evaluation failed in block 1 ("'Tensor' object has no
attribute 'elem'"). Inductor, as `train.compile` (AOT autograd's eager backend does not fail so): slow
tier, ~20 s of C++ builds."""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _losses(rank: int, world: int, compiled: bool) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from trainers.models import ModelConfig, build_model
    from trainers.parallel.parallelize import apply_tensor_parallel, compile_blocks

    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=2, max_seq_len=16))
    apply_tensor_parallel(model, init_device_mesh("cpu", (world,)))
    if compiled:
        compile_blocks(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):  # two steps, as the Trainer: grad-mode graphs
        tokens = torch.randint(0, 64, (2, 16), generator=g)
        with loss_parallel():
            loss = model(tokens, tokens)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    with torch.no_grad(), loss_parallel():  # the evaluation: a no-grad graph
        loss = model(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g))
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    return losses


def test_compiled_tp_blocks_train_and_evaluate_as_eager():
    eager = run_ranks(_losses, 2, False)
    compiled = run_ranks(_losses, 2, True)
    assert eager[0] == eager[1] and compiled[0] == compiled[1]
    assert compiled[0] == pytest.approx(eager[0], rel=1e-5)
