"""A world's ranks leave the store rank 0 serves together (dpt.distributed._HostedStore): rank 0
stays until the others are done with it, so a rank a step behind never finds the server gone
(torch then prints `recvValue failed ... Connection reset by peer` under the run's one line; seen
under a SIGTERM to a loaded 2-rank ddp launcher). Two ranks as threads of this process, on a
loopback store."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from dpt import distributed
from dpt.rendezvous import loopback_store


def _world() -> tuple[distributed._HostedStore, distributed._HostedStore]:
    host = loopback_store(0, True, timedelta(seconds=10))  # no wait for the client to join
    client = loopback_store(host.port, False, timedelta(seconds=10))
    return distributed._HostedStore(host, 0, 2), distributed._HostedStore(client, 1, 2)


def _leaving(rank: distributed._HostedStore) -> threading.Thread:
    thread = threading.Thread(target=rank.leave, daemon=True)
    thread.start()
    return thread


def test_rank_0_serves_the_store_until_the_others_have_left() -> None:
    rank0, rank1 = _world()
    leaving = _leaving(rank0)
    time.sleep(0.3)  # rank 1 still at work, polling the store as its roll-call thread does
    assert leaving.is_alive()
    assert rank1.store.check(["dpt/rollcall/asked"]) is False  # the server still answers
    rank1.leave()  # a rank other than 0 never waits
    leaving.join(timeout=5)
    assert not leaving.is_alive()


def test_a_rank_that_failed_leaves_the_store_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where rank 0 failed, or every rank failed alike, rank 1 does not ask a store whose
    server may be gone."""
    asked: list[distributed._HostedStore] = []
    monkeypatch.setattr(distributed._HostedStore, "leave", lambda self: asked.append(self))
    monkeypatch.setattr(distributed, "_hosted_store", _world()[1])
    distributed.destroy_process_group(together=False)
    assert asked == [] and distributed._hosted_store is None


def test_rank_0_waits_at_most_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distributed, "LEAVE_WAIT_S", 0.2)
    rank0, _ = _world()  # rank 1 never leaves (killed)
    started = time.monotonic()
    rank0.leave()
    assert 0.2 <= time.monotonic() - started < 2
