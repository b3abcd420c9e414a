"""How the workers start: in this process, through PyTorch's elastic launcher, or under torchrun.

The config is composed once, by Hydra, in the process the user started; workers receive the
resolved config and the run folder as arguments. No rank re-runs `sys.argv` through Hydra, so
there is one run folder per job and a multirun never restarts itself inside a worker.

Importing this module imports no torch: a local world starts its ranks' fork server
(dpt/launch/fork_server.py) before this process imports torch (dpt/launch/local_world.py), so
that the two imports overlap.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from dpt.config.store import cpu_cores
from dpt.config.strategies import is_distributed
from dpt.config.tasks import CUSTOM, task_kind
from dpt.errors import DptError
from dpt.launch import job_place
from dpt.launch.environ import restored_environ
from dpt.launch.validate import parse_nproc

log = logging.getLogger("dpt")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def resolved(cfg: DictConfig) -> dict[str, Any]:
    container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)
    return container


class LocalLauncher:
    """Workers on this machine: ddp and fsdp through `elastic_launch`, the others in this
    process."""

    def __init__(self, nproc_per_node: str, max_restarts: int) -> None:
        self.nproc_per_node = nproc_per_node
        self.max_restarts = max_restarts

    def run(self, cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
        if "TORCHELASTIC_RUN_ID" in os.environ:
            raise DptError("this process was started by torchrun: add launcher=torchrun")
        if not is_distributed(cfg.strategy):
            return run_worker(resolved(cfg), run_dir)
        from dpt.launch import fork_server  # here: a single process needs none of it

        own_metrics = task_kind(cfg.task) != CUSTOM  # a task of yours may name any metric
        fork_server.start(own_metrics)  # the ranks' imports, beside this process's (torch, below)
        nproc = self.processes(cfg.trainer.device)
        name = get_class(cfg.strategy._target_).name
        log.info(f"starting {nproc} {name} workers through torch.distributed's elastic launcher")
        from dpt.launch.local_world import launch_local_world

        return launch_local_world(
            resolved(cfg),
            run_dir,
            nproc,
            self.max_restarts,
            cfg.trainer.timeout_s,
            job_place.place(run_dir),
            own_metrics,
        )

    def processes(self, device: str) -> int:
        """`auto`: one per visible GPU, or 2 on a machine without one."""
        import torch

        requested = parse_nproc(self.nproc_per_node)
        gpus = torch.cuda.device_count() if device in ("auto", "cuda") else 0
        if device == "cuda" and not gpus:
            raise DptError("trainer.device=cuda: no CUDA device is visible")
        if requested is None:
            return gpus or 2
        if gpus and requested > gpus:
            raise DptError(
                f"launcher.nproc_per_node={requested}: only {gpus} GPU(s) visible; use at most "
                f"{gpus}, or trainer.device=cpu"
            )
        if not gpus:
            check_cpu_processes(requested, cpu_cores())
        return requested


# CPU ranks beyond the cores only take turns; far beyond, each rank's memory (a full copy of
# torch, model, data and loader workers) fills the machine long before the first step.
MAX_PROCESSES_PER_CORE = 4


def check_cpu_processes(nproc: int, cores: int) -> None:
    """Warn when CPU ranks outnumber the cores; refuse far past that."""
    if nproc > MAX_PROCESSES_PER_CORE * cores:
        raise DptError(
            f"launcher.nproc_per_node={nproc}: more than {MAX_PROCESSES_PER_CORE} CPU processes "
            f"per core ({cores} cores here); use at most {MAX_PROCESSES_PER_CORE * cores}"
        )
    if nproc > cores:
        log.warning(
            f"launcher.nproc_per_node={nproc}: more processes than the {cores} CPU cores here; "
            "they share the cores, each step is slower than with fewer processes"
        )


class TorchrunLauncher:
    """torchrun started this process; only its rank 0 runs Hydra (see
    `dpt.launch.cli.follow_torchrun`)."""

    def run(self, cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
        require_torchrun_env()
        return run_worker(resolved(cfg), run_dir)


class SlurmLauncher:
    """SLURM started this process, one task per rank, through Hydra's submitit launcher (`-m`).

    The resource keys of `launcher=slurm` are read by that launcher (dpt/conf/launcher/slurm.yaml);
    here only the world size they ask for matters, to check it against SLURM's.
    """

    def __init__(self, nodes: int, tasks_per_node: int, **resources: Any) -> None:
        self.world_size = nodes * tasks_per_node

    def run(self, cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
        from dpt.launch.slurm import torch_env_from_slurm

        check_world(cfg, self.world_size, "launcher.nodes=1 launcher.tasks_per_node=1")
        with restored_environ():
            os.environ.update(torch_env_from_slurm(self.world_size))
            return run_worker(resolved(cfg), run_dir)


def check_world(cfg: DictConfig, world_size: int, one: str) -> None:
    """One line where a launcher starts `world_size` ranks for a strategy of one process (`one`:
    the launcher's keys for a world of one)."""
    if world_size > 1 and not is_distributed(cfg.strategy):
        raise DptError(
            f"strategy={get_class(cfg.strategy._target_).name} runs one process: "
            f"use strategy=ddp, or {one}"
        )


def require_torchrun_env() -> None:
    missing = [name for name in TORCHRUN_VARS if name not in os.environ]
    if missing:
        raise DptError(
            f"launcher=torchrun: {', '.join(missing)} not set; start with "
            "`torchrun --nproc_per_node=N train.py launcher=torchrun ...`, or use launcher=local"
        )


def follow_torchrun_world(cfg: DictConfig) -> None:
    """A torchrun rank >= 1 (composed by `dpt.launch.cli.follow_torchrun`): join rank 0's world."""
    if get_class(cfg.launcher._target_) is not TorchrunLauncher:
        raise DptError("this process was started by torchrun: add launcher=torchrun")
    run_worker(resolved(cfg), run_dir=None)  # rank 0 broadcasts its config, folder and place


def run_worker(cfg_dict: dict[str, Any], run_dir: str | Path | None) -> dict[str, Any]:
    """This process's rank of the Hydra job in `run_dir`, its TensorBoard place made here, where
    Hydra runs the job (None: a torchrun rank >= 1, which takes rank 0's folder and place):
    `dpt.launch.worker.run_worker`, imported (with torch) only when this process runs a rank."""
    from dpt.loop import collector

    tb = None if run_dir is None else job_place.place(Path(run_dir))
    with collector.off_during_startup():
        from dpt.launch.worker import run_worker as run

        return run(cfg_dict, "" if run_dir is None else str(run_dir), tb)
