"""The ranks of a local world fork from a server that has imported torch and dpt once.

Started with `spawn`, every rank imported torch, torch._dynamo (the optimizer's constructor
imports it) and dpt on its own: about 3 s of CPU each, and only after the launcher had imported
torch itself. Python's `forkserver` start method imports them once, in a server process, and forks
each rank from it. The server is started as soon as the config asks for a local world, before this
process imports torch, so the two imports overlap; a restarted round (`launcher.max_restarts`)
and the next job of a multirun fork from the same server.

The server never touches a GPU: each rank initialises CUDA after the fork, as under `spawn`.
Ranks inherit the server's environment (plus the per-rank variables the elastic agent passes)
and modules, so the server is started anew when the environment or what it imports changed since
it started (e.g. the next job of a sweep sets other `hydra.job.env_set` variables, or its task
is your own): ranks see the environment the launcher had when it launched them, as under
`spawn`.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from dpt.launch.parent_death import LAUNCHER_PID

START_METHOD = "forkserver"
# Gloo's and NCCL's interfaces, set to loopback for the server's ranks where the user set none.
LOOPBACK_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

# process_exit first: the server ends with its launcher (and its ranks with it), and leaves
# without finalization (dpt/launch/parent_death.py, process_exit.py). Then what every rank
# imports before its first step: dpt's worker (torch, dpt's parts, Hydra's instantiate) and
# torch._dynamo, which the optimizer's constructor imports; then torch.distributed.checkpoint
# (with DTensor and torch's elastic agent), which every rank imports at its first checkpoint.
RANK_IMPORTS = ("dpt.launch.worker", "torch._dynamo", "torch.distributed.checkpoint")
PRELOAD = ("dpt.launch.process_exit", *RANK_IMPORTS)
# After PRELOAD, for a run whose metrics are dpt's own: torchmetrics as such a run imports it
# (dpt/tasks/metrics_import.py), once here in place of once per rank at the first validation. A
# task of yours may name any metric: its ranks import torchmetrics whole, themselves.
OWN_METRICS = "dpt.tasks.own_metrics"


# The environment and the imports of the running server (its ranks' environment and modules).
_started_with: tuple[dict[str, str], list[str]] | None = None


def start(own_metrics: bool = False) -> None:
    """Start the server now, importing PRELOAD (and OWN_METRICS where `own_metrics`) while this
    process goes on; a no-op while it runs with this process's environment and those imports."""
    global _started_with
    extra = {**collectives_on_loopback(), LAUNCHER_PID: str(os.getpid())}
    started = ({**os.environ, **extra}, [*PRELOAD, *([OWN_METRICS] if own_metrics else [])])
    if _started_with is not None and started != _started_with:
        multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]
    multiprocessing.get_context(START_METHOD).set_forkserver_preload(started[1])
    with _environ(extra):
        multiprocessing.forkserver.ensure_running()
    _started_with = started


def collectives_on_loopback() -> dict[str, str]:
    """Gloo's and NCCL's own sockets on the loopback interface for the ranks of a local world,
    unless the user chose an interface. Left alone, both bind the address the hostname resolves
    to, which on many machines is on the network."""
    names = {name for _, name in socket.if_nameindex()}
    loopback = next((name for name in ("lo", "lo0") if name in names), None)
    if loopback is None:
        return {}
    return {name: loopback for name in LOOPBACK_VARIABLES if name not in os.environ}


@contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """`extra` in the environment for the server to inherit, not left in this process's."""
    os.environ.update(extra)
    try:
        yield
    finally:
        for name in extra:
            os.environ.pop(name, None)
