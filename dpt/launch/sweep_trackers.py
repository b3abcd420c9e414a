"""A sweep's run in the trackers that have one (MLflow): opened before the first job, so that
every job's run is its child; closed with the sweep's summary once every job has run."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dpt.config.loggers import MLFLOW
from dpt.errors import Abort, DptError, clipped, one_line
from dpt.observe.trackers.ids import read_ids, write_ids
from dpt.observe.trackers.opening import HINTS, needs_package
from dpt.state.sweep_folder import SUMMARY_CSV, SUMMARY_PNG


def open_sweep(config: DictConfig, sweep_dir: Path) -> None:
    cfg = OmegaConf.select(config, f"logger.{MLFLOW}")
    if cfg is None:
        return
    try:
        from dpt.observe.trackers.mlflow_run import open_sweep_run

        ids = open_sweep_run(cfg, sweep_dir)
    except ImportError:
        raise Abort(needs_package(MLFLOW)) from None
    except Exception as error:
        why = clipped(one_line(error))
        raise Abort(DptError(f"logger {MLFLOW}: the sweep's run could not start ({why}); "
                             f"{HINTS[MLFLOW]}")) from error  # fmt: skip
    write_ids(sweep_dir, {**read_ids(sweep_dir), MLFLOW: ids})


def close_sweep(sweep_dir: Path, failed: bool) -> None:
    """Never stops the sweep's own end (its summary is written already): a warning at most."""
    ids = read_ids(sweep_dir).get(MLFLOW)
    if ids is None:
        return
    try:
        from dpt.observe.trackers.mlflow_run import close_sweep_run

        files = [sweep_dir / SUMMARY_CSV, sweep_dir / SUMMARY_PNG]
        close_sweep_run(ids, files, "FAILED" if failed else "FINISHED")
    except Exception as error:
        print(f"[sweep] logger {MLFLOW}: the sweep's run could not be closed ({one_line(error)})")
