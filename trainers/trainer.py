"""The training loop: global batch = micro-batch x accumulation x data-parallel size.

The Trainer builds its parts from a RunConfig, restores the newest complete checkpoint (or a given one),
then `fit()` runs steps until `train.steps`. Everything a step depends on is a function of the step number
and the restored state (data position, learning rate, RNG), so a resumed run repeats an uninterrupted one.

A loop that drives the run from outside (a PBT trial: `search.hooks.GateLoop`) calls `fit(until=s)`, which
returns at step `s` with the checkpoint of `s` committed, decides, and may `restore(path, hparams)` another
checkpoint before it calls `fit` again. State comes in only through `restore` (the constructor's resume is
one), and only between `fit` calls: a callback cannot move the trainer's step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainers._base import NonFiniteLossError
from trainers.checkpoint import Checkpointer, CheckpointError, Committed, is_complete
from trainers.checkpoint_files import checkpoint_step
from trainers.config import ConfigError, RunConfig, check_hparam_keys, with_values
from trainers.data.dataset import GlobalSampler, TokenWindows, eval_window_ids, shard_for_rank
from trainers.hf.pretrained import load_pretrained, materialize
from trainers.host_memory import hold_freed_heap, release_freed_heap
from trainers.loss import lm_loss
from trainers.metrics import MetricsLog, peak_memory_bytes, read_metrics
from trainers.models import build_model, flops_per_token
from trainers.optim import LRSchedule
from trainers.parallel import build_engine
from trainers.parallel.engine import Engine
from trainers.preflight import check_inputs
from trainers.profiling import build_profiler, span
from trainers.progress import progress_bar
from trainers.resume import check_compatible, compat_of
from trainers.run_dir import RunDir
from trainers.storage import ensure_folder, location
from trainers.tracking import build_sinks

__all__ = ["FitResult", "NonFiniteLossError", "Trainer", "TrainerCallback", "lm_loss"]


class TrainerCallback:
    """User hooks; every method is a no-op by default. `after_checkpoint` runs once `path` is committed: with
    `checkpoint.mode: async` that is a few steps after the step it holds (`checkpoint_step(path)`), while
    `trainer.step` has moved on."""

    # The whole model as built, on every rank, before the engine parallelizes, shards or wraps it (and before
    # the optimizer exists): freeze parameters, add forward hooks. Its parameters hold their initial values;
    # when they come from a checkpoint or a Hugging Face folder they may not be there yet (the meta device).
    def on_model_built(self, trainer: Trainer, model: torch.nn.Module) -> None: ...
    def on_fit_start(self, trainer: Trainer) -> None: ...
    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None: ...
    # `record` ({"val_loss": ...}) may be given the callback's own values (numbers, e.g. an accuracy it
    # measured): they go into the eval row of metrics.jsonl and a run's reports, and a search can rank by
    # them (`metric: eval/accuracy`).
    def after_eval(self, trainer: Trainer, record: dict[str, Any]) -> None: ...
    def after_checkpoint(self, trainer: Trainer, path: Path) -> None: ...


_HOOKS = tuple(name for name in vars(TrainerCallback) if name.startswith(("on_", "after_")))


def _check_callbacks(callbacks: list[Any]) -> None:
    """A callback written without subclassing `TrainerCallback` is refused in one line naming the hooks it
    lacks, at the Trainer's construction, not with an AttributeError at the first hook it misses."""
    for cb in callbacks:
        missing = [name for name in _HOOKS if not callable(getattr(cb, name, None))]
        if missing:
            raise TypeError(
                f"callback {type(cb).__name__} has no {', '.join(missing)}; fix: subclass "
                "trainers.TrainerCallback (every hook is a no-op there) and override the ones it needs"
            )


