"""Validation on a schedule (trainer.val_every_n_steps, trainer.val_batches): a run whose epoch is
longer than the run has a validation curve; the best model, early stopping and the trackers
follow each validation; a run stopped by max_steps and resumed validates where the
uninterrupted run does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    FAST,
    committed_checkpoints,
    max_abs_diff,
    read_checkpoint,
    run_train,
    tb_points,
)
from tests.trackers_read import history, metric_steps, runs_of

pytestmark = pytest.mark.slow  # the session's MLflow server (tests/session_runs.py)

# 2,048 samples in batches of 16: an epoch of 128 steps, more than the run's 60.
SCHEDULE = [*FAST, "trainer.batch_size=16", "trainer.val_every_n_steps=20",
            "trainer.val_batches=4", "trainer.log_every_n_steps=10", "optimizer=sgd",
            "optimizer.lr=0.05", "checkpoint.every_n_steps=20"]  # fmt: skip
POINTS = [20, 40, 60]


def _run(run_dir: Path, uri: str, steps: int) -> str:
    result = run_train(run_dir, *SCHEDULE, f"trainer.max_steps={steps}",
                       "logger=[tensorboard,mlflow]",
                       f"logger.mlflow.tracking_uri={uri}")  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def runs(mlflow_uri: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("validation_schedule")
    _run(root / "whole", mlflow_uri, 60)
    _run(root / "resumed", mlflow_uri, 30)  # stopped by max_steps at step 30...
    resumed = _run(root / "resumed", mlflow_uri, 60)  # ...and resumed to 60 in its folder
    # The done line counts the steps this process trained, and says where the run stands
    assert "done: 30 steps (resumed at step 30, now at 60) in " in resumed
    return {"whole": root / "whole", "resumed": root / "resumed"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["whole", "resumed"])
def test_validation_every_20_steps_on_4_batches_reaches_every_record(
    runs: dict[str, Path], mlflow_uri: str, name: str
) -> None:
    run_dir = runs[name]
    val_rows = [row for row in history(run_dir) if "val/loss" in row]
    assert [int(row["step"]) for row in val_rows] == POINTS  # metrics.json
    assert {row["val/samples"] for row in val_rows} == {4 * 16}  # 4 batches of 16, no more
    points = [(int(row["step"]), row["val/loss"]) for row in val_rows]
    tb = tb_points(run_dir / "tb" / "world", "val/loss")
    assert [step for step, _ in tb] == POINTS
    assert [v for _, v in tb] == pytest.approx([v for _, v in points], rel=1e-6)  # TensorBoard
    [tracked] = [r for r in runs_of(mlflow_uri) if r.info.run_name.endswith(f"/{name}")]
    assert metric_steps(mlflow_uri, tracked.info.run_id, "val/loss") == [
        (step, pytest.approx(value, rel=1e-6)) for step, value in points
    ]  # MLflow: one run, resumed, with the same three points


@pytest.mark.timeout(300)
def test_the_best_model_is_the_best_validation_and_a_resume_keeps_the_schedule(
    runs: dict[str, Path],
) -> None:
    whole, resumed = runs["whole"], runs["resumed"]
    points = {int(r["step"]): r["val/loss"] for r in history(whole) if "val/loss" in r}
    best = json.loads((whole / "metrics.json").read_text())["best"]
    assert best["step"] == min(points, key=points.__getitem__)
    assert best["value"] == pytest.approx(min(points.values()))
    # The resumed run validated at the same steps, to the same values, and kept the same best
    assert json.loads((resumed / "metrics.json").read_text())["best"] == best
    kept = {
        name: torch.load(run / "model_best.pt", weights_only=True) for name, run in runs.items()
    }
    assert max_abs_diff(kept["whole"], kept["resumed"]) < 1e-6
    # model_best.pt holds the weights of the best validation's step (its checkpoint's)
    [at_best] = [p for p in committed_checkpoints(whole) if p.name == f"step-{best['step']:08d}"]
    assert max_abs_diff(kept["whole"], read_checkpoint(at_best)["model"]) == 0


@pytest.mark.timeout(120)
def test_early_stopping_counts_validations_on_the_schedule(tmp_path: Path) -> None:
    # Nothing counts as an improvement: the first validation (step 20) sets the best, the
    # second (step 40) is one without improvement, and patience 1 ends the run there.
    result = run_train(tmp_path, *SCHEDULE, "trainer.max_steps=100",
                       "trainer.early_stopping.patience=1",
                       "trainer.early_stopping.min_delta=1000")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "early stopping: val/loss did not improve for 1 validation(s)" in result.stdout
    assert "step 20 validation | val loss " in result.stdout
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert (summary["steps"], summary["stopped_early"]) == (40, True)
    assert [int(r["step"]) for r in history(tmp_path) if "val/loss" in r] == [20, 40]
