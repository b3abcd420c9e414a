"""One run per run folder at a time: an OS lock on `<run folder>/.lock`.

`fcntl.flock` is released by the kernel when its holder exits, however it ends (SIGKILL
included), so a lock never outlives its run and no stale lock needs cleaning. The file also tells
who holds it (pid, host, since when): the second start names it.

The process that runs Hydra takes the lock before Hydra writes anything into the folder (the
launcher with `launcher=local`, whose workers are its children; rank 0 under torchrun); under
SLURM every task runs Hydra's job, and rank 0's task holds it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from dpt.errors import DptError, could_not_write

LOCK_NAME = ".lock"

_held: dict[Path, int] = {}  # folder -> descriptor of its lock, in this process


class FolderInUse(DptError):
    """Another live process holds the run folder."""


def holds_lock_here() -> bool:
    """Whether this process is the one of its world that holds the run folder: not a rank > 0
    (torchrun sets RANK, SLURM sets SLURM_PROCID for each task)."""
    return all(os.environ.get(var, "0") == "0" for var in ("RANK", "SLURM_PROCID"))


def acquire(folder: Path) -> None:
    """Lock `folder` for this process (again: nothing happens), or raise FolderInUse at once."""
    key = folder.resolve()
    if key in _held:
        return
    path = key / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise FolderInUse(
            f"run folder {folder} is in use by another run ({holder}); wait for it to end, or "
            "start this one in another folder (hydra.run.dir=...)"
        ) from None
    try:
        _write_holder(fd)
    except OSError as error:
        os.close(fd)
        raise DptError(could_not_write(path, error)) from error
    _held[key] = fd


def held() -> list[Path]:
    """The run folders this process holds, in the order it took them."""
    return list(_held)


def release(folder: Path) -> None:
    fd = _held.pop(folder.resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the last descriptor of the open file releases the lock


@contextlib.contextmanager
def holding(folder: Path) -> Iterator[None]:
    """The lock for the block, unless this process held it already (then it keeps it)."""
    if folder.resolve() in _held:
        yield
        return
    acquire(folder)
    try:
        yield
    finally:
        release(folder)


def _write_holder(fd: int) -> None:
    info = {"pid": os.getpid(), "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}  # fmt: skip
    data = json.dumps(info).encode()
    os.ftruncate(fd, 0)
    if os.pwrite(fd, data, 0) != len(data):  # a short write: the disk filled up under it
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _holder(fd: int) -> str:
    """`pid 123 on host-a since ...`, from the holder's own record."""
    try:
        info = json.loads(os.pread(fd, 4096, 0))
        return f"pid {info['pid']} on {info['host']} since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet said who it is"
