"""SIGTERM / SIGINT (a cluster's preemption notice, Ctrl-C): finish the step, then stop cleanly."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

from dpt.errors import DptError

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(DptError):
    """SIGTERM/SIGINT arrived; the step finished and a checkpoint was written."""


class DataStopped(Interrupted):
    """The data could not be had (a source gone too long, too many samples skipped): stopped
    to be resumed with the same command, from a checkpoint."""


class StopRequest:
    """Set by a signal handler; the training loop reads it between steps."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.at: float | None = None  # when it arrived (time.monotonic)

    def __bool__(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name
        self.at = self.at or time.monotonic()


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Install the handlers (main thread only, as Python requires) and restore them after."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.signal(sig, request._handle) for sig in SIGNALS}
    yield request  # an error (e.g. Interrupted) propagates with the handlers still installed:
    # launchers repeat SIGTERM while ranks exit, and the default action would kill a rank before
    # it has reported its error or reached the checkpoint barrier. Only a normal end restores them.
    for sig, handler in previous.items():
        signal.signal(sig, handler)
