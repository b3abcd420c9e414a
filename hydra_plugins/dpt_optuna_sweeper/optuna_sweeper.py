"""dpt's Optuna sweeper: a Hydra sweeper on Optuna's ask-and-tell API (dpt.launch.search).

hydra-optuna-sweeper 1.3 pins optuna<3 (2.10, whose storage needs SQLAlchemy < 2 and an alembic
of that time): this plugin takes its config keys and its override grammar on current Optuna.
"""

from __future__ import annotations

from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from hydra_plugins.dpt_optuna_sweeper import config as _config  # noqa: F401  # registers it


class OptunaSweeper(Sweeper):
    def __init__(self, **settings: Any) -> None:
        from dpt.launch.search import Search  # Optuna, only when a search runs

        self.search = Search(**settings)

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.search.setup(hydra_context, task_function, config)

    def sweep(self, arguments: list[str]) -> None:
        self.search.run(arguments)
