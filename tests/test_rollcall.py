"""The roll call's part in process: a rank that was itself stopped calls no roll of its own (the
others named it; asking their store, which may be gone, only prints torch's C++ errors)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dpt.distributed import DistEnv
from dpt.observe import rollcall
from dpt.observe.rollcall import RollCall

ENV = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, device=torch.device("cpu"))


def _polling(roll_call: RollCall) -> threading.Event:
    """A stand-in answering thread that stays alive until the returned event is set."""
    done = threading.Event()
    roll_call._thread = threading.Thread(target=done.wait, daemon=True)
    roll_call._thread.start()
    return done


def test_a_rank_whose_answering_thread_stalled_calls_no_roll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    roll_call = RollCall(ENV)
    asked: list[float] = []
    monkeypatch.setattr(roll_call, "_client", lambda timeout_s: asked.append(timeout_s))
    done = _polling(roll_call)
    try:
        roll_call._polled = time.monotonic() - rollcall.FROZEN_AFTER_S - 1  # SIGSTOPped meanwhile
        assert roll_call.absent(timeout_s=15) is None
        assert asked == []  # the store was not asked
        roll_call._polled = time.monotonic()  # it stays the rank that was frozen
        assert roll_call.was_frozen()
    finally:
        done.set()


def test_a_rank_that_kept_polling_calls_the_roll(monkeypatch: pytest.MonkeyPatch) -> None:
    roll_call = RollCall(ENV)
    asked: list[float] = []

    def client(timeout_s: float) -> None:
        asked.append(timeout_s)
        raise ConnectionError("no store here")

    monkeypatch.setattr(roll_call, "_client", client)
    done = _polling(roll_call)
    try:
        roll_call._polled = time.monotonic()
        assert roll_call.absent(timeout_s=15) is None  # no store: nothing to name
        assert asked == [rollcall.ANSWER_WITHIN_S]
    finally:
        done.set()
    roll_call._thread.join()
    roll_call._polled = time.monotonic() - rollcall.FROZEN_AFTER_S - 1
    assert not roll_call.was_frozen()  # the thread ended (it answered): not a stall
