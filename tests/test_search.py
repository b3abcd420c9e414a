"""dpt's Optuna sweeper in process: the override grammar as a search space, the objective and its
direction, and a study that fails, is cut short and goes on, driven by a stand-in launcher."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import optuna
import pytest
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from dpt.errors import Abort, ConfigError
from dpt.launch import search_space
from dpt.launch.search import RETRY_OF, Search, finished
from dpt.tasks import objective
from tests.helpers import compose

# --- the search space -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argument", "expected"),
    [
        ("a=choice(32, 64, 128)", CategoricalDistribution([32, 64, 128])),
        ("a=choice(adam, sgd)", CategoricalDistribution(["adam", "sgd"])),
        ("a=range(1, 5)", IntDistribution(1, 4)),  # `stop` left out, as in Python
        ("a=range(2, 11, 4)", IntDistribution(2, 10, step=4)),
        ("a=range(0, 1, 0.25)", FloatDistribution(0.0, 0.75, step=0.25)),
        ("a=interval(0.1, 0.5)", FloatDistribution(0.1, 0.5)),
        ("a=interval(1, 8)", FloatDistribution(1.0, 8.0)),  # Hydra's intervals are of floats
        ("a=tag(log, interval(1e-4, 1e-1))", FloatDistribution(1e-4, 1e-1, log=True)),
    ],
)  # fmt: skip
def test_the_override_grammar_is_a_search_space(argument: str, expected: Any) -> None:
    searched, fixed = search_space.parse([argument])
    assert searched == {"a": expected} and fixed == {}


def test_a_plain_value_is_fixed_and_a_searched_key_wins() -> None:
    searched, fixed = search_space.parse(["b=3", "a=choice(1, 2)", "a=5"])
    assert fixed == {"b": "3"} and list(searched) == ["a"]
    assert search_space.overrides({"a": 2}, fixed) == ["a=2", "b=3"]


def test_an_empty_range_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^a=range\(3, 3, 1\): no value in the range$"):
        search_space.parse(["a=range(3, 3)"])


# --- the objective ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "watched", "mode", "validation", "expected"),
    [
        ("auto", "val/acc1", "max", True, ("val/acc1", "maximize")),
        ("auto", "val/loss", "min", True, ("val/loss", "minimize")),
        ("auto", "val/acc1", "max", False, ("train/loss", "minimize")),
        ("val/acc5", "val/loss", "min", True, ("val/acc5", "maximize")),
        ("train/loss", "val/acc1", "max", True, ("train/loss", "minimize")),
    ],
)  # fmt: skip
def test_the_objective_and_its_direction(
    name: str, watched: str, mode: str, validation: bool, expected: tuple[str, str]
) -> None:
    found = objective.resolve(name, watched, mode, validation)
    assert (found.name, found.direction) == expected


def test_its_value_is_the_best_epochs_or_the_final_loss() -> None:
    summary = {"final_loss": 0.25, "best_per_metric": {"val/acc1": 0.875, "val/loss": 0.5}}
    assert objective.Objective("val/acc1", "maximize").value(summary) == 0.875
    assert objective.Objective("train/loss", "minimize").value(summary) == 0.25
    none = objective.Objective("val/acc5", "maximize")
    assert math.isnan(none.value(summary)) and none.record(summary)["value"] is None


# --- the study ------------------------------------------------------------------------------------


class StandInLauncher:
    """Runs a trial as `(lr - 0.01)^2`, or raises where lr > `fails_above` (a diverging run)."""

    def __init__(self, fails_above: float = math.inf) -> None:
        self.fails_above = fails_above
        self.launched: list[tuple[int, list[str]]] = []

    def launch(self, lines: list[list[str]], initial_job_idx: int) -> list[JobReturn]:
        returns = []
        for i, line in enumerate(lines):
            self.launched.append((initial_job_idx + i, line))
            lr = float(dict(item.split("=", 1) for item in line)["optimizer.lr"])
            ret = JobReturn()
            ret.status = JobStatus.COMPLETED  # as dpt's sweep callback leaves even a failure
            ret._return_value = (
                ValueError("non-finite loss") if lr > self.fails_above else (lr - 0.01) ** 2
            )
            returns.append(ret)
        return returns


def search(
    tmp_path: Path, launcher: StandInLauncher, n_trials: int = 6, direction: str | None = None
) -> Search:
    """A search of optimizer.lr on the synthetic task without validation (train/loss)."""
    sampler = {"_target_": "optuna.samplers.TPESampler", "seed": 0, "n_startup_trials": 3}
    space = {"optimizer.lr": "tag(log, interval(1e-4, 1))"}
    found = Search(sampler=OmegaConf.create(sampler), direction=direction, storage=None,
                   study_name="dpt", n_trials=n_trials, n_jobs=2, max_failure_rate=1.0,
                   params=OmegaConf.create(space))  # fmt: skip
    found.config, found.sweep_dir = compose("dataset.num_val_samples=0"), tmp_path
    found.launcher = launcher
    return found


def stored(tmp_path: Path) -> optuna.Study:
    return optuna.load_study(study_name="dpt", storage=f"sqlite:///{tmp_path / 'optuna.db'}")


def test_a_study_runs_its_trials_as_jobs_numbered_by_trial(tmp_path: Path) -> None:
    launcher = StandInLauncher()
    search(tmp_path, launcher).run(["trainer.seed=3"])
    study = stored(tmp_path)
    assert [number for number, _ in launcher.launched] == list(range(6))
    assert all(line[-1] == "trainer.seed=3" for _, line in launcher.launched)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 6
    assert study.direction.name == "MINIMIZE"  # train/loss: no validation
    results = OmegaConf.load(tmp_path / "optimization_results.yaml")
    assert results.best_value == study.best_value and results.best_trial == study.best_trial.number


def test_a_failed_trial_is_failed_and_the_study_goes_on(tmp_path: Path) -> None:
    launcher = StandInLauncher(fails_above=0.05)
    search(tmp_path, launcher, n_trials=8).run([])
    study = stored(tmp_path)
    states = [t.state for t in study.trials]
    assert len(states) == 8 and TrialState.FAIL in states and TrialState.COMPLETE in states
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    assert all(t.params["optimizer.lr"] > 0.05 for t in failed)
    assert failed[0].user_attrs["failure"] == "ValueError: non-finite loss"


def test_a_study_started_again_runs_only_the_missing_trials(tmp_path: Path) -> None:
    first = StandInLauncher()
    search(tmp_path, first, n_trials=3).run([])
    # A trial left RUNNING, as a sweeper killed while it ran leaves it.
    study = stored(tmp_path)
    cut = study.ask({"optimizer.lr": FloatDistribution(1e-4, 1, log=True)})
    again = StandInLauncher()
    search(tmp_path, again, n_trials=6).run([])
    study = stored(tmp_path)
    assert study.trials[cut.number].state == TrialState.FAIL
    retry = [t for t in study.trials if t.user_attrs.get(RETRY_OF) == cut.number]
    assert len(retry) == 1 and retry[0].params == cut.params  # run again, with its values
    assert len(finished(study)) == 6 and len(again.launched) == 3
    done = [t.params["optimizer.lr"] for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(done) == 6 and len(set(done)) == 6  # none run twice
    # The sampler drew on: the new trials are not the first start's again.
    first_values = {float(line[0].split("=")[1]) for _, line in first.launched}
    assert not first_values & {t.params["optimizer.lr"] for t in study.trials[4:]}


def test_a_direction_against_the_objective_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(Abort) as caught:  # one line, past Hydra's own reporting
        search(tmp_path, StandInLauncher(), direction="maximize").run([])
    assert str(caught.value) == (
        "hydra.sweeper.direction=maximize: the objective (train/loss, sweep.objective=auto) is "
        "to minimize; set one of them to agree"
    )
