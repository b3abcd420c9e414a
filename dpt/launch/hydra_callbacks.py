"""Hydra callbacks: checks that must run before Hydra makes a run folder or writes into it."""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from dpt.errors import Abort, ConfigError, DptError
from dpt.launch import preflight, ray_cluster, run_lock, torchrun_job
from dpt.launch.validate import validate

RESTART_LOCK_WAIT_S = 60.0  # torchrun's agent gives a stopped worker 30 s before SIGKILL


class ValidateConfig(Callback):
    """Validate ranges before the run folder exists, so bad input leaves nothing behind.

    `on_run_start` fires before `run_job` creates the folder. In a multirun, each job's own
    overrides are only known per job, so the job is checked again (in its own folder) by the task.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _own_clock_folder(config)
        _validate(config, "hydra.run.dir", fit=True)
        _lock(run_folder(config))

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        run_lock.release(run_folder(config))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _validate(config, "hydra.sweep.dir")


def _own_clock_folder(config: DictConfig) -> None:
    """A run folder named by the clock (`outputs/<date>/<time>`, the default) that is there
    already belongs to a run started in the same second: this one takes `<time>-1` (or -2, ...)
    instead of resuming it, or finding it finished and training nothing. A folder the user names
    is theirs to resume."""
    raw = OmegaConf.to_container(config.hydra.run, resolve=False)
    assert isinstance(raw, dict)
    if "${now:" not in str(raw.get("dir")):
        return
    folder = run_folder(config)
    if not folder.exists():
        return
    free = next(
        n for n in itertools.count(1) if not folder.with_name(f"{folder.name}-{n}").exists()
    )
    with read_write(config), open_dict(config):
        config.hydra.run.dir = str(folder.with_name(f"{folder.name}-{free}"))


def _validate(config: DictConfig, folder_key: str, fit: bool = False) -> None:
    """`fit`: also whether the task fits a data set, model or loss of yours, built for that
    (dpt.launch.preflight), before the folder is made."""
    try:
        validate(config)
        ray_cluster.check(config.launcher)  # a cluster that does not answer: before any job
        if fit:
            preflight.check(config)
        check_writable(Path(str(OmegaConf.select(config, folder_key))), folder_key)
    except DptError as error:
        raise Abort(error) from error


def run_folder(config: DictConfig) -> Path:
    return Path(str(OmegaConf.select(config, "hydra.run.dir")))


def _lock(folder: Path) -> None:
    """Before Hydra writes its `.hydra/` files: a second start must not touch a live run's
    folder. A multirun's jobs are locked by the task (their folders are known only there)."""
    if not run_lock.holds_lock_here():
        return
    # The folder an earlier attempt of this torchrun job recorded: that attempt's ranks are
    # being stopped. Any other folder in use is refused at once, as without torchrun.
    ours = torchrun_job.recorded_run_dir() == str(folder.resolve())
    try:
        run_lock.acquire(folder, RESTART_LOCK_WAIT_S if ours else 0.0)
    except DptError as error:
        raise Abort(error) from error
    if not ours:  # the job's first attempt: where its later ones run
        torchrun_job.record(folder)


def check_writable(folder: Path, key: str) -> None:
    """Fail now, in one line, rather than after workers started (or deep inside Hydra)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ConfigError(
            f"{key}={folder}: the output folder cannot be written ({reason})"
        ) from error
