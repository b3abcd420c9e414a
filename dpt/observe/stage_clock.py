"""A pipeline stage's time: how much of a step it computes, and how long it idles waiting for
the stages before and after it (the bubble), per rank for TensorBoard.

The stage's own work is timed around the schedule's calls into it (`forward_one_chunk`,
`backward_one_chunk`, `backward_weight_one_chunk`); everything else in the schedule's step is
sending, receiving and waiting. On CUDA both are timed with events, read at the next log step
(an agreement, where the host waits anyway); on the CPU the host's clock is the device's.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

WORK = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class StageClock:
    def __init__(self) -> None:
        self.cuda = False
        self._work: list[Any] = []  # (start, end) pairs: seconds, or CUDA events
        self._steps: list[Any] = []
        self.totals = {"work": 0.0, "step": 0.0, "steps": 0.0}

    def watch(self, stage: Any, device: torch.device) -> None:
        """Time the stage's own work from now on."""
        self.cuda = device.type == "cuda"
        for name in WORK:
            method = getattr(stage, name, None)
            if method is not None:
                setattr(stage, name, self._timed(method))

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self._span(self._work):
                return method(*args, **kwargs)

        return timed

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around the schedule's whole step."""
        with self._span(self._steps):
            yield
        self.totals["steps"] += 1

    @contextlib.contextmanager
    def _span(self, into: list[Any]) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        into.append((start, end))

    def _seconds(self, spans: list[Any]) -> float:
        if not spans:
            return 0.0
        if self.cuda:
            spans[-1][1].synchronize()  # the last span's end: every earlier one is done too
            return sum(a.elapsed_time(b) for a, b in spans) / 1000.0
        return sum(b - a for a, b in spans)

    def scalars(self) -> dict[str, float]:
        """Per step since the last call: compute and idle seconds, and the idle share."""
        self.totals["work"] += self._seconds(self._work)
        self.totals["step"] += self._seconds(self._steps)
        self._work, self._steps = [], []
        steps, step_s, work_s = self.totals["steps"], self.totals["step"], self.totals["work"]
        self.totals = {"work": 0.0, "step": 0.0, "steps": 0.0}
        if not steps:
            return {}
        idle_s = max(step_s - work_s, 0.0)
        return {"pipeline/compute_s": work_s / steps, "pipeline/idle_s": idle_s / steps,
                "pipeline/bubble": idle_s / step_s if step_s > 0 else 0.0}  # fmt: skip
