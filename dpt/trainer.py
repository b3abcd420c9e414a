"""The training loop: forward, loss, backward, step. Everything else is called from here.

`Trainer.fit` reads top to bottom like a hand-written PyTorch loop; precision, checkpoints,
signals, validation and logging are small calls out of it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from dpt import checkpoint
from dpt.config import CheckpointConfig, TrainerConfig
from dpt.data.loaders import Batch, Loaders
from dpt.distributed import DistEnv, agree_max, all_reduce_sum
from dpt.errors import DptError
from dpt.evaluate import evaluate
from dpt.interrupt import Interrupted, StopRequest, stop_on_signals
from dpt.metrics import MetricsLogger
from dpt.models import unwrap
from dpt.precision import Precision

log = logging.getLogger("dpt")


class NonFiniteLoss(DptError):
    """The loss became NaN or infinite (trainer.on_nonfinite=error)."""


class FirstNonFinite:
    """The first non-finite loss since the last `take`, kept on the device: noting a step costs
    no host-device sync; `take`, once per agreement, costs one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._reset()

    def _reset(self) -> None:
        self.step = torch.zeros((), dtype=torch.int64, device=self.device)
        self.loss = torch.zeros((), device=self.device)

    def note(self, loss: torch.Tensor, step: int) -> None:
        first = ~torch.isfinite(loss) & (self.step == 0)
        self.step = torch.where(first, step, self.step)
        self.loss = torch.where(first, loss.detach().float(), self.loss)

    def take(self) -> tuple[int, float]:
        """(step, loss) of the first non-finite loss, or (0, 0.0); starts over."""
        step = int(self.step.item())
        loss = float(self.loss.item()) if step else 0.0
        self._reset()
        return step, loss


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint (plain numbers only)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # the epoch in progress (0-based)
    step_in_epoch: int = 0  # optimizer steps done inside `epoch`
    bad_samples: int = 0  # unreadable inputs skipped, world-wide, in finished epochs
    best_val: dict[str, float] = field(default_factory=dict)
    stale_epochs: int = 0  # epochs without improvement of the early-stopping metric


@dataclass
class TrainResult:
    steps: int
    samples: int  # world-wide, in this session
    wall_time_s: float
    final_loss: float | None
    bad_samples: int
    val: dict[str, float]
    best_val: dict[str, float]
    stopped_early: bool


