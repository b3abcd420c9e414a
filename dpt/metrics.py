"""Training metrics: per-rank TensorBoard, world aggregates on rank 0, console lines, a bar.

Per step nothing is computed: the loss and gradient norm are kept as the device made them, counts
and times summed on the host. At each agreement (`dpt.agreement`: at least once per logging
window) the kept values come back in one read-back, the one wait for the device, and the window's
sums travel to every rank in the agreement's one collective; rank 0 then writes the world's
numbers, including how far the slowest rank lags (stragglers).
"""

from __future__ import annotations

import functools
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dpt import dashboard
from dpt.dashboard import WORLD
from dpt.distributed import DistEnv

log = logging.getLogger("dpt")

# How long written scalars are held before they go to their event files, all in one write each
# (dpt.event_file): framing and writing them costs the training thread less in bulk, with its
# caches warm, than one window at a time.
HOLD_S = 1.0

# The payload one rank sends at an agreement, in this order (see `MetricsLogger.payload`).
FIELDS = ("samples_since", "bad_since", "loss", "grad_norm", "steps", "samples", "elapsed",
          "data_s", "work_s")  # fmt: skip


class StragglerWatch:
    """Warns when one rank's own work per step (data and forward, before it waits for the other
    ranks) exceeds `ratio` x the median rank's for `windows` logging windows in a row."""

    def __init__(self, ratio: float = 1.25, windows: int = 3) -> None:
        self.ratio, self.windows = ratio, windows
        self.rank: int | None = None
        self.streak = 0

    def update(self, work_s: list[float]) -> dict[str, float]:
        """World metrics of one window; logs a warning when a straggler persists."""
        median = statistics.median_low(work_s)
        slowest = max(range(len(work_s)), key=work_s.__getitem__)
        ratio = work_s[slowest] / median if median > 0 else 1.0
        if ratio > self.ratio and slowest == self.rank:
            self.streak += 1
        else:
            self.rank, self.streak = (slowest, 1) if ratio > self.ratio else (None, 0)
        if self.streak == self.windows:  # once per streak
            log.warning(
                f"rank {slowest} is a straggler: its work per step (data and forward, before "
                f"the gradient sync) took {ratio:.2f}x the median rank's for {self.windows} "
                "logging windows in a row"
            )
        return {
            "world/work_s_max": work_s[slowest],
            "world/work_s_min": min(work_s),
            "world/straggler_ratio": ratio,
        }


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        env: DistEnv,
        log_every_n_steps: int,
        total_steps: int,
        memory: Callable[[], dict[str, float]] | None = None,  # per-rank sizes (dpt.memory)
    ) -> None:
        self.env, self.tb = env, dashboard.place(run_dir)
        self.memory = memory
        self.log_every = log_every_n_steps
        self.total_steps = total_steps
        self.purge_step: int | None = None
        self._writers: dict[str, Any] = {}  # made at the first write: tensorboard imports slowly
        # (writer, scalars, step, wall time): scalars made since the last hand-over
        self._held: list[tuple[str, dict[str, float], int, float]] = []
        self._held_since = time.perf_counter()
        # Summaries for a writer not made yet, built with it: HPARAMS' protos import slowly.
        self._pending: dict[str, Callable[[], list[Any]]] = {}
        self.bar = self._progress_bar() if env.is_main and sys.stdout.isatty() else None
        self.stragglers = StragglerWatch()
        self.last_world_loss: float | None = None
        self.world_samples = 0  # world-wide samples trained in this session
        self.bad_samples = 0  # world-wide unreadable samples skipped since the last `take_bad`
        self._since = [0, 0]  # samples trained, unreadable ones skipped: since the last agreement
        self._reset_window()

    def _progress_bar(self) -> Any:
        from tqdm import tqdm

        return tqdm(total=self.total_steps, unit="step", dynamic_ncols=True, file=sys.stdout)

    def start_at(self, step: int) -> None:
        """A resumed run (before the first write): the curves and the bar continue at `step`."""
        # purge_step drops events a crashed run wrote past the resumed step: curves never fold back.
        self.purge_step = step + 1
        if self.bar is not None:
            self.bar.n = self.bar.initial = step
            self.bar.refresh()

    def replan(self, total_steps: int) -> None:
        """A resumed run whose steps changed size (another global batch) has another total."""
        self.total_steps = total_steps
        if self.bar is not None:
            self.bar.total = total_steps
            self.bar.refresh()

    def _reset_window(self) -> None:
        self._unread: list[torch.Tensor] = []  # per step since the last read-back, on the device
        self._unread_norms: list[torch.Tensor] = []
        self._loss_sum = self._grad_norm_sum = 0.0  # of the window's steps already read back
        self._clipped = False  # the window has gradient norms (trainer.grad_clip_norm)
        self._steps = 0
        self._samples = 0
        self._data_s = 0.0
        self._work_s = 0.0
        self._window_start = time.perf_counter()

    def record(
        self,
        loss: torch.Tensor,
        samples: int,
        bad: int,
        data_s: float,
        work_s: float,
        grad_norm: torch.Tensor | None,
    ) -> None:
        """One optimizer step. Nothing here waits for the device or another rank."""
        self._unread.append(loss)
        if grad_norm is not None:
            self._unread_norms.append(grad_norm.detach())
            self._clipped = True
        self._steps += 1
        self._samples += samples
        self._since[0] += samples
        self._since[1] += bad
        self._data_s += data_s
        self._work_s += work_s
        if self.bar is not None:
            self.bar.update(1)

    def read_back(self) -> list[float]:
        """The losses of the steps since the last read-back, in order, as floats: one wait for
        the device (one stack, one copy). Their sums join the window's."""
        if not self._unread:
            return []
        kept = self._unread + self._unread_norms
        if any(t.dtype != torch.float32 for t in kept):  # e.g. a bf16 loss: one dtype to stack
            kept = [t.float() for t in kept]
        values = torch.stack(kept).tolist()  # waits for the device
        losses, norms = values[: len(self._unread)], values[len(self._unread) :]
        self._loss_sum += sum(losses)
        self._grad_norm_sum += sum(norms)
        self._unread, self._unread_norms = [], []
        return losses

    def payload(self) -> list[float]:
        """This rank's numbers for the agreement, in the order of FIELDS (after `read_back`)."""
        elapsed = time.perf_counter() - self._window_start
        return [*self._since, self._loss_sum, self._grad_norm_sum, self._steps, self._samples,
                elapsed, self._data_s, self._work_s]  # fmt: skip

    def agreed(self, rows: list[list[float]], step: int, epoch: int, lr: float, log: bool) -> None:
        """Take in every rank's payload; write and reset the window if `log` (same on all ranks)."""
        world = [dict(zip(FIELDS, row, strict=True)) for row in rows]
        self.world_samples += int(sum(r["samples_since"] for r in world))
        self.bad_samples += int(sum(r["bad_since"] for r in world))
        self._since = [0, 0]
        if log and self._steps:
            self._write_window(world, step, epoch, lr)
            self._reset_window()

    def take_bad(self) -> int:
        """World-wide unreadable samples skipped since the last call."""
        bad, self.bad_samples = self.bad_samples, 0
        return bad

    def _write_window(
        self, world: list[dict[str, float]], step: int, epoch: int, lr: float
    ) -> None:
        mine = world[self.env.rank]
        steps, elapsed = mine["steps"], mine["elapsed"]
        loss = mine["loss"] / steps
        rank_scalars = {
            "train/loss": loss,
            "train/samples_per_s": mine["samples"] / elapsed,
            "time/step_s": elapsed / steps,
            "time/data_s": mine["data_s"] / steps,
            "time/work_s": mine["work_s"] / steps,
            "optim/lr": lr,
        }
        if self._clipped:  # mean pre-clip global norm over the window
            rank_scalars["optim/grad_norm"] = mine["grad_norm"] / steps
        if self.memory is not None:
            rank_scalars |= self.memory()
        if self.env.device.type == "cuda":
            rank_scalars["memory/cuda_allocated_gb"] = torch.cuda.memory_allocated() / 2**30
            rank_scalars["memory/cuda_max_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        self._write(f"rank{self.env.rank}", rank_scalars, step)
        self.last_world_loss = sum(r["loss"] for r in world) / sum(r["steps"] for r in world)
        world_samples_s = sum(r["samples"] for r in world) / max(r["elapsed"] for r in world)
        stragglers = self.stragglers.update([r["work_s"] / r["steps"] for r in world])
        if self.env.is_main:
            world_scalars = {"train/loss": self.last_world_loss,
                             "train/samples_per_s": world_samples_s, **stragglers}  # fmt: skip
            self._write(WORLD, world_scalars, step)
        log.info(
            f"epoch {epoch + 1} | step {step}/{self.total_steps} | loss {loss:.4f} | "
            f"{mine['samples'] / elapsed:,.0f} samples/s"
        )
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{self.last_world_loss:.4f}", samples_s=f"{world_samples_s:,.0f}"
            )

    def scalars(self, values: dict[str, float], step: int) -> None:
        """Already-aggregated values (e.g. validation): rank 0 writes them to the world folder."""
        if self.env.is_main and values:
            self._write(WORLD, values, step)

    def start_session(self, hparams: dict[str, Any]) -> None:
        """Rank 0: this run's HPARAMS session in the world folder, whose own scalar tags are the
        session's metrics; the overlay charts; and a single run's experiment. Written with the
        world folder's first event, after the first step."""
        if self.env.is_main:
            self._pending[WORLD] = functools.partial(self._session_summaries, hparams)

    def _session_summaries(self, hparams: dict[str, Any]) -> list[Any]:
        summaries = [dashboard.session_start(hparams), dashboard.overlay_layout()]
        if self.tb.writes_experiment:
            summaries.append(dashboard.experiment([hparams]))
        return summaries

    def end_session(self, ok: bool) -> None:
        if self.env.is_main:
            self._add(WORLD, [dashboard.session_end(ok)])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.flush()
        for writer in self._writers.values():
            writer.close()

    def _writer(self, name: str) -> Any:
        if name not in self._writers:
            from dpt.event_file import EventFile

            self._writers[name] = EventFile(self.tb.folder / name, purge_step=self.purge_step)
            pending = self._pending.pop(name, None)
            if pending is not None:
                self._add(name, pending())
        return self._writers[name]

    def _add(self, name: str, summaries: list[Any]) -> None:
        from dpt.event_file import summary_event

        self.flush()  # in the order they were made
        # Into the folder's one open event file: TensorBoard reads a folder's event files one
        # after the other and does not go back to an earlier one that still grows.
        self._writer(name).write([summary_event(summary) for summary in summaries])

    def _write(self, name: str, scalars: dict[str, float], step: int) -> None:
        """Hold a window's scalars; their event is made at the hand-over (`flush`)."""
        self._held.append((name, scalars, step, time.time()))
        if time.perf_counter() - self._held_since >= HOLD_S:
            self.flush()

    def flush(self) -> None:
        """The held scalars to their event files, in order, stamped when they were made. Before a
        checkpoint: a run killed later resumes there, and its curves must hold every step up
        to it (a resume drops only what was logged after)."""
        held, self._held = self._held, []
        self._held_since = time.perf_counter()
        if not held:
            return
        from dpt.event_file import scalars_event

        events: dict[str, list[Any]] = {}
        for name, scalars, step, wall_time in held:
            events.setdefault(name, []).append(scalars_event(scalars, step, wall_time))
        for name, batch in events.items():
            self._writer(name).write(batch)
