"""Detectors of training instability, judged against robust running levels.

Each keeps its history as plain values (`state_dict()` / `load_state_dict()`, torch.distributed
.checkpoint's `Stateful`), since the checkpoint stores such parts as one JSON string: a resumed
run judges its next values exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

MAD_TO_SIGMA = 1.4826  # MAD * this = the standard deviation, for normal noise
# Scale floors. A constant series (a loss logged rounded, a plateau, a fixed step time) has a MAD
# of 0, so any later wobble would score infinitely high; 1 % of the level keeps a wobble of a few
# percent ordinary (at threshold 6, an alarm needs +6 % over a flat level) while a real spike (2x)
# still scores ~100. The absolute floor only matters for a level of ~0.
REL_FLOOR = 0.01
ABS_FLOOR = 1e-12
# The level (median and deviation) is taken again every window/REFRESHES accepted values, not at
# every value: two sorts of the window cost ~9 us, more than the 1 % of a small model's step the
# monitor may take per step; a level ten values old judges a spike alike.
REFRESHES = 10


@dataclass(frozen=True)
class Alarm:
    """One detector's verdict on one value.

    `value` is what was judged (for "slowdown": its ratio to the level), `level` the running median
    it was judged against, `threshold_value` the bound it passed (same units as `value`), and
    `signal` which quantity raised it, for detectors that watch more than one.
    """

    detector: str
    value: float
    level: float
    threshold_value: float
    signal: str = ""


class RobustLevel:
    """The median and a robust scale (1.4826 * MAD, floored) of the last `window` accepted values,
    taken when the warm-up ends and then every `window // REFRESHES` accepted values.

    Median and MAD ignore the few outliers a window holds, where a mean and standard deviation
    would be dragged up by the very spikes they should flag.
    """

    def __init__(self, window: int, warmup: int, rel_floor: float = REL_FLOOR) -> None:
        if not 1 <= warmup <= window:
            raise ValueError(f"need 1 <= warmup <= window, got warmup={warmup}, window={window}")
        self.warmup, self.rel_floor = warmup, rel_floor
        self.every = max(1, window // REFRESHES)
        self.values: deque[float] = deque(maxlen=window)
        self.added = 0  # values accepted since the start: when the level is taken again
        self.level: tuple[float, float] | None = None  # (median, scale), once ready

    @property
    def ready(self) -> bool:
        """Whether enough values were seen for the level to mean something."""
        return self.level is not None

    @property
    def median(self) -> float:
        assert self.level is not None, "not warmed up"
        return self.level[0]

    @property
    def scale(self) -> float:
        assert self.level is not None, "not warmed up"
        return self.level[1]

    def add(self, value: float) -> None:
        self.values.append(float(value))
        self.added += 1
        if len(self.values) >= self.warmup and (self.level is None or self.added % self.every == 0):
            self.level = self._take()

    def _take(self) -> tuple[float, float]:
        median = statistics.median(self.values)
        mad = statistics.median(abs(v - median) for v in self.values)
        return median, max(MAD_TO_SIGMA * mad, self.rel_floor * abs(median), ABS_FLOOR)

    def score(self, value: float) -> float:
        """How far `value` lies above the median, in robust units (negative: below)."""
        return (value - self.median) / self.scale

    def state_dict(self) -> dict[str, Any]:
        level = None if self.level is None else list(self.level)
        return {"values": list(self.values), "added": self.added, "level": level}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A window shortened between runs keeps the newest values (deque's maxlen drops the rest).
        self.values.clear()
        self.values.extend(float(v) for v in state["values"])
        self.added = int(state["added"])
        level = state["level"]
        self.level = None if level is None else (float(level[0]), float(level[1]))
        if self.level is None and len(self.values) >= self.warmup:  # a shorter warm-up now
            self.level = self._take()


class SpikeDetector:
    """Flags a value more than `threshold` robust units above its running median ("loss_spike" on
    the world-mean loss, "grad_spike" on the global pre-clip gradient norm). Only upward spikes;
    non-finite values are another check's job and are neither judged nor kept. A value that alarms
    is not kept either, so a burst of spikes does not raise the level it is judged against.
    """

    def __init__(self, name: str, threshold: float, window: int, warmup: int) -> None:
        self.name, self.threshold = name, threshold
        self.level = RobustLevel(window, warmup)

    def fires(self, value: float) -> bool:
        """Whether `value` would alarm (a non-finite one too), without keeping it."""
        level = self.level
        return not math.isfinite(value) or (level.ready and level.score(value) > self.threshold)

    def check(self, value: float) -> Alarm | None:
        if not math.isfinite(value):
            return None
        level = self.level
        if level.ready and level.score(value) > self.threshold:
            bound = level.median + self.threshold * level.scale
            return Alarm(self.name, value, level.median, bound)
        level.add(value)
        return None

    def state_dict(self) -> dict[str, Any]:
        return self.level.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.level.load_state_dict(state)


class SlowdownDetector:
    """Flags `patience` logging windows in a row more than `threshold` times slower than usual
    ("slowdown"): the world's time per step against its running median, or the straggler ratio
    (slowest rank's compute per step / the median rank's, >= 1) against its own, which names one
    slow rank before it slows the world much. Once per streak: the next event needs a window at
    the usual speed first.

    Ratios, not robust units: step times jitter little, and what matters is how much slower. A
    single slow window (a loader refilling after validation, the machine's other work) is not a
    slowdown; `patience` windows are. Each series keeps its values unless they are over the
    threshold; non-finite values are ignored.
    """

    name = "slowdown"

    def __init__(self, threshold: float, window: int, warmup: int, patience: int = 1) -> None:
        self.threshold, self.patience = threshold, patience
        self.levels = {
            "step_time": RobustLevel(window, warmup),
            "straggler_ratio": RobustLevel(window, warmup),
        }
        self.streak = 0  # windows in a row over the threshold

    def check(self, step_time_s: float, straggler_ratio: float) -> Alarm | None:
        """The alarm of the worse of the two signals, once `patience` windows in a row were
        over the threshold."""
        alarms = [
            self._judge(signal, value)
            for signal, value in (("step_time", step_time_s), ("straggler_ratio", straggler_ratio))
        ]
        raised = [alarm for alarm in alarms if alarm is not None]
        self.streak = self.streak + 1 if raised else 0
        if self.streak != self.patience:
            return None
        return max(raised, key=lambda alarm: alarm.value)

    def _judge(self, signal: str, value: float) -> Alarm | None:
        if not math.isfinite(value):
            return None
        level = self.levels[signal]
        if level.ready and level.median > 0 and value > self.threshold * level.median:
            return Alarm(self.name, value / level.median, level.median, self.threshold, signal)
        level.add(value)
        return None

    def state_dict(self) -> dict[str, Any]:
        levels = {signal: level.state_dict() for signal, level in self.levels.items()}
        return {**levels, "streak": self.streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for signal, level in self.levels.items():
            level.load_state_dict(state[signal])
        self.streak = int(state["streak"])
