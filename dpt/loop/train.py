"""One rank's run, from its config to its results: `train(cfg, env, run_dir) -> summary`.

The parts are built once from the typed config (dpt.loop.parts), the run resumes where its
folder says (or is found finished), `Trainer.fit` trains, and rank 0 writes what the run leaves:
`model.pt`, `metrics.json` (the summary returned), `data.json`. The process around it (the
world, the run folder's lock, how a failure is reported) is dpt.launch.worker's.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from dpt.config.tasks import val_metrics
from dpt.distributed import DistEnv
from dpt.loop import collector, resume_apply
from dpt.loop.interrupt import Interrupted
from dpt.loop.parts import Parts, RunConfig, build_parts, length_key, run_length
from dpt.loop.trainer import Trainer, TrainResult
from dpt.observe import dashboard
from dpt.observe.console import count
from dpt.observe.logs import setup_logging
from dpt.observe.metrics import Speed, done_speeds
from dpt.observe.trackers import Trackers
from dpt.observe.trackers.opening import open_trackers, run_tags, trackers_named
from dpt.observe.trackers.tracker import RunInfo
from dpt.state import checkpoint
from dpt.state.results import BEST_MODEL, DATA_FILE, LAST_MODEL, METRICS_FILE, write_run_data
from dpt.state.stateful import full_state_dict
from dpt.tasks import objective

log = logging.getLogger("dpt")

# How a run ended, as its trackers record it (`ended` in `_fit`; None: stopped to be resumed).
TRACKER_STATUS = {True: "FINISHED", False: "FAILED", None: "KILLED"}


def train(
    cfg: DictConfig,
    env: DistEnv,
    run_dir: Path,
    tb: dashboard.TbPlace | None = None,
    restart: str = "",
) -> dict[str, Any]:
    """This rank's run of `cfg` in `run_dir`; returns its summary (what metrics.json holds).
    `tb`: where its TensorBoard folders go (None: a run of its own); `restart`: `torchrun
    restart 1 of 2: ` on a torchrun attempt after the first (it resumes where the job was)."""
    tb = tb or dashboard.one_run(run_dir)
    log_file = run_dir / "logs" / f"rank{env.rank}.log"
    setup_logging(f"rank {env.rank}", log_file, speaks_once=env.is_main)
    limit_cpu_threads(env)
    parts = build_parts(RunConfig.of(cfg), env, run_dir, log_file, tb)
    trainer = Trainer(parts)
    if env.is_main:  # where to look, and what `hydra.run.dir=` resumes
        log.info(f"run folder {run_dir}")
    parts.checkpoints.restarted = bool(restart)
    resumed, done = _resume(trainer, parts, restart)
    if done is not None:
        parts.metrics.close()
        return done
    _log_start(parts)
    if env.is_main:  # before the first step: a run cut short still leaves what predict needs
        write_run_data(run_dir, parts.run_data, parts.run_files)
    hparams = _hparams(cfg, env, parts.global_batch, tb.groups)
    if env.is_main:  # MLflow, W&B, CSV: one line here, before training, where one cannot start
        parts.metrics.trackers = _trackers(cfg, parts, hparams, tb, resumed)
    metrics = list(val_metrics(cfg.task))
    parts.metrics.start_session(hparams, dashboard.session_metrics(metrics))
    return _fit(cfg, trainer, hparams, metrics)


def _fit(
    cfg: DictConfig, trainer: Trainer, hparams: dict[str, Any], metrics: list[str]
) -> dict[str, Any]:
    """Train; rank 0 says it is done and writes the results. The HPARAMS session ends with the
    run, unless it was stopped to be resumed."""
    parts, env = trainer.parts, trainer.parts.env
    ended: bool | None = False  # the session's end as HPARAMS shows it; None: not over yet
    try:
        collector.freeze_for_training()  # start-up's objects left out of collections
        result = trainer.fit()
        whole_rate = result.samples / result.wall_time_s if result.wall_time_s else 0.0
        steady, whole = parts.metrics.speeds(whole_rate)
        summary = _summary(result, parts, hparams, steady, whole) | {"val_metrics": metrics}
        summary["objective"] = _objective(cfg, parts).record(summary)
        if summary["objective"]["value"] is not None:  # HPARAMS lists it for every run
            parts.metrics.scalars({"objective": summary["objective"]["value"]}, result.steps)
        summary["history"] = parts.metrics.history.rows  # the world's metrics at their steps
        # All ranks: fsdp gathers the shards to rank 0, a pipeline its stages.
        weights = full_state_dict(parts.strategy.whole_model(parts.model))
        if env.is_main:
            resumed = result.steps - result.session_steps
            since = f" (resumed at step {resumed}, now at {result.steps})" if resumed else ""
            log.info(
                f"done: {count(result.session_steps, 'step')}{since} in "
                f"{result.wall_time_s:.1f} s | "
                f"{done_speeds(steady, whole)} | final loss {_fmt(result.final_loss)} | "
                f"run folder {parts.run_dir}"
            )
            write_outputs(parts.run_dir, weights, summary)
            parts.metrics.trackers.log_files(run_files(parts.run_dir))
        ended = True
    except Interrupted:
        ended = None  # stopped to be resumed: the session goes on in the resumed run
        raise
    finally:
        if ended is not None:
            parts.metrics.end_session(ok=ended)
        parts.metrics.close()
        parts.metrics.trackers.close(TRACKER_STATUS[ended])
        parts.loaders.close()  # its loader workers end with the run, not at a later collection
    return summary


def _resume(
    trainer: Trainer, parts: Parts, restart: str
) -> tuple[checkpoint.Committed | None, dict[str, Any] | None]:
    """Load the checkpoint `checkpoint.resume` picks, with the config's changed settings in
    effect; returns it, and a finished run's summary when there is nothing left to train."""
    resumed = trainer.resume()
    if resumed is None:
        return None, None
    log.info(f"{restart}resumed from {resumed.path} at step {resumed.step}")
    resume_apply.after_load(trainer, resumed.changes)
    resume_apply.replan(trainer)  # batches a rollback skipped before the checkpoint: fewer steps
    length = length_key(parts.settings)
    return resumed, finished(parts.run_dir, resumed, parts.total_steps, parts.env, length)


