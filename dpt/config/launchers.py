"""`launcher`: how the workers start (dpt/launch/launchers.py): here, under torchrun, on SLURM,
on a Ray cluster."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from dpt.config.checks import at_least


@dataclass
class LocalLauncherConfig:
    _target_: str = "dpt.launch.launchers.LocalLauncher"
    # A string so that both `auto` and a number fit; `validate` checks it.
    nproc_per_node: str = MISSING
    max_restarts: int = at_least(0)


@dataclass
class TorchrunLauncherConfig:
    _target_: str = "dpt.launch.launchers.TorchrunLauncher"


@dataclass
class SlurmLauncherConfig:
    """One SLURM job per multirun job, one task per rank (conf/launcher/slurm.yaml passes these
    to Hydra's submitit launcher). They size the allocation of the whole sweep: not sweepable."""

    _target_: str = "dpt.launch.launchers.SlurmLauncher"
    nodes: int = at_least(1)
    tasks_per_node: int = at_least(1)  # = ranks per node
    gpus_per_node: int | None = at_least(0)
    cpus_per_task: int | None = at_least(1)
    mem_gb: int | None = at_least(1)  # per node
    time: int = at_least(1)  # minutes
    partition: str | None = MISSING
    sbatch: dict[str, Any] = MISSING  # extra `#SBATCH --key=value` lines
    setup: list[str] = MISSING  # shell lines run before the tasks start
    max_num_timeout: int = at_least(0)  # times a job that reaches its time limit is requeued


# launcher.address: a running cluster found as Ray finds it (RAY_ADDRESS, or the one started on
# this machine), or a cluster of this process's own.
RAY_AUTO, RAY_LOCAL = "auto", "local"


@dataclass
class RayLauncherConfig:
    """Each job's ranks as Ray Train's workers (dpt/launch/ray_job.py), on a Ray cluster."""

    _target_: str = "dpt.launch.ray_job.RayLauncher"
    address: str = MISSING  # auto | local | host:port (the head's GCS address)
    num_workers: int = at_least(1)  # = ranks
    use_gpu: bool = MISSING  # one GPU per worker
    cpus_per_worker: float = at_least(0)
    max_failures: int = at_least(0)  # times Ray restarts the group after a worker died


LAUNCHERS: dict[str, type] = {
    "local": LocalLauncherConfig,
    "torchrun": TorchrunLauncherConfig,
    "slurm": SlurmLauncherConfig,
    "ray": RayLauncherConfig,
}
