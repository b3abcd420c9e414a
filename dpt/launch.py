"""How the workers start: in this process, through PyTorch's elastic launcher, or under torchrun.

The config is composed once, by Hydra, in the process the user started; workers receive the
resolved config and the run folder as arguments. No rank re-runs `sys.argv` through Hydra, so
there is one run folder per job and a multirun never restarts itself inside a worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from dpt.checkpoint import checkpoint_dir, committed
from dpt.config import cpu_cores, is_distributed, parse_nproc
from dpt.errors import DptError
from dpt.rendezvous import keep_collectives_on_loopback, register_loopback_rendezvous
from dpt.rollcall import SILENT_RANK
from dpt.worker import run_worker

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
            return run_worker(resolved(cfg), str(run_dir))
        nproc = self.processes(cfg.trainer.device)
        name = get_class(cfg.strategy._target_).name
        log.info(f"starting {nproc} {name} workers through torch.distributed's elastic launcher")
        return launch_local_world(
            resolved(cfg), run_dir, nproc, self.max_restarts, cfg.trainer.timeout_s
        )

    def processes(self, device: str) -> int:
        """`auto`: one per visible GPU, or 2 on a machine without one."""
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


def launch_local_world(
    cfg_dict: dict[str, Any], run_dir: Path, nproc: int, max_restarts: int, timeout_s: float
) -> dict[str, Any]:
    """One single-node world through torchrun's engine; returns rank 0's summary."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"dpt-{uuid.uuid4().hex[:12]}",
        rdzv_backend=register_loopback_rendezvous(),
        rdzv_configs={"timeout": int(timeout_s)},
        local_addr="127.0.0.1",  # MASTER_ADDR: rank 0's store listens on loopback only
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )
    with restored_environ(), stdlib_start_method(), quiet_elastic_logs():
        # Each round's rank 0 hosts a fresh store. Sharing the rendezvous store, a restarted
        # round (launcher.max_restarts) could read the previous round's Gloo addresses and fail
        # with "Connection refused" (torch assumes a new store per retry; this one outlives it).
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        keep_collectives_on_loopback()
        try:
            results = elastic_launch(config, run_worker)(cfg_dict, str(run_dir))
        except ChildFailedError as failed:
            raise DptError(describe_failure(failed, run_dir)) from failed
        except SignalException as stopped:  # SIGTERM/SIGINT to this process: ranks checkpointed
            raise DptError(describe_stop(stopped, run_dir)) from stopped
    return results[0]


def describe_stop(stopped: Any, run_dir: Path) -> str:
    """The launcher was told to stop; the elastic agent passed the signal on to the ranks, which
    finished their step and wrote a checkpoint."""
    saved = committed(checkpoint_dir(run_dir))
    where = f"newest checkpoint {saved[-1].path}" if saved else "no checkpoint was written"
    return (
        f"stopped by {signal.Signals(stopped.sigval).name}; {where}. Resume: the same command "
        f"with hydra.run.dir={run_dir} (checkpoint.resume=auto picks the newest checkpoint)"
    )


def describe_failure(failed: Any, run_dir: Path) -> str:
    """One line naming the rank that caused the failure and why (from torchelastic's error
    files): a rank that stopped answering, as another rank's roll call found; else the first
    rank that failed."""
    for noticed_by, failure in sorted(failed.failures.items()):
        silent = SILENT_RANK.match(_message(failure))
        if silent:
            log_file = run_dir / "logs" / f"rank{silent.group(1)}.log"
            return f"{silent.group(0)} (noticed by rank {noticed_by}; log: {log_file})"
    rank, failure = failed.get_first_failure()
    log_file = run_dir / "logs" / f"rank{rank}.log"
    raw = _message(failure)
    if failure.exitcode < 0:
        why = f"killed by {failure.signal_name()}"
    elif not raw or raw.startswith("To enable traceback"):  # no error file was written
        why = f"exit code {failure.exitcode}"
    else:
        why = raw
    return f"rank {rank} failed: {why} (log: {log_file})"


def _message(failure: Any) -> str:
    raw = failure.message
    if isinstance(raw, dict):  # the error file's {"message": ..., "extraInfo": ...}
        raw = raw.get("message")
    return str(raw or "").strip().removeprefix("DptError: ")


class TorchrunLauncher:
    """torchrun started this process; only its rank 0 runs Hydra (see `dpt.cli.follow_torchrun`)."""

    def run(self, cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
        require_torchrun_env()
        return run_worker(resolved(cfg), str(run_dir))


class SlurmLauncher:
    """SLURM started this process, one task per rank, through Hydra's submitit launcher (`-m`).

    The resource keys of `launcher=slurm` are read by that launcher (dpt/conf/launcher/slurm.yaml);
    here only the world size they ask for matters, to check it against SLURM's.
    """

    def __init__(self, nodes: int, tasks_per_node: int, **resources: Any) -> None:
        self.world_size = nodes * tasks_per_node

    def run(self, cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
        from dpt.slurm import torch_env_from_slurm

        if self.world_size > 1 and not is_distributed(cfg.strategy):
            raise DptError(
                f"strategy={get_class(cfg.strategy._target_).name} runs one process: "
                "use strategy=ddp, or launcher.nodes=1 launcher.tasks_per_node=1"
            )
        with restored_environ():
            os.environ.update(torch_env_from_slurm(self.world_size))
            return run_worker(resolved(cfg), str(run_dir))


def require_torchrun_env() -> None:
    missing = [name for name in TORCHRUN_VARS if name not in os.environ]
    if missing:
        raise DptError(
            f"launcher=torchrun: {', '.join(missing)} not set; start with "
            "`torchrun --nproc_per_node=N train.py launcher=torchrun ...`, or use launcher=local"
        )


def follow_torchrun_world(cfg: DictConfig) -> None:
    """A torchrun rank >= 1 (composed by `dpt.cli.follow_torchrun`): join rank 0's world."""
    if get_class(cfg.launcher._target_) is not TorchrunLauncher:
        raise DptError("this process was started by torchrun: add launcher=torchrun")
    run_worker(resolved(cfg), run_dir="")  # rank 0 broadcasts its config and folder


@contextlib.contextmanager
def stdlib_start_method() -> Iterator[None]:
    """Spawn workers from a standard start method, also inside a joblib (loky) worker.

    There the default start method is `loky`, and a spawned child, which imports only the standard
    `multiprocessing`, dies with "cannot find context for 'loky'" (hydra/launcher=joblib).
    """
    import multiprocessing

    current = multiprocessing.get_start_method(allow_none=True)
    if current in (None, "spawn", "fork", "forkserver"):
        yield
        return
    multiprocessing.set_start_method("spawn", force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(current, force=True)


@contextlib.contextmanager
def quiet_elastic_logs() -> Iterator[None]:
    """The elastic agent logs each failure with tracebacks and each shutdown step; dpt reports
    the failing rank in one line instead (describe_failure)."""
    prefixes = ("torch.distributed", "torch.multiprocessing")
    names = [n for n in logging.root.manager.loggerDict if n.startswith(prefixes)]
    loggers = [logging.getLogger(n) for n in (*prefixes, *names)]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


@contextlib.contextmanager
def restored_environ() -> Iterator[None]:
    """Leave no MASTER_PORT, RANK, ... behind for the next job of a multirun."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
