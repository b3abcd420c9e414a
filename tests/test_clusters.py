"""The engines clusters run on, as docs/guides/clusters.md shows them: Kubeflow's manifests
(their kinds, the pod's command, the run folder on the shared volume), the pod's command run
in two network namespaces with exactly the variables the operator injects (2 pods x 1 rank
train as one process; a SIGTERM to the pods ends in a committed checkpoint well
within their 30 s of grace, and the same command again resumes to the uninterrupted weights),
and SkyPilot's and dstack's task lines: one command, whose world their variables give (dstack's
started here)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from dpt.launch.cluster_env import torchrun_variables
from tests.helpers import (
    BIN,
    REPO,
    TRAIN,
    Result,
    committed_checkpoints,
    compose,
    free_port,
    load_weights,
    max_abs_diff,
    run_cmd,
    run_here,
    start,
)
from tests.netns import TwoHosts

GUIDE = REPO / "docs" / "guides" / "clusters.md"
GRACE_S = 30  # Kubernetes' default terminationGracePeriodSeconds, as the manifests set it
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # two ranks share the two cores


def _yaml_blocks() -> list[dict[str, Any]]:
    text = GUIDE.read_text()
    return [yaml.safe_load(block.split("```", 1)[0]) for block in text.split("```yaml\n")[1:]]


def _manifest(kind: str) -> dict[str, Any]:
    (found,) = [b for b in _yaml_blocks() if b.get("kind") == kind]
    return found


def _pod_command(job: dict[str, Any], replica: str = "Master") -> list[str]:
    (container,) = job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"]
    return [*container["command"], *container["args"]]


def test_the_manifests_run_dpt_torchrun_with_the_run_folder_on_the_shared_volume() -> None:
    job = _manifest("PyTorchJob")
    assert job["apiVersion"] == "kubeflow.org/v1"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {name: spec["replicas"] for name, spec in replicas.items()} == {"Master": 1, "Worker": 1}
    command = _pod_command(job)
    assert command[:3] == ["dpt-torchrun", "train.py", "launcher=torchrun"]
    run_dir = next(a.split("=", 1)[1] for a in command if a.startswith("hydra.run.dir="))
    for spec in replicas.values():
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert [*container["command"], *container["args"]] == command  # every pod the same
        assert spec["restartPolicy"] == "OnFailure" and pod["terminationGracePeriodSeconds"] == 30
        (mount,) = container["volumeMounts"]
        assert mount["mountPath"] == f"{container['workingDir']}/{Path(run_dir).parts[0]}"
        assert [v["name"] for v in pod["volumes"]] == [mount["name"]]  # a shared claim
    train_job = _manifest("TrainJob")
    assert train_job["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    trainer = train_job["spec"]["trainer"]
    assert train_job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    assert trainer["numNodes"] == 2 and [*trainer["command"], *trainer["args"]] == command
    (override,) = train_job["spec"]["podSpecOverrides"]
    (container,) = override["containers"]
    assert container["volumeMounts"][0]["mountPath"].endswith(f"/{Path(run_dir).parts[0]}")


SKYPILOT = {"SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2\n", "SKYPILOT_NODE_RANK": "1",
            "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NUM_GPUS_PER_NODE": "8"}  # fmt: skip
DSTACK = {"DSTACK_MASTER_NODE_IP": "10.0.0.1", "DSTACK_NODE_RANK": "1", "DSTACK_NODES_NUM": "2",
          "DSTACK_GPUS_PER_NODE": "8", "DSTACK_NODES_IPS": "10.0.0.1\n10.0.0.2"}  # fmt: skip


@pytest.mark.parametrize("engine", [SKYPILOT, DSTACK])
def test_skypilot_and_dstack_variables_are_torchruns_world(
    engine: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.run import parse_args

    world = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "10.0.0.1",
             "PET_NPROC_PER_NODE": "8"}  # fmt: skip
    assert torchrun_variables(engine) == world
    for key, value in world.items():  # torchrun takes what it is not given from them
        monkeypatch.setenv(key, value)
    args = parse_args(["train.py"])
    assert (args.nnodes, args.node_rank, args.master_addr, args.nproc_per_node) == (
        "2", 1, "10.0.0.1", "8")  # fmt: skip
    # A node without GPUs: torchrun's own count; what the command's variables say wins.
    cpu = {key: "0" if "GPUS" in key else value for key, value in engine.items()}
    assert "PET_NPROC_PER_NODE" not in torchrun_variables(cpu)
    assert "PET_NODE_RANK" not in torchrun_variables({**engine, "PET_NODE_RANK": "0"})
    assert torchrun_variables({}) == {}


def _task_line(engine: str) -> list[str]:
    """The dpt-torchrun line of the guide's SkyPilot (`run:`) or dstack (`commands:`) task."""
    (task,) = [b for b in _yaml_blocks() if b.get("name") == "dpt" and
               ("run" in b) == (engine == "skypilot")]  # fmt: skip
    lines = task["run"].splitlines() if engine == "skypilot" else task["commands"]
    (line,) = [line for line in lines if "dpt-torchrun" in line]
    return shlex.split(line)


