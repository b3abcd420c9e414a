"""Rank 0's side of the trackers: the world's rows held and sent to the trackers' process
(dpt.observe.trackers.process) in batches, by time (every SEND_EVERY_S), before a checkpoint
and at the end, however the run ends. The loop only appends a row; the clients' work, and even
the pickling of a batch, is never in a step. A row held when the rank is killed is not lost: the
resumed run sends its history again, up to its checkpoint, to every tracker that lacks it."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from dpt.errors import DptError
from dpt.observe.trackers.tracker import Row, RunInfo

log = logging.getLogger("dpt")

SEND_EVERY_S = 2.0  # the held rows go to the trackers at most this often (and at a checkpoint)
START_WAIT_S = 300.0  # for the trackers' runs to start (a server's first answer: MLflow's tries)
CLOSE_WAIT_S = 120.0  # at the end, how long the run waits for the trackers' last calls


class Trackers:
    """The trackers' process of a run (none: every call does nothing); `close` waits for it."""

    def __init__(self, proc: subprocess.Popen[bytes] | None = None, names: str = "") -> None:
        self.proc, self.names = proc, names
        self._held: list[Row] = []
        self._sent_at = time.monotonic()
        self._answers: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._started = self._closing = False
        self._reader: threading.Thread | None = None
        if proc is not None:
            self._reader = threading.Thread(target=self._read, name="dpt-trackers", daemon=True)
            self._reader.start()

    @classmethod
    def start(cls, logger: dict[str, Any], info: RunInfo, names: list[str]) -> Trackers:
        """The trackers' process, their runs started (or the one line why one cannot start)."""
        path = os.pathsep.join(p for p in sys.path if p)  # what the rank imports from
        proc = subprocess.Popen(
            [sys.executable, "-m", "dpt.observe.trackers.process"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": path},
        )  # fmt: skip
        trackers = cls(proc, ", ".join(names))
        trackers._send(("start", logger, info))
        try:
            kind, found = trackers._answers.get(timeout=START_WAIT_S)
        except queue.Empty:
            kind, found = "failed", f"logger {trackers.names}: no answer in {START_WAIT_S:.0f} s"
        if kind != "started":
            trackers.close(None)
            raise DptError(str(found))
        trackers._started = True
        return trackers

    def log_metrics(self, scalars: dict[str, float], step: int, wall_time: float) -> None:
        if self.proc is None:
            return
        self._held.append((dict(scalars), step, wall_time))
        if time.monotonic() - self._sent_at >= SEND_EVERY_S:
            self.flush()

    def flush(self) -> None:
        """The held rows to the trackers now (before a checkpoint: a resume starts there)."""
        held, self._held, self._sent_at = self._held, [], time.monotonic()
        if held:
            self._send(("metrics", held))

    def log_files(self, paths: list[Path]) -> None:
        self.flush()
        self._send(("files", [p for p in paths if p.exists()]))

    def close(self, status: str | None = "FINISHED") -> None:
        """Send what is held and the run's status (None: none, the runs did not start); wait
        for the trackers' last calls, at most CLOSE_WAIT_S."""
        if self.proc is None:
            return
        self.flush()
        self._closing = True
        if status is not None:
            self._send(("finish", status))
        proc, self.proc = self.proc, None
        _close_quietly(proc.stdin)
        try:
            proc.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning(f"logger {self.names}: still busy after {CLOSE_WAIT_S:.0f} s at the "
                        "run's end; left behind (the run's own files are complete)")  # fmt: skip
            return
        if self._reader is not None:
            self._reader.join(10)

    def _send(self, message: tuple[Any, ...]) -> None:
        if self.proc is None or self.proc.stdin is None or self.proc.stdin.closed:
            return
        try:
            pickle.dump(message, self.proc.stdin)
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # the process ended: the reader said why
            _close_quietly(self.proc.stdin)

    def _read(self) -> None:
        """The process's answers: its start's, then its warnings, into the run's log."""
        assert self.proc is not None and self.proc.stdout is not None
        out = self.proc.stdout
        while True:
            try:
                kind, text = pickle.load(out)
            except (EOFError, OSError, pickle.UnpicklingError):  # it ended (its stderr says how)
                self._ended()
                return
            if kind == "warning":
                log.warning(text)
            else:
                self._answers.put((kind, text))

    def _ended(self) -> None:
        """The process gone before the run closed it: before its start, the start's answer;
        after it, one warning (the run goes on; its own files are complete)."""
        if not self._started:
            self._answers.put(("failed", f"logger {self.names}: the trackers' process ended "
                                         "before their runs started"))  # fmt: skip
        elif not self._closing:
            log.warning(f"logger {self.names}: the trackers' process ended mid-run; the rest of "
                        "this run is not in them (the run goes on; its own files, metrics.json "
                        "and tb/, are complete)")  # fmt: skip


def _close_quietly(pipe: IO[bytes] | None) -> None:
    if pipe is not None:
        with contextlib.suppress(OSError):  # its reader gone: what it holds goes nowhere
            pipe.close()
