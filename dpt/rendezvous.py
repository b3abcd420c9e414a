"""Stores that a local run opens on 127.0.0.1 only, never on the network.

A TCPStore server listens on every interface, whatever host it is given, and torchrun's c10d
rendezvous hosts one even for a one-machine world. Here a store gets a socket already bound to
loopback (`master_listen_fd`), for the local launcher's rendezvous and for rank 0's store.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import random
import socket
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from dpt.errors import DptError

LOOPBACK_RENDEZVOUS = "dpt-loopback"
# Ports for a world's store below Linux's ephemeral ports (32768 and up by default), which
# every outgoing connection of the machine takes one of: a port chosen there and bound a moment
# later by rank 0 can be taken in between (EADDRINUSE, seen beside a Ray cluster's connections).
# Here only a server that asks for the very port competes.
STORE_PORTS = (20000, 32767)


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


# --- a store of each attempt's own, under a torchrun agent ----------------------------------------

ATTEMPT_STORE_KEY = "dpt/attempt_store"  # in the agent's store: where this attempt's store listens
STALE_RETRY_S = 1.0  # a port the previous attempt's rank 0 published: refused at once, read again


def agent_store(timeout: timedelta) -> dist.TCPStore:
    """A client of the store torchrun's agent serves at MASTER_ADDR:MASTER_PORT: one for the whole
    job, its keys outliving every restart."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)


def attempt_store(rank: int, timeout: timedelta) -> dist.TCPStore:
    """A fresh store for this attempt of the world, hosted by its rank 0.

    torchrun's agent shares its own store with the ranks and keeps it across restarts (and across
    a change of members), with no key of the attempt's own: a restarted world would read the
    previous attempt's Gloo addresses and fail ("connectFullMesh ... Connection refused"). So rank
    0 hosts a new store and publishes its port in the agent's; the others connect to what it
    publishes, reading again while what they find is the previous rank 0's (its process is gone,
    so its port refuses). MASTER_PORT is then this store's, for whatever else connects to the
    world (dpt.observe.rollcall)."""
    agent = agent_store(timeout)
    host = os.environ["MASTER_ADDR"]
    if rank == 0:
        store = (
            loopback_store(0, True, timeout)
            if is_loopback(host)
            else dist.TCPStore(host, 0, None, True, timeout, wait_for_workers=False)
        )
        agent.set(ATTEMPT_STORE_KEY, f"{store.port} {os.getpid()}")
    else:
        store = _published_store(agent, host, timeout)
    os.environ["MASTER_PORT"] = str(store.port)
    return store


def _published_store(agent: dist.TCPStore, host: str, timeout: timedelta) -> dist.TCPStore:
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        port = int(agent.get(ATTEMPT_STORE_KEY).split()[0])  # waits for the first attempt's
        if _listening(host, port):
            try:  # a store answers its client's greeting at once
                store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                      timeout=timedelta(seconds=5 * STALE_RETRY_S))  # fmt: skip
            except dist.DistError:  # the old port, taken since by something else
                pass
            else:
                store.set_timeout(timeout)
                return store
        if time.monotonic() > deadline:
            raise DptError(
                f"no store of this world's rank 0 at {host}:{port} within "
                f"{timeout.total_seconds():g} s (trainer.timeout_s)"
            )
        time.sleep(0.1)  # the previous attempt's port: this attempt's rank 0 publishes soon


def _listening(host: str, port: int) -> bool:
    """Whether something accepts connections at host:port (quietly: TCPStore's own client logs
    each refused try with a C++ stack)."""
    try:
        socket.create_connection((host, port), timeout=STALE_RETRY_S).close()
    except OSError:
        return False
    return True


class _LoopbackBackend(C10dRendezvousBackend):
    """torchrun's c10d rendezvous state, under the name the handler was registered with."""

    @property
    def name(self) -> str:
        return LOOPBACK_RENDEZVOUS


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
    store = loopback_store(0, True, timeout)
    handler = create_handler(store, _LoopbackBackend(store, params.run_id), params)
    # torch picks rank 0's port among the ephemeral ones (get_free_port); one of STORE_PORTS
    # in its place. One node: its agent alone hands the port to its ranks.
    handler.next_rendezvous = functools.partial(_on_a_store_port, handler.next_rendezvous)
    return handler


def _on_a_store_port(next_rendezvous: Any) -> Any:
    info = next_rendezvous()
    info.bootstrap_store_info.master_port = free_store_port()
    return info


def free_store_port() -> int:
    """A port of STORE_PORTS that nothing holds on 127.0.0.1 now."""
    for _ in range(200):
        port = random.randint(*STORE_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise DptError(f"no free port for the world's store in {STORE_PORTS[0]}-{STORE_PORTS[1]}")


def register_loopback_rendezvous() -> str:
    """Make the rendezvous backend `dpt-loopback` known to the elastic launcher; returns its name.

    It is torchrun's c10d rendezvous for a world on this machine, its store on 127.0.0.1.
    """
    from torch.distributed.elastic.rendezvous import registry

    registry.handler_registry.register(LOOPBACK_RENDEZVOUS, _create_handler)
    return LOOPBACK_RENDEZVOUS
