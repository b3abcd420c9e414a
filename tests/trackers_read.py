"""Reading what the trackers hold, as a user's own tools would: MLflow's client, W&B's offline
run file (its records, with W&B's own protobuf classes), metrics.csv."""

from __future__ import annotations

import contextlib
import csv
import json
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.request import urlopen

from tests.helpers import BIN, free_port, start

SERVER_START_S = 180.0


@contextmanager
def mlflow_server(folder: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`mlflow server` with a SQLite store on loopback, started in `folder` (its artifacts go
    there); yields its URI and process."""
    port = free_port()
    cmd = [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{folder}/mlflow.db",
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    proc = start(cmd, cwd=folder)
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_up(uri, proc)
        yield uri, proc
    finally:
        stop(proc)


@contextmanager
def relay(uri: str) -> Iterator[tuple[str, Callable[[], None]]]:
    """A TCP relay on a free loopback port to the server at `uri` (http://host:port): its URI,
    and a function that takes it away (its port closed, every connection through it cut): for
    the client, the server gone."""
    host, port = uri.removeprefix("http://").rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", 0))
    open_sockets: list[socket.socket] = [listener]
    closed = threading.Event()

    def pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        with contextlib.suppress(OSError):  # the listener closed: gone
            while True:
                client, _ = listener.accept()
                if closed.is_set():  # accepted as it went away
                    client.close()
                    return
                server = socket.create_connection((host, int(port)))
                open_sockets.extend((client, server))
                for ends in ((client, server), (server, client)):
                    threading.Thread(target=pump, args=ends, daemon=True).start()

    def gone() -> None:
        closed.set()
        for one in list(open_sockets):
            with contextlib.suppress(OSError):
                one.shutdown(socket.SHUT_RDWR)
            one.close()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", gone
    finally:
        gone()


def wait_up(uri: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"mlflow server ended: {proc.communicate()[1][-2000:]}"
        try:
            with urlopen(f"{uri}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"mlflow server not up after {SERVER_START_S} s")


def stop(proc: subprocess.Popen[str]) -> None:
    import os
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def runs_of(uri: str) -> list[Any]:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    return [
        run
        for exp in client.search_experiments()
        for run in client.search_runs([exp.experiment_id])
    ]


def metric_steps(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    history = MlflowClient(uri).get_metric_history(run_id, key)
    return sorted((m.step, m.value) for m in history)


def artifacts(uri: str, run_id: str) -> list[str]:
    from mlflow import MlflowClient

    return [f.path for f in MlflowClient(uri).list_artifacts(run_id)]


def history(run_dir: Path) -> list[dict[str, float]]:
    """metrics.json's history: one row per logged step."""
    return json.loads((run_dir / "metrics.json").read_text())["history"]


def by_key(rows: list[dict[str, float]]) -> dict[str, list[tuple[int, float]]]:
    """Each metric's (step, value) points, as a tracker's history of it."""
    found: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step":
                found.setdefault(key, []).append((int(row["step"]), value))
    return found


def csv_rows(run_dir: Path) -> list[dict[str, float]]:
    with open(run_dir / "metrics.csv") as f:
        return [{k: (int(v) if k == "step" else float(v)) for k, v in row.items() if v != ""}
                for row in csv.DictReader(f)]  # fmt: skip


def wandb_records(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The config and the history rows of the run's one W&B offline run file."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    config: dict[str, Any] = {}
    rows = []
    for data in _records(files[0].read_bytes()):
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item})  # fmt: skip
    return config, rows


def _records(raw: bytes, block: int = 32768) -> Iterator[bytes]:
    """W&B's run file: a 7-byte header, then LevelDB-log-style blocks of records (a 7-byte
    header each: checksum, length, type; FULL=1, FIRST=2, MIDDLE=3, LAST=4)."""
    assert raw[:4] == b":W&B", raw[:7]
    pos, pending = 7, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        pos += 7
        if kind == 0:
            break
        pending += raw[pos : pos + length]
        pos += length
        if kind in (1, 4):
            yield pending
            pending = b""
