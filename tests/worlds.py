"""Resident worlds: in each pytest worker, worlds of 2, 3 and 4 ranks, each started once (on first
use) and kept for the session, that take work from a queue and report back.

A test hands a world a module-level function, `fn(rank, *args)`, which every rank runs (as
`torch.multiprocessing.spawn` would call it), usually a run of `train.py`'s per-rank work inside
`tests.helpers.joined_world` (a process group of its own per call, on a fresh port). What a
rank leaves in its process (imports, torch's kernels, the tokenized text's cache in the file
system) serves the next call: a world spawned per test paid Python's and torch's start-up on
every rank, about 5 s of a core each here. The ranks fork from a server that imported those once
for the pytest worker (Python's forkserver), and a world starts once per session. The pattern
is PyTorch's own `MultiProcContinuousTest`.

Rules for a function run in a resident world:
- It does its work inside `joined_world` (or `helpers.world_rank_runs`), which leaves the process
  group destroyed and the rank's process alive.
- It leaves nothing behind that the next call could trip on: threads, child processes and
  open files end with it (dpt's runs do).
- What is about processes (a kill, a signal, an exit code, peak memory) does not belong here:
  such a test spawns its own processes.

A call that fails or does not finish within its timeout fails the test with every rank's
traceback and the tail of the world's console; the world is then ended, and the next call
starts a new one. A world of more than 2 ranks runs while a lock shared by the pytest workers is
held: on 2 cores, two 4-rank worlds at once would be 8 busy ranks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Set in a resident rank's process: `joined_world` leaves such a process alive at its end.
RESIDENT = "DPT_TEST_RESIDENT_RANK"
# Where the pytest workers agree that one world of more than 2 ranks runs at a time.
_LOCK = Path(tempfile.gettempdir()) / "dpt-tests-big-worlds.lock"
# After the first rank's failure, how long the others get to report theirs (a rank waiting in a
# collective for the failed one never will: the world is then ended).
_GRACE_S = 10.0


class WorldFailed(AssertionError):
    """A call on a resident world failed or did not finish; the world is gone."""


class ResidentWorld:
    """`size` ranks that each run the functions put on their own queue."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._ranks: list[Any] = []
        self._inboxes: list[Any] = []
        self._outbox: Any = None
        self._console: Path | None = None

    @property
    def alive(self) -> bool:
        return bool(self._ranks) and all(rank.is_alive() for rank in self._ranks)

    def _start(self) -> None:
        import multiprocessing

        from dpt.launch.fork_server import RANK_IMPORTS

        # The ranks fork from a server that imported this harness and what every rank of dpt's
        # imports once for the pytest worker (Python's forkserver, as dpt's own local ranks
        # start): a spawned rank imported them itself, about 5 s of a core for each rank.
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["tests.helpers", *RANK_IMPORTS])
        fd, console = tempfile.mkstemp(prefix=f"dpt-world{self.size}-", suffix=".log")
        os.close(fd)
        self._console = Path(console)
        self._outbox = context.Queue()
        self._inboxes = [context.Queue() for _ in range(self.size)]
        self._ranks = [
            context.Process(target=_rank_loop, name=f"resident-{self.size}-rank{rank}",
                            args=(rank, self._inboxes[rank], self._outbox, console))
            for rank in range(self.size)
        ]  # fmt: skip
        for process in self._ranks:
            process.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300) -> None:
        """`fn(rank, *args)` on every rank; returns once all have returned. Fails (and ends the
        world) on any rank's exception or at `timeout` seconds."""
        with self._turn():
            if not self.alive:
                self.close()
                self._start()
            for inbox in self._inboxes:
                inbox.put((fn, args))
            try:
                self._collect(fn, timeout)
            except BaseException:  # a failure, or pytest's timeout: no rank left half-way
                self.close()
                raise

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        if self.size < 3:
            yield
            return
        with open(_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _collect(self, fn: Callable[..., Any], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        failures: dict[int, str] = {}
        reported: set[int] = set()
        while len(reported) < self.size:
            wait = deadline - time.monotonic()
            if failures:
                wait = min(wait, _GRACE_S)
            if not self.alive:
                wait = min(wait, 1.0)  # a rank died: what the others say comes at once, or never
            try:
                rank, error = self._outbox.get(timeout=max(wait, 0.01))
            except queue.Empty:
                if failures or not self.alive or time.monotonic() >= deadline:
                    break
                continue
            reported.add(rank)
            if error is not None:
                failures[rank] = error
        if failures or len(reported) < self.size:
            missing = sorted(set(range(self.size)) - reported)
            why = "".join(
                f"--- rank {rank} ---\n{error}" for rank, error in sorted(failures.items())
            )
            if missing:
                why += f"--- ranks {missing} did not finish (timeout {timeout:.0f} s or died) ---\n"
            tail = self._console_tail()  # read before `run` ends the world (and its file)
            raise WorldFailed(f"{fn.__module__}.{fn.__qualname__} on {self.size} resident ranks:\n"
                              f"{why}--- the world's console, last lines ---\n{tail}")  # fmt: skip

    def _console_tail(self, lines: int = 40) -> str:
        if self._console is None or not self._console.exists():
            return ""
        return "\n".join(self._console.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        """Every rank asked to leave, then killed if it does not within a few seconds."""
        for inbox, process in zip(self._inboxes, self._ranks, strict=True):
            if process.is_alive():
                with contextlib.suppress(Exception):
                    inbox.put(None)
        for process in self._ranks:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        self._ranks, self._inboxes = [], []
        if self._console is not None:
            self._console.unlink(missing_ok=True)
            self._console = None


def _rank_loop(rank: int, inbox: Any, outbox: Any, console: str) -> None:
    """A resident rank: run what comes, report how it went, until told to leave."""
    os.environ[RESIDENT] = "1"
    log = os.open(console, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)  # the ranks' console in the world's file, not in a test's captured output
    os.dup2(log, 2)
    parent = os.getppid()
    from tests.helpers import collector_as_found  # in the rank: helpers imports this module

    while (task := _next_task(inbox, parent)) is not None:
        fn, args = task
        try:
            with collector_as_found():  # each call's runs start as in a fresh process
                fn(rank, *args)
            outbox.put((rank, None))
        except BaseException:  # SystemExit too: reported, and the rank stays
            outbox.put((rank, traceback.format_exc()))
        sys.stdout.flush()
        sys.stderr.flush()
    # As dpt's local ranks leave: without the interpreter's finalization (Gloo's can abort).
    os._exit(0)


def _next_task(inbox: Any, parent: int) -> tuple[Callable[..., Any], tuple[Any, ...]] | None:
    """The next function to run; None when told to leave or when the pytest worker is gone (a
    rank never outlives its session): its parent, the fork server, ends with the worker."""
    while os.getppid() == parent:
        try:
            return inbox.get(timeout=1.0)
        except queue.Empty:
            continue
    return None


_WORLDS: dict[int, ResidentWorld] = {}


def world(size: int) -> ResidentWorld:
    """This pytest worker's resident world of `size` ranks (2 and 4 serve most tests; 3, the
    resharding's odd world, too), started on first use."""
    if not 2 <= size <= 4:
        raise ValueError(f"resident worlds have 2 to 4 ranks, not {size}")
    return _WORLDS.setdefault(size, ResidentWorld(size))


def close_all() -> None:
    """At the end of the session (tests/conftest.py)."""
    for resident in _WORLDS.values():
        resident.close()
    _WORLDS.clear()


def in_resident_rank() -> bool:
    return os.environ.get(RESIDENT) == "1"
