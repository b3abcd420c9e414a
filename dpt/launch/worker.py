"""What every rank runs: join the world, build data, model and strategy, train, write results."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, NoReturn

import torch
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from dpt import config, user_code
from dpt.distributed import (
    DistEnv,
    broadcast_object,
    destroy_process_group,
    env_from_environment,
    init_process_group,
)
from dpt.errors import DptError, could_not_write, is_disk_full, one_line
from dpt.launch import allocator, collector, objective, run_lock, torchrun_job
from dpt.launch.parent_death import LAUNCHER_PID
from dpt.launch.rank_failure import describe
from dpt.loop import resume_apply
from dpt.loop.interrupt import Interrupted
from dpt.loop.parts import Parts, RunConfig, build_parts, length_key, run_length
from dpt.loop.trainer import Trainer, TrainResult
from dpt.observe import dashboard
from dpt.observe.logs import TRACE_LOGGER_NAME, setup_logging, traceback_file
from dpt.observe.metrics import Speed, done_speeds
from dpt.observe.rollcall import RollCall
from dpt.state import checkpoint
from dpt.state.results import LAST_MODEL, METRICS_FILE, write_run_data
from dpt.state.stateful import full_state_dict

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
    try:
        # Rank 0's config and folder win: ranks that composed their own config under torchrun
        # may differ in `${now:...}` and must all write into one run folder.
        cfg_dict, run_dir, tb = broadcast_object((cfg_dict, run_dir, tb), env)
        folder = Path(run_dir)
        torchrun_job.note_run_dir(folder)
        roll_call.start_answering()
        with run_lock.holding(folder, rank=env.rank):  # beside the run's starter
            return _run(OmegaConf.create(cfg_dict), folder, env, tb or dashboard.one_run(folder))
    except Exception as error:
        reported = _disk_full(error, run_dir)
        if "TORCHELASTIC_ERROR_FILE" not in os.environ:
            failure = _in_one_line(reported, env.rank)
            if failure is error:
                raise  # in-process: the caller reports it
            raise failure from error
        _exit_reporting(reported, cfg_dict["trainer"]["timeout_s"], roll_call)
    finally:
        roll_call.stop_answering()
        destroy_process_group()


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


def _run(
    cfg: DictConfig, run_dir: Path, env: DistEnv, tb: dashboard.TbPlace | None = None
) -> dict[str, Any]:
    """The run of one rank; `tb`: where its TensorBoard folders go (None: a run of its own)."""
    tb = tb or dashboard.one_run(run_dir)
    log_file = run_dir / "logs" / f"rank{env.rank}.log"
    setup_logging(f"rank {env.rank}", log_file, speaks_once=env.is_main)
    limit_cpu_threads(env)
    run_cfg = RunConfig.of(cfg)
    parts = build_parts(run_cfg, env, run_dir, log_file, tb)
    trainer = Trainer(parts)
    if env.is_main:  # where to look, and what `hydra.run.dir=` resumes
        log.info(f"run folder {run_dir}")
    parts.checkpoints.restarted = torchrun_job.is_restart()
    finished = _resume(trainer, parts)
    if finished is not None:
        parts.metrics.close()
        return finished
    _log_start(parts)
    if env.is_main:  # before the first step: a run cut short still leaves what predict needs
        write_run_data(run_dir, parts.run_data, parts.run_files)
    hparams = _hparams(cfg, env, parts.global_batch, tb.groups)
    val_metrics = list(config.val_metrics(cfg.task))
    parts.metrics.start_session(hparams, dashboard.session_metrics(val_metrics))
    ended: bool | None = False  # the session's end as HPARAMS shows it; None: not over yet
    try:
        collector.freeze_for_training()  # start-up's objects left out of collections
        result = trainer.fit()
        whole_rate = result.samples / result.wall_time_s if result.wall_time_s else 0.0
        steady, whole = parts.metrics.speeds(whole_rate)
        summary = _summary(result, env, parts.global_batch, hparams, steady, whole)
        summary["task"] = parts.task.kind
        summary["val_metrics"] = val_metrics  # the sweep's columns
        summary["best"] = parts.best_model.summary()
        summary["objective"] = _objective(cfg, parts).record(summary)
        if summary["objective"]["value"] is not None:  # HPARAMS lists it for every run
            parts.metrics.scalars({"objective": summary["objective"]["value"]}, result.steps)
        # All ranks: fsdp gathers the shards to rank 0, a pipeline its stages.
        weights = full_state_dict(parts.strategy.whole_model(parts.model))
        if env.is_main:
            log.info(
                f"done: {result.steps} steps in {result.wall_time_s:.1f} s | "
                f"{done_speeds(steady, whole)} | final loss {_fmt(result.final_loss)} | "
                f"run folder {run_dir}"
            )
            _write_outputs(run_dir, weights, summary)
        ended = True
    except Interrupted:
        ended = None  # stopped to be resumed: the session goes on in the resumed run
        raise
    finally:
        if ended is not None:
            parts.metrics.end_session(ok=ended)
        parts.metrics.close()
        parts.loaders.close()  # its loader workers end with the run, not at a later collection
    return summary


def _resume(trainer: Trainer, parts: Parts) -> dict[str, Any] | None:
    """Load the checkpoint `checkpoint.resume` picks, with the config's changed settings in
    effect; a finished run's summary when there is nothing left to train."""
    resumed = trainer.resume()
    if resumed is None:
        return None
    log.info(f"{torchrun_job.attempt()}resumed from {resumed.path} at step {resumed.step}")
    resume_apply.after_load(trainer, resumed.changes)
    resume_apply.replan(trainer)  # batches a rollback skipped before the checkpoint: fewer steps
    return _finished(
        parts.run_dir, resumed, parts.total_steps, parts.env, length_key(parts.settings)
    )


