"""Hydra callbacks: checks that must run before Hydra makes a run folder."""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from dpt.config import validate
from dpt.errors import Abort, ConfigError


class ValidateConfig(Callback):
    """Validate ranges before the run folder exists, so bad input leaves nothing behind.

    `on_run_start` fires before `run_job` creates the folder. In a multirun, each job's own
    overrides are only known per job, so the job is checked again (in its own folder) by the task.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _validate(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _validate(config)


def _validate(config: DictConfig) -> None:
    try:
        validate(config)
    except ConfigError as error:
        raise Abort(error) from error
