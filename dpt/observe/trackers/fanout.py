"""The trackers' own thread: the loop hands calls over and goes on; failures stay here."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpt.errors import one_line
from dpt.observe.trackers.tracker import Row, Tracker

log = logging.getLogger("dpt")

TRIES = 3  # a failed call is tried this many times in all before its tracker is dropped
RETRY_WAIT_S = 1.0  # before the 2nd try; twice that before the 3rd
CLOSE_WAIT_S = 120.0  # at the end, how long the run waits for the trackers' last calls


class Trackers:
    """Calls to every live tracker, in order, in one thread; `close` waits for the last."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.live = list(trackers)
        self._calls: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if self.live:
            self._thread = threading.Thread(target=self._work, name="dpt-trackers", daemon=True)
            self._thread.start()

    def log_metrics(self, scalars: dict[str, float], step: int, wall_time: float) -> None:
        if self._thread is not None:
            self._calls.put(("metrics", (dict(scalars), step, wall_time)))

    def log_files(self, paths: list[Path]) -> None:
        if self._thread is not None:
            self._calls.put(("files", [p for p in paths if p.exists()]))

    def close(self, status: str = "FINISHED") -> None:
        """Finish every tracker's run, after the calls before it (at most CLOSE_WAIT_S)."""
        if self._thread is None:
            return
        self._calls.put(("finish", status))
        self._calls.put(None)
        self._thread.join(CLOSE_WAIT_S)
        if self._thread.is_alive():
            names = ", ".join(t.name for t in self.live)
            log.warning(f"logger {names}: still busy after {CLOSE_WAIT_S:.0f} s at the run's end; "
                        "left behind (the run's own files are complete)")  # fmt: skip
        self._thread = None

    def _work(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            kind, args = call
            if kind == "metrics":  # with those queued behind it: one call for all of them
                rows: list[Row] = [args]
                while not self._calls.empty() and (self._calls.queue[0] or ("",))[0] == "metrics":
                    rows.append(self._calls.get()[1])  # type: ignore[index]
                self._each(lambda t, rows=rows: t.log_metrics(rows))
            elif kind == "files":
                self._each(lambda t, paths=args: t.log_files(paths))
            elif kind == "finish":
                self._each(lambda t, status=args: t.finish(status))

    def _each(self, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.live):
            self._try(tracker, call)

    def _try(self, tracker: Tracker, call: Callable[[Tracker], None]) -> None:
        for attempt in range(1, TRIES + 1):
            try:
                call(tracker)
                return
            except Exception as error:  # a tracker's failure never reaches the run
                if attempt < TRIES:
                    time.sleep(RETRY_WAIT_S * attempt)
                    continue
                self.live.remove(tracker)
                log.warning(
                    f"logger {tracker.name}: {one_line(error)[:300]}; dropped after {TRIES} "
                    "tries: the rest of this run is not in it (the run goes on; its own "
                    "files, metrics.json and tb/, are complete)"
                )
