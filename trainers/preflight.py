"""Checks of a run's inputs that read the disk or a model folder (the data's manifest, shards and vocabulary,
a `model.init_from` folder) or need an optional package, made once before any worker starts. What needs only
the YAML is checked when the config loads (`trainers.config`). Each failure is a one-line `ConfigError`.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from trainers._base import ConfigError
from trainers.data.manifest import SPLITS, check_shard, read_manifest

__all__ = ["check_engine_installed", "check_inputs", "require_deepspeed"]


def check_inputs(cfg: Any, shards: bool = True) -> dict[str, Any]:
    """The data manifest and every shard it lists (`shards=False`: the caller's dataset checks them as it
    reads them, so each byte is hashed once); returns the manifest. `cfg` is a `trainers.config.RunConfig`."""
    check_engine_installed(cfg)
    manifest = read_manifest(cfg.data.path)
    for split in SPLITS if shards else ():
        for shard in manifest["splits"][split]["shards"]:
            check_shard(cfg.data.path, shard)
    vocab = manifest["tokenizer"]["vocab_size"]
    if vocab > cfg.model.vocab_size:
        fix = (
            f"tokenize the data with the model's tokenizer: raytrain data prepare --tokenizer {cfg.model.init_from}"
            if cfg.model.init_from is not None  # its vocab_size comes from config.json
            else f"--set model.vocab_size={vocab}"
        )
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab}; fix: {fix}"
        )
    if cfg.model.init_from is not None:
        from trainers.hf.pretrained import check_init_from  # safetensors headers, tokenizer.json

        check_init_from(cfg.model, cfg.data.path)
    for split in SPLITS:
        n = manifest["splits"][split]["tokens"]
        if n < cfg.data.seq_len + 1:
            raise ConfigError(
                f"data.path={cfg.data.path}: the {split} split holds {n} tokens, fewer than one window of "
                f"data.seq_len+1={cfg.data.seq_len + 1}; fix: add text or lower data.seq_len"
            )
    return manifest


def check_engine_installed(cfg: Any) -> None:
    """parallel.engine=deepspeed needs DeepSpeed, an optional extra: refused here, before any worker imports it."""
    if cfg.parallel.engine == "deepspeed":
        require_deepspeed("parallel.engine=deepspeed", " (or set parallel.engine=fsdp)")


def require_deepspeed(what: str, alternative: str = "") -> None:
    """ConfigError where DeepSpeed is not installed (`raytrain-ext[deepspeed]`); looked up, not imported."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(
            f"{what} needs DeepSpeed, which is not installed; fix: pip install 'raytrain-ext[deepspeed]'{alternative}"
        )
