"""The trackers a run's `logger` list names, started on rank 0 before its first step."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dpt.config.loggers import CSV, EXTRAS, MLFLOW, TENSORBOARD, WANDB, chosen
from dpt.errors import DptError, clipped, one_line
from dpt.observe.trackers.handoff import Trackers
from dpt.observe.trackers.ids import read_ids, write_ids
from dpt.observe.trackers.tracker import RunInfo, Tracker

# What to change when a tracker cannot start, by tracker.
HINTS = {
    MLFLOW: "is the server up at logger.mlflow.tracking_uri? Set it, or leave mlflow out of "
    "logger=[...]",
    WANDB: "set logger.wandb.mode=offline, or leave wandb out of logger=[...]",
    CSV: "is the run folder writable?",
}


def needs_package(name: str) -> DptError:
    extra = EXTRAS[name]
    return DptError(f"logger=[...,{name}] needs the {extra} package: pip install "
                    f"'dpt[{extra}]' (scripts/setup.sh installs it)")  # fmt: skip


def make(name: str, node: Any, run_dir: Path) -> Tracker:
    """The tracker of one `logger` option (tensorboard is the metrics logger's own)."""
    if name == CSV:
        from dpt.observe.trackers.csv_file import CsvTracker

        return CsvTracker(run_dir, str(node.file))
    if name == MLFLOW:
        from dpt.observe.trackers.mlflow_run import MlflowTracker

        return MlflowTracker(node)
    from dpt.observe.trackers.wandb_run import WandbTracker

    return WandbTracker(node)


def trackers_named(logger: Any) -> list[str]:
    """The trackers of a `logger` node besides TensorBoard (the metrics logger's own)."""
    return [name for name in chosen(logger) if name != TENSORBOARD]


def open_trackers(logger: Any, info: RunInfo) -> Trackers:
    """The trackers the `logger` node names, started in their own process (one line where one
    cannot start: before training); their ids kept in `<run>/trackers.json`."""
    names = trackers_named(logger)
    if not names:
        return Trackers()
    return Trackers.start(OmegaConf.to_container(logger, resolve=True), info, names)


def start_all(logger: Any, info: RunInfo) -> tuple[list[Tracker], dict[str, Any]]:
    """Start every tracker the `logger` node names (in the trackers' process) and keep their
    ids in `<run>/trackers.json`: the trackers, and their ids."""
    stored = read_ids(info.run_dir)
    trackers, ids = [], dict(stored)
    for name in trackers_named(logger):
        tracker = make(name, getattr(logger, name), info.run_dir)
        try:
            ids[name] = tracker.start(info, stored.get(name))
        except Exception as error:
            _give_up(trackers)
            if isinstance(error, ImportError) and name in EXTRAS and EXTRAS[name] in str(error):
                raise needs_package(name) from None
            raise DptError(f"logger {name}: its run could not start ({clipped(one_line(error))}); "
                           f"{HINTS[name]}") from error  # fmt: skip
        trackers.append(tracker)
    if trackers:
        write_ids(info.run_dir, ids)
    return trackers, ids


def _give_up(started: list[Tracker]) -> None:
    """The trackers started before one that could not: their runs end as failed."""
    for tracker in started:
        with contextlib.suppress(Exception):
            tracker.finish("FAILED")


def git_commit(folder: Path) -> str | None:
    """The commit of the git work tree dpt runs in, where there is one."""
    try:
        found = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True,
                               text=True, timeout=10, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() or None if found.returncode == 0 else None


def run_tags(strategy: str, world_size: int, task: str) -> dict[str, str]:
    """dpt's own tags of a run: how it ran, what it learned, from which commit."""
    tags = {"strategy": strategy, "world_size": str(world_size), "task": task}
    commit = git_commit(Path.cwd())
    if commit:
        tags["git_commit"] = commit
    return tags
