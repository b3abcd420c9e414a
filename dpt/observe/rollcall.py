"""Which rank stopped answering: a roll call over the world's store after a collective timed out.

A collective that times out only tells the ranks that waited that *someone* is missing. Each rank
therefore keeps a small thread that answers a roll call through the store (MASTER_ADDR:
MASTER_PORT) and publishes its host and pid at start. A rank whose collective timed out calls the
roll: a rank that does not answer within a few seconds is stopped (SIGSTOP, a debugger), hung with
the interpreter locked, or cut off; it is named in the run's final line, and, when it runs on this
host and is stopped, woken (SIGCONT) so that it can act on the launcher's SIGTERM at once.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from dpt.distributed import DistEnv
from dpt.errors import DptError

ANSWER_WITHIN_S = 3.0
POLL_S = 0.5  # how often a rank looks for a roll call (one store round trip)
# A poll this late means the process itself did not run (SIGSTOP, a debugger): the other ranks
# have given up on it, and the store, hosted by rank 0, may be gone with them.
FROZEN_AFTER_S = POLL_S + 5.0
# How the launcher finds, among the ranks' error messages, the rank that a roll call named.
SILENT_RANK = re.compile(r"^rank (\d+) stopped answering: .*")


class RankStoppedAnswering(DptError):
    """A rank did not answer the roll call after a collective timed out; names that rank."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid  # set when the silent rank runs on this host

    def wake_it(self) -> None:
        """SIGCONT to the silent rank if it runs on this host: a stopped process cannot act on
        the launcher's SIGTERM, which would then wait 30 s before SIGKILL. Woken, it finds its
        peers gone and exits. Call it last: this rank's error must be recorded first."""
        if self.pid is not None:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGCONT)


class RollCall:
    def __init__(self, env: DistEnv) -> None:
        self.env = env
        self.address = (os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT", 0)))
        self._done, self._thread = threading.Event(), None
        self._polled = time.monotonic()  # the answering thread's last poll
        self._frozen = False
        self.prefix = "dpt/rollcall/"  # each world's store is its own, a restart's too

    def _client(self, timeout_s: float) -> dist.TCPStore:
        host, port = self.address
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)  # fmt: skip

    def start_answering(self) -> None:
        """Publish this rank's host and pid, then answer the roll call from a daemon thread."""
        if self.env.world_size == 1 or not self.address[1]:
            return
        self._polled = time.monotonic()
        self._thread = threading.Thread(target=self._answer, name="dpt-rollcall", daemon=True)
        self._thread.start()

    def stop_answering(self) -> None:
        """Before the process group goes: a thread inside a store call when the store's server
        shuts down would abort the process."""
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * POLL_S + 1)

    def _answer(self) -> None:
        with contextlib.suppress(Exception):  # the store went away: the world is ending anyway
            store = self._client(timeout_s=10)
            store.set(f"{self.prefix}who/{self.env.rank}", f"{socket.gethostname()} {os.getpid()}")
            self._polled = time.monotonic()
            # Polled, not a blocking wait: the thread must be able to stop before the store does.
            while not self._done.wait(POLL_S):
                if self.was_frozen():
                    return  # asking a store that may be gone only prints torch's C++ errors
                self._polled = time.monotonic()
                if store.check([f"{self.prefix}asked"]):
                    store.set(f"{self.prefix}here/{self.env.rank}", "1")
                    return

    def was_frozen(self) -> bool:
        """Whether this process stopped running for a while (its answering thread could not
        poll): then it is the rank the others named, and calls no roll of its own."""
        polling = self._thread is not None and self._thread.is_alive()
        stalled = polling and time.monotonic() - self._polled > FROZEN_AFTER_S
        self._frozen = self._frozen or stalled
        return self._frozen

    def absent(self, timeout_s: float) -> RankStoppedAnswering | None:
        """Call the roll; the lowest rank that did not answer, as an error naming it, or None when
        all answered, the store cannot be reached, or this rank itself was the silent one."""
        if self.was_frozen():
            return None
        try:
            store = self._client(timeout_s=ANSWER_WITHIN_S)
            store.set(f"{self.prefix}asked", "1")
            deadline = time.monotonic() + ANSWER_WITHIN_S
            while (missing := self._missing(store)) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not missing:
                return None
            who_key = f"{self.prefix}who/{missing[0]}"
            host, _, pid = (
                store.get(who_key).decode() if store.check([who_key]) else ""
            ).partition(" ")
        except Exception:  # no store, no roll call: the caller says what it knows
            return None
        local = bool(pid) and host == socket.gethostname()
        where = f"; pid {pid} on {host}" if pid else ""
        return RankStoppedAnswering(
            f"rank {missing[0]} stopped answering: no reply within "
            f"trainer.timeout_s={timeout_s:g}{where}",
            int(pid) if local else None,
        )

    def _missing(self, store: dist.TCPStore) -> list[int]:
        return [r for r in range(self.env.world_size)
                if r != self.env.rank and not store.check([f"{self.prefix}here/{r}"])]  # fmt: skip
