"""A folder served over HTTP on loopback for the length of a `with` (Python's http.server in a
thread of the test process): what the shards tests read as a remote store."""

from __future__ import annotations

import functools
import threading
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


def _stopper(server: ThreadingHTTPServer, thread: threading.Thread) -> Callable[[], None]:
    def stop() -> None:
        if thread.is_alive():
            server.shutdown()
            server.server_close()
            thread.join()

    return stop


class _Handler(SimpleHTTPRequestHandler):
    served: Served

    def do_GET(self) -> None:
        self.served.requests.append(self.path)
        super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request on stderr otherwise


@contextmanager
def serve(folder: Path) -> Iterator[Served]:
    served = Served("")
    handler = type("Handler", (_Handler,), {"served": served})
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=folder))
    served.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    served.stop = _stopper(server, thread)
    try:
        yield served
    finally:
        served.stop()
