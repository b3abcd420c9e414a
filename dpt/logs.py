"""Console and per-rank log files: every line says which rank wrote it."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tqdm import tqdm

LOGGER_NAME = "dpt"
TRACE_LOGGER_NAME = "dpt_traceback"


class _TqdmStreamHandler(logging.Handler):
    """Writes through tqdm so that lines never tear a progress bar on a terminal."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            if getattr(tqdm, "_instances", None):
                tqdm.write(line, file=sys.stdout)
            else:
                # One write per line: ranks sharing a pipe then never splice their lines together.
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
        except Exception:  # logging must never crash training
            self.handleError(record)


def setup_logging(prefix: str, log_file: Path | None = None) -> logging.Logger:
    """Configure the `dpt` logger for this process: `[<prefix>] message` on stdout, and the same
    lines in `log_file` (one file per rank, so ranks never interleave inside a file)."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # Hydra's root handlers would print every line twice
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(f"[{prefix}] %(message)s")
    console = _TqdmStreamHandler()
    console.setFormatter(formatter)
    logger.addHandler(console)
    trace = logging.getLogger(TRACE_LOGGER_NAME)
    trace.propagate = False  # tracebacks go to the rank's file only, never to the console
    for handler in list(trace.handlers):
        trace.removeHandler(handler)
        handler.close()
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file)
        file_handler.setFormatter(logging.Formatter(f"%(asctime)s [{prefix}] %(message)s"))
        logger.addHandler(file_handler)
        trace.addHandler(file_handler)
    return logger
