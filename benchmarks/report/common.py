"""What the sections' reports share: Markdown tables, ratios, the targets and their verdicts, and
error bars for the plots."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.runner import Stat

Results = dict[str, Any]  # what the sections measured, by key (see benchmarks/bench.py)
TargetRow = tuple[str, str, str]  # (target, measured, verdict)

# The targets. Logging at every step must cost under 5 % of an MLP step; 1 % stays the goal.
THROUGHPUT_TARGET = 0.99  # dpt/plain samples/s
LOGGING_TARGET_PCT, LOGGING_GOAL_PCT = 5.0, 1.0
STARTUP_TARGET = 1.2  # dpt/plain seconds to the first optimizer step


def md_table(headers: str | Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table; `headers` may be one string, the column names separated by `|`."""
    if isinstance(headers, str):
        headers = [h.strip() for h in headers.split("|")]
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_ratio(stat: Stat) -> str:
    return stat.fmt(".3f")


def target(
    name: str, stat: Stat, ok: Callable[[float], bool], spec: str = ".3f", unit: str = ""
) -> TargetRow:
    """A row of the targets table. The median decides; a range that crosses the line is said
    too (a shared machine)."""
    verdict = "met" if ok(stat.median) else "**not met**"
    if ok(stat.low) != ok(stat.high):
        verdict += " (not in every round)" if ok(stat.median) else " (met in some rounds)"
    return (name, stat.fmt(spec) + unit, verdict)


def logging_target(name: str, share: Stat, spec: str) -> TargetRow:
    """The logging target (under LOGGING_TARGET_PCT % of the step), with the goal's state."""
    goal = "goal 1 % met" if share.median < LOGGING_GOAL_PCT else "goal 1 % not yet"
    return target(f"{name} ({goal})", share, lambda v: v < LOGGING_TARGET_PCT, spec, " %")


def error_bars(stats: list[Stat]) -> list[list[float]]:
    """matplotlib's asymmetric error bars: from each median down to its low, up to its high."""
    return [[s.median - s.low for s in stats], [s.high - s.median for s in stats]]
