"""One world of ranks on this machine, through torchrun's engine (the elastic launcher).

Imported once the config asks for such a world (`dpt.launch.launchers.LocalLauncher`), after
the fork server that the ranks start from (dpt/launch/fork_server.py) is on its way: torch is
imported here.
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

from dpt.errors import DptError
from dpt.launch import fork_server
from dpt.launch.environ import restored_environ
from dpt.launch.worker import run_worker
from dpt.observe.dashboard import TbPlace
from dpt.observe.rollcall import SILENT_RANK
from dpt.rendezvous import register_loopback_rendezvous
from dpt.state.checkpoint import checkpoint_dir, committed


def launch_local_world(
    cfg_dict: dict[str, Any],
    run_dir: Path,
    nproc: int,
    max_restarts: int,
    timeout_s: float,
    tb: TbPlace | None = None,
    own_metrics: bool = False,
) -> dict[str, Any]:
    """One single-node world through torchrun's engine; returns rank 0's summary. `tb`: where
    the ranks' TensorBoard folders go (dpt.launch.job_place, made where Hydra runs the job);
    `own_metrics`: the task's metrics are dpt's own (the fork server imports torchmetrics)."""
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
        start_method=fork_server.START_METHOD,
    )
    with restored_environ(), stdlib_start_method(), quiet_elastic_logs():
        # Started by LocalLauncher already, unless called directly or the environment changed
        fork_server.start(own_metrics)
        # Each round's rank 0 hosts a fresh store. Sharing the rendezvous store, a restarted
        # round (launcher.max_restarts) could read the previous round's Gloo addresses and fail
        # with "Connection refused" (torch assumes a new store per retry; this one outlives it).
        # For the agent only: set after the server started, the ranks never see it.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        try:
            results = elastic_launch(config, run_worker)(cfg_dict, str(run_dir), tb)
        except ChildFailedError as failed:
            raise DptError(describe_failure(failed, run_dir)) from failed
        except SignalException as stopped:  # SIGTERM/SIGINT to this process: ranks checkpointed
            raise DptError(describe_stop(stopped, run_dir)) from stopped
    return results[0]


def describe_stop(stopped: Any, run_dir: Path | None) -> str:
    """The launcher was told to stop; the elastic agent passed the signal on to the ranks, which
    finished their step and wrote a checkpoint."""
    name = signal.Signals(stopped.sigval).name
    if run_dir is None:  # stopped before any rank knew its run folder
        return f"stopped by {name} before the run started"
    saved = committed(checkpoint_dir(run_dir))
    where = f"newest checkpoint {saved[-1].path}" if saved else "no checkpoint was written"
    return (
        f"stopped by {name}; {where}. Resume: the same command with hydra.run.dir={run_dir} "
        "(checkpoint.resume=auto picks the newest checkpoint)"
    )


def describe_failure(failed: Any, run_dir: Path | None) -> str:
    """One line naming the rank that caused the failure and why (from torchelastic's error
    files): a rank that stopped answering, as another rank's roll call found; else the first
    rank that failed. `run_dir` None: no rank got as far as its run folder."""

    def log_file(rank: int | str) -> str:
        return "no log yet" if run_dir is None else f"log: {run_dir / 'logs' / f'rank{rank}.log'}"

    for noticed_by, failure in sorted(failed.failures.items()):
        silent = SILENT_RANK.match(_message(failure))
        if silent:
            return f"{silent.group(0)} (noticed by rank {noticed_by}; {log_file(silent.group(1))})"
    rank, failure = failed.get_first_failure()
    raw = _message(failure)
    if failure.exitcode < 0:
        why = f"killed by {failure.signal_name()}"
    elif not raw or raw.startswith("To enable traceback"):  # no error file was written
        why = f"exit code {failure.exitcode}"
    else:
        why = raw
    return f"rank {rank} failed: {why} ({log_file(rank)})"


def _message(failure: Any) -> str:
    raw = failure.message
    if isinstance(raw, dict):  # the error file's {"message": ..., "extraInfo": ...}
        raw = raw.get("message")
    return str(raw or "").strip().removeprefix("DptError: ")


@contextlib.contextmanager
def stdlib_start_method() -> Iterator[None]:
    """A standard default start method while ranks start, also inside a joblib (loky) worker.

    There the default start method is `loky`; a rank takes the default over from its parent, and
    importing only the standard `multiprocessing`, dies with "cannot find context for 'loky'"
    (hydra/launcher=joblib).
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
