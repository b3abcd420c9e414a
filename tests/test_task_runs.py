"""Every task trains, on one process and on two: the tutorial's SimpleNet with task=binary (ddp
2 x 64 equals single x 128), a linear regression that recovers its coefficients, multi-label
tags, a focal loss and a metric of one's own watched through a sweep; and a run of each task
stopped on 2 ranks and resumed on 1 ends with the uninterrupted run's weights.

The 2-rank work runs in one spawned world (one start-up); the one-process runs in this process,
through the rank's own entry point (`run_worker`: resume, model.pt, metrics.json, TensorBoard)."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dpt.launch.launchers import resolved
from dpt.state.stateful import full_state_dict
from tests.helpers import (
    REPO,
    build_trainer,
    compose,
    free_port,
    joined_world,
    load_weights,
    max_abs_diff,
    run_config_here,
    spawn,
    summary,
    tb_points,
    train,
)

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "tasks"
CONF = ["--config-dir", str(EXAMPLE / "conf")]
SGD = ["optimizer=sgd", "optimizer.lr=0.01", "optimizer.momentum=0", "trainer.log_every_n_steps=5"]
TASKS = {
    "binary": ["model=simple_net", "dataset=random", "task=binary"],
    "multilabel": ["dataset=tags", "task=multilabel", "model.hidden_dims=[32]"],
    "regression": ["dataset=line", "task=regression", "model.hidden_dims=[]"],
    "custom": ["model=simple_net", "dataset=random", "task=focal"],
}
FIRST, TOTAL = 8, 20  # steps before the stop, and of the whole run (past an epoch's end: 15)
LINE = {"weights": [1.5, -2.0, 0.5, 3.0], "bias": 0.7}  # examples/tasks/conf/dataset/line.yaml
# SGD with momentum, 3 epochs of 2048 points: converged to the noise's level (0.1).
LINE_RUN = [*CONF, *TASKS["regression"], "optimizer=sgd", "optimizer.lr=0.05",
            "optimizer.momentum=0.9", "trainer.epochs=3", "checkpoint.enabled=false"]  # fmt: skip


def _world_size(ranks: int, global_batch: int) -> list[str]:
    return [f"trainer.batch_size={global_batch // ranks}",
            "strategy=ddp" if ranks > 1 else "strategy=single"]  # fmt: skip


def _two_ranks(rank: int, world: int, port: int, out: Path) -> None:
    """Every 2-rank run, one after the other in one world: SimpleNet's 10 steps, each task's
    first FIRST steps (stopped there with a checkpoint, as a killed run resumes), the line."""
    sys.path.insert(0, str(EXAMPLE))  # the example's modules, as dpt started in its folder
    runs = {
        "simple-10": [*TASKS["binary"], *SGD, "trainer.max_steps=10", "checkpoint.enabled=false"],
        **{f"{task}-first": [*overrides, *SGD, f"trainer.max_steps={FIRST}"]
           for task, overrides in TASKS.items()},
        "line": LINE_RUN[2:],
    }  # fmt: skip
    try:
        with joined_world(rank, world, port) as env:
            for name, overrides in runs.items():
                batch = _world_size(2, 128 if name == "simple-10" else 64)
                trainer = build_trainer(out / name, env, *CONF, *overrides, *batch)
                trainer.fit()
                trainer.metrics.close()
                weights = full_state_dict(trainer.model)
                if env.is_main:
                    torch.save(weights, out / f"{name}.pt")
    finally:  # a resident rank (tests/worlds.py) goes on to other tests
        sys.path.remove(str(EXAMPLE))


@pytest.fixture(scope="module")
def example_on_path() -> Iterator[None]:
    sys.path.insert(0, str(EXAMPLE))
    try:
        yield
    finally:
        sys.path.remove(str(EXAMPLE))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, example_on_path: None) -> Path:
    out = tmp_path_factory.mktemp("task-ranks")
    spawn(_two_ranks, 2, free_port(), out, nprocs=2)
    return out


def _run(run_dir: Path, *overrides: str) -> dict[str, Any]:
    """One process's run, as `train.py` runs it (without Hydra's folder files)."""
    return run_config_here(resolved(compose(*CONF, *overrides)), run_dir)


# --- SimpleNet, task=binary -----------------------------------------------------------------------


def test_simplenet_on_two_ddp_ranks_of_64_equals_one_process_of_128(
    two_ranks: Path, tmp_path: Path
) -> None:
    _run(tmp_path, *TASKS["binary"], *SGD, "trainer.max_steps=10", "trainer.batch_size=128")
    single = load_weights(tmp_path)
    ddp = torch.load(two_ranks / "simple-10.pt", weights_only=True)
    assert max_abs_diff(single, ddp) < 1e-5
    # The bound means something: 2 steps fewer (the same run stopped at 8) differ by far more.
    assert max_abs_diff(single, torch.load(two_ranks / "binary-first.pt")) > 1e-4


# --- linear regression ----------------------------------------------------------------------------


def _coefficients(weights: dict[str, torch.Tensor]) -> tuple[list[float], float]:
    return weights["0.weight"][0].tolist(), float(weights["0.bias"][0])  # MLP without hidden layers


def test_a_linear_regression_recovers_its_coefficients_on_one_process_and_two(
    two_ranks: Path, tmp_path: Path
) -> None:
    result = _run(tmp_path, *LINE_RUN[2:], "trainer.batch_size=64")
    for weights in (load_weights(tmp_path), torch.load(two_ranks / "line.pt")):
        found, bias = _coefficients(weights)
        assert all(abs(w - t) < 0.05 for w, t in zip(found, LINE["weights"], strict=True)), found
        assert abs(bias - LINE["bias"]) < 0.05, bias
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["val"]["val/r2"] == result["val"]["val/r2"] > 0.99
    assert metrics["val_metrics"] == ["val/loss", "val/mse", "val/mae", "val/r2"]
    curve = tb_points(tmp_path / "tb" / "world", "val/r2")
    assert [step for step, _ in curve] == [32, 64, 96]  # each epoch's end
    assert curve[-1][1] == pytest.approx(metrics["val"]["val/r2"])


# --- stopped on 2 ranks, resumed on 1 -------------------------------------------------------------


@pytest.mark.parametrize("task", list(TASKS))
def test_a_run_stopped_on_two_ranks_resumes_on_one_to_the_uninterrupted_weights(
    two_ranks: Path, tmp_path: Path, task: str
) -> None:
    overrides = [*TASKS[task], *SGD, f"trainer.max_steps={TOTAL}", *_world_size(1, 64)]
    _run(tmp_path / "whole", *overrides)
    resumed = tmp_path / "resumed"
    shutil.copytree(two_ranks / f"{task}-first", resumed)
    result = _run(resumed, *overrides)
    assert result["steps"] == TOTAL and result["task"] == task
    whole = load_weights(tmp_path / "whole")
    assert max_abs_diff(load_weights(resumed), whole) < 1e-6
    first = torch.load(two_ranks / f"{task}-first.pt", weights_only=True)
    assert max_abs_diff(first, whole) > 1e-4  # the steps after the stop count


# --- a loss and a metric of one's own, through a sweep --------------------------------------------


@pytest.fixture(scope="module")
def focal_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two jobs (seeds) of the example's focal loss with its Brier score watched and optimized."""
    sweep = tmp_path_factory.mktemp("focal") / "sweep"
    train(None, "-m", *CONF, *TASKS["custom"], "trainer.epochs=2", "trainer.seed=0,1",
          "optimizer.lr=0.01", "sweep.objective=val/brier", f"hydra.sweep.dir={sweep}",
          timeout=180, env={"PYTHONPATH": str(EXAMPLE)})  # fmt: skip
    return sweep


