"""dpt's TensorBoard event files (dpt/observe/event_file.py) read as TensorBoard reads its own:
every record's checksums pass TensorBoard's reader, scalars and summaries come back, and a resumed
run's purge step hides what an earlier run wrote past it."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

from dpt.observe import event_file
from dpt.observe.event_file import EventFile, scalars_event


def test_the_checksum_is_tensorboards() -> None:
    rng = random.Random(0)
    for size in (0, 1, 8, 137, 4096):
        data = bytes(rng.randrange(256) for _ in range(size))
        assert event_file.masked_crc32c(data) == masked_crc32c(data)


def _scalars(folder: Path) -> dict[str, list[tuple[int, float, float]]]:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}  # fmt: skip


def test_scalars_and_summaries_read_back_through_tensorboard(tmp_path: Path) -> None:
    events = EventFile(tmp_path)
    events.write(
        [
            scalars_event({"train/loss": 2.5, "optim/lr": 0.1}, step, 1000.0 + step)
            for step in (1, 2)
        ]
    )
    events.write(
        [event_file.summary_event(Summary(value=[Summary.Value(tag="x", simple_value=7)]))]
    )
    events.close()
    assert events.path.name.startswith("events.out.tfevents.")
    assert f".{os.getpid()}." in events.path.name
    assert _scalars(tmp_path) == {
        "train/loss": [(1, 2.5, 1001.0), (2, 2.5, 1002.0)],
        "optim/lr": [(1, pytest.approx(0.1), 1001.0), (2, pytest.approx(0.1), 1002.0)],
        "x": [(0, 7.0, pytest.approx(_scalars(tmp_path)["x"][0][2]))],
    }
    first = next(iter(EventFileLoader(str(events.path)).Load()))
    assert first.file_version == "brain.Event:2"


def test_a_corrupted_record_fails_tensorboards_check(tmp_path: Path) -> None:
    """The checksums are really checked by the reader the tests above rely on."""
    events = EventFile(tmp_path)
    events.write([scalars_event({"train/loss": 1.0}, 1, 1.0)])
    events.close()
    data = bytearray(events.path.read_bytes())
    data[-6] ^= 0xFF  # inside the last record's data
    events.path.write_bytes(bytes(data))
    loaded = list(EventFileLoader(str(events.path)).Load())
    assert [event.file_version for event in loaded] == ["brain.Event:2"]  # the bad record: dropped


def test_a_resumed_runs_file_hides_the_steps_past_its_purge_step(tmp_path: Path) -> None:
    first = EventFile(tmp_path)  # a run that logged up to step 9, then died
    first.write([scalars_event({"train/loss": float(s)}, s, float(s)) for s in range(1, 10)])
    first.close()
    resumed = EventFile(tmp_path, purge_step=6)  # resumed from step 5's checkpoint
    resumed.write([scalars_event({"train/loss": -float(s)}, s, 100.0 + s) for s in (6, 7)])
    resumed.close()
    assert [(s, v) for s, v, _ in _scalars(tmp_path)["train/loss"]] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, -6.0), (7, -7.0)
    ]  # fmt: skip
