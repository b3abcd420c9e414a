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


QUICK_BANNER = "\n\n**A `--quick` run: one round, few steps. Its numbers are not a measurement.**"


def quick_banner(section: dict[str, Any]) -> str:
    """The warning under a marked section's title when it was measured with --quick."""
    return QUICK_BANNER if section["quick"] else ""


def measured_alone(section: dict[str, Any], command: str, note: str, cores: bool = False) -> str:
    """A marked section's line on how and when it was measured on its own (`note` ends it)."""
    load = ", ".join
    before, after = ([f"{x:.2f}" for x in loads] for loads in section["load"])
    where = f"{section['cores']} cores, " if cores else ""
    return (
        f"*Measured on its own: `{command}`, {section['date']}, "
        f"{section['duration_s'] / 60:.1f} min, {section['rounds']} round(s), {where}load "
        f"average{' (1, 5, 15 min)' if cores else ''} before {load(before)}, after "
        f"{load(after)}. {note}*"
    )


def stamp(args: Any, started: float) -> dict[str, Any]:
    """What a marked section records of its own measurement (for `measured_alone`)."""
    import os
    import time

    return {
        "quick": args.quick, "smoke": args.smoke, "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "duration_s": time.time() - started, "cores": os.cpu_count(),
    }  # fmt: skip
