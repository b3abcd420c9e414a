"""A search: Optuna's study asked for trials, each run as a Hydra job by the configured launcher,
told its result (dpt's task returns the run's objective, dpt.launch.objective).

The study lives in an RDB storage (by default `<sweep folder>/optuna.db`), and
`hydra.sweeper.n_trials` is its total: the same command, with the same sweep folder, continues a
study that was killed. Trials that finished (completed or failed) are not run again; a trial cut
short (left RUNNING by a process that died) is marked failed and its parameters are queued again
(user attribute `retry_of`), and the sampler draws on from `seed + trials so far`, not from where
the first start drew. One sweeper per study: RUNNING trials are taken to be cut short.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from dpt.errors import Abort, ConfigError, DptError, first_line
from dpt.launch import search_space
from dpt.state.sweep_folder import SWEEP_CONFIG
from dpt.tasks import objective

RESULTS = "optimization_results.yaml"  # as hydra-optuna-sweeper writes it
RETRY_OF = "retry_of"  # user attribute of a trial that reruns one cut short


class Search:
    def __init__(
        self,
        sampler: DictConfig | None,
        direction: str | None,
        storage: str | None,
        study_name: str | None,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        params: DictConfig | None,
    ) -> None:
        self.sampler_cfg, self.direction, self.storage = sampler, direction, storage
        self.study_name, self.n_trials, self.n_jobs = study_name, n_trials, n_jobs
        self.max_failure_rate = max_failure_rate
        self.params = dict(params or {})

    def setup(
        self, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )
        self.sweep_dir = Path(config.hydra.sweep.dir)

    def run(self, arguments: list[str]) -> None:
        try:  # bad input, before any trial: one line (Abort passes Hydra's own reporting)
            self._check()
            space = [f"{key}={value}" for key, value in self.params.items()] + arguments
            searched, fixed = search_space.parse(space)
        except DptError as error:
            raise Abort(error) from error
        study = self._study()
        # The sweep's config, as Hydra's own sweeper saves it: what the jobs' TensorBoard
        # folders are named by (the searched keys: sweep_folder.swept_keys), and a record.
        OmegaConf.save(self.config, self.sweep_dir / SWEEP_CONFIG)
        self._retry_cut_short(study)
        while (left := self.n_trials - len(finished(study))) > 0:
            trials = [study.ask(searched) for _ in range(min(self.n_jobs, left))]
            lines = [search_space.overrides(trial.params, fixed) for trial in trials]
            returns = self._launch(trials, lines)
            failed = [trial for trial, ret in zip(trials, returns, strict=True)
                      if not tell(study, trial, ret)]  # fmt: skip
            if len(failed) > self.max_failure_rate * len(trials):
                raise Abort(DptError(
                    f"{len(failed)} of {len(trials)} trials failed (first: trial "
                    f"{failed[0].number}), more than hydra.sweeper.max_failure_rate="
                    f"{self.max_failure_rate:g} allows"
                ))  # fmt: skip
        self._write_results(study)

    # --- the study ---

    def _check(self) -> None:
        """The study's direction is the objective's; a direction set otherwise is one line."""
        wanted = objective.of_config(self.config)
        if self.direction is not None and self.direction != wanted.direction:
            raise ConfigError(
                f"hydra.sweeper.direction={self.direction}: the objective ({wanted.name}, "
                f"sweep.objective={self.config.sweep.objective}) is to {wanted.direction}; set "
                "one of them to agree"
            )
        self.direction = wanted.direction

    def _study(self) -> Any:
        import optuna
        from sqlalchemy.exc import SQLAlchemyError  # Optuna's storage underneath

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # dpt says what matters
        storage = self.storage or f"sqlite:///{self.sweep_dir.resolve() / 'optuna.db'}"
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        try:
            existing = _trials_in(storage, self.study_name)
            study = optuna.create_study(
                storage=storage, study_name=self.study_name, direction=self.direction,
                sampler=self._sampler(existing), load_if_exists=True,
            )  # fmt: skip
        except SQLAlchemyError as error:  # a damaged or foreign file where the study should be
            raise DptError(
                f"the study's storage {storage} cannot be read ({_database_reason(error)}): move "
                "it aside to start the study afresh, or name another with hydra.sweeper.storage"
            ) from error
        done = len(finished(study))
        print(f"[sweep] study {study.study_name} in {storage}: {done} of {self.n_trials} trials "
              "done", flush=True)  # fmt: skip
        return study

    def _sampler(self, trials_so_far: int) -> Any:
        """The configured sampler; a study that goes on draws from seed + its trials so far, so
        that its new trials are not the first start's again."""
        if self.sampler_cfg is None:
            return None
        from hydra.utils import instantiate

        cfg = OmegaConf.to_container(self.sampler_cfg, resolve=True)
        assert isinstance(cfg, dict)
        if cfg.get("seed") is not None:
            cfg["seed"] = int(cfg["seed"]) + trials_so_far
        return instantiate(cfg)

    def _retry_cut_short(self, study: Any) -> None:
        """RUNNING trials were cut short (the sweeper that ran them died): failed, and queued
        again with their parameters, once each."""
        from optuna.trial import TrialState

        retried = _retried(study.get_trials(deepcopy=False))
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            study.tell(trial.number, state=TrialState.FAIL)
            if trial.number not in retried:
                study.enqueue_trial(trial.params, user_attrs={RETRY_OF: trial.number})
                say(f"[sweep] trial {trial.number} was cut short: it runs again")

    def _launch(self, trials: list[Any], lines: list[list[str]]) -> list[JobReturn]:
        """Each trial as Hydra job number = its trial number (its folder in the sweep)."""
        numbers = [trial.number for trial in trials]
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            return list(self.launcher.launch(lines, initial_job_idx=numbers[0]))
        return [ret for number, line in zip(numbers, lines, strict=True)
                for ret in self.launcher.launch([line], initial_job_idx=number)]  # fmt: skip

    def _write_results(self, study: Any) -> None:
        from optuna.trial import TrialState

        if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            say("[sweep] no trial completed: no best trial")
            return
        best = study.best_trial
        results = {"name": "optuna", "best_params": best.params, "best_value": best.value,
                   "best_trial": best.number}  # fmt: skip
        OmegaConf.save(OmegaConf.create(results), self.sweep_dir / RESULTS)
        print(f"[sweep] best trial: {best.number}, {best.value:.6g}, {best.params}", flush=True)


