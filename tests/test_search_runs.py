"""Searches for real (`hydra/sweeper=optuna`): a TPE study of ddp trials two at a time, a study
killed and started again, a trial that diverges; what the sweeper saw against what each run
wrote, and the summary's best against the study's."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from omegaconf import OmegaConf
from optuna.trial import TrialState
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import TRAIN, hydra_sweep, job_tb, run_cmd, run_until, summary

pytestmark = pytest.mark.slow  # every test here runs trials

# A short run of the synthetic task with validation: the objective is val/loss at its best epoch.
SHORT = [
    "dataset.num_samples=1024",
    "dataset.num_val_samples=256",
    "trainer.max_steps=12",
    "trainer.log_every_n_steps=4",
    "hydra/sweeper=optuna",
    "hydra.sweeper.sampler.seed=0",
]
# A TPE search of the learning rate, its model taking over after 3 random trials.
LR = ["optimizer.lr=tag(log,interval(1e-4,1e-1))", "hydra.sweeper.sampler.n_startup_trials=3"]


def search(sweep: Path, *overrides: str, check: bool = True) -> Any:
    cmd = [sys.executable, str(TRAIN), "-m", *SHORT, *overrides, f"hydra.sweep.dir={sweep}"]
    return run_cmd(cmd, timeout=280, check=check)


def study(sweep: Path) -> optuna.Study:
    return optuna.load_study(study_name="dpt", storage=f"sqlite:///{sweep / 'optuna.db'}")


def objective(sweep: Path, job: int) -> dict[str, Any]:
    return json.loads((sweep / str(job) / "metrics.json").read_text())["objective"]


def test_a_tpe_study_of_ddp_trials_two_at_a_time(tmp_path: Path) -> None:
    """From a fresh folder, in Hydra's own sweep folder (`multirun/<date>/<time>`)."""
    # 2 random trials, then 2 of TPE's model: 4 ddp trials, 2 at a time
    cmd = [sys.executable, str(TRAIN), "-m", *SHORT, *LR,
           "hydra.sweeper.sampler.n_startup_trials=2", "trainer.batch_size=choice(16,32)",
           "strategy=ddp", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
           "hydra.sweeper.n_jobs=2", "hydra.sweeper.n_trials=4"]  # fmt: skip
    run_cmd(cmd, timeout=280, cwd=tmp_path)
    sweep = hydra_sweep(tmp_path)
    trials = study(sweep).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    # What the sweeper saw is each run's own objective, trial n in job folder n.
    for trial in trials:
        found = objective(sweep, trial.number)
        assert (found["name"], found["direction"]) == ("val/loss", "minimize")
        assert trial.value == found["value"]
        assert trial.params["trainer.batch_size"] in (16, 32)
    best = study(sweep).best_trial
    rows = summary(sweep)
    assert [row["job"] for row in rows] == [str(t.number) for t in trials]  # in trial order
    assert [row["job"] for row in rows if row["best"] == "True"] == [str(best.number)]
    assert os.readlink(sweep / "best") == str(best.number)
    assert (sweep / "best" / "model_best.pt").is_file()
    results = OmegaConf.load(sweep / "optimization_results.yaml")
    assert results.best_value == best.value and results.best_params == best.params
    # Each trial's TensorBoard folder names its searched values, numbers in 4 digits.
    lr, batch = best.params["optimizer.lr"], best.params["trainer.batch_size"]
    label = f"{best.number} optimizer.lr={lr:.4g},trainer.batch_size={batch}"
    assert job_tb(sweep, best.number).name == label
    # HPARAMS: the objective is a metric of the sweep's experiment and every trial's session.
    acc = EventAccumulator(str(job_tb(sweep, best.number) / "world"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("objective")] == [pytest.approx(best.value)]
    experiment = (sweep / "tb").glob("events.out.tfevents.*")
    assert any(b"objective" in path.read_bytes() for path in experiment)


def test_a_study_killed_after_3_trials_ends_with_6_none_run_twice(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    command = ["-m", *SHORT, *LR, "hydra.sweeper.n_jobs=1", "hydra.sweeper.n_trials=6",
               f"hydra.sweep.dir={sweep}"]  # fmt: skip
    # Killed (the whole process group) as trial 3 starts: 3 done, the 4th cut short.
    run_until(sweep, command, "#3 : ", lambda proc, _: os.killpg(proc.pid, signal.SIGKILL))
    assert len([t for t in study(sweep).trials if t.state == TrialState.COMPLETE]) == 3
    result = search(sweep, *LR, "hydra.sweeper.n_jobs=1", "hydra.sweeper.n_trials=6")
    assert "[sweep] study dpt in" in result.stdout and "3 of 6 trials done" in result.stdout
    assert "trial 3 was cut short: it runs again" in result.stderr
    trials = study(sweep).trials
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(done) == 6
    assert len({t.params["optimizer.lr"] for t in done}) == 6  # none run twice
    assert trials[3].state == TrialState.FAIL  # cut short; its values run again as trial 4
    assert trials[4].user_attrs["retry_of"] == 3 and trials[4].params == trials[3].params
    assert all(t.value == objective(sweep, t.number)["value"] for t in done)


def test_a_trial_that_diverges_is_failed_and_the_study_goes_on(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # Random sampling with this seed draws the diverging lr for trial 0, then both.
    result = search(sweep, "optimizer=sgd", "optimizer.lr=choice(0.01,1e30)",
                    "trainer.on_nonfinite=error", "hydra/sweeper/sampler=random",
                    "hydra.sweeper.n_jobs=1", "hydra.sweeper.n_trials=4")  # fmt: skip
    assert result.returncode == 0  # a search's failed trials are its results, not its failure
    trials = study(sweep).trials
    states = {t.params["optimizer.lr"]: t.state for t in trials}
    assert states == {1e30: TrialState.FAIL, 0.01: TrialState.COMPLETE}
    failed = next(t for t in trials if t.state == TrialState.FAIL)
    assert "non-finite loss" in failed.user_attrs["failure"]
    rows = {row["job"]: row for row in summary(sweep)}
    assert rows[str(failed.number)]["status"] == "FAILED"
    assert math.isfinite(float(rows[str(study(sweep).best_trial.number)]["objective"]))