def _in_a_clone(folder: Path) -> Path:
    """`folder` laid out as the job's working folder (a clone of dpt): train.py in it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.py").symlink_to(TRAIN)
    return folder


def test_the_task_lines_are_one_command_in_two_run_folders() -> None:
    """SkyPilot's and dstack's tasks run the same dpt-torchrun line (each in a run folder of its
    own): what differs is only the variables, mapped above, so one engine's line is started
    below (another 2-rank world added nothing but seconds)."""
    sky, dstack = _task_line("skypilot"), _task_line("dstack")
    assert sky[0] == dstack[0] == ".venv/bin/dpt-torchrun"  # the task's setup made it
    assert [a for a in sky if not a.startswith("hydra.run.dir=")] == [
        a for a in dstack if not a.startswith("hydra.run.dir=")]  # fmt: skip
    assert "hydra.run.dir=runs/dpt-sky" in sky and "hydra.run.dir=runs/dpt-dstack" in dstack


@pytest.mark.slow  # a world of 2 ranks
@pytest.mark.timeout(180)
def test_dstacks_task_line_starts_its_world(tmp_path: Path) -> None:
    """One node of 2 GPUs, as dstack describes it (the port is the job's own: the engines leave
    torchrun's default, which another test's world may hold here)."""
    variables = {"DSTACK_MASTER_NODE_IP": "127.0.0.1", "DSTACK_NODE_RANK": "0",
                 "DSTACK_NODES_NUM": "1", "DSTACK_GPUS_PER_NODE": "2"}  # fmt: skip
    args = _task_line("dstack")[1:]
    folder = _in_a_clone(tmp_path / "job")
    env = {**variables, **ONE_THREAD, "PET_MASTER_PORT": str(free_port())}
    run_cmd([str(BIN / "dpt-torchrun"), *args], timeout=150, env=env, cwd=folder)
    run_dir = folder / next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir="))
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    assert "world size 2" in (run_dir / "logs" / "rank1.log").read_text()


# --- Kubernetes: the pod's command on two hosts ---------------------------------------------


def _pods(two_hosts: TwoHosts) -> list[list[str]]:
    """Each pod's command on its host, with what the operator injects into it."""
    command = _pod_command(_manifest("PyTorchJob"))
    master = two_hosts.hosts[0].address
    return [
        [*host.prefix("PET_NNODES=2", "PET_NPROC_PER_NODE=1", f"PET_NODE_RANK={rank}",
                      f"PET_MASTER_ADDR={master}", "PET_MASTER_PORT=29500",
                      "GLOO_SOCKET_IFNAME=eth0"),  # Gloo's interface: one hostname for both
         str(BIN / command[0]), *command[1:]]
        for rank, host in enumerate(two_hosts.hosts)
    ]  # fmt: skip


def _run_pods(pods: list[list[str]], folder: Path) -> list[Result]:
    with ThreadPoolExecutor(len(pods)) as pool:
        futures = [pool.submit(run_cmd, pod, timeout=150, env=ONE_THREAD, cwd=folder)
                   for pod in pods]  # fmt: skip
        return [f.result() for f in futures]


def _preempt(pods: list[list[str]], folder: Path, at: str) -> list[float]:
    """Start the pods; once the first says `at`, SIGTERM each pod's first process (what the
    kubelet signals); the seconds each took to end after it."""
    procs = [start(pod, ONE_THREAD, folder) for pod in pods]
    ended: list[float] = []
    try:
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            if at in line:
                break
        else:
            raise AssertionError(f"the pod ended before {at!r}")
        signalled = time.monotonic()
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        threading.Thread(target=procs[0].communicate, daemon=True).start()  # keep it draining
        for proc in procs:
            proc.wait(timeout=GRACE_S + 30)
            ended.append(time.monotonic() - signalled)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return ended


@pytest.mark.slow  # worlds of ranks in network namespaces
@pytest.mark.timeout(300)
def test_the_pods_command_trains_as_one_process_and_a_sigterm_ends_in_a_resumable_checkpoint(
    two_hosts: TwoHosts, tmp_path: Path
) -> None:
    pods = _pods(two_hosts)
    run_dir_arg = next(a for a in pods[0] if a.startswith("hydra.run.dir="))
    overrides = [a for a in pods[0][pods[0].index("launcher=torchrun") + 1 :] if a != run_dir_arg]
    # One process on the same global batch: the 2 pods' ranks of the default batch each
    one = tmp_path / "one-process"
    batch = compose(*overrides).trainer.batch_size
    run_here(one, *overrides, "strategy=single", f"trainer.batch_size={2 * batch}")

    run_dir = run_dir_arg.split("=", 1)[1]
    stopped = _in_a_clone(tmp_path / "stopped")
    took = _preempt(pods, stopped, "step 50/")
    assert max(took) < GRACE_S, took  # the checkpoint, then the end, within the grace
    (newest,) = committed_checkpoints(stopped / run_dir)[-1:]
    step = int(re.sub(r"\D", "", newest.name))
    assert 50 <= step < 300, newest  # the preemption's own checkpoint, mid-run
    resumed = _run_pods(pods, stopped)  # the resubmitted pods: the same command
    assert "resumed from" in resumed[0].stdout, resumed[0].stdout
    # Preempted, resumed, and still what one process trains, uninterrupted
    assert max_abs_diff(load_weights(stopped / run_dir), load_weights(one)) < 1e-6
