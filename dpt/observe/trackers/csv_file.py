"""`logger=[...,csv]`: `<run>/metrics.csv`, one row per logged step, a column per world metric,
the same rows as metrics.json's `history`."""

from __future__ import annotations

import csv
import os
import time
from pathlib import Path
from typing import Any

from dpt.config.loggers import CSV
from dpt.observe.trackers.tracker import Row, RunInfo
from dpt.observe.world_history import STEP, WorldHistory

WRITE_EVERY_S = 5.0  # the file is rewritten whole, at most this often and at the end


class CsvTracker:
    name = CSV

    def __init__(self, run_dir: Path, file: str) -> None:
        self.path = run_dir / file
        self.history = WorldHistory()
        self._written_at = 0.0

    def start(self, info: RunInfo, stored: dict[str, Any] | None) -> dict[str, Any]:
        """A resumed run starts from its checkpoint's history: rows logged after that step by
        the run that stopped are dropped (they are logged again), as TensorBoard purges them."""
        self.history.rows = [dict(row) for row in info.history] if info.resumed else []
        self._write()
        return {"file": self.path.name}

    def log_metrics(self, rows: list[Row]) -> None:
        for scalars, step, _ in rows:
            self.history.add(scalars, step)
        if time.monotonic() - self._written_at >= WRITE_EVERY_S:
            self._write()

    def log_files(self, paths: list[Path]) -> None:
        pass  # they are in the run folder already

    def finish(self, status: str) -> None:
        self._write()

    def _write(self) -> None:
        rows = self.history.rows
        columns = [STEP, *dict.fromkeys(key for row in rows for key in row if key != STEP)]
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows({k: repr(v) if isinstance(v, float) else v for k, v in row.items()}
                             for row in rows)  # fmt: skip
        os.replace(tmp, self.path)
        self._written_at = time.monotonic()
