"""Training metrics: per-rank TensorBoard, world aggregates on rank 0, console lines, a bar.

Per step nothing is computed: the loss and gradient norm are kept as the device made them, counts
and times summed on the host. A logging window ends on the host alone (its sums set aside, its
time stamped). At each agreement (`dpt.loop.agreement`: one per logging window, or one per several
short ones) the kept losses come back in one read-back, the one wait for the device, and the
ended windows' sums travel to every rank in the agreement's one collective; every window is then
written with its own step and time, and rank 0 writes the world's numbers, including how far
the slowest rank lags (stragglers).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dpt.distributed import DistEnv
from dpt.observe import dashboard
from dpt.observe.dashboard import WORLD
from dpt.observe.flops import Throughput
from dpt.observe.logs import HeldLines
from dpt.observe.trackers import Trackers
from dpt.observe.world_history import WorldHistory

log = logging.getLogger("dpt")

# How long written scalars are held before they go to their event files, all in one write each
# (dpt.observe.event_file): framing and writing them costs the training thread less in bulk,
# with its caches warm, than one window at a time. Where logger.tensorboard.flush_s is not set.
HOLD_S = 1.0

# The payload one rank sends at an agreement (see `MetricsLogger.payload`): SINCE, then
# WINDOW for each logging window that ended since the last agreement, oldest first.
SINCE = ("samples_since", "bad_since")
WINDOW = ("loss", "grad_norm", "steps", "samples", "elapsed", "data_s", "work_s")


@dataclass
class Window:
    """One logging window of this rank: sums on the host, losses still on the device."""

    steps: int = 0
    samples: int = 0
    data_s: float = 0.0
    work_s: float = 0.0
    loss: float = 0.0  # sums of the losses and gradient norms read back so far
    grad_norm: float = 0.0
    unread: int = 0  # of its steps, those whose loss is still on the device
    clipped: bool = False  # it has gradient norms (trainer.grad_clip_norm)
    # Set when it ends:
    step: int = 0
    epoch: int = 0
    lr: float = 0.0
    group_lrs: dict[str, float] = field(default_factory=dict)  # several groups: each one's
    elapsed: float = 0.0
    wall_time: float = 0.0  # its events' stamp
    extra: dict[str, float] = field(default_factory=dict)  # e.g. CUDA memory at its end

    def sent(self) -> list[float]:
        """Its numbers in the order of WINDOW."""
        return [self.loss, self.grad_norm, self.steps, self.samples, self.elapsed, self.data_s,
                self.work_s]  # fmt: skip


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


def throughput_text(scalars: dict[str, float]) -> str:
    """` | 51,200 tokens/s | MFU 38.5%` (or `| 0.052 TFLOP/s`): a console line's tail."""
    return "".join(f" | {part}" for part in _throughput_parts(scalars))


def _throughput_parts(scalars: dict[str, float]) -> list[str]:
    parts = []
    if "train/tokens_per_s" in scalars:
        parts.append(f"{scalars['train/tokens_per_s']:,.0f} tokens/s")
    if "perf/mfu" in scalars:
        parts.append(f"MFU {_percent(scalars['perf/mfu'])}")
    elif "perf/tflops" in scalars:
        parts.append(f"{scalars['perf/tflops']:.3g} TFLOP/s")
    return parts


@dataclass(frozen=True)
class Speed:
    """The world's pace over some span: samples/s, and for a task of tokens its tokens/s and
    MFU (or TFLOP/s), by TensorBoard tag."""

    samples_per_s: float
    throughput: dict[str, float] = field(default_factory=dict)

    def text(self) -> str:
        """`18,961 samples/s, 6,700 tokens/s, MFU 38.5%`."""
        return ", ".join([f"{self.samples_per_s:,.0f} samples/s",
                          *_throughput_parts(self.throughput)])  # fmt: skip

    def record(self, prefix: str = "") -> dict[str, float]:
        """As metrics.json has it: `samples_per_s`, `tokens_per_s`, `mfu`, each after `prefix`."""
        found = {f"{prefix}samples_per_s": self.samples_per_s}
        return found | {f"{prefix}{tag.split('/')[1]}": v for tag, v in self.throughput.items()}


def done_speeds(steady: Speed | None, whole: Speed) -> str:
    """The done line's speeds, each labelled: the loop's steady pace (its logging windows after
    the first) beside the whole run's (start-up, validation and checkpoints included)."""
    text = f"whole run {whole.text()} (world, with start-up, validation and checkpoints)"
    if steady is None:  # one logging window: no pace without start-up to say
        return text
    return f"loop {steady.text()} (world, after the first logging window) | {text}"


def _percent(share: float) -> str:
    """`38.5%`; a small model on a large GPU uses a sliver of it: `0.0015%`, not `0.0%`."""
    return f"{share:.1%}" if share >= 0.01 else f"{share * 100:.2g}%"


