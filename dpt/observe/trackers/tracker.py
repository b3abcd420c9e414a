"""What every tracker answers, and what it is told of the run when it starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

# One logged step's scalars: (metrics, step, wall time in seconds since the epoch).
Row = tuple[dict[str, float], int, float]


@dataclass
class RunInfo:
    run_dir: Path
    name: str  # the run folder's name; a sweep's job: its number and swept values
    params: dict[str, Any]  # the resolved config, flat (`optimizer.lr`), with the groups' options
    tags: dict[str, str]  # dpt's own: strategy, world_size, task, git_commit where known
    resumed: bool  # from a checkpoint: the tracker continues its stored run
    history: list[dict[str, float]] = field(default_factory=list)  # a resumed run's rows so far
    sweep_dir: Path | None = None  # a sweep's job: the sweep's folder (its parent run's ids)


class Tracker(Protocol):
    name: str  # as in logger=[...]

    def start(self, info: RunInfo, stored: dict[str, Any] | None) -> dict[str, Any]:
        """Open (or, resumed, continue) the run; returns what finds it again (kept in
        `<run>/trackers.json`). `stored`: what an earlier start of this run returned."""

    def log_metrics(self, rows: list[Row]) -> None: ...

    def log_files(self, paths: list[Path]) -> None: ...

    def finish(self, status: str) -> None:
        """`status`: FINISHED, FAILED, or KILLED (stopped to be resumed)."""