def finished(study: Any) -> list[Any]:
    """The trials that count towards n_trials: completed or failed, not those cut short."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    retried = _retried(trials)
    return [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL)
            and t.number not in retried]  # fmt: skip


def _retried(trials: list[Any]) -> set[int]:
    """The numbers of the trials cut short that a later trial runs again (its `retry_of`)."""
    return {t.user_attrs[RETRY_OF] for t in trials if RETRY_OF in t.user_attrs}


def tell(study: Any, trial: Any, ret: JobReturn) -> bool:
    """The job's result to Optuna: its objective, or failed (the job raised, or the objective is
    not a finite number: a diverged run). Returns whether the trial completed."""
    from optuna.trial import TrialState

    value = ret._return_value  # `return_value` would raise a failed job's exception here
    failure = _failure(ret.status, value)
    if failure is None:
        study.tell(trial, float(value))
        return True
    trial.set_user_attr("failure", failure)
    study.tell(trial, state=TrialState.FAIL)
    say(f"[sweep] trial {trial.number} failed: {failure}")
    return False


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _failure(status: JobStatus, value: Any) -> str | None:
    if isinstance(value, BaseException) or status == JobStatus.FAILED:
        return f"{type(value).__name__}: {value}"
    if not isinstance(value, int | float) or not math.isfinite(value):
        return f"objective {value} (diverged, or no value to report)"
    return None


def _database_reason(error: BaseException) -> str:
    """`(sqlite3.DatabaseError) file is not a database [SQL: ...]` -> `file is not a database`."""
    line = first_line(error)
    return line.split(") ", 1)[1] if line.startswith("(") and ") " in line else line


def _trials_in(storage: str, study_name: str | None) -> int:
    """How many trials the stored study has (0 where there is none yet)."""
    import optuna

    try:
        return len(optuna.load_study(study_name=study_name, storage=storage).trials)
    except KeyError:  # no such study yet (optuna's own word for it)
        return 0
