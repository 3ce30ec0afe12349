"""What a resume may change: the keys that fix the shapes of the saved state must match the checkpoint.

A checkpoint records them (`trainer_state.json` -> `compat`): the whole `model` section, the window length
and the tokenizer. Everything else may change on purpose between a save and a resume: optimizer and
schedule (PBT), world size, engine and layout (elastic runs, resharding), steps. The driver checks before
any worker starts (`check_resume`); the Trainer checks the checkpoint it actually restores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainers._base import ConfigError, flat_keys
from trainers.checkpoint_files import checkpoint_step, committed_checkpoints, is_complete, read_trainer_state
from trainers.config import RunConfig
from trainers.run_dir import RunDir
from trainers.storage import location

__all__ = ["check_compatible", "check_resume", "compat_of", "resume_candidate"]

# Model keys that only weigh losses or drop tokens (or matter at init only): tuning them on a resume is fine.
_MAY_CHANGE = {
    "model.init_std",
    "model.moe.aux_loss_coef",
    "model.moe.z_loss_coef",
    "model.moe.capacity_factor",
    "model.moe.impl",  # how the experts run, not what they hold (and absent from older checkpoints)
    "model.init_from",  # where a new run's weights came from: a resume loads the checkpoint's
}

_FIX = (
    "fix: keep the saved value, start a new run with a new run_dir or --set checkpoint.resume=none "
    "(that run starts from scratch, or from model.init_from: a Hugging Face folder, e.g. this run exported "
    "with `raytrain export`)"
)


def compat_of(cfg: RunConfig, manifest: dict[str, Any]) -> dict[str, Any]:
    """The saved state's shape-defining keys, flat: `model.dim`, `data.seq_len`, `tokenizer.kind`, ..."""
    tokenizer = manifest.get("tokenizer", {})
    model = flat_keys(cfg.model.model_dump(mode="json"), "model.")
    keys = {k: v for k, v in model.items() if k not in _MAY_CHANGE}
    keys["data.seq_len"] = cfg.data.seq_len
    keys.update({f"tokenizer.{k}": tokenizer.get(k) for k in ("kind", "vocab_size", "eos_id")})
    return keys


def check_compatible(saved: dict[str, Any] | None, now: dict[str, Any], checkpoint: Path) -> None:
    """ConfigError naming the first key whose value differs. `saved` None: a checkpoint from before
    these records, nothing to compare."""
    if not saved:
        return
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key):
            source = "data.path's manifest" if key.startswith("tokenizer.") else "the run"
            raise ConfigError(
                f"{key}={now.get(key)!r} (from {source}) but checkpoint {checkpoint} was saved with "
                f"{key}={saved.get(key)!r}; a resume cannot change the model's shape, window or tokenizer; {_FIX}"
            )


def resume_candidate(resume: str, out_dir: Path) -> Path | None:
    """The checkpoint `resume` (checkpoint.resume) restores first: auto, the newest complete one in the run dir
    `out_dir`; a path, it if complete. Reads files only: the command line asks it before torch is imported."""
    if resume == "none":
        return None
    if resume == "auto":
        done = committed_checkpoints(out_dir / "checkpoints")
        return done[0] if done else None
    return location(resume) if is_complete(location(resume)) else None


def check_resume(cfg: RunConfig, manifest: dict[str, Any]) -> None:
    """Before any worker starts: the checkpoint this run would resume from was saved with the same
    shape-defining keys. An unreadable record is left for the restore to report (it falls back)."""
    path = resume_candidate(cfg.checkpoint.resume, cfg.out_dir)
    if path is None:
        return
    try:
        saved = read_trainer_state(path).get("compat")
    except (OSError, ValueError):
        return
    check_compatible(saved, compat_of(cfg, manifest), path)


def continue_hint(run_dir: Any) -> str:
    """What an interrupted run tells its user: the same command continues, from which step."""
    done = committed_checkpoints(RunDir(run_dir).checkpoints)
    where = f"from step {checkpoint_step(done[0])}" if done else "from the start (no checkpoint yet)"
    return f"interrupted; run the same command again to continue {where} ({run_dir})"