@dataclass
class FitResult:
    run_dir: Path
    step: int
    train_loss: float | None
    val_loss: float | None
    checkpoint: Path | None
    stopped: str | None = None  # why a callback ended the run before train.steps (`Trainer.request_stop`)


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        engine: Engine | None = None,
        callbacks: list[TrainerCallback] | tuple = (),
        progress: bool = True,
    ):
        if cfg.memory.fit == "auto":
            raise ConfigError(
                "memory.fit=auto is resolved before the Trainer is built (it shapes the engine's layout); fix: "
                "start the run with trainers.run_local, or build the Trainer from "
                "trainers.autofit.resolve_fit(cfg)[0]"
            )
        self.cfg, self.callbacks, self.progress = cfg, list(callbacks), progress
        _check_callbacks(self.callbacks)
        self.engine = engine or build_engine(cfg)
        self.device = self.engine.device
        self.run_dir = cfg.out_dir
        self.manifest = check_inputs(cfg, shards=False)  # TokenWindows checks each shard as it reads it
        self.accum = cfg.train.accumulation(self.engine.dp_size)
        data = cfg.data
        self.train_data = TokenWindows(data.path, "train", data.seq_len, data.cache, data.cache_limit)
        self.val_data = TokenWindows(data.path, "val", data.seq_len, data.cache, data.cache_limit)
        self.sampler = GlobalSampler(self.train_data.num_windows, cfg.seed, cfg.data.shuffle)
        self.checkpointer = Checkpointer(
            RunDir(self.run_dir).checkpoints,
            cfg.checkpoint.keep,
            self.engine.checkpoint_backend,
            mode=cfg.checkpoint.mode,
            threads=cfg.checkpoint.threads,
        )
        resume = self._resume_path()  # before the model: a resume wins over model.init_from
        pretrained = cfg.model.init_from if resume[0] is None else None
        loaded = resume[0] is not None or pretrained is not None  # the weights come from files: no init
        model = self._build_model(pretrained, loaded)
        for cb in self.callbacks:
            cb.on_model_built(self, model)
        self.engine.setup(model, cfg)
        if loaded and self.engine.shards_meta_models:
            self.engine.materialize()  # this rank's shards only, then each reads its part
            if pretrained is not None:
                load_pretrained(self.engine.model, pretrained)
        self.model = self.engine.model
        self.log = MetricsLog(
            self.run_dir,
            enabled=self.engine.is_main,
            tensorboard=cfg.train.tensorboard,
            sinks=build_sinks(cfg) if self.engine.is_main else (),
        )
        self.profiler = build_profiler(cfg.profile, self.run_dir, self.device)
        self.step, self.bad_steps, self.last_checkpoint = 0, 0, None
        self.stop_reason: str | None = None
        self.train_loss: float | None = None  # the latest finite training loss and validation loss
        self.val_loss: float | None = None
        self._fitting = False  # inside fit(): restore() is refused (a callback cannot move the step)
        self._fit_started = False  # on_fit_start has run (at the first fit call)
        self._ended = False  # the run reached train.steps, stopped or failed: its log is closed
        self._replicas: int | None = None  # the live replica groups of the last step (per-step fault tolerance)
        # A replica group's first quorum, before any checkpoint is read: one that joins live groups ahead of it
        # takes their state from memory (no other engine heals: False).
        healed = self.engine.join((self._replica_state, self._load_replica_state))
        self.log.set_writer(self.engine.is_main)
        if healed:
            self._healed(self.engine.healed_from)
        else:
            self._restore(*resume)
            self.engine.committed_step(self.step)
            if resume[0] is None:
                self.set_hparams({})  # the learning-rate schedule (a restore sets it up itself)
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)

    # ------------------------------------------------------------------------------------------ build

    def _build_model(self, pretrained: Path | None, loaded: bool) -> torch.nn.Module:
        # Same seed, same init, whatever the world size; parallelism is applied from outside, by the engine's
        # setup (trainers/parallel/parallelize.py: TP -> activation checkpointing -> EP -> FSDP).
        torch.manual_seed(self.cfg.seed)
        chunk = self.cfg.memory.loss_chunk
        if not loaded:
            return build_model(self.cfg.model, loss_chunk=chunk)
        # Weights from a checkpoint or a Hugging Face folder: meta first, no init (6 s of a 1.1B resume's
        # build on the CPU, bench/results/resume_profile_gpu.txt); an engine that shards allocates only its
        # shards (see trainers/hf/pretrained.py), the others the whole model here.
        model = build_model(self.cfg.model, device="meta", loss_chunk=chunk)
        if not self.engine.shards_meta_models:
            materialize([model], torch.get_default_device())
            if pretrained is not None:
                load_pretrained(model, pretrained)
        return model

    def _resume_candidates(self) -> list[Path]:
        resume = self.cfg.checkpoint.resume
        if resume == "none":
            return []
        if resume == "auto":
            return self.checkpointer.candidates()
        path = location(resume)  # a local folder or a URI
        if not is_complete(path):
            raise ConfigError(
                f"checkpoint.resume={resume} is not a complete checkpoint; fix: point it at a step_XXXXXXXX "
                f"folder with a COMMITTED file, or use auto/none"
            )
        return [path]  # a given checkpoint (e.g. a PBT donor's): no fallback to others

    def _resume_path(self) -> tuple[Path | None, list[dict[str, str]], float]:
        """The newest checkpoint whose files match their checksums, those skipped on the way (why), and the
        seconds the checks took."""
        candidates, skipped = self._resume_candidates(), []
        start = time.perf_counter()
        for path in candidates:
            problem = self.checkpointer.verify(path, self.checkpointer.threads)
            if problem is None:
                return path, skipped, time.perf_counter() - start
            skipped.append({"checkpoint": str(path), "reason": problem})
        if skipped:
            told = "; ".join(f"{s['checkpoint'].rstrip('/').rsplit('/', 1)[-1]}: {s['reason']}" for s in skipped)
            raise CheckpointError(
                f"no readable checkpoint to resume from in {candidates[0].parent} ({told}); fix: restore "
                f"those files, or start over with --set checkpoint.resume=none or a new run_dir"
            )
        return None, skipped, time.perf_counter() - start

    def set_hparams(self, values: dict[str, Any]) -> None:
        """The one way a running trainer's hyperparameters change (a restore, a PBT exploit, a replayed
        schedule, live values): dotted `optimizer.*` and `schedule.*` run-config keys, validated with the
        whole config, written into the optimizer's param groups (`Engine.apply_hparams`) and the learning-rate
        schedule (closed-form in the step). `{}` re-applies the current ones (over a restored optimizer's)."""
        check_hparam_keys(values)
        cfg = with_values(self.cfg, values) if values else self.cfg
        self.cfg = cfg
        self.engine.apply_hparams(cfg.optimizer)
        self.lr_schedule = LRSchedule(self.engine.param_groups, cfg.schedule, cfg.train.steps)

    def restore(
        self, path: Path, hparams: dict[str, Any] | None = None, event: str = "restore", **fields: Any
    ) -> None:
        """Collective, between `fit` calls: load the committed checkpoint `path` (weights, optimizer state,
        data position, RNG and step) into this trainer, with the hyperparameters `hparams` (dotted keys,
        `set_hparams`) applied over its optimizer state and schedule: exactly a new run resumed from `path`
        with those values, without a new process, model build or process group. The metrics after its step
        are dropped (they will be recomputed) and an `event` record is written with `fields` (a PBT exploit:
        `event="exploit"`, the donor and the values its trackers show). Refused inside `fit` (a callback's)."""
        if self._fitting or self._ended:
            raise RuntimeError(
                "Trainer.restore is called between fit() calls of a run that has not ended (a callback cannot "
                "move the trainer's step); fix: return from fit (fit(until=step)), then restore"
            )
        values = dict(hparams or {})
        check_hparam_keys(values)
        # applied by the restore, over the checkpoint's optimizer state
        self.cfg = with_values(self.cfg, values) if values else self.cfg
        self._restore(location(path), [], event=event, **fields)
        self.engine.committed_step(self.step)  # replica groups: the quorum's step is the checkpoint's

    def request_stop(self, reason: str) -> None:
        """Ends the run at the next step boundary on purpose (a Tune segment's last step, a trial stopped by
        its scheduler): `fit()` returns with `FitResult.stopped = reason` after no further step or save (a
        save in flight commits first). Called from a callback, on every rank at the same step."""
        self.stop_reason = reason

    def _restore(
        self,
        path: Path | None,
        skipped: list[dict[str, str]],
        verify_s: float = 0.0,
        event: str = "resume",
        **fields: Any,
    ) -> None:
        """Load `path` (None: a fresh start); the metrics are kept up to its step."""
        if path is None:
            self.log.resume_from(0)  # a fresh run in an old run dir starts a fresh log
            start = {"init_from": str(self.cfg.model.init_from)} if self.cfg.model.init_from else {}
            self._emit(
                "event", event="start", world_size=self.engine.world_size, accumulation=self.accum, **start
            )
            return
        saved = self.checkpointer.trainer_state(path)
        check_compatible(saved.get("compat"), compat_of(self.cfg, self.manifest), path)
        same_optimizer = saved.get("optimizer") == self.cfg.optimizer.name
        state = self.engine.checkpoint_state(with_optimizer=same_optimizer)
        start = time.perf_counter()
        trainer_state, rng = self.checkpointer.load(path, state)
        restore_s = time.perf_counter() - start
        self.set_hparams({})  # this run's hyperparameters over the saved optimizer's (which may differ)
        self.step = int(trainer_state["step"])
        self.bad_steps = int(trainer_state.get("bad_steps", 0))
        self.engine.load_extra_state(trainer_state.get("engine", {}))
        if rng is not None:
            torch.set_rng_state(rng["torch"])
        self.last_checkpoint = path
        self.log.resume_from(self.step)
        self._emit(
            "event",
            event=event,
            checkpoint=str(path),
            **fields,
            restore_s=round(restore_s, 4),
            **({"verify_s": round(verify_s, 4)} if event == "resume" else {}),
            world_size=self.engine.world_size,
            saved_world_size=trainer_state.get("world_size"),
            **({"skipped": skipped} if skipped else {}),
        )
        saved_world = trainer_state.get("world_size")
        if saved_world is not None and saved_world != self.engine.world_size:
            # An elastic restart (or a manual resume at another size): same global batch, new accumulation.
            self._emit(
                "event",
                event="resize",
                old_world_size=saved_world,
                new_world_size=self.engine.world_size,
                accumulation=self.accum,
            )

    # ------------------------------------------------------------------------------------------- loop

    def fit(self, until: int | None = None) -> FitResult:
        """Train up to step `until` (default, and at most, `train.steps`). Returns at that step boundary with
        its checkpoint committed (saved there if the schedule had none), or earlier where a callback asked
        to stop (`request_stop`); call it again to go on. The run ends (its log closed, its trackers told)
        when it reaches `train.steps`, stops, or fails. Callbacks' `on_fit_start` runs at the first call."""
        cfg = self.cfg
        end = cfg.train.steps if until is None else min(int(until), cfg.train.steps)
        if self._ended:
            raise RuntimeError("this Trainer's run has ended; fix: build a new Trainer to train again")
        ensure_folder(self.run_dir)
        if self.engine.is_main:
            RunDir(self.run_dir).write_config(cfg.to_yaml())
        if not self._fit_started:  # once per run: a loop's later fit(until=...) calls go on with it
            self._fit_started = True
            for cb in self.callbacks:
                cb.on_fit_start(self)
        bar = self._progress_bar()
        status = "KILLED"  # for trackers: stopped (Ctrl-C, a lost worker, a Tune trial's end), may go on
        hold_freed_heap()  # on CPU, glibc would hand each step's activations back and fault them in again
        self._fitting = True
        try:
            while self.step < end and self.stop_reason is None:
                record = self.train_step()
                if record is None:  # not committed: the same step again, in the next quorum
                    continue
                self._collect(wait=False)  # a background save that committed: its event and callbacks
                if self.stop_reason is not None:  # a callback asked (after this step, or at a commit)
                    break
                self.train_loss = record["loss"] if math.isfinite(record["loss"]) else self.train_loss
                done = self.step == cfg.train.steps
                if (cfg.train.eval_every and self.step % cfg.train.eval_every == 0) or done:
                    self.val_loss = self.evaluate()
                due = (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) or (done and cfg.checkpoint.final)
                if due or (self.step == end and not done):  # fit(until) returns with that step committed
                    self._start_save()
                if self.step == end:  # the last save of this call commits before it returns
                    self._collect(wait=True)
                if bar is not None:
                    bar.update(1)
                    if self.step % cfg.train.log_every == 0 or done:
                        bar.set_postfix(
                            loss=f"{record['loss']:.3f}",
                            val=self.val_loss and f"{self.val_loss:.3f}",
                            tok_s=f"{record['tokens_per_s']:.0f}",
                            lr=f"{record['lr']:.2e}",
                        )
            if self.stop_reason is None and self.step < cfg.train.steps:
                status = "RUNNING"  # returned at `until`: the run goes on at the next call
            elif self.stop_reason is None:
                status = "FINISHED"
            else:  # stopped on purpose: the save in flight (if any) commits first, without a report
                self._stop_with_save_in_flight(None)
        except (NonFiniteLossError, ConfigError, CheckpointError) as e:
            status = "FAILED"
            self._stop_with_save_in_flight(e)
            raise
        except BaseException as e:
            self._stop_with_save_in_flight(e)
            raise
        finally:
            self._fitting = False
            if bar is not None:
                bar.close()
            release_freed_heap()
            if status != "RUNNING":
                self._ended = True
                self.profiler.close()
                self.log.close(status)
        return FitResult(
            self.run_dir, self.step, self.train_loss, self.val_loss, self.last_checkpoint, self.stop_reason
        )

    def _left_behind(self) -> bool:
        """Per-step fault tolerance: this group was behind the others (a straggler, one cut off and back) and is
        now alone in its quorum, so no live group is ahead to heal from: the others finished the run, or were
        all lost. Were it to train on from its own step, the steps the others committed would be trained and
        recorded twice; it goes on from the run's newest committed checkpoint instead when that is ahead of it
        (the run's end, when the others finished), as a group Ray starts then would. With none ahead (the others
        finished between two checkpoints, `checkpoint.final: false`) it trains their steps after its own again,
        and their rows give way to its own (each step once in the records, as after a restart)."""
        was, now = self._replicas, self.engine.replicas
        if now != 1 or was is None or was <= 1:
            return False
        newest = self.checkpointer.latest()
        self.log.set_writer(self.engine.is_main)  # alone: its records are the run's
        if newest is None or checkpoint_step(newest) <= self.step:
            written = read_metrics(self.log.path, "train")
            if written and written[-1]["step"] > self.step:
                self.log.resume_from(self.step)
            return False
        self._restore(newest, [])
        self.engine.committed_step(self.step)
        self._replicas = 1
        return True

    def _healed(self, heal: dict[str, Any]) -> None:
        """This replica group took a live one's state: the schedule is rebuilt over the optimizer's new param
        groups (a loaded optimizer replaces them; the schedule held the old ones, and set a learning rate the
        optimizer no longer read: the healed group's weights then drifted from its peers'), and it is told."""
        self.set_hparams({})
        if self.engine.group_rank == 0:  # told once for the group
            self.log.append({"kind": "event", "event": "healed", "step": self.step, "time": time.time(), **heal,
                             "replicas": self.engine.replicas})

    def _replica_state(self) -> dict[str, Any]:
        """What a replica group that heals takes from a live one, beside the engine's model and optimizer."""
        hparams = {f"{section}.{k}": v for section in ("optimizer", "schedule")
                   for k, v in getattr(self.cfg, section).model_dump(mode="json").items()}
        return {"step": self.step, "bad_steps": self.bad_steps, "rng": torch.get_rng_state(), "replicas": self._replicas,
                "hparams": hparams}

    def _load_replica_state(self, state: dict[str, Any]) -> None:
        self.step, self.bad_steps = int(state["step"]), int(state["bad_steps"])
        # the live group's hyperparameters (a PBT exploit's, which this group may have started before): `_healed`
        # applies them
        self.cfg = with_values(self.cfg, state["hparams"])
        torch.set_rng_state(state["rng"])
        # the live groups' last step's count: a healed group that becomes the records' writer (the lowest index)
        # tells the change its return makes
        self._replicas = state.get("replicas")

    def train_step(self) -> dict[str, Any] | None:
        """One step; None when it did not commit (per-step fault tolerance: a replica group was lost inside it,
        and the next quorum trains the same samples again)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        self.engine.begin_step()  # a replica group's quorum (a group behind heals here): may move the step
        quorum_s = time.perf_counter() - t0
        if (heal := self.engine.take_heal()) is not None:
            self._healed(heal)
        elif self._left_behind():
            return None  # restored to the run's record: its step is the next to train (or the run is done)
        step = self.step
        self.profiler.before_step(step + 1)
        if self.engine.replicas is not None:
            self._follow_replicas()
        batch = cfg.train.global_batch_size
        sample_ids = self.sampler.window_ids(step * batch, batch)  # global batch t = samples [tB, (t+1)B)
        micro_batches = np.split(
            shard_for_rank(sample_ids, self.engine.dp_rank, self.engine.dp_size), self.accum
        )
        # The next step's windows are fetched while this one computes (a bucket's pieces; a local disk's hint).
        ahead = self.sampler.window_ids((step + 1) * batch, batch)
        self.train_data.prefetch(shard_for_rank(ahead, self.engine.dp_rank, self.engine.dp_size))
        lr = self.lr_schedule.apply(step)
        self.engine.zero_grad()
        data_s = [0.0]  # the engine pulls micro-batches as it goes: their loading is timed one by one
        t_fb = time.perf_counter()
        loss = self.engine.forward_backward(self._batches(micro_batches, data_s), self.accum)
        with span("communication"):
            loss_value = float(self.engine.reduce_mean(loss))
        if not self.engine.should_commit():
            self.engine.zero_grad()
            return None
        t_opt = time.perf_counter()
        grad_norm, bad = math.nan, True
        if math.isfinite(loss_value):
            with span("optimizer"):
                grad_norm, bad = self.engine.step(cfg.optimizer.grad_clip)
        t_end = time.perf_counter()
        ok = not bad
        if ok:
            self.bad_steps = 0
        else:
            self._bad_step(loss_value)
        self.step += 1
        dt = time.perf_counter() - t0
        tokens_per_s = batch * cfg.data.seq_len / dt
        record = dict(
            loss=loss_value,
            lr=lr,
            grad_norm=grad_norm,
            step_time_s=dt,
            # Host clock only (no added sync): on a GPU a phase ends when its result is read back (the
            # loss for forward+backward, the grad norm for the optimizer), so each includes queued work.
            data_s=data_s[0],
            forward_backward_s=t_opt - t_fb - data_s[0],
            optimizer_s=t_end - t_opt,
            tokens_per_s=tokens_per_s,
            mfu=self.flops_per_token * tokens_per_s / (cfg.train.peak_tflops * 1e12 * self.engine.world_size),
            peak_mem_bytes=peak_memory_bytes(self.device),
            samples=self.step * batch,
            world_size=self.engine.world_size,
            skipped=not ok,
        )
        if self.engine.replicas is not None:  # per-step fault tolerance: the step's live groups, its quorum's time
            record.update(replicas=self.engine.replicas, quorum_s=quorum_s)
        if self.engine.loss_scale != 1.0:
            record["loss_scale"] = self.engine.loss_scale
        record.update(self.engine.moe_stats())
        self._emit("train", **record)
        profiled = self.profiler.after_step(self.step)
        if profiled is not None:
            self._emit("event", event="profile", **profiled)
        for cb in self.callbacks:
            cb.after_step(self, record)
        return record

    def _follow_replicas(self) -> None:
        """Per-step fault tolerance: the step's number of live replica groups sets the accumulation (the global
        batch is kept), and the group that writes the records may change with it."""
        replicas = self.engine.replicas
        self.accum = self.cfg.train.accumulation(self.engine.dp_size)
        self.log.set_writer(self.engine.is_main)
        if self._replicas is not None and replicas != self._replicas:
            self._emit("event", event="replicas", old_replicas=self._replicas, new_replicas=replicas,
                       accumulation=self.accum)
        self._replicas = replicas

    def _batches(self, micro_batches: list[np.ndarray], data_s: list[float]):
        for ids in micro_batches:
            t = time.perf_counter()
            with span("data"):
                batch = tuple(x.to(self.device, non_blocking=True) for x in self.train_data.get(ids))
            data_s[0] += time.perf_counter() - t
            yield batch

    def _bad_step(self, loss_value: float) -> None:
        self.engine.zero_grad()
        self.bad_steps += 1
        if self.bad_steps >= self.cfg.train.max_bad_steps:
            keep = self.last_checkpoint or "none saved yet"
            raise NonFiniteLossError(
                f"loss is {loss_value} for {self.bad_steps} steps in a row (train.max_bad_steps="
                f"{self.cfg.train.max_bad_steps}) at step {self.step + 1}; fix: lower optimizer.lr, set "
                f"optimizer.grad_clip, or use precision.dtype=bf16; last good checkpoint: {keep}"
            )

    @torch.no_grad()
    def evaluate(self) -> float:
        cfg = self.cfg
        # The same validation windows at every world size (a global count, split across dp ranks), so
        # val_loss does not jump when an elastic run resumes at another size.
        rank, dp = self.engine.eval_shard()
        count = min(cfg.train.eval_batches * cfg.train.micro_batch_size, self.val_data.num_windows) // dp * dp
        ids = shard_for_rank(eval_window_ids(self.val_data.num_windows, count), rank, dp)
        chunks = np.array_split(ids, max(len(ids) // cfg.train.micro_batch_size, 1))
        batches = (tuple(t.to(self.device) for t in self.val_data.get(chunk)) for chunk in chunks)
        total = self.engine.eval_loss(batches)
        val_loss = float(self.engine.reduce_mean(total / len(ids)))
        record = {"val_loss": val_loss}
        for cb in self.callbacks:  # a callback may add its own values: logged with the row, reported to Ray
            cb.after_eval(self, record)
        self._emit("eval", **record)
        return val_loss

    def save(self) -> Path | None:
        """Collective: a checkpoint of the current step, returned once committed (its event written, its
        callbacks run), in either `checkpoint.mode`. None when a callback stopped the run at the commit of
        the save before it (nothing is saved then)."""
        if not self._start_save():
            return None
        self._collect(wait=True)
        return self.last_checkpoint

    def _start_save(self) -> bool:
        """Collective. `sync`: the save, committed and reported. `async`: returns once the state is staged;
        the commit is reported (event, callbacks) at a later step boundary by `_collect`. At most one save is
        in flight: this one waits for the one before to commit (`wait_s`). False when that commit's callbacks
        stopped the run: nothing is saved then."""
        if not self.engine.saves:  # per-step fault tolerance: one replica group writes the run's checkpoints
            return True
        start = time.perf_counter()
        self._collect(wait=True)
        if self.stop_reason is not None:
            return False
        wait_s = time.perf_counter() - start
        trainer_state = {
            "step": self.step,
            "samples": self.step * self.cfg.train.global_batch_size,
            "bad_steps": self.bad_steps,
            "world_size": self.engine.world_size,
            "engine": self.engine.extra_state(),
            "optimizer": self.cfg.optimizer.name,
            "compat": compat_of(self.cfg, self.manifest),
            "model": self.cfg.model.model_dump(mode="json"),  # what `raytrain export` describes,
            "data_path": str(self.cfg.data.path),  # and where it finds the tokenizer
        }
        # A run dir on an object store gets the records up to this step before the step is committed.
        self.log.flush()
        state, rng = self.engine.checkpoint_state(), {"torch": torch.get_rng_state()}
        if self.checkpointer.mode == "async":
            self.checkpointer.start_save(self.step, state, trainer_state, rng, wait_s=wait_s)
        else:
            self._on_commit(self.checkpointer.save_with_figures(self.step, state, trainer_state, rng, wait_s=wait_s))
        return True

    def _collect(self, wait: bool) -> None:
        """Collective while a save is in flight: report it if it committed (with `wait`: once it has)."""
        committed = self.checkpointer.collect(wait)
        if committed is not None:
            self._on_commit(committed)

    def _on_commit(self, committed: Committed, callbacks: bool = True) -> None:
        """A committed checkpoint: its event (at its own step, with what it cost) and the callbacks (a Ray
        report, a PBT trial's gate), which thus only ever see committed checkpoints."""
        self.last_checkpoint = committed.path
        figures = {k: round(v, 4) if isinstance(v, float) else v for k, v in vars(committed.figures).items()}
        self._emit("event", event="checkpoint", path=str(committed.path), **figures, step=committed.step)
        for cb in self.callbacks if callbacks else ():
            cb.after_checkpoint(self, committed.path)

    def _stop_with_save_in_flight(self, error: BaseException | None) -> None:
        """Stopping on `error` (None: on request, `request_stop`) with a save in flight: on one process, on
        request, or on an error every rank meets at the same point, wait for its commit (it is then the resume
        point); else (a lost peer could hold its barriers forever) leave it: it commits if its writer still
        can, and is never loaded if not. Says which."""
        step = self.checkpointer.in_flight
        if step is None:
            return
        why = "stop requested" if error is None else type(error).__name__
        together = error is None or isinstance(error, (NonFiniteLossError, ConfigError))
        if self.engine.world_size == 1 or together:
            try:
                committed = self.checkpointer.collect(wait=True)
            except CheckpointError as e:
                self._say(f"stopping ({why}): the save of step {step} failed ({e})")
                return
            if committed is not None:
                self._on_commit(committed, callbacks=False)  # no report: the run is stopping
                self._say(f"stopping ({why}): waited for the save of step {step}, committed: {committed.path}")
            return
        self.checkpointer.abandon()
        self._emit("event", event="checkpoint_abandoned", checkpoint_step=step, reason=why)
        self._say(
            f"stopping ({why}) with the save of step {step} in flight: not waited for (another rank may be "
            f"gone); a resume takes the newest committed checkpoint"
        )

    def _say(self, line: str) -> None:
        if self.engine.is_main:
            print(line, flush=True)

    # ---------------------------------------------------------------------------------------- helpers

    def _emit(self, kind: str, **fields: Any) -> None:
        """A record at the current step (an event about another step passes `step=`)."""
        self.log.write({"kind": kind, "step": self.step, "time": time.time(), **fields})

    def _progress_bar(self):
        if not (self.progress and self.engine.is_main):
            return None
        return progress_bar(self.cfg.train.steps, self.cfg.name, initial=self.step)
