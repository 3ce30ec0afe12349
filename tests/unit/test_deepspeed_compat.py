"""trainers.deepspeed_compat holds every private name of DeepSpeed that trainers/ uses. These tests fail when
the installed DeepSpeed moved one or changed its shape; skipped where DeepSpeed (optional) is not installed."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from trainers import deepspeed_compat


@pytest.fixture
def deepspeed(monkeypatch):
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # importing deepspeed sets it; undone after
    return pytest.importorskip("deepspeed")


def test_the_installed_deepspeed_is_the_minor_version_the_names_were_read_from(deepspeed):
    minor = deepspeed.__version__.split("+")[0].rsplit(".", 1)[0]
    assert minor == deepspeed_compat.DEEPSPEED_VERSION.rsplit(".", 1)[0], (
        f"DeepSpeed {deepspeed.__version__}: trainers/deepspeed_compat.py was read from "
        f"{deepspeed_compat.DEEPSPEED_VERSION}; check each entry there against the new version, then change it"
    )


def test_the_engine_reads_the_universal_flag_from_its_private_config(deepspeed):
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    reader = inspect.getsource(DeepSpeedEngine.load_universal_checkpoint)
    assert "self._config.load_universal_checkpoint" in reader
    assert "self._config = " in inspect.getsource(DeepSpeedEngine.__init__)
    assert "self.load_universal_checkpoint = " in inspect.getsource(DeepSpeedConfig)


def test_loading_universal_checkpoint_sets_the_flag_for_the_block_only():
    engine = SimpleNamespace(_config=SimpleNamespace(load_universal_checkpoint=False))
    with pytest.raises(RuntimeError):
        with deepspeed_compat.loading_universal_checkpoint(engine):
            assert engine._config.load_universal_checkpoint is True
            raise RuntimeError("a failed load")
    assert engine._config.load_universal_checkpoint is False
