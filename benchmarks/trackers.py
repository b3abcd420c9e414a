"""Section `trackers` (not run by default): what MLflow and the CSV file cost the loop.

The default job (dpt's MLP on synthetic vectors, one process) for STEPS steps logging every 10,
with `logger=[tensorboard]` and with `logger=[tensorboard,mlflow,csv]` (MLflow's SQLite store,
a file of each run's own), alternated round by round. Per run: its steady pace (the done line's
loop samples/s, `steady_samples_per_s`: the windows after the first), and what its MLflow run
holds against the run's history (every logged step, read back with MLflow's client). Its
section of docs/performance.md sits between two markers (benchmarks/report/trackers.py).

    python -m benchmarks --sections trackers --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.report.common import stamp
from benchmarks.runner import REPO, Say, alternate, run_process

LOGGERS = ("[tensorboard]", "[tensorboard,mlflow,csv]")
STEPS, QUICK_STEPS = 4000, 300
LOG_EVERY = 10
RUN_TIMEOUT_S = 600.0


def run(args: argparse.Namespace, tmp: Path, say: Say) -> dict[str, Any]:
    steps = QUICK_STEPS if args.quick else STEPS
    numbers = itertools.count()
    contenders = {logger: functools.partial(_run, logger, steps, args.threads, tmp, numbers)
                  for logger in LOGGERS}  # fmt: skip

    def done(key: str, r: int, seconds: float) -> None:
        say(f"  logger={key}, round {r + 1}/{args.rounds} done ({seconds:.0f} s)")

    started, load_before = time.time(), os.getloadavg()
    runs = alternate(contenders, args.rounds, done=done)
    found = {"steps": steps, "log_every": LOG_EVERY, "threads": args.threads, "runs": runs}
    found |= stamp(args, started) | {"load": (load_before, os.getloadavg())}
    return {"trackers": found}


def _run(
    logger: str, steps: int, threads: int, tmp: Path, numbers: itertools.count[int]
) -> dict[str, float]:
    """One run of the default job; its steady pace and, with MLflow, the steps its run holds."""
    run_dir = tmp / f"trackers-{next(numbers)}"
    store = f"sqlite:///{run_dir}-mlflow.db"
    cmd = [sys.executable, str(REPO / "train.py"), f"trainer.max_steps={steps}",
           f"trainer.log_every_n_steps={LOG_EVERY}", f"logger={logger}",
           "checkpoint.enabled=false", f"hydra.run.dir={run_dir}"]  # fmt: skip
    if "mlflow" in logger:
        cmd.append(f"logger.mlflow.tracking_uri={store}")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    console = tmp / f"{run_dir.name}.txt"
    run_process(cmd, console, env, RUN_TIMEOUT_S, f"logger={logger}", cwd=tmp)
    summary = json.loads((run_dir / "metrics.json").read_text())
    logged = [row["step"] for row in summary["history"] if "train/loss" in row]
    row = {"steady": summary["steady_samples_per_s"], "logged": len(logged)}
    if "mlflow" in logger:
        from mlflow import MlflowClient

        run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"]
        held = MlflowClient(store).get_metric_history(run_id, "train/loss")
        row["held"] = len({m.step for m in held} & set(logged))
    return row
