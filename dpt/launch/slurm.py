"""Inside a SLURM job started by Hydra's submitit launcher: which rank this task is.

One task per rank. submitit's `TorchDistributedEnvironment` reads SLURM's variables
(SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST, ...) and names the first node of
the allocation as the rendezvous address; this module turns that into the torchrun variables
that `dpt.launch.worker.run_worker` reads, and checks that SLURM started the world the config
asks for.
"""

from __future__ import annotations

import os
import random

from dpt.errors import DptError
from dpt.rendezvous import STORE_PORTS


def in_slurm_job() -> bool:
    return os.environ.get("SUBMITIT_EXECUTOR") == "slurm" and "SLURM_JOB_ID" in os.environ


# A port derived from the job id is the same on every task of a job (no messages needed to
# agree on it) and differs between the jobs of a sweep; one of dpt.rendezvous.STORE_PORTS, below
# the ephemeral ports (submitit's 20000-60000 let a job's store find its port taken by one of
# the node's outgoing connections: EADDRINUSE, seen in a sweep of two jobs on one node).
def master_port(job_id: str) -> int:
    return random.Random(job_id).randint(*STORE_PORTS)


def torch_env_from_slurm(expected_world_size: int) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT for this task."""
    if not in_slurm_job():
        raise DptError(
            "launcher=slurm runs inside jobs that Hydra's submitit launcher submitted: "
            "python train.py -m launcher=slurm ..."
        )
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    job = JobEnvironment()
    if job.num_tasks != expected_world_size:
        raise DptError(
            f"this SLURM job has {job.num_tasks} task(s) but launcher.nodes x "
            f"launcher.tasks_per_node = {expected_world_size}: the launcher.* keys size every job "
            "of a sweep and cannot be swept"
        )
    dist = TorchDistributedEnvironment()
    return {
        "RANK": str(dist.rank),
        "WORLD_SIZE": str(dist.world_size),
        "LOCAL_RANK": str(dist.local_rank),
        "LOCAL_WORLD_SIZE": str(dist.local_world_size),
        "MASTER_ADDR": dist.master_addr,
        # Not submitit's port: it prefers an inherited MASTER_PORT, which sbatch copies from the
        # submitting shell into every job of the sweep.
        "MASTER_PORT": str(master_port(job.job_id)),
    }
