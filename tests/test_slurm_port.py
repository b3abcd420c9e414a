"""The rendezvous port of a SLURM job, in process (tests/test_slurm.py runs jobs on a cluster)."""

from __future__ import annotations

from dpt.launch.slurm import master_port

EPHEMERAL = 32768  # where Linux's ports for outgoing connections start by default


def test_a_jobs_port_is_its_own_and_below_the_ephemeral_ports() -> None:
    ports = [master_port(str(job)) for job in range(1000, 3000)]
    # Every task of a job derives the same port from the job id, with no message to agree on it.
    assert ports[:5] == [master_port(str(job)) for job in range(1000, 1005)]
    # Not one a node's outgoing connection may hold (EADDRINUSE, seen with 20000-60000).
    assert all(20000 <= port < EPHEMERAL for port in ports)
    # The jobs of a sweep, started side by side on one node, mostly get different ports.
    assert len(set(ports)) > 1700
