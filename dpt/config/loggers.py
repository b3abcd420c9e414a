"""`logger`: where a run's metrics go besides its own files, chosen as a list
(`logger=[tensorboard,mlflow]`). Each option is one tracker (dpt/observe/trackers); the
per-rank views stay in TensorBoard, the trackers get the world's numbers from rank 0."""

from __future__ import annotations

from dataclasses import dataclass, field

from dpt.config.checks import above, one_of

TENSORBOARD, MLFLOW, WANDB, CSV = "tensorboard", "mlflow", "wandb", "csv"
WANDB_MODES = ("offline", "online", "disabled")
# The trackers that need a package of their own (`pip install 'dpt[mlflow]'`): imported only
# by a run that names them.
EXTRAS = {MLFLOW: "mlflow", WANDB: "wandb"}
# The URI schemes MLflow's tracking stores take ("": a path, a file store; a database's with
# its driver too: postgresql+psycopg2://).
MLFLOW_SCHEMES = ("", "file", "http", "https", "sqlite", "postgresql", "mysql", "mssql",
                  "databricks")  # fmt: skip


@dataclass
class TensorBoardLoggerConfig:
    """Per-rank and world event files under the run's `tb/` (dpt.observe.metrics)."""

    # Seconds written scalars are held before they go to their event files, in one write each
    # (cheaper in bulk for the training thread); a checkpoint writes them at once.
    flush_s: float = above(0, 1.0)


@dataclass
class MlflowLoggerConfig:
    # An MLflow tracking URI (http://host:5000, sqlite:///path.db, databricks); relative
    # paths are from the folder dpt starts in.
    tracking_uri: str = "sqlite:///outputs/mlflow.db"
    experiment: str = "dpt"  # the MLflow experiment (made where it does not exist)
    run_name: str | None = None  # null: the run folder's name (a sweep's job: its label)
    log_model: bool = True  # model_best.pt (or model.pt) as an artifact at the run's end
    tags: dict[str, str] = field(
        default_factory=dict
    )  # beside dpt's own (strategy, world size, ...)


@dataclass
class WandbLoggerConfig:
    mode: str = one_of(
        WANDB_MODES, "offline"
    )  # offline: `wandb sync <run>/wandb/offline-run-*` later
    project: str = "dpt"
    entity: str | None = None  # your W&B team or user (online); null: your default
    run_name: str | None = None  # null: the run folder's name (a sweep's job: its label)
    log_model: bool = True  # model_best.pt (or model.pt) saved with the run at its end
    tags: list[str] = field(default_factory=list)  # beside dpt's own


@dataclass
class CsvLoggerConfig:
    """`<run>/metrics.csv`: one row per logged step, a column per world metric."""

    file: str = "metrics.csv"  # in the run folder


# Each option of the `logger` group and its schema.
LOGGERS: dict[str, type] = {
    TENSORBOARD: TensorBoardLoggerConfig,
    MLFLOW: MlflowLoggerConfig,
    WANDB: WandbLoggerConfig,
    CSV: CsvLoggerConfig,
}


def chosen(logger: object) -> list[str]:
    """The trackers a config's `logger` node names (its keys), in LOGGERS' order."""
    return [name for name in LOGGERS if name in logger]