def _finished(
    run_dir: Path,
    resumed: checkpoint.Committed,
    total_steps: int,
    env: DistEnv,
    length: str = "trainer.epochs",
) -> dict[str, Any] | None:
    """A run folder whose run is over (its results written, its newest checkpoint at the end or
    where early stopping ended it): nothing to train, nothing to overwrite. Its summary, as the
    run returned it; None when there is training left. `length`: the key that sets the run's
    length (trainer.max_steps where set)."""
    try:
        summary = json.loads((run_dir / METRICS_FILE).read_text())
    except (OSError, ValueError):
        return None  # no results yet: the run is not over (or was cut off before writing them)
    stopped_early = bool(summary.get("stopped_early")) and summary.get("steps") == resumed.step
    if resumed.step < total_steps and not stopped_early:
        return None
    if env.is_main:
        how, knob = (
            ("stopped early at", "trainer.early_stopping.patience")
            if resumed.step < total_steps
            else ("trained to", length)
        )
        log.info(
            f"run folder {run_dir} is complete ({how} step {resumed.step} of {total_steps}); "
            f"nothing overwritten. To train further, raise {knob} (checkpoint.resume=auto "
            f"continues from step {resumed.step}), or start a new run folder (hydra.run.dir=...)"
        )
    return summary


def _objective(cfg: DictConfig, parts: Parts) -> objective.Objective:
    """What this run reports to a search (sweep.objective; `auto`: the watched metric)."""
    es = cfg.trainer.early_stopping
    has_validation = parts.validation.loader is not None
    return objective.resolve(cfg.sweep.objective, es.metric, es.mode, has_validation,
                             parts.task.higher_is_better)  # fmt: skip


def _log_start(parts: Parts) -> None:
    env, settings = parts.env, parts.settings
    backend = env.backend if env.world_size > 1 else "none"
    if env.world_size > 1:  # where this world met: tells jobs of a sweep apart, helps debugging
        backend += f" at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    accum = settings.grad_accum_steps
    accum_text = f" x {accum} accumulation steps" if accum > 1 else ""
    # A pipeline's stages share their replica's batch.
    holder = "replica" if parts.strategy.copies > 1 else "process"
    log.info(
        f"pid {os.getpid()} | strategy={parts.strategy.name}{parts.strategy.layout()} | world "
        f"size {env.world_size} | device {env.device} | backend {backend} | precision "
        f"{settings.precision} | batch per {holder} {settings.batch_size}{accum_text} | global "
        f"batch {parts.global_batch} | "
        f"{run_length(settings, parts.total_steps, parts.loaders.steps_per_epoch(accum))}"
    )


def limit_cpu_threads(env: DistEnv) -> None:
    """Several ranks on one CPU must share its cores, as torchrun does with OMP_NUM_THREADS."""
    if (
        env.device.type == "cpu"
        and env.local_world_size > 1
        and "OMP_NUM_THREADS" not in os.environ
    ):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))


def _summary(
    result: TrainResult,
    env: DistEnv,
    global_batch: int,
    hparams: dict[str, Any],
    steady: Speed | None,
    whole: Speed,
) -> dict[str, Any]:
    """metrics.json. The run's pace twice: over the whole run (`samples_per_s`, with tokens/s
    and MFU for a task of tokens), and the loop's after its first logging window (`steady_*`)."""
    return {
        "final_loss": result.final_loss,
        **whole.record(),
        **(steady.record("steady_") if steady else {}),
        "wall_time_s": result.wall_time_s,
        "world_size": env.world_size,
        "global_batch_size": global_batch,
        "steps": result.steps,
        "samples": result.samples,
        "bad_samples": result.bad_samples,
        "stopped_early": result.stopped_early,
        "val": result.val,
        "best_per_metric": result.best_per_metric,  # each at its own best epoch
        # The settings, as in HPARAMS: with the result, the sweep writes its one experiment.
        "hparams": hparams,
    }


def _write_outputs(run_dir: Path, state: dict[str, Any], summary: dict[str, Any]) -> None:
    checkpoint.write_atomically(run_dir / LAST_MODEL, lambda f: torch.save(state, f), "model")
    text = (json.dumps(summary, indent=2) + "\n").encode()
    checkpoint.write_atomically(run_dir / METRICS_FILE, lambda f: f.write(text), "metrics")


def _hparams(
    cfg: DictConfig, env: DistEnv, global_batch: int, groups: dict[str, str]
) -> dict[str, Any]:
    """The run's settings as HPARAMS lists them: the config groups' options, the resolved config
    flat, and what they make (world size, global batch)."""
    flat: dict[str, Any] = {**groups, "world_size": env.world_size,
                            "global_batch_size": global_batch}  # fmt: skip
    container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)
    _flatten(container, "", flat)
    return flat


def _flatten(node: dict[str, Any], prefix: str, out: dict[str, Any]) -> None:
    for key, value in node.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            _flatten(value, f"{name}.", out)
        elif isinstance(value, bool | int | float | str):
            out[name] = value
        elif value is not None:
            out[name] = str(value)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
