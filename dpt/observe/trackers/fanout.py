"""The trackers' calls, one after another, in the trackers' process (dpt.observe.trackers.process):
a call that fails is tried again, then its tracker is dropped with one warning; the run never
hears of it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from dpt.errors import one_line
from dpt.observe.trackers.tracker import Row, Tracker

log = logging.getLogger("dpt")

TRIES = 3  # a failed call is tried this many times in all before its tracker is dropped
RETRY_WAIT_S = 1.0  # before the 2nd try; twice that before the 3rd


class Fanout:
    """Each call to every live tracker, in order."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.live = list(trackers)

    def log_metrics(self, rows: list[Row]) -> None:
        self._each(lambda t: t.log_metrics(rows))

    def log_files(self, paths: list[Path]) -> None:
        self._each(lambda t: t.log_files(paths))

    def finish(self, status: str) -> None:
        self._each(lambda t: t.finish(status))

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
