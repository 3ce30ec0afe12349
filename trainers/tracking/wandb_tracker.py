"""Weights & Biases: the resolved config as the run's config, each train/eval record logged at its step,
events and the final checkpoint's path in the run's summary, `config.yaml` among its files. Run files go to
`RUN_DIR/wandb/` (`mode: offline` writes them there for a later `wandb sync`)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from trainers.sections.tracking import WandbConfig
from trainers.tracking.sink import Tracker, metric_values

__all__ = ["WandbTracker"]


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(
        self, cfg: WandbConfig, run_name: str, run_dir: Path, config: dict[str, Any], config_yaml: str
    ):
        self.cfg, self.run_name, self.run_dir = cfg, run_name, Path(run_dir)
        self.config, self.config_yaml = config, config_yaml
        self.run: Any = None
        self.last_checkpoint: str | None = None

    def open(self, state: dict[str, Any]) -> None:
        import wandb

        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg = self.cfg
        self.run = wandb.init(
            project=cfg.project, entity=cfg.entity, group=cfg.group, mode=cfg.mode, dir=str(self.run_dir),
            id=state.get("run_id") or uuid.uuid4().hex[:8],
            resume="allow",  # a resumed run continues its W&B run
            name=self.run_name,
            config=self.config,
            reinit="create_new",  # several runs in one process (tests, notebooks)
            settings=wandb.Settings(console="off", silent=True),
        )
        state["run_id"] = self.run.id
        (Path(self.run.dir) / "config.yaml").write_text(self.config_yaml)

    def send(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            if r.get("kind") in ("train", "eval"):
                self.run.log(metric_values(r), step=r["step"])
            elif r.get("event") == "checkpoint":
                self.last_checkpoint = r.get("path")
                self.run.summary["checkpoint"] = self.last_checkpoint
            elif r.get("kind") == "event":
                fields = {k: v for k, v in r.items() if k not in ("kind", "event", "step")}
                self.run.summary[f"event/{r.get('step', 0):08d}/{r.get('event')}"] = json.dumps(
                    fields, default=str
                )

    def finish(self, status: str) -> None:
        if status == "FINISHED" and self.last_checkpoint:
            self.run.summary["final_checkpoint"] = self.last_checkpoint
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
