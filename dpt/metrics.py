"""Training metrics: per-rank TensorBoard, world aggregates on rank 0, console lines, a bar.

The loss is accumulated on the device and read back only once per `log_every_n_steps`, so logging
adds no host-device synchronisation to the other steps.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from dpt.distributed import DistEnv, agree_max, all_reduce_sum

log = logging.getLogger("dpt")


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        env: DistEnv,
        log_every_n_steps: int,
        total_steps: int,
        start_step: int = 0,
    ) -> None:
        self.env = env
        self.log_every = log_every_n_steps
        self.total_steps = total_steps
        # purge_step drops events a crashed run wrote past the resumed step: curves never fold back.
        purge = start_step + 1 if start_step else None
        self.rank_writer = SummaryWriter(run_dir / "tb" / f"rank{env.rank}", purge_step=purge)
        self.world_writer = (
            SummaryWriter(run_dir / "tb" / "world", purge_step=purge) if env.is_main else None
        )
        show_bar = env.is_main and sys.stdout.isatty()
        self.bar = (
            tqdm(
                total=total_steps,
                initial=start_step,
                unit="step",
                dynamic_ncols=True,
                file=sys.stdout,
            )
            if show_bar
            else None
        )
        self.last_world_loss: float | None = None
        self._reset_window()

    def _reset_window(self) -> None:
        self._loss_sum = torch.zeros((), device=self.env.device)
        self._grad_norm_sum: torch.Tensor | None = None
        self._steps = 0
        self._samples = 0
        self._data_s = 0.0
        self._window_start = time.perf_counter()

    def step(
        self,
        step: int,
        epoch: int,
        loss: torch.Tensor,
        samples: int,
        data_s: float,
        lr: float,
        grad_norm: torch.Tensor | None = None,
    ) -> None:
        """Record one optimizer step; `step` counts from 1. Tensors stay on the device."""
        self._loss_sum += loss.detach().float()
        if grad_norm is not None:
            norm = grad_norm.detach().float()
            self._grad_norm_sum = (
                norm if self._grad_norm_sum is None else self._grad_norm_sum + norm
            )
        self._steps += 1
        self._samples += samples
        self._data_s += data_s
        if self.bar is not None:
            self.bar.update(1)
        if step % self.log_every == 0:
            self.flush(step, epoch, lr)

    def flush(self, step: int, epoch: int, lr: float) -> None:
        """Write the window's averages. Every rank must call this at the same steps (collective)."""
        if self._steps == 0:
            return
        elapsed = time.perf_counter() - self._window_start
        loss = (self._loss_sum / self._steps).item()  # the one device sync of the window
        rank_scalars = {
            "train/loss": loss,
            "train/samples_per_s": self._samples / elapsed,
            "time/step_s": elapsed / self._steps,
            "time/data_s": self._data_s / self._steps,
            "optim/lr": lr,
        }
        if self._grad_norm_sum is not None:  # mean pre-clip global norm over the window
            rank_scalars["optim/grad_norm"] = (self._grad_norm_sum / self._steps).item()
        if self.env.device.type == "cuda":
            rank_scalars["memory/cuda_allocated_gb"] = torch.cuda.memory_allocated() / 2**30
            rank_scalars["memory/cuda_max_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        self._write(self.rank_writer, rank_scalars, step)

        loss_sum, steps, samples = all_reduce_sum(
            [loss * self._steps, self._steps, self._samples], self.env
        )
        (slowest,) = agree_max([elapsed], self.env)
        self.last_world_loss = loss_sum / steps
        world_samples_s = samples / slowest
        if self.world_writer is not None:
            self._write(
                self.world_writer,
                {"train/loss": self.last_world_loss, "train/samples_per_s": world_samples_s},
                step,
            )
        self._console(
            f"epoch {epoch + 1} | step {step}/{self.total_steps} | loss {loss:.4f} | "
            f"{self._samples / elapsed:,.0f} samples/s"
        )
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{self.last_world_loss:.4f}", samples_s=f"{world_samples_s:,.0f}"
            )
        self._reset_window()

    def scalars(self, values: dict[str, float], step: int, world: bool = True) -> None:
        """Already-aggregated values (e.g. validation): rank 0 writes them to the world folder."""
        if world and self.world_writer is not None:
            self._write(self.world_writer, values, step)

    def hparams(self, hparams: dict[str, Any], final: dict[str, float]) -> None:
        if self.world_writer is None:
            return
        # run_name="." keeps the hparams in the world folder instead of a timestamped sub-run.
        self.world_writer.add_hparams(
            hparams, {f"hparam/{k}": v for k, v in final.items()}, run_name="."
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for writer in (self.rank_writer, self.world_writer):
            if writer is not None:
                writer.close()

    def _console(self, message: str) -> None:
        # With a bar on rank 0 the bar carries the numbers; lines still go to the rank's log file.
        log.info(message)

    @staticmethod
    def _write(writer: SummaryWriter, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, step)
