"""A folder served over HTTP on loopback for the length of a `with` (Python's http.server in a
thread of the test process): what the shards tests read as a remote store."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


@dataclass
class Served:
    url: str  # http://127.0.0.1:<port>, the folder's root
    requests: list[str] = field(default_factory=list)  # the paths asked for, in order
    stop: Callable[[], None] = lambda: None  # the server gone: its port refuses connections
    start: Callable[[], None] = lambda: None  # the server back, on the same port
    # An outage: when the server is asked for its `outage_after`-th shard, it stops instead of
    # answering, and comes back `outage_s` seconds later.
    outage_after: int | None = None
    outage_s: float = 0.0

    def tars_asked(self) -> int:
        return sum(path.endswith(".tar") for path in self.requests)


class _Handler(SimpleHTTPRequestHandler):
    served: Served

    def do_GET(self) -> None:
        self.served.requests.append(self.path)
        if self.path.endswith(".tar") and self.served.tars_asked() == self.served.outage_after:
            threading.Thread(target=_outage, args=(self.served,), daemon=True).start()
            self.close_connection = True  # no answer: the server is going away
            return
        super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request on stderr otherwise


def _outage(served: Served) -> None:
    served.stop()
    time.sleep(served.outage_s)
    served.start()


@contextmanager
def serve(folder: Path) -> Iterator[Served]:
    served = Served("")
    handler = functools.partial(type("Handler", (_Handler,), {"served": served}), directory=folder)
    running: list[tuple[ThreadingHTTPServer, threading.Thread]] = []

    def start(port: int = 0) -> None:
        server = ThreadingHTTPServer(("127.0.0.1", port or _port(served)), handler)
        served.url = f"http://127.0.0.1:{server.server_address[1]}"
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        running.append((server, thread))

    def stop() -> None:
        while running:
            server, thread = running.pop()
            server.shutdown()
            server.server_close()
            thread.join()

    served.start, served.stop = start, stop
    start()
    try:
        yield served
    finally:
        served.stop()


def _port(served: Served) -> int:
    return int(served.url.rsplit(":", 1)[1]) if served.url else 0
