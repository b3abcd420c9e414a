"""Shared pieces of the benchmark: medians with their spread, paired ratios, timing, a table."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # dpt from this checkout, wherever the script is started from
    sys.path.insert(0, str(REPO))

# The file in which scripts/bench_train.py stamps dpt's first optimizer step (unset: no stamp).
FIRST_STEP_ENV = "DPT_BENCH_FIRST_STEP"


@dataclass(frozen=True)
class Stat:
    """The median of repeated measurements, with their range: a single time is never reported."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        if not values:
            raise ValueError("no measurements")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def fmt(self, spec: str = ",.0f", spread: bool = True) -> str:
        text = format(self.median, spec)
        if spread and self.n > 1:
            text += f" ({format(self.low, spec)}-{format(self.high, spec)})"
        return text


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> Stat:
    """Ratios of measurements taken side by side (round i with round i): the load on a shared
    machine drifts between rounds, much less between two neighbouring runs."""
    return Stat.of([a / b for a, b in zip(numerators, denominators, strict=True)])


def time_calls(func: Callable[[], object], repeat: int) -> list[float]:
    """Seconds per call, `repeat` calls, each timed on its own."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        func()
        times.append(time.perf_counter() - start)
    return times


def md_table(headers: str | Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table; `headers` may be one string, the column names separated by `|`."""
    if isinstance(headers, str):
        headers = [h.strip() for h in headers.split("|")]
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
