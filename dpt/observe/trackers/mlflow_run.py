"""`logger=[...,mlflow]`: an MLflow run per dpt run, through MLflow's own client (`MlflowClient`).

The config goes as parameters (flat keys), dpt's facts as tags, the world's metrics at their
steps in batches, the run's files as artifacts at the end. A run resumed from a checkpoint
continues its MLflow run (its id in `<run>/trackers.json`): it sends the checkpoint's history
that run lacks (rows held for a batch when it stopped) and skips the steps it holds already (a
resume re-trains from its checkpoint to where it was stopped, with the same numbers, and MLflow
would otherwise hold those steps twice). A sweep's job is a child of the sweep's run.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from dpt.config.loggers import MLFLOW
from dpt.observe.trackers.tracker import Row, RunInfo
from dpt.observe.world_history import STEP

log = logging.getLogger("dpt")

PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the UI nests the run under its parent
MAX_PARAMS, MAX_METRICS = 100, 1000  # per log_batch call (MLflow's limits)
MAX_VALUE = 6000  # characters of a parameter's value MLflow keeps
# MLflow retries an HTTP call 7 times over minutes by default; dpt tries a call again itself
# (dpt.observe.trackers.fanout), so MLflow's own tries are kept short unless the user set them.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}


def absolute_uri(uri: str) -> str:
    """A store named by a relative path (`sqlite:///outputs/mlflow.db`, the default) is the
    same store for every rank, job and later `dpt-evaluate`: made absolute where dpt starts."""
    for scheme in ("sqlite:///", "file:"):
        if uri.startswith(scheme):
            path = Path(uri[len(scheme) :])
            if not path.is_absolute():
                path = Path.cwd() / path
            path.parent.mkdir(parents=True, exist_ok=True)
            return f"{scheme}{path}"
    return uri


def client(uri: str) -> Any:
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def experiment_id(mlflow: Any, name: str, uri: str) -> str:
    """The experiment's id, made where it does not exist. A local store keeps its artifacts
    beside it (`mlartifacts/`); a server decides where its own go."""
    found = mlflow.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    location = None
    if uri.startswith("sqlite:///"):
        location = (Path(uri[len("sqlite:///") :]).parent / "mlartifacts").as_uri()
    return str(mlflow.create_experiment(name, artifact_location=location))


def as_param(value: Any) -> str:
    text = str(value)
    return text if len(text) <= MAX_VALUE else text[: MAX_VALUE - 3] + "..."


class MlflowTracker:
    name = MLFLOW

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.uri = absolute_uri(str(cfg.tracking_uri))
        self.mlflow: Any = None
        self.run_id = ""
        self.held: dict[str, int] = {}  # a continued run: each metric's last step it holds

    def start(self, info: RunInfo, stored: dict[str, Any] | None) -> dict[str, Any]:
        self.mlflow = client(self.uri)
        if info.resumed and stored and stored.get("tracking_uri") == self.uri:
            self.run_id = str(stored["run_id"])
            if self._continue(info):
                return {"run_id": self.run_id, "tracking_uri": self.uri}
            log.warning(f"logger {MLFLOW}: the run {self.run_id} this one continues is gone "
                        f"from {self.uri}; it goes on in a new MLflow run")  # fmt: skip
        self._create(info)
        return {"run_id": self.run_id, "tracking_uri": self.uri}

    def _create(self, info: RunInfo) -> None:
        tags = {**info.tags, **{str(k): str(v) for k, v in self.cfg.tags.items()}}
        parent = parent_of(info.sweep_dir)
        if parent is not None and parent.get("tracking_uri") == self.uri:
            tags[PARENT_TAG] = str(parent["run_id"])
        experiment = experiment_id(self.mlflow, str(self.cfg.experiment), self.uri)
        run = self.mlflow.create_run(experiment, run_name=self.cfg.run_name or info.name,
                                     tags=tags)  # fmt: skip
        self.run_id = run.info.run_id
        self._params(info.params)

    def _continue(self, info: RunInfo) -> bool:
        """The stored run goes on: its status RUNNING again, new keys as parameters (MLflow
        refuses to change one: a changed setting is a tag `resumed.<key>`), and the steps it
        holds already are not sent again. False: the store no longer has it (deleted)."""
        from mlflow.entities import LifecycleStage, RunTag
        from mlflow.exceptions import MlflowException

        try:
            run = self.mlflow.get_run(self.run_id)
        except MlflowException as error:
            if error.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise
        if run.info.lifecycle_stage == LifecycleStage.DELETED:
            return False
        self.mlflow.update_run(self.run_id, status="RUNNING")
        held = run.data.params
        self._params({k: v for k, v in info.params.items() if k not in held})
        changed = [RunTag(f"resumed.{k}", as_param(v)) for k, v in info.params.items()
                   if k in held and held[k] != as_param(v)]  # fmt: skip
        if changed:
            self.mlflow.log_batch(self.run_id, tags=changed)
        for key in run.data.metrics:
            steps = [m.step for m in self.mlflow.get_metric_history(self.run_id, key)]
            self.held[key] = max(steps, default=-1)
        # The checkpoint's history past what the run holds: rows the stopped run had not sent
        # yet (held for a batch when it was killed); the resume trains only the steps after it.
        now = time.time()
        self.log_metrics([({k: v for k, v in row.items() if k != STEP}, int(row[STEP]), now)
                          for row in info.history])  # fmt: skip
        return True

    def _params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(str(k), as_param(v)) for k, v in params.items()]
        for i in range(0, len(items), MAX_PARAMS):
            self.mlflow.log_batch(self.run_id, params=items[i : i + MAX_PARAMS])

    def log_metrics(self, rows: list[Row]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(key, float(value), int(wall_time * 1000), step)
                   for scalars, step, wall_time in rows for key, value in scalars.items()
                   if step > self.held.get(key, -1)]  # fmt: skip
        for i in range(0, len(metrics), MAX_METRICS):
            self.mlflow.log_batch(self.run_id, metrics=metrics[i : i + MAX_METRICS])

    def log_files(self, paths: list[Path]) -> None:
        for path in paths:
            if path.suffix == ".pt" and not self.cfg.log_model:  # log_model=false: no weights
                continue
            if path.is_dir():
                self.mlflow.log_artifacts(self.run_id, str(path), artifact_path=path.name)
            else:
                self.mlflow.log_artifact(self.run_id, str(path))

    def finish(self, status: str) -> None:
        self.mlflow.set_terminated(self.run_id, status)


def parent_of(sweep_dir: Path | None) -> dict[str, Any] | None:
    """The sweep's MLflow run, where the sweep opened one (dpt.launch.sweep_trackers)."""
    if sweep_dir is None:
        return None
    from dpt.observe.trackers.ids import read_ids

    return read_ids(sweep_dir).get(MLFLOW)


