"""Whether a server answers at a host and port: asked before any job starts (a tracker's
server, a Ray cluster's head), so that one that does not is one line, not a client's retries."""

from __future__ import annotations

import socket

CONNECT_TIMEOUT_S = 5.0


def why_silent(host: str, port: int) -> str | None:
    """Why nothing accepts a connection at `host`:`port` (`Connection refused`); None: something
    does."""
    try:
        with socket.create_connection((host, port), CONNECT_TIMEOUT_S):
            return None
    except OSError as error:
        return error.strerror or type(error).__name__
