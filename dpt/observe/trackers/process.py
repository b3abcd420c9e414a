"""The trackers' own process (`python -m dpt.observe.trackers.process`), started by rank 0.

Their clients' work (MLflow's SQL store, W&B's, the CSV file) is done here, not in the training
process, where even a thread of its own holds the interpreter the loop needs. It reads the
rank's messages from stdin, one pickled tuple each: ("start", logger, info) first, then
("metrics", rows), ("files", paths), ("finish", status), and answers on its stdout: ("started",
ids) or ("failed", one line), then ("warning", line) as they come. Its stdin's end (the rank
gone, however it ended) is its own end, once what it was sent is done.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
from typing import Any, BinaryIO

from omegaconf import OmegaConf

from dpt.observe.trackers.fanout import Fanout
from dpt.observe.trackers.opening import start_all


class _Answers(logging.Handler):
    """The `dpt` logger's warnings, sent to the rank, whose log holds them."""

    def __init__(self, out: BinaryIO) -> None:
        super().__init__(logging.WARNING)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        answer(self.out, ("warning", record.getMessage()))


def answer(out: BinaryIO, message: tuple[Any, ...]) -> None:
    pickle.dump(message, out)
    out.flush()


def serve(inbox: BinaryIO, out: BinaryIO) -> None:
    """Start the trackers, then take the rank's calls until its stdin ends."""
    log = logging.getLogger("dpt")
    log.addHandler(_Answers(out))
    log.propagate = False
    _, logger, info = pickle.load(inbox)
    try:
        trackers, ids = start_all(OmegaConf.create(logger), info)
    except Exception as error:  # the rank raises it, one line, before its first step
        answer(out, ("failed", str(error)))
        return
    answer(out, ("started", ids))
    fanout = Fanout(trackers)
    calls = {"metrics": fanout.log_metrics, "files": fanout.log_files, "finish": fanout.finish}
    while True:
        try:
            kind, args = pickle.load(inbox)
        except EOFError:
            return
        calls[kind](args)


def main() -> None:
    # A Ctrl-C or a scheduler's SIGTERM reaches the whole process group: the rank stops, sends
    # what it holds and closes this process's stdin, which it then ends at (or when the rank
    # itself was killed).
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.SIG_IGN)
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a client's own prints: to stderr
    serve(sys.stdin.buffer, out)


if __name__ == "__main__":
    main()
