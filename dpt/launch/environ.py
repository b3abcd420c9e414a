"""A job's changes to the environment, undone when it ends."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def restored_environ() -> Iterator[None]:
    """Leave no MASTER_PORT, RANK, ... behind for the next job of a multirun."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