class MetricsLogger:
    def __init__(
        self,
        tb: dashboard.TbPlace,  # where its TensorBoard folders go (dpt.launch.job_place)
        env: DistEnv,
        total_steps: int,
        memory: Callable[[], dict[str, float]] | None = None,  # per-rank sizes (dpt.observe.memory)
        throughput: Throughput | None = None,  # tokens/s and MFU, for models of tokens
        copies: int = 1,  # ranks that train each sample (a pipeline's stages)
        # logger.tensorboard.flush_s; None: no event files (a logger list without tensorboard)
        flush_s: float | None = HOLD_S,
    ) -> None:
        self.env, self.tb = env, tb
        self.tensorboard, self.flush_s = flush_s is not None, flush_s or HOLD_S
        # Rank 0: the world's numbers at their steps (metrics.json's history), and the trackers
        # that get them as they are made (set once the run knows whether it resumes).
        self.history = WorldHistory()
        self.trackers = Trackers()
        self.copies = copies
        self.memory, self.throughput = memory, throughput
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
        self.lines = HeldLines(log)  # the windows' console lines
        self.last_world_loss: float | None = None
        self.world_samples = 0  # world-wide samples trained in this session
        # The loop's steady pace: world-wide samples and the slowest rank's seconds of this
        # session's windows after its first (which holds start-up: the first steps, compilation).
        self.windows_written = 0
        self._steady = [0.0, 0.0]
        self._outside = False  # in a span left out of the windows' time (`outside_windows`)
        self.bad_samples = 0  # world-wide unreadable samples skipped since the last `take_bad`
        self._since = [0, 0]  # samples trained, unreadable ones skipped: since the last agreement
        self._unread: list[torch.Tensor] = []  # per step since the last read-back, on the device
        self._unread_norms: list[torch.Tensor] = []
        self._open = Window()
        self._ended: list[Window] = []  # since the last agreement, oldest first
        self._window_start = time.perf_counter()

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

    def record(
        self,
        loss: torch.Tensor,
        samples: int,
        bad: int,
        data_s: float,
        work_s: float,
        grad_norm: torch.Tensor | None,
        clipped: bool = True,
    ) -> None:
        """One optimizer step. Nothing here waits for the device or another rank. `grad_norm`:
        the global norm clipping computed (`clipped`; logged), or one this rank computed for the
        monitor alone (not logged: under fsdp it is this rank's shards')."""
        self._unread.append(loss)
        window = self._open
        if grad_norm is not None:
            self._unread_norms.append(grad_norm.detach())
            window.clipped = clipped
        window.steps += 1
        window.unread += 1
        window.samples += samples
        window.data_s += data_s
        window.work_s += work_s
        self._since[0] += samples
        self._since[1] += bad
        if self.bar is not None:
            self.bar.update(1)

    def end_window(self, step: int, epoch: int) -> None:
        """The window ends at `step` (the same steps on every rank): its time is taken here, on
        the host; it is written after the next agreement."""
        window, now = self._open, time.perf_counter()
        window.step, window.epoch, window.wall_time = step, epoch, time.time()
        window.elapsed, self._window_start = now - self._window_start, now
        if self.env.device.type == "cuda":
            window.extra = {
                "memory/cuda_allocated_gb": torch.cuda.memory_allocated() / 2**30,
                "memory/cuda_max_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
            }
        self._ended.append(window)
        self._open = Window()

    def set_lr(self, lrs: dict[str, float]) -> None:
        """The learning rates logged with the window that just ended, the ones going forward,
        by the optimizer's group names: `optim/lr` (the first group's), and `optim/lr/<name>`
        for each where there are several."""
        window = self._ended[-1]
        window.lr = next(iter(lrs.values()))
        window.group_lrs = lrs if len(lrs) > 1 else {}

    def read_back(self) -> tuple[list[float], list[float]]:
        """The losses and gradient norms (none where none are kept) of the steps since the last
        read-back, in order, as floats: one wait for the device (one copy). Their sums join
        their windows'."""
        if not self._unread:
            return [], []
        kept = self._unread + self._unread_norms
        if any(t.dtype != torch.float32 for t in kept):  # e.g. a bf16 loss: one dtype to stack
            kept = [t.float() for t in kept]
        values = (torch.stack(kept) if len(kept) > 1 else kept[0]).tolist()  # waits
        values = values if isinstance(values, list) else [values]
        count = len(self._unread)
        losses, norms = values[:count], values[count:]
        start = 0
        for window in (*self._ended, self._open):
            end = start + window.unread
            window.loss += sum(losses[start:end])
            window.grad_norm += sum(norms[start:end])
            window.unread, start = 0, end
        self._unread, self._unread_norms = [], []
        return losses, norms

    def payload(self) -> list[float]:
        """This rank's numbers for the agreement (after `read_back`): SINCE, then WINDOW for each
        window ended since the last agreement."""
        sent = [float(n) for n in self._since]
        for window in self._ended:
            sent += window.sent()
        return sent

    def agreed(self, rows: list[list[float]]) -> list[tuple[int, list[dict[str, float]]]]:
        """Take in every rank's payload; write the windows ended since the last agreement.
        Returns each window's step and every rank's numbers of it (the monitor judges them)."""
        self.world_samples += int(sum(row[0] for row in rows)) // self.copies
        self.bad_samples += int(sum(row[1] for row in rows)) // self.copies
        self._since = [0, 0]
        width, at = len(WINDOW), len(SINCE)
        windows = []
        for i, window in enumerate(self._ended):
            world = [dict(zip(WINDOW, row[at + i * width : at + (i + 1) * width], strict=True))
                     for row in rows]  # fmt: skip
            self._write_window(window, world)
            windows.append((window.step, world))
        self._ended = []
        self.lines.release()  # the windows' lines, in one write
        return windows

    def event(self, tag: str, value: float, text: str, step: int) -> None:
        """Rank 0: a monitor event on TensorBoard, in the world folder: a point on the detector's
        own curve (`monitor/<detector>`) and a line of the text log (`monitor/events`)."""
        self._world({tag: value}, step, time.time())
        if not self.env.is_main:
            return
        from dpt.observe.event_file import summary_event

        self.flush()  # in order with the scalars held before it
        self._writer(WORLD).write([summary_event(dashboard.text("monitor/events", text), step)])

    def rolled_back(self, step: int) -> None:
        """The run went back to `step` (a rollback): the windows not yet written are dropped, and
        TensorBoard drops what was written past `step` (a purge, as at a resume), so the curves
        show the line the run goes on with; the bar goes back too."""
        self._ended, self._open = [], Window()
        self._unread, self._unread_norms, self._since = [], [], [0, 0]
        self._window_start = time.perf_counter()
        self.flush()
        from dpt.observe.event_file import purge_event

        for writer in self._writers.values():
            writer.write([purge_event(step + 1)])
        self.purge_step = step + 1  # writers made from now on purge alike
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def take_bad(self) -> int:
        """World-wide unreadable samples skipped since the last call."""
        bad, self.bad_samples = self.bad_samples, 0
        return bad

    def _write_window(self, window: Window, world: list[dict[str, float]]) -> None:
        mine = world[self.env.rank]
        steps, elapsed = mine["steps"], mine["elapsed"]
        loss = mine["loss"] / steps
        rank_scalars = {
            "train/loss": loss,
            "train/samples_per_s": mine["samples"] / elapsed,
            "time/step_s": elapsed / steps,
            "time/data_s": mine["data_s"] / steps,
            "time/work_s": mine["work_s"] / steps,
            "optim/lr": window.lr,
            **{f"optim/lr/{name}": lr for name, lr in window.group_lrs.items()},
        }
        if window.clipped:  # mean pre-clip global norm over the window
            rank_scalars["optim/grad_norm"] = mine["grad_norm"] / steps
        if self.memory is not None:
            rank_scalars |= self.memory()
        rank_throughput = self._throughput(mine["samples"] / elapsed)
        rank_scalars |= window.extra | rank_throughput
        self._hold(f"rank{self.env.rank}", rank_scalars, window.step, window.wall_time)
        self.last_world_loss = sum(r["loss"] for r in world) / sum(r["steps"] for r in world)
        samples, seconds = (
            sum(r["samples"] for r in world) / self.copies,
            max(r["elapsed"] for r in world),
        )
        world_samples_s = samples / seconds
        if self.windows_written:
            self._steady[0] += samples
            self._steady[1] += seconds
        self.windows_written += 1
        stragglers = self.stragglers.update([r["work_s"] / r["steps"] for r in world])
        world_scalars = {"train/loss": self.last_world_loss,
                         "train/samples_per_s": world_samples_s, **stragglers,
                         **self._throughput(world_samples_s, len(world))}  # fmt: skip
        self._world(world_scalars, window.step, window.wall_time)
        self.lines.add(
            f"epoch {window.epoch + 1} | step {window.step}/{self.total_steps} | "
            f"loss {loss:.4f} | {mine['samples'] / elapsed:,.0f} samples/s"
            + throughput_text(rank_throughput)
        )
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{self.last_world_loss:.4f}", samples_s=f"{world_samples_s:,.0f}"
            )

    def speeds(self, whole_samples_per_s: float) -> tuple[Speed | None, Speed]:
        """The world's pace in this session's logging windows after the first (the loop's own,
        without start-up; None where there was one window), and over the whole run."""
        devices = self.env.world_size
        samples, seconds = self._steady
        steady = None
        if seconds > 0:
            steady = Speed(samples / seconds, self._throughput(samples / seconds, devices))
        whole = Speed(whole_samples_per_s, self._throughput(whole_samples_per_s, devices))
        return steady, whole

    @contextlib.contextmanager
    def outside_windows(self) -> Iterator[None]:
        """Time that is not training (validation, a checkpoint), left out of the open window's
        time: a window's samples/s and step time are the loop's."""
        if self._outside:  # inside another such span (a checkpoint at an epoch's end)
            yield
            return
        self._outside, start = True, time.perf_counter()
        try:
            yield
        finally:
            self._outside = False
            self._window_start += time.perf_counter() - start

    def _throughput(self, samples_per_s: float, devices: int = 1) -> dict[str, float]:
        """tokens/s and MFU (or TFLOP/s) of `devices` devices at `samples_per_s` together."""
        if self.throughput is None:
            return {}
        return self.throughput.scalars(samples_per_s, devices)

    def scalars(self, values: dict[str, float], step: int) -> None:
        """Already-aggregated values (e.g. validation): rank 0 writes them to the world folder."""
        if values:
            self._world(values, step, time.time())

    def _world(self, scalars: dict[str, float], step: int, wall_time: float) -> None:
        """The world's numbers (the same on every rank): into the history on every rank (each
        checkpoints it alike); rank 0 writes them to the world folder and hands them to the
        trackers (held, then sent in batches to the trackers' own process)."""
        self.history.add(scalars, step)
        if self.env.is_main:
            self._hold(WORLD, scalars, step, wall_time)
            self.trackers.log_metrics(scalars, step, wall_time)

    def start_session(self, hparams: dict[str, Any], metrics: Sequence[str]) -> None:
        """Rank 0: this run's HPARAMS session in the world folder, whose own scalar tags are the
        session's `metrics`; the overlay charts; and a single run's experiment. Written with
        the world folder's first event, after the first step."""
        if self.env.is_main:
            self._pending[WORLD] = functools.partial(self._session_summaries, hparams, metrics)

    def _session_summaries(self, hparams: dict[str, Any], metrics: Sequence[str]) -> list[Any]:
        summaries = [dashboard.session_start(hparams), dashboard.overlay_layout()]
        if self.tb.writes_experiment:
            summaries.append(dashboard.experiment([hparams], metrics))
        return summaries

    def end_session(self, ok: bool) -> None:
        if self.env.is_main:
            self._add(WORLD, [dashboard.session_end(ok)])

    def close(self) -> None:
        self.lines.close()
        if self.bar is not None:
            self.bar.close()
        self.flush()
        for writer in self._writers.values():
            writer.close()

    def _writer(self, name: str) -> Any:
        if not self.tensorboard:
            return _NoEvents()
        if name not in self._writers:
            from dpt.observe.event_file import EventFile

            self._writers[name] = EventFile(self.tb.folder / name, purge_step=self.purge_step)
            pending = self._pending.pop(name, None)
            if pending is not None:
                self._add(name, pending())
        return self._writers[name]

    def _add(self, name: str, summaries: list[Any]) -> None:
        from dpt.observe.event_file import summary_event

        self.flush()  # in the order they were made
        # Into the folder's one open event file: TensorBoard reads a folder's event files one
        # after the other and does not go back to an earlier one that still grows.
        self._writer(name).write([summary_event(summary) for summary in summaries])

    def _hold(self, name: str, scalars: dict[str, float], step: int, wall_time: float) -> None:
        """Hold scalars; their event is made at the hand-over (`flush`)."""
        self._held.append((name, scalars, step, wall_time))
        if time.perf_counter() - self._held_since >= self.flush_s:
            self._write_events()

    def flush(self) -> None:
        """The held scalars to their event files, and the trackers' held rows to them. Before a
        checkpoint: a run killed later resumes there, and its curves must hold every step up
        to it (a resume drops only what was logged after)."""
        self._write_events()
        self.trackers.flush()

    def _write_events(self) -> None:
        """The held scalars to their event files, in order, stamped when they were made."""
        held, self._held = self._held, []
        self._held_since = time.perf_counter()
        if not held:
            return
        from dpt.observe.event_file import scalars_event

        events: dict[str, list[Any]] = {}
        for name, scalars, step, wall_time in held:
            events.setdefault(name, []).append(scalars_event(scalars, step, wall_time))
        for name, batch in events.items():
            self._writer(name).write(batch)


class _NoEvents:
    """The event writer of a run without TensorBoard (a logger list that leaves it out)."""

    def write(self, events: list[Any]) -> None:
        pass

    def close(self) -> None:
        pass
