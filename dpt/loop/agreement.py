"""The one place where ranks agree, in one small collective per logging window.

Every rank must take the same decisions at the same step: apply this update or skip it (a
non-finite loss somewhere), stop now or go on (a signal on some rank). Between agreements nothing
waits for the device or the network: each step's loss stays on the device
(`dpt.observe.metrics` keeps it) and a signal sets a flag. At the agreement the losses since
the last one come back in one device round trip (`MetricsLogger.read_back`) and are checked
here on the host; one `all_gather` then carries the flags and the metrics window, so logging
costs no second collective. Under `trainer.on_nonfinite=skip` ranks agree every step, since the
update itself waits for the verdict: the documented exception.

Ranks agree at log steps, but not more often than every `SPACING_S` seconds of training: where
logging windows are shorter (a fast step logged every step), one agreement carries several
windows, each still written with its own step and time. How many is planned at each agreement
from the slowest rank's seconds per step, which every rank has from the same collective, so all
ranks plan the same next step. Checkpoint steps and an epoch's or the run's last step always
agree.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

from dpt.distributed import DistEnv, all_gather_floats
from dpt.errors import DptError
from dpt.loop.interrupt import StopRequest
from dpt.monitor.monitor import Judgement

log = logging.getLogger("dpt")

# The least training time between two agreements that the loop's own cadence calls: one
# agreement's read-back, collective and bookkeeping then cost well under 1 % of the steps between.
SPACING_S = 0.05
# The most logging windows one agreement carries (its collective sends 7 floats per window).
MAX_WINDOWS = 100
# The share of trainer.stop_within that the steps to the next agreement and a checkpoint may take.
STOP_SHARE = 0.8


class NonFiniteLoss(DptError):
    """The loss became NaN or infinite (trainer.on_nonfinite=error). `rows`: every rank's
    payload of that agreement, so that the windows it carried can still be written; `step` and
    `rank`: where it was first."""

    rows: list[list[float]] = []
    step: int = 0
    rank: int = 0


class Header(NamedTuple):
    """What every rank sends before its payload."""

    nonfinite: float  # its first non-finite loss since the last agreement, coded (0: none)
    stop: float  # 1: a stop signal reached it
    seconds: float  # its training time since the last agreement
    checkpoint_s: float  # its newest checkpoint's time (trainer.stop_within plans with the max)


@dataclass
class Verdict:
    """What every rank decided together at one step, and every rank's payload row."""

    apply_update: bool
    stop: bool
    rows: list[list[float]]  # rows[rank] = that rank's payload, as it sent it
    nonfinite: tuple[int, int] | None = None  # (step, rank) of the first non-finite loss


@dataclass
class Rows:
    """Every rank's payload of one agreement, by its parts (rows[rank])."""

    metrics: list[list[float]]  # the logging windows' numbers (dpt.observe.metrics)
    monitor: list[list[float]]  # the monitor's values of the steps (dpt.monitor)


@dataclass
class Payload:
    """What this rank sends at an agreement, by its parts."""

    metrics: list[float]
    monitor: list[float]

    def row(self) -> list[float]:
        return self.metrics + self.monitor

    def split(self, rows: list[list[float]]) -> Rows:
        """Every rank's row, laid out as this one's (the ranks' parts are the same sizes)."""
        at = len(self.metrics)
        return Rows([row[:at] for row in rows], [row[at:] for row in rows])


@dataclass
class Agreed:
    """One agreement's outcome, the same on every rank: whether to stop, the monitor's
    judgement of the steps it covers (whether this step's update applies, its events), and
    every rank's payload."""

    stop: bool
    judgement: Judgement
    rows: Rows


