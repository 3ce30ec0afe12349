"""bench/lean.py's rows are valid runs of the seed's model with the option each names (so a renamed config
key fails here, not an hour into `make bench`), and every row is planned (no timing: the bench measures)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import lean  # noqa: E402
from measure import reference_config  # noqa: E402


def _cfg(name: str, corpus: Path):
    return reference_config(str(corpus), 16, lean.SEQ, 10, "off", "unused", False, lean.VOCAB,
                            lean._overrides(name, 16))


def test_each_row_is_the_seed_model_with_its_technique(corpus_dir):
    cfgs = {name: _cfg(name, corpus_dir) for name in lean.ROWS}
    assert {c.model.vocab_size for c in cfgs.values()} == {50257} and {c.data.seq_len for c in cfgs.values()} == {512}
    assert cfgs["chunked_loss"].memory.loss_chunk == lean.CHUNK
    assert cfgs["ac_selective"].memory.ac_selective and cfgs["ac_every"].memory.ac_every == 1
    assert cfgs["fused_optimizer"].optimizer.fused and cfgs["compile"].train.compile
    assert cfgs["micro_batch"].train.micro_batch_size == 4 and cfgs["micro_batch"].train.global_batch_size == 16
    assert cfgs["bf16"].precision.dtype == "bf16"
    all_ = cfgs["all"]
    assert (all_.memory.loss_chunk, all_.memory.ac_every, all_.optimizer.fused, all_.train.micro_batch_size) == (
        lean.CHUNK, 1, True, 4)
    for name in ("naive", "plain", "trainer"):  # the loops' own config: every option off
        c = cfgs[name]
        assert (c.memory.loss_chunk, c.memory.ac_every, c.optimizer.fused, c.train.compile) == (0, 0, False, False)


def test_the_naive_row_is_planned_with_its_gradients_kept(corpus_dir):
    class Args:
        data, batch = str(corpus_dir), 16

    naive, plain = lean.planned_bytes("naive", Args), lean.planned_bytes("plain", Args)
    assert naive > plain  # zero_grad() without set_to_none keeps every gradient through the step
