"""What every rank's process does around its run (dpt.loop.train): join the world, agree on the
run folder and hold it, and report a failure in one line (the traceback in the rank's log)."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any, NoReturn

import torch
from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from dpt import user_code
from dpt.distributed import (
    broadcast_object,
    destroy_process_group,
    env_from_environment,
    init_process_group,
)
from dpt.errors import DptError, could_not_write, is_disk_full, one_line
from dpt.launch import allocator, run_lock, torchrun_job
from dpt.launch.parent_death import LAUNCHER_PID
from dpt.launch.rank_failure import describe
from dpt.loop.interrupt import Interrupted
from dpt.loop.train import train
from dpt.observe import dashboard
from dpt.observe.logs import TRACE_LOGGER_NAME, traceback_file
from dpt.observe.rollcall import RollCall

log = logging.getLogger("dpt")


def run_worker(
    cfg_dict: dict[str, Any], run_dir: str, tb: dashboard.TbPlace | None = None
) -> dict[str, Any]:
    """Entry point of every rank: in-process, elastic launch, torchrun or SLURM started it.
    `tb`: where its TensorBoard folders go, as the process that runs Hydra's job placed them
    (`dpt.launch.job_place`; rank 0's is every rank's); None: a run of its own."""
    allocator.keep_freed_memory()  # before the parts: their blocks go to the heap from the start
    user_code.add_recorded_folders()  # a user's model or data set imports as in the launcher
    env = env_from_environment(cfg_dict["trainer"]["device"])
    init_process_group(env, cfg_dict["trainer"]["timeout_s"])
    roll_call = RollCall(env)
    together = True  # the run ends on every rank at once: done, or a stop they agreed on
    try:
        # Rank 0's config and folder win: ranks that composed their own config under torchrun
        # may differ in `${now:...}` and must all write into one run folder.
        cfg_dict, run_dir, tb = broadcast_object((cfg_dict, run_dir, tb), env)
        folder = Path(run_dir)
        torchrun_job.note_run_dir(folder)
        roll_call.start_answering()
        with run_lock.holding(folder, rank=env.rank):  # beside the run's starter
            return train(OmegaConf.create(cfg_dict), env, folder, tb, torchrun_job.attempt())
    except Exception as error:
        together = isinstance(error, Interrupted)
        reported = _disk_full(error, run_dir)
        if "TORCHELASTIC_ERROR_FILE" not in os.environ:
            failure = _in_one_line(reported, env.rank)
            if failure is error:
                raise  # in-process: the caller reports it
            raise failure from error
        _exit_reporting(reported, cfg_dict["trainer"]["timeout_s"], roll_call)
    finally:
        roll_call.stop_answering()
        destroy_process_group(together)


def _disk_full(error: Exception, run_dir: str) -> Exception:
    """A full disk under TensorBoard, the log or any other write: one line naming the file (or
    the run folder, when the failed write names none), not the writer's traceback."""
    if is_disk_full(error):
        assert isinstance(error, OSError)
        return DptError(could_not_write(run_dir, error))
    return error


PEER_FAILURE_GRACE_S = 2.0
_TIMED_OUT = re.compile(r"timed out|timeout", re.I)
_PEER_FAILURE = re.compile(
    r"Connection (closed|reset) by peer|remote worker crash|Broken pipe|NCCL communicator was "
    rf"aborted|{_TIMED_OUT.pattern}",
    re.I,
)


def is_peer_failure(error: BaseException) -> bool:
    """Did this rank fail because another rank went away (a collective broke or timed out)?"""
    return isinstance(error, torch.distributed.DistError) or bool(_PEER_FAILURE.search(str(error)))


def _in_one_line(error: Exception, rank: int) -> Exception:
    """In this process (single, dp, SLURM's tasks): a failure that is not already a sentence (a
    DptError) is said as under an elastic agent, `rank 0 failed: <what failed> (log: ...)`, its
    traceback in the rank's log file; before the rank has a log file, it stays as it is."""
    log_file = traceback_file()
    if isinstance(error, DptError) or log_file is None:
        return error
    what = describe(error)
    log.error(f"failed: {what}")
    logging.getLogger(TRACE_LOGGER_NAME).error("traceback", exc_info=error)
    return DptError(f"rank {rank} failed: {what} (log: {log_file})")


def _exit_reporting(error: Exception, timeout_s: float, roll_call: RollCall) -> NoReturn:
    """Under an elastic agent (local launcher, torchrun): one console line, the traceback in this
    rank's log file, the error in torchelastic's error file for the launcher's one-line report;
    then exit 1 without a traceback, so a failure is not a wall of tracebacks from every rank."""
    reported: Exception = error
    silent = None
    peer = is_peer_failure(error)
    if peer:
        why = "another rank failed or stopped answering"
        if _TIMED_OUT.search(str(error)):  # a silent peer: a hung rank, a lost node or link
            why += f" (no reply within trainer.timeout_s={timeout_s:g})"
            silent = roll_call.absent(timeout_s)
            if silent is not None:  # the cause is known: report it, no need to wait for it
                reported, peer = silent, False
        log.error(f"stopped: {why}")
        if silent is not None:
            log.error(one_line(silent))
    elif isinstance(error, Interrupted):
        log.info(one_line(error))  # a requested stop, not a failure
    else:
        reported = error if isinstance(error, DptError) else DptError(describe(error))
        # Under dpt's own launcher its `Error:` line names the rank, the cause and this log: the
        # rank's own line goes to its log only (else every failing rank echoes it).
        says = logging.getLogger(TRACE_LOGGER_NAME) if os.environ.get(LAUNCHER_PID) else log
        says.error(f"failed: {one_line(reported)}")
    logging.getLogger(TRACE_LOGGER_NAME).error("traceback", exc_info=error)
    if peer:
        # Only a consequence of another rank's failure: let that rank's exit be seen first, so
        # the launcher names the cause, not this echo of it.
        time.sleep(PEER_FAILURE_GRACE_S)
    # A DptError is already a sentence; other errors keep their type name ("ValueError: ...").
    ErrorHandler().record_exception(
        DptError(one_line(reported)) if isinstance(reported, DptError) else reported
    )
    if silent is not None:
        silent.wake_it()
    raise SystemExit(1)
