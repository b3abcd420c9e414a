"""One run per run folder at a time: an OS lock on `<run folder>/.lock`, held by every process
of the run.

The process that starts the run (the launcher with `launcher=local`, whose workers are its
children; rank 0 under torchrun and under SLURM, where every task runs Hydra's job) takes the
lock before Hydra writes anything into the folder: exclusively, which fails at once while any
process holds it, then turned into a shared lock in one step. Every rank then joins with a shared
lock of its own, so a second run cannot start while any process of the first lives, its launcher
killed or not (its ranks end with it, dpt/launch/parent_death.py, but not in the same instant).

POSIX record locks (`fcntl.lockf`): the kernel releases them when their holder exits, however it
ends (SIGKILL included), so a lock never outlives its run and no stale lock needs cleaning; they
turn from exclusive to shared atomically (`flock` does not promise that); and NFS honours them.
They belong to the process, and closing *any* descriptor of the file in it releases them: only
this module opens `.lock`. The file also tells who holds it, one JSON line per holder (pid, host,
since when): the second start names them.
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
from typing import Any, NoReturn

from dpt.errors import DptError, could_not_write

LOCK_NAME = ".lock"

_held: dict[Path, int] = {}  # folder -> descriptor of its lock, in this process


class FolderInUse(DptError):
    """Another live process holds the run folder."""


def holds_lock_here() -> bool:
    """Whether this process is the one of its world that starts the run and takes the run folder
    first: not a rank > 0 (torchrun sets RANK, SLURM sets SLURM_PROCID for each task)."""
    return all(os.environ.get(var, "0") == "0" for var in ("RANK", "SLURM_PROCID"))


def acquire(folder: Path, wait_s: float = 0.0) -> None:
    """Take `folder` for a run that starts in this process (again: nothing happens), or raise
    FolderInUse while any process holds it: at once, or after waiting `wait_s` for it."""
    key = folder.resolve()
    if key in _held:
        return
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fd = _locked(folder, key, fcntl.LOCK_EX)
            break
        except FolderInUse:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
    try:
        os.ftruncate(fd, 0)  # the previous run's holders: gone, as the lock was free
        _write_holder(fd, {})
    except OSError as error:
        os.close(fd)
        raise DptError(could_not_write(key / LOCK_NAME, error)) from error
    fcntl.lockf(fd, fcntl.LOCK_SH)  # in one step: no other start can come in between
    _held[key] = fd


def join(folder: Path, rank: int) -> None:
    """Hold `folder` beside the process that started the run (in this process: nothing
    happens)."""
    key = folder.resolve()
    if key in _held:
        return
    key.mkdir(parents=True, exist_ok=True)  # made by the starter, unless called on its own
    fd = _locked(folder, key, fcntl.LOCK_SH)  # refused while another start holds it alone
    with contextlib.suppress(OSError):  # who holds it is for people; the lock is what counts
        _write_holder(fd, {"rank": rank})
    _held[key] = fd


def held() -> list[Path]:
    """The run folders this process holds, in the order it took them."""
    return list(_held)


def release(folder: Path) -> None:
    fd = _held.pop(folder.resolve(), None)
    if fd is not None:
        os.close(fd)  # releases this process's locks on the file


@contextlib.contextmanager
def holding(folder: Path, rank: int | None = None) -> Iterator[None]:
    """The lock for the block (taken, or joined as `rank`), unless this process held it already
    (then it keeps it)."""
    if folder.resolve() in _held:
        yield
        return
    if rank is None:
        acquire(folder)
    else:
        join(folder, rank)
    try:
        yield
    finally:
        release(folder)


def _locked(folder: Path, key: Path, how: int) -> int:
    """A descriptor of `key/.lock` holding the lock `how` (LOCK_EX or LOCK_SH), taken at once
    or refused."""
    fd = os.open(key / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, how | fcntl.LOCK_NB)
    except OSError as error:
        _refuse(fd, folder, error)
    return fd


def _refuse(fd: int, folder: Path, error: OSError) -> NoReturn:
    if error.errno not in (errno.EACCES, errno.EAGAIN):
        os.close(fd)
        raise DptError(f"cannot lock run folder {folder}: {error.strerror}") from error
    holders = _holders(fd)
    os.close(fd)
    raise FolderInUse(
        f"run folder {folder} is in use by another run ({holders}); wait for it to end, or "
        "start this one in another folder (hydra.run.dir=...)"
    ) from None


def _write_holder(fd: int, role: dict[str, int]) -> None:
    """One line, appended in one write (ranks add theirs side by side)."""
    info = {"pid": os.getpid(), "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), **role}  # fmt: skip
    data = (json.dumps(info) + "\n").encode()
    end = os.fstat(fd).st_size
    if os.pwrite(fd, data, end) != len(data):  # a short write: the disk filled up under it
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def read_holders(text: str) -> list[dict[str, Any]]:
    """The holders a lock file records, the run's starter first."""
    holders = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            info = json.loads(line)
            if isinstance(info, dict) and {"pid", "host", "since"} <= info.keys():
                holders.append(info)
    return holders


def _holders(fd: int) -> str:
    """`pid 123 on host-a since ...`: the run's starter, if it lives; else the ranks still alive
    after it ended."""
    try:
        holders = read_holders(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
    except OSError:
        holders = []
    if not holders:
        return "a process that has not yet said who it is"
    starter, ranks = holders[0], [h for h in holders[1:] if _may_live(h)]
    if _may_live(starter) or not ranks:
        return f"pid {starter['pid']} on {starter['host']} since {starter['since']}"
    pids = ", ".join(str(h["pid"]) for h in ranks)
    return (
        f"its ranks, pids {pids} on {ranks[0]['host']}, outlived its launcher, pid {starter['pid']}"
    )


def _may_live(holder: dict[str, Any]) -> bool:
    """False only for a process of this host that is known to have ended."""
    if holder["host"] != socket.gethostname():
        return True
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError):
        return True
    return True