def _trackers(
    cfg: DictConfig,
    parts: Parts,
    hparams: dict[str, Any],
    tb: dashboard.TbPlace,
    resumed: checkpoint.Committed | None,
) -> Trackers:
    """Rank 0's trackers (logger=[...]), told the run's config and whether it continues."""
    if not trackers_named(cfg.logger):  # TensorBoard alone: nothing to start (nor git to ask)
        return Trackers()
    run_dir = parts.run_dir
    name = tb.folder.name if tb.sweep_dir else f"{run_dir.parent.name}/{run_dir.name}"
    tags = run_tags(parts.strategy.name, parts.env.world_size, parts.task.kind)
    info = RunInfo(run_dir, name, hparams, tags, resumed is not None,
                   parts.metrics.history.rows, tb.sweep_dir)  # fmt: skip
    return open_trackers(cfg.logger, info)


def run_files(run_dir: Path) -> list[Path]:
    """What a run hands its trackers at the end: its config, results, data facts and model
    (the best epoch's where it kept one)."""
    model = run_dir / BEST_MODEL
    model = model if model.exists() else run_dir / LAST_MODEL
    return [run_dir / ".hydra" / "config.yaml", run_dir / METRICS_FILE, run_dir / DATA_FILE,
            model]  # fmt: skip


def finished(
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
        f"batch {parts.global_batch} | {parts.trainable} | "
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
    parts: Parts,
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
        "world_size": parts.env.world_size,
        "global_batch_size": parts.global_batch,
        "steps": result.steps,
        "samples": result.samples,
        "bad_samples": result.bad_samples,
        "stopped_early": result.stopped_early,
        "val": result.val,
        "best_per_metric": result.best_per_metric,  # each at its own best epoch
        # The settings, as in HPARAMS: with the result, the sweep writes its one experiment.
        "hparams": hparams,
        "task": parts.task.kind,
        "best": parts.best_model.summary(),  # the epoch model_best.pt holds
    }


def write_outputs(run_dir: Path, state: dict[str, Any], summary: dict[str, Any]) -> None:
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
