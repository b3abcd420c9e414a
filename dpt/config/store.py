"""The whole config's schema, every group's options, and their place in Hydra's ConfigStore.

The YAML files under `dpt/conf/` extend these schemas (`defaults: [/schema/<group>/<name>@_here_]`),
so OmegaConf rejects an unknown key or a value of the wrong type while Hydra composes the config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from dpt.config.datasets import DATASETS
from dpt.config.finetune import FinetuneConfig
from dpt.config.launchers import LAUNCHERS
from dpt.config.loggers import LOGGERS
from dpt.config.models import MODELS
from dpt.config.monitor import MonitorConfig
from dpt.config.optim import OPTIMIZERS, SCHEDULERS
from dpt.config.strategies import STRATEGIES
from dpt.config.tasks import TASKS
from dpt.config.trainer import CheckpointConfig, SweepConfig, TrainerConfig


@dataclass
class Config:
    model: Any = MISSING
    dataset: Any = MISSING
    task: Any = MISSING
    strategy: Any = MISSING
    launcher: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    logger: Any = field(default_factory=dict)  # the chosen trackers, a key each (logger=[...])


# Each config group's options and their schemas (`schema/<group>/<option>` in the ConfigStore).
SCHEMAS: dict[str, dict[str, type]] = {
    "model": MODELS,
    "dataset": DATASETS,
    "task": TASKS,
    "strategy": STRATEGIES,
    "launcher": LAUNCHERS,
    "optimizer": OPTIMIZERS,
    "scheduler": SCHEDULERS,
    "logger": LOGGERS,
}
# Groups chosen as a list (`logger=[tensorboard,mlflow]`): each option's keys are under
# `<group>.<option>` (its YAML's `@package`).
LIST_GROUPS = ("logger",)


def cpu_cores() -> int:
    """The cores this process may run on (what DataLoader compares its workers with)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cores_at_most(wanted: int) -> int:
    """`${dpt.cores:N}`: N, or the number of cores where there are fewer (loader workers beyond
    the cores only compete with the ranks, and DataLoader warns about each loader)."""
    return min(int(wanted), cpu_cores())


def register_configs() -> None:
    """Store the schemas under `schema/`, out of sight of the user-facing group listings."""
    OmegaConf.register_new_resolver("dpt.cores", cores_at_most, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    for group, options in SCHEMAS.items():
        for name, node in options.items():
            cs.store(group=f"schema/{group}", name=name, node=node)
