"""What the monitor saw and did: one `Event` per detection, its console line, and the run folder's
`events.jsonl` (rank 0 appends one JSON object a line).

The log follows the run's line as checkpoints do: a checkpoint records how many events the run had
written by then, and a run resumed from it moves the lines written after (by a run that went on
and was killed) aside to `events.abandoned-<UTC time>.jsonl`, so the replayed steps write their
events once. A rollback is not a resume: its event stays, and so do the events before it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("dpt")

EVENTS = "events.jsonl"
ABANDONED_EVENTS = "events.abandoned-"

# What each action did, for the console line.
DONE = {
    "warn": "warned",
    "skip": "update skipped",
    "rollback": "rolled back",
    "stop": "stopped",
    "error": "stopped",
}


@dataclass
class Event:
    """One detection and the reaction every rank took. JSON keys: these fields; `value` and
    `level` are null where not finite or not known (a non-finite loss has no level)."""

    step: int  # the optimizer step whose value raised it (a slowdown: its window's last step)
    epoch: int  # 0-based, as the data position counts
    detector: str  # loss_spike, grad_spike, nonfinite, slowdown
    value: float | None  # the loss, gradient norm, or slowdown ratio judged
    level: float | None  # the running median it was judged against
    threshold: float | None  # the bound it passed, in the units of `value`
    action: str  # warn, skip, rollback, stop, error
    skipped_samples: int = 0  # samples whose update was not applied (skip, rollback)
    sample: int | None = None  # where the step's global batch begins in the epoch's order
    # Global-order positions [from, to) of `epoch` that a rollback skipped (not trained again).
    skipped: list[int] | None = None
    rollback_to: int | None = None  # the checkpoint's step a rollback returned to
    signal: str = ""  # which quantity: slowdown's step_time or straggler_ratio
    rank: int | None = None  # nonfinite: the rank whose loss was not finite first
    module: str | None = None  # nonfinite: the first module whose output was not finite
    module_class: str | None = None  # its class, e.g. Linear
    note: str = ""  # what else the reader should know (how the module was found, ...)
    time: float = 0.0  # Unix time

    def to_json(self) -> str:
        record = asdict(self)
        for key in ("value", "level", "threshold"):
            value = record[key]
            record[key] = value if value is None or math.isfinite(value) else None
        record = {key: value for key, value in record.items() if value not in (None, "", [])}
        if self.value is not None and not math.isfinite(self.value):
            record["value_text"] = str(self.value)  # nan, inf: JSON has no literal for them
        return json.dumps(record, sort_keys=False)

    def line(self) -> str:
        """The console line: what, where, against what, and what was done."""
        what = f"monitor: {self.detector}"
        if self.signal:
            what += f" ({self.signal})"
        text = f"{what} at step {self.step}: "
        if self.detector == "slowdown":  # a ratio to the level, over a threshold ratio
            unit = " s per step" if self.signal == "step_time" else ""
            text += (f"{_number(self.value)}x the usual ({_number(self.level)}{unit}), over "
                     f"{_number(self.threshold)}x")  # fmt: skip
        elif self.threshold is not None and self.level is not None:
            text += (
                f"{_number(self.value)} > {_number(self.threshold)} (level {_number(self.level)})"
            )
        else:
            text += _number(self.value)
        if self.rank is not None:
            text += f" on rank {self.rank}"
        if self.module is not None:
            text += f", first non-finite output: {self.module}"
            if self.module_class is not None:
                text += f" ({self.module_class})"
        text += f"; {DONE[self.action]}"
        if self.rollback_to is not None:
            text += f" to step {self.rollback_to}"
        if self.skipped_samples:
            text += f", {self.skipped_samples:,} samples skipped"
        return text + (f" ({self.note})" if self.note else "")


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


class EventLog:
    """`<run>/events.jsonl`, written by rank 0 only (every rank takes the same decisions, so one
    writer tells the whole story); `written` counts the run's events, stored in checkpoints."""

    def __init__(self, run_dir: Path, is_main: bool) -> None:
        self.path, self.is_main = run_dir / EVENTS, is_main
        self.written = 0

    def add(self, event: Event) -> None:
        """One line, flushed and synced: a run killed right after still shows what happened."""
        self.written += 1
        if not self.is_main:
            return
        with open(self.path, "a") as f:
            f.write(event.to_json() + "\n")
            f.flush()
            os.fsync(f.fileno())

    def resume_at(self, written: int) -> None:
        """A run resumed from a checkpoint that had `written` events: later lines move aside."""
        self.written = written
        if not self.is_main:
            return
        lines = read_lines(self.path)
        if len(lines) <= written:
            return
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = self.path.with_name(f"{ABANDONED_EVENTS}{stamp}.jsonl")
        aside.write_text("".join(lines[written:]))
        tmp = self.path.with_name(f".{EVENTS}.tmp-{os.getpid()}")
        tmp.write_text("".join(lines[:written]))
        os.replace(tmp, self.path)
        log.info(
            f"{len(lines) - written} event(s) written after the checkpoint moved aside to {aside}:"
            " the steps they came from run again"
        )


def read_lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return []


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """A run folder's events, oldest first (the sweep summary counts them)."""
    return [json.loads(line) for line in read_lines(run_dir / EVENTS) if line.strip()]
