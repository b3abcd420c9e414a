"""Console and per-rank log files: every line says which rank wrote it."""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path

from dpt.errors import could_not_write
from dpt.loggers import LOGGER_NAME, ONCE_LOGGER_NAME

TRACE_LOGGER_NAME = "dpt_traceback"


class _EveryLineFormatter(logging.Formatter):
    """Prefixes every line of a message, not only its first (a record of held lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        message = record.message
        if "\n" not in message:
            return super().formatMessage(record)
        lines = []
        for line in message.split("\n"):
            record.message = line
            lines.append(super().formatMessage(record))
        record.message = message
        return "\n".join(lines)


class HeldLines(logging.Filter):
    """Info lines held, then handed to the logger's handlers as one record: one write and one
    flush per handler instead of one per line. Any other record of the logger first releases
    them, so lines keep their order."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger, self.lines = logger, list[str]()
        logger.addFilter(self)

    def add(self, line: str) -> None:
        self.lines.append(line)

    def release(self) -> None:
        if self.lines:
            lines, self.lines = self.lines, []
            self.logger.info("\n".join(lines))

    def close(self) -> None:
        self.release()
        self.logger.removeFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if self.lines:
            self.release()  # before this record: it was made after them
        return True


class _TqdmStreamHandler(logging.Handler):
    """Writes through tqdm so that lines never tear a progress bar on a terminal."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            bars = sys.modules.get("tqdm")  # imported where a progress bar was made
            if bars is not None and getattr(bars.tqdm, "_instances", None):
                bars.tqdm.write(line, file=sys.stdout)
            else:
                # One write per line: ranks sharing a pipe then never splice their lines together.
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
        except Exception:  # logging must never crash training
            self.handleError(record)


class _RankFileHandler(logging.FileHandler):
    """The rank's log file. A write that fails (a full disk) is said once on the console, naming
    the file, and the file is given up: the console keeps every line, and training goes on (a
    checkpoint write then fails in one line of its own if the disk stays full), instead of
    logging's traceback for every line."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        self.failed = True
        with contextlib.suppress(OSError):  # closing flushes the buffer, onto the same full disk
            self.close()
        logging.getLogger(LOGGER_NAME).warning(
            f"{could_not_write(self.baseFilename, error)}; this rank's lines now go to the "
            "console only"
        )


def setup_logging(
    prefix: str, log_file: Path | None = None, speaks_once: bool = True
) -> logging.Logger:
    """Configure the `dpt` logger for this process: `[<prefix>] message` on stdout, and the same
    lines in `log_file` (one file per rank, so ranks never interleave inside a file).
    `speaks_once`: this process says the lines every rank says alike (`dpt.once`: rank 0, a
    command) on the console; the other ranks and a launching process keep them to their file."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # Hydra's root handlers would print every line twice
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    formatter = _EveryLineFormatter(f"[{prefix}] %(message)s")
    console = _TqdmStreamHandler()
    console.setFormatter(formatter)
    if not speaks_once:
        console.addFilter(lambda record: record.name != ONCE_LOGGER_NAME)
    logger.addHandler(console)
    trace = logging.getLogger(TRACE_LOGGER_NAME)
    trace.propagate = False  # tracebacks go to the rank's file only, never to the console
    for handler in list(trace.handlers):
        trace.removeHandler(handler)
        handler.close()
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = _RankFileHandler(log_file)
        file_handler.setFormatter(_EveryLineFormatter(f"%(asctime)s [{prefix}] %(message)s"))
        logger.addHandler(file_handler)
        trace.addHandler(file_handler)
    return logger


def traceback_file() -> Path | None:
    """The rank log file this process's tracebacks go to (None before `setup_logging` gave it
    one, or once a full disk made it give the file up)."""
    for handler in logging.getLogger(TRACE_LOGGER_NAME).handlers:
        if isinstance(handler, _RankFileHandler) and not handler.failed:
            return Path(handler.baseFilename)
    return None
