"""The monitor: the detectors judged on what the ranks' agreement gathered, and the actions taken.

At each agreement (dpt.loop.agreement) every rank has every rank's payload; the monitor's part of
it is the rank's loss of every step since the last agreement and, where one is computed, its
gradient norm. Each rank judges the same numbers the same way, so all take the same decision at
the same step without a collective of their own. Per step it costs a mean over the ranks and a
comparison or two; the running levels are taken again every few values (dpt.monitor.detectors).

The trainer acts on the verdict: `skip` withholds the update, `rollback` and `stop` end the
step's agreement with a reaction (dpt.loop.trainer), and every event is recorded once its
reaction is known (`record`).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpt.config.monitor import MonitorConfig
from dpt.monitor.detectors import Alarm, SlowdownDetector, SpikeDetector
from dpt.monitor.events import Event, EventLog

log = logging.getLogger("dpt")

# Actions that end the judging of an agreement's steps: what comes after is undone or not run.
DECISIVE = ("rollback", "stop", "error")
# Actions of grad_spike that pay for a gradient norm per step where clipping computes none.
NORM_ACTIONS = ("skip", "rollback", "stop")


@dataclass
class StepValues:
    """What one step contributed to an agreement: its world-mean loss and gradient norm (None
    where none was computed), and where its batch lies in the epoch's global order."""

    step: int
    loss: float
    grad_norm: float | None
    epoch: int
    sample: int  # the position of the step's first sample


@dataclass
class Span:
    """Logging windows gathered until they span monitor.slowdown.span_s seconds of training:
    a slowdown is judged on spans, so that a window stalled for a moment (another process on
    the machine, a collection) is not one."""

    steps: int = 0
    time_s: float = 0.0  # per window, the slowest rank's data wait and compute, summed
    work_s: list[float] = field(default_factory=list)  # per rank: its compute, summed


@dataclass
class Judgement:
    """The monitor's decision at one agreement. `events`: every alarm judged, in step order; the
    last is `decisive` when one asked to roll back or stop (the steps after it were not judged)."""

    events: list[Event] = field(default_factory=list)
    apply_update: bool = True  # False: `skip` at the agreement's own step
    decisive: Event | None = None


