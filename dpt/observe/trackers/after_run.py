"""What a command measures after a run (dpt-evaluate) goes to that run's trackers: the same
MLflow run, the same W&B run id, found by `<run>/trackers.json`."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from dpt.config.loggers import MLFLOW, WANDB
from dpt.errors import one_line
from dpt.observe.trackers.ids import read_ids

log = logging.getLogger("dpt")


def log_evaluation(
    run_dir: Path, metrics: dict[str, float], files: list[Path], step: int
) -> list[str]:
    """Log `metrics` (`test/acc1`, as `eval/test/acc1`, at `step`: the run's last) and `files`
    to every tracker the run had; returns
    the names of those that took them. A tracker that cannot is one warning, never a failure:
    the files are in the run folder whatever it does."""
    # `eval/val/loss`: beside training's own `val/loss` at the same step, not a second point of it
    metrics = {f"eval/{key}": value for key, value in metrics.items()}
    ids, took = read_ids(run_dir), []
    for name, send in ((MLFLOW, _to_mlflow), (WANDB, _to_wandb)):
        if name not in ids:
            continue
        try:
            send(ids[name], run_dir, metrics, files, step)
            took.append(name)
        except Exception as error:
            log.warning(f"logger {name}: the evaluation could not be logged "
                        f"({one_line(error)[:300]}); it is in {run_dir}")  # fmt: skip
    return took


def _to_mlflow(ids: dict[str, Any], run_dir: Path, metrics: dict[str, float],
               files: list[Path], step: int) -> None:  # fmt: skip
    from mlflow.entities import Metric

    from dpt.observe.trackers.mlflow_run import client

    mlflow, run_id, now = client(str(ids["tracking_uri"])), str(ids["run_id"]), time.time()
    found = [Metric(k, float(v), int(now * 1000), step) for k, v in metrics.items()]
    mlflow.log_batch(run_id, metrics=found)
    for path in files:
        mlflow.log_artifact(run_id, str(path))


def _to_wandb(ids: dict[str, Any], run_dir: Path, metrics: dict[str, float],
              files: list[Path], step: int) -> None:  # fmt: skip
    import wandb

    from dpt.observe.trackers.wandb_run import log_artifact, quiet

    run = wandb.init(id=str(ids["id"]), mode=str(ids.get("mode", "offline")), resume="allow",
                     dir=str(run_dir), reinit="create_new", settings=quiet())  # fmt: skip
    run.summary.update(metrics)
    log_artifact(run, files, "evaluation")
    run.finish()
