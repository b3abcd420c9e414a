"""What a run opens on the network, and what it does when the network goes away.

Both tests run on "hosts" that are network namespaces (tests/netns.py), where the hostname
resolves to the host's network address as on a real machine (outside them, here, to 127.0.0.1,
which would hide a socket bound to "the hostname's address").
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import (
    FAST,
    TORCHRUN,
    TRAIN,
    Process,
    assert_no_leftovers,
    listening_sockets,
    session_members,
    start,
)
from tests.netns import TwoHosts

pytestmark = pytest.mark.slow  # every test here starts train.py or ranks


@pytest.mark.timeout(180)
def test_a_local_ddp_run_listens_on_loopback_only(tmp_path: Path, two_hosts: TwoHosts) -> None:
    """The launcher's rendezvous store, rank 0's store and Gloo's sockets: 127.0.0.1 only,
    although the hostname resolves to an address the other host can reach."""
    host = two_hosts.hosts[0]
    cmd = [
        *host.prefix(),
        sys.executable,
        str(TRAIN),
        "strategy=ddp",
        "launcher.nproc_per_node=2",
        *FAST,
        "trainer.max_steps=60",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    proc = start(cmd)
    listeners: dict[int, set[tuple[str, int]]] = {}
    deadline = time.monotonic() + 150
    while proc.poll() is None and time.monotonic() < deadline:
        for pid in session_members(proc.pid):
            listeners.setdefault(pid, set()).update(listening_sockets(pid))
        time.sleep(0.1)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stdout + stderr
    assert_no_leftovers(proc.pid)
    opened = {pid: socks for pid, socks in listeners.items() if socks}
    # `ip netns exec` becomes the launcher (same pid); each rank listens for Gloo, rank 0 also
    # for its store.
    assert proc.pid in opened, opened
    assert len(opened) == 3, opened
    addresses = {address for socks in opened.values() for address, _ in socks}
    assert addresses == {"127.0.0.1"}, opened


@pytest.mark.timeout(240)
def test_a_pulled_link_stops_both_nodes_within_the_timeout(
    tmp_path: Path, two_hosts: TwoHosts
) -> None:
    """Two torchrun nodes in two namespaces; node 1's cable is pulled mid-training. Nothing is
    reset, packets just vanish: every rank must give up after trainer.timeout_s and say why."""
    timeout_s = 8  # long enough for a step on a busy machine, short enough to wait out
    master = two_hosts.hosts[0].address

    def node(rank: int) -> Process:
        host = two_hosts.hosts[rank]
        cmd = [
            *host.prefix("GLOO_SOCKET_IFNAME=eth0", "OMP_NUM_THREADS=1"),
            *TORCHRUN,
            "--nnodes=2",
            "--nproc_per_node=1",
            f"--node_rank={rank}",
            "--rdzv_backend=static",
            f"--master_addr={master}",
            "--master_port=29500",
            f"--local_addr={host.address}",
            str(TRAIN),
            "launcher=torchrun",
            "strategy=ddp",
            *FAST,
            f"trainer.timeout_s={timeout_s}",
            "trainer.batch_size=32",
            "trainer.max_steps=2000",
            "dataset.num_samples=65536",
            "model.hidden_dims=[512,512]",
            f"hydra.run.dir={tmp_path / 'run'}",
        ]
        return start(cmd)

    nodes = [node(0), node(1)]
    try:
        survivor = nodes[0]
        assert survivor.stdout is not None
        seen = []
        for line in survivor.stdout:
            seen.append(line)
            if "step 10/" in line:
                break
        else:
            pytest.fail("node 0 ended before step 10:\n" + "".join(seen))
        two_hosts.unplug(1)
        pulled_at = time.monotonic()
        outputs = [p.communicate(timeout=timeout_s + 60) for p in nodes]
        took = time.monotonic() - pulled_at
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    # A collective waits timeout_s for the silent peer; then the ranks report and exit.
    assert timeout_s <= took < timeout_s + 30, took
    for rank, (proc, (stdout, stderr)) in enumerate(zip(nodes, outputs, strict=True)):
        assert proc.returncode != 0, stdout + stderr
        said = (
            f"[rank {rank}] stopped: another rank failed or stopped answering "
            f"(no reply within trainer.timeout_s={timeout_s})"
        )
        assert said in stdout, stdout + stderr
        assert_no_leftovers(proc.pid)
