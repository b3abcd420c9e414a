"""The port of a world's store, a SLURM job's and a local world's, in process (tests/test_slurm.py
runs jobs on a cluster)."""

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


def test_a_local_worlds_store_port_is_below_the_ephemeral_ports_and_free() -> None:
    """The local launcher's rendezvous (one node, in this process) hands rank 0 a port for its
    store that no outgoing connection can hold, and that nothing holds now."""
    import socket

    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    from dpt.rendezvous import register_loopback_rendezvous

    params = RendezvousParameters(backend=register_loopback_rendezvous(), endpoint="",
                                  run_id="ports", min_nodes=1, max_nodes=1,
                                  local_addr="127.0.0.1")  # fmt: skip
    handler = registry.get_rendezvous_handler(params)
    try:
        ports = {handler.next_rendezvous().bootstrap_store_info.master_port for _ in range(3)}
    finally:
        handler.shutdown()
    assert all(20000 <= port < EPHEMERAL for port in ports), ports
    for port in ports:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))  # free for rank 0's store to take