def test_an_own_metric_is_watched_reported_and_optimized(focal_sweep: Path) -> None:
    rows = summary(focal_sweep)
    assert [row["status"] for row in rows] == ["COMPLETED", "COMPLETED"]
    best_job = min(rows, key=lambda row: float(row["objective"]))  # val/brier: lower is better
    assert [row["best"] for row in rows].count("True") == 1 and best_job["best"] == "True"
    for job, row in enumerate(rows):
        run = focal_sweep / str(job)
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["objective"]["name"] == "val/brier"
        assert metrics["objective"]["direction"] == "minimize"
        assert float(row["objective"]) == pytest.approx(metrics["best_per_metric"]["val/brier"])
        assert float(row["best_val/brier"]) == pytest.approx(
            metrics["best_per_metric"]["val/brier"]
        )
        assert "best_val/acc" in row
        assert metrics["best"]["metric"] == "val/brier" and metrics["best"]["mode"] == "min"
        best_epoch_brier = min(value for _, value in _tb_world(focal_sweep, job, "val/brier"))
        assert metrics["best"]["value"] == pytest.approx(best_epoch_brier)
        assert (run / "model_best.pt").is_file()
    hparams = _experiment_metrics(focal_sweep / "tb")
    assert {"val/brier", "val/acc", "val/loss", "objective"} <= set(hparams)


def _tb_world(sweep: Path, job: int, tag: str) -> list[tuple[int, float]]:
    folder = next(p for p in (sweep / "tb").iterdir() if p.name.split(" ")[0] == str(job))
    return tb_points(folder / "world", tag)


def _experiment_metrics(folder: Path) -> list[str]:
    """The metric tags of the HPARAMS experiment written in `folder`."""
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    acc = EventAccumulator(str(folder))
    acc.Reload()
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.EXPERIMENT_TAG]
    data = plugin_data_pb2.HParamsPluginData.FromString(content)
    return [info.name.tag for info in data.experiment.metric_infos]


def test_the_custom_task_is_recorded_with_its_nodes(focal_sweep: Path) -> None:
    saved = OmegaConf.load(focal_sweep / "0" / ".hydra" / "config.yaml")
    assert saved.task.loss._target_ == "problems.focal_loss" and saved.task.watch == "val/brier"
    data = json.loads((focal_sweep / "0" / "data.json").read_text())
    assert (data["task"], data["classes"], data["target_shape"]) == ("custom", ["0"], [1])
