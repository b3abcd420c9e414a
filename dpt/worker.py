"""What every rank runs: join the world, build data, model and strategy, train, write results."""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from dpt.data.loaders import build_loaders
from dpt.distributed import (
    DistEnv,
    broadcast_object,
    destroy_process_group,
    env_from_environment,
    init_process_group,
)
from dpt.logs import setup_logging
from dpt.metrics import MetricsLogger
from dpt.models import build_model, unwrap
from dpt.strategy import Strategy
from dpt.trainer import TrainResult, planned_steps, train

log = logging.getLogger("dpt")


@record  # a failing rank leaves its error in torchelastic's error file, for the launcher
def run_worker(cfg_dict: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """Entry point of every rank: in-process, elastic launch, torchrun or SLURM started it."""
    env = env_from_environment(cfg_dict["trainer"]["device"])
    init_process_group(env, cfg_dict["trainer"]["timeout_s"])
    try:
        # Rank 0's config and folder win: ranks that composed their own config under torchrun
        # may differ in `${now:...}` and must all write into one run folder.
        cfg_dict, run_dir = broadcast_object((cfg_dict, run_dir), env)
        return _run(OmegaConf.create(cfg_dict), Path(run_dir), env)
    finally:
        destroy_process_group()


def _run(cfg: DictConfig, run_dir: Path, env: DistEnv) -> dict[str, Any]:
    setup_logging(f"rank {env.rank}", run_dir / "logs" / f"rank{env.rank}.log")
    _limit_cpu_threads(env)
    seed = cfg.trainer.seed
    seed_everything(seed)

    data = instantiate(cfg.dataset, seed=seed)
    strategy: Strategy = instantiate(cfg.strategy)
    loaders = build_loaders(data, env, cfg.trainer.batch_size, seed)
    torch.manual_seed(seed)  # identical initial weights on every rank and in every strategy
    model = build_model(cfg.model, data.input_shape, data.num_classes).to(env.device)
    model = strategy.wrap(model, env)
    optimizer = instantiate(cfg.optimizer)(model.parameters())

    global_batch = strategy.global_batch(cfg.trainer.batch_size, env)
    total_steps = planned_steps(len(loaders.train), cfg.trainer.epochs, cfg.trainer.max_steps)
    log.info(
        f"strategy={strategy.name} | world size {env.world_size} | device {env.device} | "
        f"backend {env.backend if env.world_size > 1 else 'none'} | batch per process "
        f"{cfg.trainer.batch_size} | global batch {global_batch} | {total_steps} steps"
    )
    metrics = MetricsLogger(run_dir, env, cfg.trainer.log_every_n_steps, total_steps)
    try:
        result = train(
            model,
            optimizer,
            loaders,
            env,
            metrics,
            epochs=cfg.trainer.epochs,
            max_steps=cfg.trainer.max_steps,
            num_classes=data.num_classes,
        )
        summary = _summary(result, env, global_batch)
        if env.is_main:
            log.info(
                f"done: {result.steps} steps in {result.wall_time_s:.1f} s | "
                f"{summary['samples_per_s']:,.0f} samples/s (world) | final loss "
                f"{_fmt(result.final_loss)}"
            )
            _write_outputs(run_dir, unwrap(model), summary)
            metrics.hparams(_hparams(cfg, env, global_batch), _final_metrics(summary))
    finally:
        metrics.close()
    return summary


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _limit_cpu_threads(env: DistEnv) -> None:
    """Several ranks on one CPU must share its cores, as torchrun does with OMP_NUM_THREADS."""
    if (
        env.device.type == "cpu"
        and env.local_world_size > 1
        and "OMP_NUM_THREADS" not in os.environ
    ):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))


def _summary(result: TrainResult, env: DistEnv, global_batch: int) -> dict[str, Any]:
    return {
        "final_loss": result.final_loss,
        "samples_per_s": result.samples / result.wall_time_s if result.wall_time_s else 0.0,
        "wall_time_s": result.wall_time_s,
        "world_size": env.world_size,
        "global_batch_size": global_batch,
        "steps": result.steps,
        "samples": result.samples,
        "bad_samples": result.bad_samples,
        "val": result.val,
        "best_val": result.best_val,
    }


def _write_outputs(run_dir: Path, model: torch.nn.Module, summary: dict[str, Any]) -> None:
    torch.save(model.state_dict(), run_dir / "model.pt")
    (run_dir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")


def _hparams(cfg: DictConfig, env: DistEnv, global_batch: int) -> dict[str, Any]:
    flat: dict[str, Any] = {"world_size": env.world_size, "global_batch_size": global_batch}
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


def _final_metrics(summary: dict[str, Any]) -> dict[str, float]:
    final = {"samples_per_s": summary["samples_per_s"], "wall_time_s": summary["wall_time_s"]}
    if summary["final_loss"] is not None:
        final["final_loss"] = summary["final_loss"]
    final.update(summary["val"])
    return final


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