class Levels:
    """The detectors' running levels, a checkpoint part that a rollback returns with the model:
    values of steps that are trained again must not count twice."""

    optional = True  # checkpoints written before the monitor load it fresh

    def __init__(self, detectors: dict[str, Any]) -> None:
        self.detectors = detectors

    def state_dict(self) -> dict[str, Any]:
        return {name: detector.state_dict() for name, detector in self.detectors.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, detector in self.detectors.items():
            if name in state:  # a detector switched on since: it starts afresh
                detector.load_state_dict(state[name])


class History:
    """What the run did about its instabilities, a checkpoint part that a rollback keeps (it is
    not rolled back): events written, rollbacks taken, and the samples rollbacks skipped."""

    optional = True  # checkpoints written before the monitor load it fresh

    def __init__(self, events: EventLog) -> None:
        self.events = events
        self.rollbacks = 0
        self.skipped: list[list[int]] = []  # [epoch, from, to) ranges of the global order

    def state_dict(self) -> dict[str, Any]:
        return {"events": self.events.written, "rollbacks": self.rollbacks,
                "skipped": self.skipped}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.events.resume_at(int(state["events"]))
        self.rollbacks = int(state["rollbacks"])
        self.skipped = [list(map(int, r)) for r in state["skipped"]]

    def skip(self, epoch: int, start: int, end: int) -> int:
        """Record [start, end) of `epoch` as skipped; returns how many of them were not already."""
        new = end - start
        for e, a, b in self.skipped:
            if e == epoch:
                new -= max(0, min(b, end) - max(a, start))
        self.skipped.append([epoch, start, end])
        return new


class Monitor:
    def __init__(
        self,
        settings: MonitorConfig,
        run_dir: Path,
        is_main: bool,
        clipping: bool,
        sharded_norm: bool,
    ) -> None:
        self.settings = settings
        self.spikes = {
            name: SpikeDetector(name, node.threshold, node.window, node.warmup)
            for name, node in (("loss_spike", settings.loss_spike),
                               ("grad_spike", settings.grad_spike))
            if node.action != "off"
        }  # fmt: skip
        slow = settings.slowdown
        self.slowdown = (
            SlowdownDetector(slow.threshold, slow.window, slow.warmup, slow.patience)
            if slow.action != "off"
            else None
        )
        detectors: dict[str, Any] = dict(self.spikes)
        if self.slowdown is not None:
            detectors["slowdown"] = self.slowdown
        self.levels = Levels(detectors)
        self.span = Span()
        self.history = History(EventLog(run_dir, is_main))
        grad = settings.grad_spike
        # A norm per step: clipping's own, or one computed for this detector's reactions alone.
        self.computes_norm = not clipping and grad.action in NORM_ACTIONS
        # Under fsdp without clipping each rank's norm is its shards' (partial): summed in squares.
        self.partial_norm = self.computes_norm and sharded_norm
        self.watches_norm = "grad_spike" in self.spikes and (clipping or self.computes_norm)

    @property
    def every_step(self) -> bool:
        """Whether an update waits for the verdict on its own step (a spike's `skip`)."""
        return any(self._action(name) == "skip" for name in self.spikes)

    def _action(self, detector: str) -> str:
        node = getattr(self.settings, detector)
        return str(node.action)

    # --- judging ------------------------------------------------------------------------------

    def step_values(
        self, rows: Sequence[Sequence[float]], last_step: int, epoch: int, next_sample: int,
        global_batch: int,
    ) -> list[StepValues]:  # fmt: skip
        """The world's values of the steps since the last agreement, from every rank's part of
        the payload (`payload`): `last_step` is the agreement's step, whose batch starts at
        `next_sample` of `epoch`'s order."""
        count = len(rows[0]) // (2 if self.watches_norm else 1)
        values = []
        for i in range(count):
            losses = [row[i] for row in rows]
            norm = None
            if self.watches_norm:
                norms = [row[count + i] for row in rows]
                norm = math.sqrt(sum(n * n for n in norms)) if self.partial_norm else norms[0]
            offset = count - 1 - i  # steps before the agreement's own
            values.append(StepValues(last_step - offset, sum(losses) / len(losses), norm, epoch,
                                     next_sample - offset * global_batch))  # fmt: skip
        return values

    def payload(self, losses: list[float], norms: list[float]) -> list[float]:
        """This rank's part of the agreement: its losses since the last one, then its norms."""
        return losses + (norms if self.watches_norm else [])

    def judge(
        self,
        steps: list[StepValues],
        nonfinite: tuple[int, int] | None,
        windows: list[tuple[int, list[dict[str, float]]]],
        epoch: int = 0,
    ) -> Judgement:
        """Every detector on every step in order; slowdown on each logging window that ended
        (in `epoch`). `nonfinite`: (step, rank) of the first non-finite loss the agreement
        found."""
        verdict = Judgement()
        for values in steps:
            for event in self._step_events(values, nonfinite):
                verdict.events.append(event)
                if event.action in DECISIVE:
                    verdict.decisive = event
                    return verdict
                if event.action == "skip":
                    verdict.apply_update = False
        for step, world in windows:
            event = self._slowdown(step, epoch, world)
            if event is not None:
                verdict.events.append(event)
                if event.action == "stop":
                    verdict.decisive = event
                    return verdict
        return verdict

    def _step_events(self, values: StepValues, nonfinite: tuple[int, int] | None) -> list[Event]:
        events = []
        if nonfinite is not None and nonfinite[0] == values.step:
            events.append(self._event(values, "nonfinite", None, rank=nonfinite[1]))
        checks = (("loss_spike", values.loss), ("grad_spike", values.grad_norm))
        for name, value in checks:
            detector = self.spikes.get(name)
            if detector is None or value is None:
                continue
            alarm = detector.check(value)
            if alarm is not None:
                events.append(self._event(values, name, alarm))
        return events

    def _event(
        self, values: StepValues, detector: str, alarm: Alarm | None, rank: int | None = None
    ) -> Event:
        value = values.loss if alarm is None else alarm.value
        return Event(
            step=values.step, epoch=values.epoch, detector=detector, value=value,
            level=None if alarm is None else alarm.level,
            threshold=None if alarm is None else alarm.threshold_value,
            action=self._action(detector), rank=rank, sample=values.sample, time=time.time(),
        )  # fmt: skip

    def _slowdown(self, step: int, epoch: int, world: list[dict[str, float]]) -> Event | None:
        """One logging window into the span; a span of monitor.slowdown.span_s seconds judged."""
        if self.slowdown is None:
            return None
        span = self.span
        span.steps += int(world[0]["steps"])
        span.time_s += max(r["data_s"] + r["work_s"] for r in world)  # the slowest rank's
        added = span.work_s or [0.0] * len(world)
        span.work_s = [a + r["work_s"] for a, r in zip(added, world, strict=True)]
        if span.time_s < self.settings.slowdown.span_s:
            return None
        self.span = Span()
        median = statistics.median_low(span.work_s)
        straggler = max(span.work_s) / median if median > 0 else 1.0
        alarm = self.slowdown.check(span.time_s / span.steps, straggler)
        if alarm is None:
            return None
        return Event(step=step, epoch=epoch, detector="slowdown", value=alarm.value,
                     level=alarm.level, threshold=alarm.threshold_value,
                     action=self._action("slowdown"), signal=alarm.signal,
                     time=time.time())  # fmt: skip

    # --- recording ----------------------------------------------------------------------------

    def record(self, event: Event) -> None:
        """The event, once its reaction is known: the console (rank 0) and events.jsonl."""
        self.history.events.add(event)
        if self.history.events.is_main:
            log.warning(event.line())
