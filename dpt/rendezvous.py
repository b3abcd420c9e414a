"""Stores that a local run opens on 127.0.0.1 only, never on the network.

A TCPStore server listens on every interface, whatever host it is given, and torchrun's c10d
rendezvous hosts one even for a one-machine world. Here a store gets a socket already bound to
loopback (`master_listen_fd`), for the local launcher's rendezvous and for rank 0's store.
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from dpt.errors import DptError

LOOPBACK_RENDEZVOUS = "dpt-loopback"


def is_loopback(host: str) -> bool:
    """Only a literal loopback address (or `localhost`): a hostname may map to 127.0.1.1 on its
    own machine and to a network address on the others (Debian's /etc/hosts)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_store(
    port: int, is_master: bool, timeout: timedelta, world_size: int | None = None
) -> dist.TCPStore:
    """A TCPStore on 127.0.0.1:`port`; its server (`is_master`) listens there only. Port 0: the
    OS picks a free one (read it back from `.port`)."""
    if not is_master:
        return dist.TCPStore("127.0.0.1", port, world_size, False, timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(socket.SOMAXCONN)
    except OSError as error:
        sock.close()
        raise DptError(f"cannot listen on 127.0.0.1:{port}: {error.strerror}") from error
    port = sock.getsockname()[1]
    # The store owns the socket from here on (detach: Python must not close it too).
    return dist.TCPStore(
        "127.0.0.1", port, world_size, True, timeout, master_listen_fd=sock.detach()
    )


class _LoopbackBackend(C10dRendezvousBackend):
    """torchrun's c10d rendezvous state, under the name the handler was registered with."""

    @property
    def name(self) -> str:
        return LOOPBACK_RENDEZVOUS


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
    store = loopback_store(0, True, timeout)
    return create_handler(store, _LoopbackBackend(store, params.run_id), params)


def register_loopback_rendezvous() -> str:
    """Make the rendezvous backend `dpt-loopback` known to the elastic launcher; returns its name.

    It is torchrun's c10d rendezvous for a world on this machine, its store on 127.0.0.1.
    """
    from torch.distributed.elastic.rendezvous import registry

    registry.handler_registry.register(LOOPBACK_RENDEZVOUS, _create_handler)
    return LOOPBACK_RENDEZVOUS
