"""`logger=[...,csv]`: `<run>/metrics.csv`, one row per logged step, a column per world metric,
the same rows as metrics.json's `history`. Rows are appended as they come; the file is written
whole only where what it holds changed: at a start (a resumed run's history), where a new metric
adds a column, or where a step's row grew after it was written (validation joining it)."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from dpt.config.loggers import CSV
from dpt.observe.trackers.tracker import Row, RunInfo
from dpt.observe.world_history import STEP, WorldHistory


class CsvTracker:
    name = CSV

    def __init__(self, run_dir: Path, file: str) -> None:
        self.path = run_dir / file
        self.history = WorldHistory()
        self._columns: list[str] = []
        self._written: list[dict[str, float]] = []  # the file's rows: the last one, as written

    def start(self, info: RunInfo, stored: dict[str, Any] | None) -> dict[str, Any]:
        """A resumed run starts from its checkpoint's history: rows logged after that step by
        the run that stopped are dropped (they are logged again), as TensorBoard purges them."""
        self.history.rows = [dict(row) for row in info.history] if info.resumed else []
        self._rewrite()
        return {"file": self.path.name}

    def log_metrics(self, rows: list[Row]) -> None:
        written = len(self.history.rows)
        for scalars, step, _ in rows:
            self.history.add(scalars, step)
        rows_now = self.history.rows
        grown = written and rows_now[written - 1] != self._written[-1]
        known = set(self._columns)
        if grown or any(key not in known for row in rows_now[written:] for key in row):
            self._rewrite()
            return
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self._columns).writerows(map(_cells, rows_now[written:]))
        self._written = [dict(rows_now[-1])] if rows_now else []

    def log_files(self, paths: list[Path]) -> None:
        pass  # they are in the run folder already

    def finish(self, status: str) -> None:
        pass  # every row is in the file already

    def _rewrite(self) -> None:
        rows = self.history.rows
        self._columns = _columns(rows)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self._columns)
            writer.writeheader()
            writer.writerows(map(_cells, rows))
        os.replace(tmp, self.path)
        self._written = [dict(rows[-1])] if rows else []


def _columns(rows: list[dict[str, float]]) -> list[str]:
    return [STEP, *dict.fromkeys(key for row in rows for key in row if key != STEP)]


def _cells(row: dict[str, float]) -> dict[str, Any]:
    return {k: repr(v) if isinstance(v, float) else v for k, v in row.items()}