def planned_steps(loaders: Loaders, settings: TrainerConfig, world_size: int) -> int:
    """Optimizer steps of the whole run: epochs x full steps per epoch, capped by max_steps."""
    per_epoch = loaders.batches_per_epoch() // settings.grad_accum_steps
    if per_epoch == 0:
        raise DptError(
            f"the training set gives no full optimizer step: {loaders.train_size} samples over "
            f"{world_size} rank(s) at trainer.batch_size={loaders.batch_size} x "
            f"trainer.grad_accum_steps={settings.grad_accum_steps}"
        )
    total = per_epoch * settings.epochs
    return min(total, settings.max_steps) if settings.max_steps else total


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: LRScheduler,
        loaders: Loaders,
        env: DistEnv,
        metrics: MetricsLogger,
        settings: TrainerConfig,
        ckpt: CheckpointConfig,
        run_dir: Path,
        num_classes: int,
        channels_last: bool = False,
        config_yaml: str = "",
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.loaders, self.env, self.metrics = loaders, env, metrics
        self.settings, self.ckpt, self.run_dir = settings, ckpt, run_dir
        self.num_classes, self.channels_last, self.config_yaml = (
            num_classes,
            channels_last,
            config_yaml,
        )
        self.precision = Precision(settings.precision, env.device)
        self.loss_fn = nn.CrossEntropyLoss()
        self.accum = settings.grad_accum_steps
        self.non_blocking = env.device.type == "cuda"  # pinned batches copy while the GPU computes
        self.progress = Progress()
        self.planned_total = planned_steps(loaders, settings, env.world_size)
        self.nonfinite = FirstNonFinite(env.device)
        self.bad_in_epoch = 0  # this rank's unreadable samples; summed over ranks at epoch end
        self.val: dict[str, float] = {}

    # --- the loop ---------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        p, total_steps = self.progress, self.planned_total
        samples, start = 0, time.perf_counter()
        stopped_early = False
        with stop_on_signals() as stop:
            while p.epoch < self.settings.epochs and p.step < total_steps and not stopped_early:
                self.model.train()
                for micro_batches, data_s in self.batches_of_epoch():
                    loss, batch_samples = self.forward_backward(micro_batches)
                    grad_norm = self.precision.clip_and_norm(
                        self.model, self.optimizer, self.settings.grad_clip_norm
                    )
                    apply_update, stop_now = self.check_finite_and_signals(loss, stop)
                    if apply_update:
                        self.precision.step(self.optimizer)
                    self.optimizer.zero_grad(set_to_none=True)
                    self.scheduler.step()

                    p.step += 1
                    p.step_in_epoch += 1
                    samples += batch_samples
                    self.metrics.step(
                        p.step,
                        p.epoch,
                        loss,
                        batch_samples,
                        data_s,
                        self.scheduler.get_last_lr()[0],
                        grad_norm,
                    )
                    if stop_now:  # the agreed decision: a signal arriving later waits a step
                        self.interrupt(stop)
                    if (
                        self.ckpt.enabled
                        and self.ckpt.every_n_steps
                        and (p.step % self.ckpt.every_n_steps == 0)
                    ):
                        self.save_checkpoint()
                    if p.step >= total_steps:
                        break
                stopped_early = self.end_of_epoch()
        if p.step_in_epoch and self.ckpt.enabled:  # stopped inside an epoch (max_steps)
            self.save_checkpoint()
        return TrainResult(
            steps=p.step,
            samples=int(all_reduce_sum([samples], self.env)[0]),
            wall_time_s=time.perf_counter() - start,
            final_loss=self.metrics.last_world_loss,
            bad_samples=p.bad_samples,
            val=self.val,
            best_val=p.best_val,
            stopped_early=stopped_early,
        )

    def forward_backward(self, micro_batches: list[Batch]) -> tuple[torch.Tensor, int]:
        """Accumulate gradients over the micro-batches; DDP all-reduces only after the last."""
        total_loss = torch.zeros((), device=self.env.device)
        samples = 0
        for i, (inputs, labels, _) in enumerate(micro_batches):
            inputs, labels = (
                self.to_device(inputs),
                labels.to(self.env.device, non_blocking=self.non_blocking),
            )
            last = i == len(micro_batches) - 1
            with self.maybe_no_sync(skip_sync=not last):
                with self.precision.autocast():
                    loss = self.loss_fn(self.model(inputs), labels) / len(micro_batches)
                self.precision.backward(loss)  # under DDP the all-reduce overlaps with this
            total_loss += loss.detach().float()
            samples += len(labels)
        return total_loss, samples

    # --- data -------------------------------------------------------------------------------

    def steps_per_epoch(self) -> int:
        return self.loaders.batches_per_epoch() // self.accum

    def batches_of_epoch(self) -> Iterator[tuple[list[Batch], float]]:
        """Groups of `grad_accum_steps` batches, resuming inside the epoch where a checkpoint
        left it (the sampler skips the indices already seen: nothing is loaded twice)."""
        p = self.progress
        self.loaders.start_epoch(p.epoch, skip_batches=p.step_in_epoch * self.accum)
        group: list[Batch] = []
        remaining = self.steps_per_epoch() - p.step_in_epoch
        fetch_start = time.perf_counter()
        for batch in self.loaders.train:
            group.append(batch)
            if len(group) < self.accum:
                continue
            self.bad_in_epoch += sum(b[2] for b in group)
            yield group, time.perf_counter() - fetch_start
            group, remaining = [], remaining - 1
            if remaining == 0:
                return
            fetch_start = time.perf_counter()

    def to_device(self, inputs: torch.Tensor) -> torch.Tensor:
        inputs = inputs.to(self.env.device, non_blocking=self.non_blocking)
        if self.channels_last and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return inputs

    def maybe_no_sync(self, skip_sync: bool) -> contextlib.AbstractContextManager[Any]:
        no_sync = getattr(self.model, "no_sync", None)  # DDP (also through torch.compile)
        return no_sync() if skip_sync and no_sync is not None else contextlib.nullcontext()

    # --- faults and signals -----------------------------------------------------------------

    def check_finite_and_signals(self, loss: torch.Tensor, stop: StopRequest) -> tuple[bool, bool]:
        """Returns (apply the optimizer step, stop after this step), the same on every rank.

        A non-finite loss is noted on the device every step (no host sync); ranks agree on it and
        on stop signals in one small collective, only at the steps of `agrees_at`. The live
        signal flag is read only there, or one rank could stop a step before another.
        """
        step = self.progress.step + 1
        self.nonfinite.note(loss, step)
        if not self.agrees_at(step):
            return True, False
        first_step, first_loss = self.nonfinite.take()
        world, last = self.env.world_size, self.planned_total
        # The max over ranks picks the earliest bad step, then the lowest rank with it.
        code = (last + 1 - first_step) * world + world - 1 - self.env.rank if first_step else 0
        bad_code, stop_code = agree_max([float(code), 1.0 if stop else 0.0], self.env)
        stop_now = bool(stop_code)
        if stop_now and not stop:
            stop.signal_name = "a signal on another rank"
        if bad_code == 0:
            return True, stop_now
        bad_step, bad_rank = last + 1 - int(bad_code) // world, world - 1 - int(bad_code) % world
        where = f"step {bad_step} on rank {bad_rank}"
        if self.settings.on_nonfinite == "error":
            raise NonFiniteLoss(
                f"non-finite loss ({first_loss if bad_rank == self.env.rank else 'nan/inf'}) at "
                f"{where}; set trainer.on_nonfinite=skip to skip such steps"
            )
        log.warning(f"skipping the update of {where}: non-finite loss")
        return False, stop_now

    def agrees_at(self, step: int) -> bool:
        """The steps where ranks agree (a collective): every step under on_nonfinite=skip, whose
        update waits for it; otherwise before anything is logged or saved and before the loop
        can end: log and checkpoint steps, the epoch's and the run's last step. A stop signal is
        thus acted on within trainer.log_every_n_steps steps."""
        every_ckpt = self.ckpt.every_n_steps if self.ckpt.enabled else 0
        return (
            self.settings.on_nonfinite == "skip"
            or step % self.metrics.log_every == 0
            or bool(every_ckpt and step % every_ckpt == 0)
            or self.progress.step_in_epoch + 1 == self.steps_per_epoch()
            or step >= self.planned_total
        )

    def interrupt(self, stop: StopRequest) -> None:
        path = self.save_checkpoint()
        where = f" to {path}" if path else ""
        raise Interrupted(
            f"stopped by {stop.signal_name} after step {self.progress.step}; checkpoint "
            f"written{where}. Resume: the same command with hydra.run.dir={self.run_dir} "
            "(checkpoint.resume=auto picks the newest checkpoint)"
        )

    # --- epochs, validation, early stopping -------------------------------------------------

    def end_of_epoch(self) -> bool:
        """Flush metrics, validate, checkpoint; returns whether early stopping triggered."""
        p = self.progress
        epoch_finished = p.step_in_epoch >= self.steps_per_epoch()  # not cut short by max_steps
        lr = self.scheduler.get_last_lr()[0]
        if p.step % self.metrics.log_every:
            self.metrics.flush(p.step, p.epoch, lr)  # the epoch's last partial window
        (bad,) = all_reduce_sum([self.bad_in_epoch], self.env)
        p.bad_samples += int(bad)
        self.bad_in_epoch = 0
        if self.loaders.val is not None:
            self.val = evaluate(
                self.model,
                self.loaders.val,
                self.env,
                self.num_classes,
                self.non_blocking,
                self.precision.autocast,
                self.to_device,
            )
            self.metrics.scalars(self.val, p.step)
            self._track_best(self.val)
        stop = self._early_stop()
        self._log_epoch(int(bad))
        if epoch_finished:
            p.epoch, p.step_in_epoch = p.epoch + 1, 0
            if self.ckpt.enabled:
                self.save_checkpoint()
        return stop

    def _track_best(self, val: dict[str, float]) -> None:
        for key, value in val.items():
            best = self.progress.best_val.get(key)
            if best is None or (value < best if key.endswith("loss") else value > best):
                self.progress.best_val[key] = value

    def _early_stop(self) -> bool:
        es = self.settings.early_stopping
        if es.patience is None:
            return False
        if es.metric not in self.val:
            raise DptError(
                f"trainer.early_stopping.metric={es.metric}: not among the validation "
                f"metrics ({', '.join(self.val) or 'no validation split'})"
            )
        value, best = self.val[es.metric], self.progress.best_val.get(f"es/{es.metric}")
        improved = best is None or (
            value < best - es.min_delta if es.mode == "min" else value > best + es.min_delta
        )
        if improved:
            self.progress.best_val[f"es/{es.metric}"] = value
            self.progress.stale_epochs = 0
            return False
        self.progress.stale_epochs += 1
        if self.progress.stale_epochs < es.patience:
            return False
        if self.env.is_main:
            log.info(f"early stopping: {es.metric} did not improve for {es.patience} epoch(s)")
        return True

    def _log_epoch(self, bad: int) -> None:
        if not self.env.is_main:  # world-wide numbers: one line, not one per rank
            return
        parts = [f"epoch {self.progress.epoch + 1} done", f"step {self.progress.step}"]
        if self.metrics.last_world_loss is not None:
            parts.append(f"train loss {self.metrics.last_world_loss:.4f}")
        parts += [_format_val(k, v) for k, v in sorted(self.val.items(), key=_val_order)]
        if bad:
            parts.append(f"{bad} unreadable samples skipped")
        log.info(" | ".join(parts))

    # --- checkpoints ------------------------------------------------------------------------

    def save_checkpoint(self) -> Path | None:
        """Rank 0 writes; the others wait, so no rank races ahead of a half-written file."""
        path = None
        if self.env.is_main:
            path = checkpoint.save(
                self.state_dict(),
                checkpoint.checkpoint_dir(self.run_dir),
                self.progress.step,
                self.ckpt.keep,
            )
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        return path

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.precision.scaler.state_dict() if self.precision.scaler else {},
            "progress": asdict(self.progress),
            "step": self.progress.step,
            "rng": checkpoint.rng_state(),
            "config": self.config_yaml,
        }

    def load_state_dict(self, state: dict[str, Any], source: Path) -> None:
        try:
            unwrap(self.model).load_state_dict(state["model"])
        except RuntimeError as error:
            first = str(error).strip().splitlines()
            raise checkpoint.CheckpointError(
                f"checkpoint {source} does not fit this model: {' '.join(first[:2])[:300]}"
            ) from error
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.precision.scaler and state.get("scaler"):
            self.precision.scaler.load_state_dict(state["scaler"])
        self.progress = Progress(**state["progress"])
        checkpoint.set_rng_state(state["rng"])


def _val_order(item: tuple[str, float]) -> tuple[bool, str]:
    return (item[0] != "val/loss", item[0])  # loss first, then accuracies


def _format_val(key: str, value: float) -> str:
    name = key.replace("/", " ")
    if key.endswith("samples"):
        return f"{name} {value:,.0f}"
    return f"{name} {value:.2%}" if "acc" in key else f"{name} {value:.4f}"
