"""The training loop: forward, loss, backward, clip, step, schedule. Everything else is a call out.

The trainer gets its parts built (`dpt.loop.parts`) and only orders them. Between agreements
(`dpt.loop.agreement`: log steps at least 50 ms apart, checkpoint steps, an epoch's and the run's
last step) nothing waits for the device or another rank, except the gradient all-reduce inside
`backward` under ddp.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dpt.data.loaders import Batch
from dpt.data.position import DataPosition
from dpt.data.shard_fetch import SourceUnreachable
from dpt.distributed import local_part
from dpt.errors import one_line
from dpt.loop import reactions, resume_apply
from dpt.loop.agreement import Agreed, NonFiniteLoss, Payload
from dpt.loop.interrupt import DataStopped, Interrupted, StopRequest, stop_on_signals
from dpt.loop.param_groups import group_lrs
from dpt.loop.parts import Parts
from dpt.loop.reactions import RolledBack
from dpt.observe.console import log_epoch, log_validation
from dpt.state.checkpoint import Committed, committed
from dpt.state.stateful import (
    ModelState,
    OptimizerState,
    PlainState,
    Progress,
    RNGState,
)
from dpt.targets import IGNORE_INDEX


@dataclass
class TrainResult:
    steps: int  # the run's, a resumed one's earlier sessions' too
    session_steps: int  # this session's
    samples: int  # world-wide, in this session
    wall_time_s: float
    final_loss: float | None
    bad_samples: int
    val: dict[str, float]
    best_per_metric: dict[str, float]  # each metric at its own best epoch
    stopped_early: bool


class Trainer:
    def __init__(self, parts: Parts) -> None:
        self.parts, self.settings = parts, parts.settings
        self.model, self.optimizer, self.scheduler = parts.model, parts.optimizer, parts.scheduler
        self.precision, self.metrics = parts.precision, parts.metrics
        self.agreement, self.monitor = parts.agreement, parts.monitor
        self.task = parts.task  # the loss, and (in validation) the metrics
        self.global_batch = parts.global_batch
        self.progress, self.position = Progress(), DataPosition(global_batch=self.global_batch)
        self.rng = RNGState(parts.env.rank, parts.env.world_size)
        # The optimizer's and schedule's settings as configured, before any checkpoint loads.
        self.configured = resume_apply.Settings.of(self.optimizer, self.scheduler)
        # The step's forwards and backwards: the loop below, or the strategy's own schedule
        # (a pipeline streams the micro-batches through its stages).
        self.run_micro_batches = parts.strategy.forward_backward or self.forward_backward
        self.validated_at: int | None = None  # the step of this session's last validation
        self.first_step = 0  # the step this session started from (fit sets it)
        self.stopping_early = False  # a validation on the schedule called for early stopping

    # --- the loop ---------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        p, start, stopped_early = self.progress, time.perf_counter(), False
        self.first_step = p.step  # where this session starts (a resumed run's checkpoint)
        with stop_on_signals() as stop, self.stops_without_data():
            while not stopped_early and p.step < self.parts.total_steps:  # epochs or max_steps
                self.model.train()
                try:
                    for micro_batches, data_s in self.parts.loaders.epoch_batches(
                        self.position, self.settings.grad_accum_steps
                    ):
                        self.train_step(micro_batches, data_s, stop)
                        if p.step >= self.parts.total_steps or self.stopping_early:
                            break
                except RolledBack:  # back at a checkpoint: the epoch goes on past the spike
                    continue
                with self.metrics.outside_windows():  # the windows time the training alone
                    stopped_early = self.end_of_epoch()
        if self.position.sample:  # stopped inside an epoch (max_steps)
            self.save_checkpoint()
        return self.result(time.perf_counter() - start, stopped_early)

    def train_step(self, micro_batches: list[Batch], data_s: float, stop: StopRequest) -> None:
        loss, work_s = self.run_micro_batches(micro_batches, time.perf_counter() - data_s)
        self.parts.strategy.sync_gradients(self.model)
        grad_norm = self.precision.clip_and_norm(
            self.model, self.optimizer, self.settings.grad_clip_norm
        )
        clipped = grad_norm is not None
        if not clipped and self.monitor.computes_norm:  # for grad_spike's reactions alone
            grad_norm = self.precision.norm(self.model, self.optimizer)
        samples = sum(len(batch.targets) for batch in micro_batches)
        bad = sum(batch.skipped for batch in micro_batches)
        self.metrics.record(loss, samples, bad, data_s, work_s, grad_norm, clipped)
        ends_epoch_or_run, ends_window = self.ends_here()
        if ends_window:  # on the host: its sums wait for the next agreement
            self.metrics.end_window(self.progress.step + 1, self.position.epoch)
        agreed = self.agree(stop) if self.agrees_now(ends_epoch_or_run) else None  # waits: seldom
        if agreed is None or agreed.judgement.apply_update:
            self.update()
        else:
            self.precision.skip_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if ends_window:
            self.metrics.set_lr(group_lrs(self.optimizer))
        self.progress.step += 1
        self.position.sample += self.global_batch
        if agreed is not None:
            self.after_agreement(agreed, stop, ends_epoch_or_run)

    def update(self) -> None:
        """The optimizer's step, with the gradient diagnostics around it where they are due."""
        diagnosed = self.parts.diagnostics.due(self.progress.step + 1)
        if diagnosed:
            self.precision.unscale(self.optimizer)  # 16-mixed: the true gradients
            self.parts.diagnostics.before_update()
        self.precision.step(self.optimizer)  # 16-mixed: the scaler waits for its inf check
        if diagnosed:  # rare (monitor.grad_diagnostics_every): read back at once
            self.metrics.scalars(self.parts.diagnostics.after_update(), self.progress.step + 1)

    def forward_backward(
        self, micro_batches: list[Batch], step_start: float
    ) -> tuple[torch.Tensor, float]:
        """Gradients summed over the micro-batches; returns the loss (on the device) and this
        rank's own work time: until its last backward, where ddp waits for the other ranks."""
        losses, work_s = [], 0.0
        scales = self.scored_shares(micro_batches)
        for i, (inputs, targets, _) in enumerate(micro_batches):
            inputs, targets = self.parts.to_device(inputs), self.parts.to_device(targets)
            last = i == len(micro_batches) - 1
            # ddp all-reduces (fsdp reduce-scatters) once, in the last backward
            with contextlib.nullcontext() if last else self.parts.strategy.no_sync(self.model), \
                    self.parts.strategy.loss_context():  # fmt: skip
                with self.precision.autocast():
                    outputs = self.model(inputs)
                    # A micro-batch of only unreadable images: a zero loss, so that ddp's
                    # all-reduce still runs on every rank (this rank adds zero gradients).
                    loss = self.task.loss(outputs, targets) if len(targets) else outputs.sum() * 0.0
                    loss = local_part(loss)  # a loss on split logits: each rank holds it whole
                if scales is not None:
                    loss = loss * scales[i]
                elif len(micro_batches) > 1:
                    loss = loss / len(micro_batches)  # the mean over the whole batch
                if last:
                    work_s = time.perf_counter() - step_start
                self.precision.backward(loss)
            losses.append(loss.detach())
        return (losses[0] if len(losses) == 1 else torch.stack(losses).sum()), work_s

    def scored_shares(self, micro_batches: list[Batch]) -> torch.Tensor | None:
        """Targets that leave positions out (dataset=chat: IGNORE_INDEX outside the answers):
        each micro-batch's loss (a mean over its scored positions) weighed by its count of them
        over the step's, world-wide (one small all-reduce), so that the step's loss is the mean
        per scored token of the global batch, as one process on it has it. A mean of the ranks'
        means would weigh a token by how few its rank holds. None: equal shares."""
        if not self.parts.masked_targets:
            return None
        env = self.parts.env
        counts = torch.stack([(b.targets != IGNORE_INDEX).sum() for b in micro_batches])
        counts = counts.to(env.device, torch.float32)
        total = counts.sum()
        if env.world_size > 1:  # ddp averages the ranks' gradients: their shares add up
            dist.all_reduce(total)
        return counts * env.world_size / total.clamp(min=1)

    # --- agreement: the one collective per window (or per several short ones) ------------------

    def ends_here(self) -> tuple[bool, bool]:
        """Whether this step ends its epoch or the run, and whether it ends a logging window:
        every trainer.log_every_n_steps steps, and at the epoch's and the run's last step."""
        step = self.progress.step + 1
        ends_epoch_or_run = self.steps_left() == 1 or step >= self.parts.total_steps
        return ends_epoch_or_run, ends_epoch_or_run or step % self.settings.log_every_n_steps == 0

    def agrees_now(self, ends_epoch_or_run: bool) -> bool:
        """Ranks agree before anything is saved and before the loop can end: at checkpoint
        steps and the epoch's and run's last step; else when the agreement's cadence calls for
        it (log steps, spaced; every step under on_nonfinite=skip, whose update waits for the
        verdict). A stop signal is thus acted on within trainer.log_every_n_steps steps, or
        within `dpt.loop.agreement.SPACING_S` seconds where that is more steps."""
        step, every_ckpt = self.progress.step + 1, self.parts.checkpoint_every
        return (
            self.agreement.due(step)
            or bool(every_ckpt and step % every_ckpt == 0)
            or ends_epoch_or_run
            or self.validates_between_epochs(step, ends_epoch_or_run)
        )

    def validates_between_epochs(self, step: int, ends_epoch_or_run: bool) -> bool:
        """A step on trainer.val_every_n_steps' schedule that does not end its epoch or the run
        (there the epoch's end validates): it validates after its agreement, before any
        checkpoint or stop, so that one resumed from either has it."""
        every = self.settings.val_every_n_steps
        return bool(every and step % every == 0 and not ends_epoch_or_run)

    def agree(self, stop: StopRequest) -> Agreed:
        """The ranks' agreement, and the monitor's judgement of the steps it covers (the same on
        every rank: it reads what the agreement gathered)."""
        losses, norms = self.metrics.read_back()  # the agreement's one wait for the device
        mine = Payload(self.metrics.payload(), self.monitor.payload(losses, norms))
        step = self.progress.step + 1
        try:
            verdict = self.agreement.agree(stop, step, losses, mine.row())
        except NonFiniteLoss as error:
            rows = mine.split(error.rows)
            self.metrics.agreed(rows.metrics)  # the curves up to the bad step, to look at
            raise reactions.nonfinite_error(self, error, rows.monitor) from None
        rows = mine.split(verdict.rows)
        values = self.monitor.step_values(rows.monitor, step, self.position.epoch,
                                          self.position.sample, self.global_batch)  # fmt: skip
        judgement = self.monitor.judge(values, verdict.nonfinite, [])
        reactions.name_skipped_nonfinite(self, judgement)  # before the update: its weights
        judgement.apply_update = judgement.apply_update and verdict.apply_update
        return Agreed(verdict.stop, judgement, rows)

    def after_agreement(self, agreed: Agreed, stop: StopRequest, ends_epoch_or_run: bool) -> None:
        windows = self.metrics.agreed(agreed.rows.metrics)  # the windows ended since the last
        self.progress.bad_samples += self.metrics.take_bad()
        self.check_skipped()
        judgement = agreed.judgement
        if judgement.decisive is None:  # the windows' speed, unless the run goes back or ends
            slow = self.monitor.judge([], None, windows, self.position.epoch)
            judgement.events += slow.events
            judgement.decisive = slow.decisive
        reactions.react(self, judgement)  # records the events; a rollback or stop raises
        if self.validates_between_epochs(self.progress.step, ends_epoch_or_run):
            with self.metrics.outside_windows():  # the windows time the training alone
                self.stopping_early = self.validate()
            if self.parts.env.is_main:
                log_validation(self.progress.step, self.parts.validation.last)
        if agreed.stop:  # agreed; a signal arriving later waits for the next agreement
            self.interrupt(stop)
        every_ckpt = self.parts.checkpoint_every
        if every_ckpt and self.progress.step % every_ckpt == 0:
            self.save_checkpoint()

    # --- data that cannot be had ----------------------------------------------------------------

    @contextlib.contextmanager
    def stops_without_data(self) -> Iterator[None]:
        """A source unreachable past dataset.outage_s (raised in this rank, maybe in a loader
        worker): the run stops with a checkpoint the same command resumes from."""
        try:
            yield
        except SourceUnreachable as error:
            # The other ranks wait in this step's collective: they cannot checkpoint with it.
            agreed = not self.parts.env.distributed
            raise self.stopped_for_data(one_line(error), agreed) from None

    def check_skipped(self) -> None:
        """At an agreement (every rank knows the world's count): more samples of damaged shards
        skipped this epoch than dataset.max_skipped_fraction allows stop the run here."""
        limit, bad = self.parts.max_skipped, self.progress.bad_in_epoch()
        if limit is None or bad <= limit:
            return
        size = len(self.parts.loaders.train.dataset)
        raise self.stopped_for_data(
            f"{bad} of this epoch's {size} samples skipped as unreadable, more than the {limit} "
            "dataset.max_skipped_fraction allows",
            agreed=True,
        )

    def stopped_for_data(self, why: str, agreed: bool) -> DataStopped:
        """This step's checkpoint where every rank is here to write it (`agreed`), else the
        newest committed one."""
        step, run_dir = self.progress.step, self.parts.run_dir
        newest = committed(self.parts.checkpoints.folder)
        if agreed:
            path: Path | None = self.save_checkpoint()
        else:
            path = newest[-1].path if newest and newest[-1].step == step else None
        if path is not None:
            saved = f"at step {step} with a checkpoint ({path})"
        elif newest:
            last = newest[-1]
            saved = f"at step {step}; its newest checkpoint is step {last.step} ({last.path})"
        else:
            saved = f"at step {step}, before any checkpoint"
        return DataStopped(
            f"{why}; stopped {saved}; the same command (hydra.run.dir={run_dir}) resumes"
        )

    def interrupt(self, stop: StopRequest) -> None:
        path = self.save_checkpoint()
        where = f" to {path}" if path else ""
        raise Interrupted(
            f"stopped by {stop.signal_name} after step {self.progress.step}; checkpoint "
            f"written{where}{self._in_time(stop)}. Resume: the same command with "
            f"hydra.run.dir={self.parts.run_dir} (checkpoint.resume=auto picks the newest "
            "checkpoint)"
        )

    def _in_time(self, stop: StopRequest) -> str:
        """` 1.2 s after the signal (trainer.stop_within=30)`, where the run has a deadline."""
        grace = self.settings.stop_within
        if grace is None or stop.at is None:
            return ""
        took = time.monotonic() - stop.at
        late = "" if took <= grace else ", past it: the last step took longer than the grace"
        return f" {took:.1f} s after the signal (trainer.stop_within={grace:g}{late})"

    # --- epochs -------------------------------------------------------------------------------

    def end_of_epoch(self) -> bool:
        """Validate (unless this step did, or the schedule skips it), checkpoint; returns
        whether early stopping triggered."""
        finished = self.steps_left() == 0  # not cut by max_steps
        step, every = self.progress.step, self.settings.val_every_n_steps
        stop = self.stopping_early
        if self.validated_at != step and (finished or not every or step % every == 0):
            stop = self.validate()
        val = self.parts.validation.last if self.validated_at == step else {}
        bad_in_epoch = self.progress.bad_in_epoch()
        self.progress.bad_at_epoch_start = self.progress.bad_samples
        if self.parts.env.is_main:  # world-wide numbers: one line, not one per rank
            log_epoch(self.position.epoch, self.progress.step, self.metrics.last_world_loss, val,
                      bad_in_epoch)  # fmt: skip
        if finished:
            self.position.next_epoch()
            self.save_checkpoint()
        return stop

    def validate(self) -> bool:
        """The world's validation at this step: its metrics to the trackers, early stopping's
        and the best model's turn; returns whether early stopping triggered."""
        model = self.model
        if self.parts.validation.loader is not None:  # a pipeline's stages put together
            model = self.parts.strategy.whole_model(self.model)
        val = self.parts.validation.run(model)
        self.validated_at = self.progress.step
        if self.parts.validation.partial:  # no metric of this validation to go by
            return False
        self.metrics.scalars(val, self.progress.step)
        self.parts.best_model.update(val, self.progress.step, self.position.epoch + 1, model)
        return self.parts.early_stopping.should_stop(val)

    def steps_left(self) -> int:
        """Full steps left in the epoch in progress."""
        return self.parts.loaders.steps_left(self.position, self.settings.grad_accum_steps)

    def result(self, wall_time_s: float, stopped_early: bool) -> TrainResult:
        return TrainResult(
            steps=self.progress.step,
            session_steps=self.progress.step - self.first_step,
            samples=self.metrics.world_samples,
            wall_time_s=wall_time_s,
            final_loss=self.metrics.last_world_loss,
            bad_samples=self.progress.bad_samples,
            val=self.parts.validation.last,
            best_per_metric=self.parts.validation.best,
            stopped_early=stopped_early,
        )

    # --- state --------------------------------------------------------------------------------

    def state_parts(self) -> dict[str, Any]:
        """Everything a checkpoint holds, each with state_dict()/load_state_dict() (DCP's
        `Stateful`): model and optimizer as tensors, the small parts as plain values."""
        plain = {
            "scheduler": self.scheduler,
            "scaler": self.precision,
            "progress": self.progress,
            "data_position": self.position,
            "validation": self.parts.validation,
            "early_stopping": self.parts.early_stopping,
            "best_model": self.parts.best_model,
            "monitor_levels": self.monitor.levels,  # rolled back with the model
            "monitor": self.monitor.history,  # kept by a rollback: what the run went through
            "history": self.metrics.history,  # the world's metrics: metrics.json, metrics.csv
        }
        return {
            "model": ModelState(self.model, trainable_only=self.parts.adapter_only),
            "optimizer": OptimizerState(self.model, self.optimizer),
            **{name: PlainState(part) for name, part in plain.items()},
            "rng": self.rng,
        }

    def save_checkpoint(self) -> Path | None:
        """Every rank writes its part; rank 0 commits once all have (see dpt.state.checkpoint)."""
        if not self.parts.checkpoint_settings.enabled:
            return None
        self.metrics.flush()  # the curves up to this step, on their way to disk first
        started = time.perf_counter()
        with self.metrics.outside_windows():
            path = self.parts.checkpoints.save(self.state_parts(), self.progress.step)
        self.agreement.checkpoint_s = time.perf_counter() - started  # a stop's deadline needs it
        return path

    def resume(self) -> Committed | None:
        """Load the checkpoint `checkpoint.resume` picks, if any; the metrics continue there."""
        start = self.parts.checkpoints.resume(
            self.parts.checkpoint_settings.resume, self.state_parts()
        )
        if start is None:  # a fresh start: an earlier run's events move aside with its work
            self.monitor.history.events.resume_at(0)
        if start is not None:
            self.parts.metrics.start_at(start.step)
            self.agreement.start_at(start.step)
        return start
