"""`hydra/sweeper=optuna`: the keys of hydra-optuna-sweeper 1.3 (`n_trials`, `n_jobs`, `direction`,
`storage`, `study_name`, `sampler`, `params`, `max_failure_rate`), so that a search file written
for it works unchanged; registered in Hydra's ConfigStore when Hydra finds its plugins.

Nothing here imports Optuna: Hydra imports every plugin's modules at start, in every process.
Hydra's plugin scan runs this module without entering it in `sys.modules`, where dataclasses
cannot resolve postponed annotations: no `from __future__ import annotations` here.
"""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class TPESamplerConf:
    """optuna.samplers.TPESampler: Bayesian optimization (tree-structured Parzen estimators).
    Its keys as hydra-optuna-sweeper names them; null: Optuna's own default."""

    _target_: str = "optuna.samplers.TPESampler"
    seed: int | None = None  # a study started again draws on from seed + its trials so far
    n_startup_trials: int = 10  # random trials before the model takes over
    n_ei_candidates: int = 24  # candidates the model scores for each new trial
    multivariate: bool | None = None  # true: the keys modelled together, not one by one
    consider_prior: bool | None = None  # TPE's prior (the rest: TPESampler's own keys)
    prior_weight: float | None = None  # the prior's weight
    consider_magic_clip: bool | None = None  # a heuristic bound on the kernels' widths
    consider_endpoints: bool | None = None  # the bounds of the space in the kernels' widths
    warn_independent_sampling: bool | None = None  # warn when a key falls back to random


@dataclass
class RandomSamplerConf:
    """optuna.samplers.RandomSampler."""

    _target_: str = "optuna.samplers.RandomSampler"
    seed: int | None = None  # null: Optuna's own (not reproducible); a study started again draws on


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.dpt_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    # The sampler arrives as its config: the sweeper builds it, reseeded where the study goes on.
    _recursive_: bool = False
    defaults: list[Any] = field(default_factory=lambda: [{"sampler": "tpe"}])
    sampler: Any = MISSING  # hydra/sweeper/sampler: tpe (default) or random, merged here
    # minimize or maximize; null: the direction of the run's objective (sweep.objective).
    direction: str | None = None
    # An RDB URL; null: sqlite:///<sweep folder>/optuna.db, so that the study lives with the
    # sweep and the same command (the same hydra.sweep.dir) continues it.
    storage: str | None = None
    study_name: str | None = "dpt"  # the study's name in its storage
    n_trials: int = 20  # the study's total: a study started again runs only what is missing
    n_jobs: int = 2  # trials launched together (each a Hydra job of the configured launcher)
    # The share of a batch's trials that may fail before the sweep ends; 1.0 (the default): a
    # failed or diverged trial is told to Optuna as failed and the study goes on.
    max_failure_rate: float = 1.0
    # key: override grammar, e.g. `optimizer.lr: tag(log, interval(1e-4, 1e-1))`; sweeps on the
    # command line join them.
    params: dict[str, str] | None = None


ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=OptunaSweeperConf,
                             provider="dpt")  # fmt: skip
ConfigStore.instance().store(group="hydra/sweeper/sampler", name="tpe", node=TPESamplerConf,
                             provider="dpt")  # fmt: skip
ConfigStore.instance().store(group="hydra/sweeper/sampler", name="random",
                             node=RandomSamplerConf, provider="dpt")  # fmt: skip