class Agreement:
    def __init__(
        self,
        env: DistEnv,
        last_step: int,
        on_nonfinite: str,
        log_every: int = 1,
        spacing_s: float | None = None,  # None: SPACING_S
        every_step: bool = False,  # an update waits for its verdict (the monitor's `skip`)
        stop_within: float | None = None,  # trainer.stop_within: a stop's deadline, seconds
    ) -> None:
        self.env, self.last_step, self.on_nonfinite = env, last_step, on_nonfinite
        self.log_every, self._every_step = log_every, every_step
        self.spacing_s = SPACING_S if spacing_s is None else spacing_s
        self.stop_within, self.checkpoint_s = stop_within, 0.0  # the newest checkpoint's time
        # The first log step; under a deadline the first step, whose time plans the next
        self.next_step = 1 if stop_within else log_every
        self._agreed_step, self._agreed_at = 0, time.perf_counter()
        self._warned = False

    @property
    def every_step(self) -> bool:
        return self.on_nonfinite == "skip" or self._every_step

    def due(self, step: int) -> bool:
        """Whether the loop's cadence calls for an agreement at `step`: every step under
        on_nonfinite=skip, else at log steps at least `spacing_s` apart (as planned), sooner
        where trainer.stop_within needs it."""
        if self.every_step:
            return True
        if self.stop_within:  # a deadline's plan may fall between log steps
            return step >= self.next_step
        return step % self.log_every == 0 and step >= self.next_step

    def start_at(self, step: int) -> None:
        """A resumed run: the next log step after `step` is due."""
        self._agreed_step, self.next_step = step, step + 1

    def agree(
        self, stop: StopRequest, step: int, losses: list[float], payload: list[float]
    ) -> Verdict:
        """One collective at `step`: ranks agree on the earliest non-finite loss and on
        stopping, and see each other's payload. `losses`: this rank's losses of the steps since
        the last agreement, the last one `step`'s. Raises NonFiniteLoss under
        on_nonfinite=error."""
        first_step, first_loss = _first_nonfinite(losses, step - len(losses) + 1)
        now = time.perf_counter()
        mine = Header(float(self._code(first_step)), float(bool(stop)), now - self._agreed_at,
                      self.checkpoint_s)  # fmt: skip
        rows = all_gather_floats([*mine, *payload], self.env)
        size = len(Header._fields)
        heads = [Header(*row[:size]) for row in rows]
        # Every rank plans the same next agreement (a collective): from the world's numbers.
        self.checkpoint_s = max(head.checkpoint_s for head in heads)
        self._plan(step, max(head.seconds for head in heads))
        self._agreed_at = now
        stop_now = any(head.stop for head in heads)
        if stop_now and not stop:
            stop.signal_name = "a signal on another rank"
        verdict = Verdict(True, stop_now, [row[size:] for row in rows])
        bad_code = max(head.nonfinite for head in heads)
        if bad_code:
            try:
                verdict.nonfinite = self._bad_step(int(bad_code), first_loss)
            except NonFiniteLoss as error:
                error.rows = verdict.rows
                raise
            verdict.apply_update = False  # skip: this step's; rollback: undone anyway
        return verdict

    def _plan(self, step: int, slowest_s: float) -> None:
        """The next log step due: enough windows that `spacing_s` of training pass first, from
        the slowest rank's time since the last agreement (the same numbers on every rank)."""
        steps, self._agreed_step = step - self._agreed_step, step
        window_s = slowest_s / max(steps, 1) * self.log_every
        windows = math.ceil(self.spacing_s / window_s) if window_s > 0 else MAX_WINDOWS
        windows = min(max(windows, 1), MAX_WINDOWS)
        self.next_step = (step // self.log_every + windows) * self.log_every
        if self.stop_within:
            self.next_step = min(
                self.next_step, step + self._steps_within(window_s / self.log_every)
            )

    def _steps_within(self, step_s: float) -> int:
        """The most steps between agreements that leave a stop signalled just after one time
        for them and a checkpoint within trainer.stop_within, a fifth of it to spare (the first
        checkpoint's time is not known yet); at least one (said in one line, once, where one
        step and a checkpoint take longer)."""
        assert self.stop_within is not None
        budget = STOP_SHARE * self.stop_within - self.checkpoint_s
        steps = int(budget // step_s) if step_s > 0 else 1 << 30
        if steps < 1 and not self._warned and self.env.is_main:
            self._warned = True
            log.warning(
                f"trainer.stop_within={self.stop_within:g}: a step takes {step_s:.1f} s and a "
                f"checkpoint {self.checkpoint_s:.1f} s, longer than that: a SIGTERM mid-step "
                "ends before its checkpoint (the run resumes from the newest one); checkpoint "
                "more often (checkpoint.every_n_steps) or give the engine a longer grace"
            )
        return max(steps, 1)

    def _code(self, first_step: int) -> int:
        """The max over ranks picks the earliest bad step, then the lowest rank with it."""
        if not first_step:
            return 0
        world = self.env.world_size
        return (self.last_step + 1 - first_step) * world + world - 1 - self.env.rank

    def _bad_step(self, code: int, my_loss: float) -> tuple[int, int]:
        """(step, rank) of the first non-finite loss; raises it under on_nonfinite=error (the
        monitor says what the other actions do)."""
        world = self.env.world_size
        step, rank = self.last_step + 1 - code // world, world - 1 - code % world
        if self.on_nonfinite == "error":
            error = NonFiniteLoss(
                f"non-finite loss ({my_loss if rank == self.env.rank else 'nan/inf'}) at step "
                f"{step} on rank {rank}; set trainer.on_nonfinite=skip to skip such steps"
            )
            error.step, error.rank = step, rank
            raise error
        return step, rank


def _first_nonfinite(losses: list[float], first_step: int) -> tuple[int, float]:
    """(step, loss) of the first non-finite loss, or (0, 0.0); losses[0] is `first_step`'s."""
    for i, loss in enumerate(losses):
        if not math.isfinite(loss):
            return first_step + i, loss
    return 0, 0.0
