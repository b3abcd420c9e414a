"""Two "nodes" on one machine: two torchrun processes, `--nnodes=2`, one world.

Each torchrun is a node with one process; together they must end with the same weights as one
node running both processes, and write one run folder: rank 0's (as on a shared file system).
c10d's rendezvous with each node in its own network namespace and address, as on two machines
(a c10d pair on loopback as well added nothing to that). The static rendezvous across two
namespaces is the Kubernetes pods' (tests/test_clusters.py: torchrun's PET_ variables, equal to
one process; a static pair on loopback added nothing to it).
"""

from __future__ import annotations

import os
import re
import signal
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import (
    FAST,
    TORCHRUN,
    TRAIN,
    Process,
    Result,
    cmd_until,
    free_port,
    load_weights,
    max_abs_diff,
    rank_pid,
    run_cmd,
    run_here,
    run_world,
    start,
    train,
    world_run,
)
from tests.netns import TwoHosts

pytestmark = pytest.mark.slow  # every test here starts train.py or ranks

COMMON = [*FAST, "trainer.max_steps=10", "trainer.seed=3", "trainer.batch_size=32", "strategy=ddp"]
# One thread per rank: two ranks share the two cores without oversubscribing them.
ENV = {"OMP_NUM_THREADS": "1"}


def run_together(cmds: list[list[str]], timeout: float) -> list[Result]:
    """Start all commands at once, wait for all (each is killed, with its children, on timeout)."""
    with ThreadPoolExecutor(len(cmds)) as pool:
        futures = [pool.submit(run_cmd, cmd, timeout=timeout, env=ENV) for cmd in cmds]
        return [f.result() for f in futures]


def node_cmd(rdzv: list[str], run_dir: Path, prefix: tuple[str, ...] = ()) -> list[str]:
    return [
        *prefix,
        *TORCHRUN,
        "--nnodes=2",
        "--nproc_per_node=1",
        *rdzv,
        str(TRAIN),
        *COMMON,
        "launcher=torchrun",
        f"hydra.run.dir={run_dir}",
    ]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: the same world size (2) on one node, started by the local launcher."""
    run_dir = tmp_path_factory.mktemp("one_node") / "run"
    train(run_dir, *COMMON, "launcher.nproc_per_node=2", env=ENV)
    return run_dir


def check_world(node_dirs: list[Path], one_node: Path) -> None:
    """Rank 0's folder holds every rank's files; the other node made no folder of its own."""
    made = [d for d in node_dirs if d.exists()]
    assert len(made) == 1, made
    run_dir = made[0]
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    assert sorted(p.name for p in (run_dir / "tb").iterdir()) == ["rank0", "rank1", "world"]
    assert "world size 2" in (run_dir / "logs" / "rank1.log").read_text()
    assert max_abs_diff(load_weights(run_dir), load_weights(one_node)) < 1e-5


@pytest.mark.timeout(240)
def test_two_network_namespaces_equal_one_node(  # c10d's rendezvous, as on two machines
    tmp_path: Path, one_node: Path, two_hosts: TwoHosts
) -> None:
    addr0 = two_hosts.hosts[0].address
    port = 29500  # a fresh namespace has every port free
    dirs = [tmp_path / f"node{n}" for n in (0, 1)]
    cmds = []
    for n, (host, run_dir) in enumerate(zip(two_hosts.hosts, dirs, strict=True)):
        rdzv = [
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={addr0}:{port}",
            "--rdzv_id=netns",
            # Both namespaces have one hostname: say who hosts the store, which address rank 0
            # advertises, and which interface Gloo uses.
            f"--rdzv_conf=is_host={int(n == 0)},read_timeout=60",
            f"--local_addr={host.address}",
        ]
        cmds.append(node_cmd(rdzv, run_dir, tuple(host.prefix("GLOO_SOCKET_IFNAME=eth0"))))
    run_together(cmds, timeout=200)
    check_world(dirs, one_node)


# --- elastic: a node lost, the world re-formed at half the size -----------------------------------

ELASTIC = [*FAST, "trainer.max_steps=40", "trainer.seed=3", "trainer.batch_size=32",
           "strategy=ddp", "checkpoint.every_n_steps=5", "checkpoint.keep=10",
           "model.hidden_dims=[512,512]"]  # fmt: skip
RESUMED = re.compile(r"\[rank 0\] torchrun restart 1 of 1: resumed from \S+/step-0*(\d+) at step")


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.timeout(240)
def test_a_lost_node_and_the_survivor_finishes_at_half_the_world(tmp_path: Path) -> None:
    """`--nnodes=1:2`: two agents, one rank each; after a checkpoint one agent and its rank are
    killed. The survivor's agent re-forms the world alone (world size 1), resumes from the
    newest checkpoint and finishes, ending as an uninterrupted run that went from 2 ranks to 1
    at that checkpoint."""
    run_dir = tmp_path / "run"
    rdzv = [f"--rdzv_endpoint=127.0.0.1:{free_port()}", f"--rdzv_id={uuid.uuid4().hex[:8]}"]

    def node(host: bool) -> list[str]:
        return [*TORCHRUN, "--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=1",
                "--rdzv_backend=c10d", *rdzv,
                # is_host: the survivor keeps the rendezvous (c10d's store lives on its host);
                # last_call_timeout: how long a round waits for a second node once one is in;
                # keep_alive_interval: a node beats every second, and one silent for 3 beats is
                # dropped from the next round (torch's default, 5 s, waits 15 s for the lost one).
                f"--rdzv_conf=is_host={int(host)},last_call_timeout=3,keep_alive_interval=1",
                str(TRAIN), "launcher=torchrun", *ELASTIC, f"hydra.run.dir={run_dir}"]  # fmt: skip

    lost = start(node(host=False), ENV)

    def kill_the_other_node(survivor: Process, line: str) -> None:
        (rank,) = [
            pid for pid in (rank_pid(run_dir, r) for r in (0, 1)) if _parent(pid) == lost.pid
        ]
        os.killpg(lost.pid, signal.SIGKILL)  # the agent (its rank runs in a session of its own)
        os.kill(rank, signal.SIGKILL)

    try:
        result = cmd_until(node(host=True), "epoch 1 | step 10/", kill_the_other_node, env=ENV)
    finally:
        if lost.poll() is None:
            os.killpg(lost.pid, signal.SIGKILL)
        lost.communicate()
    assert result.returncode == 0, result.output
    # The survivor's rank stops at once (its peer's connection closed), then the world re-forms.
    assert re.search(r"\[rank \d\] stopped: another rank failed or stopped answering\n",
                     result.stdout), result.stdout  # fmt: skip
    resumed = RESUMED.search(result.stdout)
    assert resumed, result.stdout
    assert "world size 1" in result.stdout

    # The same run uninterrupted on 2 ranks (one spawned world), then from that checkpoint on one
    # (in this process: what a world of one rank runs, on one thread as the survivor's).
    full = tmp_path / "full"
    run_world(2, [world_run("full", full, *ELASTIC)])
    changed = tmp_path / "changed"
    step = f"step-{int(resumed.group(1)):08d}"
    run_here(changed, *ELASTIC, f"checkpoint.resume={full}/checkpoints/{step}")
    assert max_abs_diff(load_weights(run_dir), load_weights(changed)) < 1e-6