def open_sweep_run(cfg: Any, sweep_dir: Path) -> dict[str, Any]:
    """The sweep's own run, whose children its jobs' runs are (a sweep started again in its
    folder continues it); its ids are kept in `<sweep>/trackers.json`."""
    from dpt.observe.trackers.ids import read_ids

    uri = absolute_uri(str(cfg.tracking_uri))
    mlflow = client(uri)
    stored = read_ids(sweep_dir).get(MLFLOW)
    if stored and stored.get("tracking_uri") == uri:
        mlflow.update_run(stored["run_id"], status="RUNNING")
        return stored
    experiment = experiment_id(mlflow, str(cfg.experiment), uri)
    name = cfg.run_name or f"sweep {sweep_dir.parent.name}/{sweep_dir.name}"
    run = mlflow.create_run(experiment, run_name=name, tags={"sweep_dir": str(sweep_dir)})
    return {"run_id": run.info.run_id, "tracking_uri": uri}


def close_sweep_run(ids: dict[str, Any], files: list[Path], status: str) -> None:
    """The sweep's summary (csv, png) as the parent run's artifacts; its status."""
    mlflow = client(str(ids["tracking_uri"]))
    for path in files:
        if path.exists():
            mlflow.log_artifact(ids["run_id"], str(path))
    mlflow.set_terminated(ids["run_id"], status)
