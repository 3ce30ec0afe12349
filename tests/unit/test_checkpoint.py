"""Checkpoints: DCP round trip, atomic commit, interrupted saves ignored, retention, checksums hashed while
written."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from trainers.checkpoint import Checkpointer, ModelOptimizerState, is_complete
from trainers.checksums import StreamDigests, digest_pieces, pieces_of


def _model_and_opt(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_round_trip_restores_model_optimizer_state_and_rng(tmp_path):
    model, opt = _model_and_opt(0)
    ckpt = Checkpointer(tmp_path, keep=2)
    rng = torch.get_rng_state()
    path = ckpt.save(
        7, {"app": ModelOptimizerState(model, opt)}, {"step": 7, "samples": 56}, rng={"torch": rng}
    )
    assert path.name == "step_00000007" and is_complete(path) and ckpt.latest() == path

    other, other_opt = _model_and_opt(1)
    assert not _same(model, other)
    state, loaded_rng = ckpt.load(path, {"app": ModelOptimizerState(other, other_opt)})
    assert state == {"step": 7, "samples": 56}
    assert torch.equal(loaded_rng["torch"], rng)
    assert _same(model, other)
    for p, q in zip(opt.state.values(), other_opt.state.values()):
        assert torch.equal(p["exp_avg"], q["exp_avg"]) and torch.equal(p["exp_avg_sq"], q["exp_avg_sq"])


def test_interrupted_save_leaves_previous_checkpoint_and_is_ignored(tmp_path):
    model, opt = _model_and_opt(0)
    ckpt = Checkpointer(tmp_path, keep=3)
    good = ckpt.save(10, {"app": ModelOptimizerState(model, opt)}, {"step": 10})

    class Crash(Exception):
        pass

    def crash(_partial):
        raise Crash

    with pytest.raises(Crash):
        ckpt.save(20, {"app": ModelOptimizerState(model, opt)}, {"step": 20}, before_commit=crash)
    assert (tmp_path / "step_00000020.partial").is_dir()
    assert not (tmp_path / "step_00000020").exists()
    assert ckpt.latest() == good
    with pytest.raises(FileNotFoundError):
        ckpt.load(tmp_path / "step_00000020.partial", {"app": ModelOptimizerState(model, opt)})
    # The next successful save clears the leftover.
    ckpt.save(30, {"app": ModelOptimizerState(model, opt)}, {"step": 30})
    assert not (tmp_path / "step_00000020.partial").exists()
    assert ckpt.load(good, {"app": ModelOptimizerState(model, opt)})[0]["step"] == 10


def test_retention_keeps_newest(tmp_path):
    model, opt = _model_and_opt(0)
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        ckpt.save(step, {"app": ModelOptimizerState(model, opt)}, {"step": step})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]


@pytest.mark.parametrize("size", [0, 1, 4096, 4097, 3 * 4096, 3 * 4096 + 5])
def test_digests_streamed_while_writing_equal_those_read_back(tmp_path, size):
    """Pieces of 4 KiB, bytes fed in uneven writes: the same digests as hashing the file's pieces."""
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
    data = data.numpy().tobytes()
    (tmp_path / "f").write_bytes(data)
    streamed = StreamDigests(piece_bytes=4096)
    cuts = [0, *sorted({min(size, c) for c in (7, 4096, 5000, 8191, 12000)}), size]
    for a, b in zip(cuts, cuts[1:]):
        streamed.update(memoryview(data)[a:b])
    read = digest_pieces(tmp_path, pieces_of({"f": size}, 4096), threads=2)
    assert streamed.size == size
    assert streamed.digests() == [read[("f", i)] for i in range(len(read))]


def test_a_save_hashes_dcps_files_as_they_are_written_and_reads_back_only_the_others(tmp_path, monkeypatch):
    import trainers.checkpoint as checkpoint

    read_back: list[str] = []

    def counting(root, pieces, threads):
        pieces = list(pieces)
        read_back.extend(name for name, *_ in pieces)
        return digest_pieces(root, pieces, threads)

    monkeypatch.setattr(checkpoint, "digest_pieces", counting)
    model, opt = _model_and_opt(0)
    ckpt = Checkpointer(tmp_path, keep=2)
    path = ckpt.save(3, {"app": ModelOptimizerState(model, opt)}, {"step": 3}, rng={"torch": torch.get_rng_state()})
    marker = json.loads((path / "COMMITTED").read_text())
    assert {n for n in marker["files"] if n.endswith(".distcp")} and ".metadata" in marker["files"]
    assert sorted(read_back) == sorted(n for n in marker["files"] if not n.endswith(".distcp") and n != ".metadata")
    # the streamed digests are the files' own: the verification on resume reads them all back and agrees
    assert Checkpointer.verify(path) is None
    sizes = {n: e["size"] for n, e in marker["files"].items()}
    found = digest_pieces(path, pieces_of(sizes), threads=2)
    assert all(found[(n, i)] == d for n, e in marker["files"].items() for i, d in enumerate(e["pieces"]))
