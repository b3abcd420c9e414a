"""TensorBoard event files, written in bulk on the caller's thread.

TensorBoard's own writer (under torch's `SummaryWriter`) hands every event to a thread that
frames it with a CRC-32C computed in pure Python and appends it to the file: ~80 us of the
interpreter per event, which the training thread then waits for, since both want the GIL
(measured: 160 us a step at `trainer.log_every_n_steps=1`, about 17 % of an MLP step). Here a
batch of events is framed at once, with google-crc32c's compiled CRC, and appended in one write.

The file is the one TensorBoard's writer makes: the same name pattern, a `brain.Event:2` event
first, and for a resumed run torch's purge events (a `SessionLog.START` at the purge step, after
which TensorBoard hides what an earlier run wrote past it).
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import google_crc32c
from google.protobuf.message import DecodeError
from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary

_MASK_DELTA = 0xA282EAD8
_file_numbers = itertools.count()  # one process may open several files in a second


def masked_crc32c(data: bytes) -> int:
    """The TFRecord checksum: CRC-32C, rotated right by 15 bits, plus a constant."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame(record: bytes) -> bytes:
    """One TFRecord: length, masked CRC of the length, the record, masked CRC of the record."""
    header = struct.pack("<Q", len(record))
    header_crc = struct.pack("<I", masked_crc32c(header))
    return header + header_crc + record + struct.pack("<I", masked_crc32c(record))


def last_step(path: Path) -> int:
    """The highest step a summary in an event file was written at (0: none): how far a run's
    curves go. Reading stops at a cut-off or damaged record."""
    data = path.read_bytes()
    pos, last = 0, 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        start, end = pos + 12, pos + 12 + length
        if end + 4 > len(data):
            break
        try:
            event = Event.FromString(data[start:end])
        except DecodeError:
            break
        if event.HasField("summary"):
            last = max(last, event.step)
        pos = end + 4
    return last


def scalars_event(scalars: dict[str, float], step: int, wall_time: float) -> Event:
    """All of a window's scalars as one event (one `add_scalar` each would write one event a
    tag, and build each value through numpy)."""
    values = [Summary.Value(tag=tag, simple_value=float(v)) for tag, v in scalars.items()]
    return Event(wall_time=wall_time, step=step, summary=Summary(value=values))


def summary_event(summary: Any, step: int = 0) -> Event:
    """A one-off summary (HPARAMS, the overlay layout, a monitor event's text), stamped now."""
    return Event(wall_time=time.time(), step=step, summary=summary)


def purge_event(step: int) -> Event:
    """TensorBoard drops what came before it at `step` and later: a run that went back (a
    resume, a rollback) continues its curves instead of folding them back."""
    return Event(wall_time=time.time(), step=step, session_log=SessionLog(status=SessionLog.START))


class EventFile:
    """A new event file in `folder`; `purge_step`: a resumed run's first step (see above)."""

    def __init__(self, folder: Path, purge_step: int | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{next(_file_numbers)}")  # fmt: skip
        self.path = folder / name
        self._file = open(self.path, "wb")  # noqa: SIM115  # open until close()
        first = [Event(wall_time=time.time(), file_version="brain.Event:2")]
        if purge_step is not None:
            first.append(purge_event(purge_step))
        self.write(first)

    def write(self, events: Iterable[Event]) -> None:
        """Append the events in one write, handed to the operating system (not fsynced)."""
        self._file.write(b"".join(frame(event.SerializeToString()) for event in events))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write(folder: Path, summaries: Iterable[Any]) -> None:
    """Summaries into a new event file of their own in `folder`."""
    events = EventFile(folder)
    try:
        events.write(summary_event(summary) for summary in summaries)
    finally:
        events.close()
