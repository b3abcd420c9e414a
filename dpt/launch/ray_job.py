"""`launcher=ray`: a job's ranks as Ray Train's workers.

The driver (the process that runs Hydra's job) connects to the cluster and fits a
`TorchTrainer` whose worker loop is one rank of dpt's run (`rank_loop`: what every launcher's
rank runs, `dpt.launch.launchers.run_worker`, in the world Ray Train joined). The run folder,
checkpoints, loggers and metrics are dpt's; Ray's own bookkeeping goes to <run folder>/ray. When
a worker dies, Ray restarts the whole group (`launcher.max_failures` times) with the same loop:
the run folder's newest committed checkpoint is where it resumes (`checkpoint.resume=auto`).
Rank 0 reports the run's summary to the driver. ray is imported only here, by runs of
`launcher=ray`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from dpt.errors import DptError
from dpt.launch.launchers import check_world, resolved, run_worker
from dpt.launch.ray_cluster import head_address

SUMMARY = "dpt_summary"  # the metric holding rank 0's summary (JSON)


class RayLauncher:
    """Each job's ranks as Ray Train's workers on a Ray cluster."""

    def __init__(
        self, address: str, num_workers: int, use_gpu: bool, cpus_per_worker: float,
        max_failures: int,
    ) -> None:  # fmt: skip
        self.options = {"address": address, "num_workers": num_workers, "use_gpu": use_gpu,
                        "cpus_per_worker": cpus_per_worker,
                        "max_failures": max_failures}  # fmt: skip

    def run(self, cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
        check_world(cfg, self.options["num_workers"], "launcher.num_workers=1")
        return run_on_ray(resolved(cfg), run_dir, **self.options)


def run_on_ray(
    cfg_dict: dict[str, Any],
    run_dir: Path,
    address: str,
    num_workers: int,
    use_gpu: bool,
    cpus_per_worker: float,
    max_failures: int,
) -> dict[str, Any]:
    """The job's run on the cluster at `address` (launcher.address); its summary."""
    ray = _ray()
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if not ray.is_initialized():
        head = head_address(address)
        ray.init(address=head, include_dashboard=False, configure_logging=False, log_to_driver=True)
    trainer = TorchTrainer(
        rank_loop,
        train_loop_config={
            "cfg": cfg_dict,
            "run_dir": str(run_dir),
            "cwd": os.getcwd(),
            "path": [p for p in sys.path if p],
        },
        scaling_config=ScalingConfig(
            num_workers=num_workers, use_gpu=use_gpu, resources_per_worker={"CPU": cpus_per_worker}
        ),
        torch_config=TorchConfig(
            backend="nccl" if use_gpu else "gloo", timeout_s=int(cfg_dict["trainer"]["timeout_s"])
        ),
        run_config=RunConfig(
            storage_path=str(run_dir.resolve()),
            name="ray",
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    try:
        result = trainer.fit()
    except Exception as error:  # Ray's TrainingFailedError: the rank's own line, if it had one
        raise DptError(_rank_failure(error)) from error
    if result.error is not None:
        raise DptError(_rank_failure(result.error))
    return json.loads((result.metrics or {}).get(SUMMARY, "{}"))


def _ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise DptError("launcher=ray needs Ray: pip install 'dpt[ray]'") from error
    return ray


def rank_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: a rank of the run, as the driver's process would run it (its
    folder, its import path); rank 0 reports the summary."""
    import ray.train

    if Path(config["cwd"]).is_dir():  # one machine, or a shared file system: relative paths
        os.chdir(config["cwd"])
    sys.path[:0] = [p for p in config["path"] if p not in sys.path]
    summary = run_worker(config["cfg"], config["run_dir"])
    first = ray.train.get_context().get_world_rank() == 0
    # Every worker reports (Ray Train waits for all); the driver keeps rank 0's.
    ray.train.report({SUMMARY: json.dumps(summary if first else {}, default=str)})


def _rank_failure(error: BaseException) -> str:
    """The first rank's one line (`rank 1 failed: ...`), wherever Ray wrapped it; else Ray's
    first line."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        found = pending.pop()
        if id(found) in seen:
            continue
        seen.add(id(found))
        if isinstance(found, DptError):
            return str(found)
        pending += [e for e in (found.__cause__, found.__context__) if e is not None]
        pending += [e for e in vars(found).values() if isinstance(e, BaseException)]
        pending += [
            e
            for v in vars(found).values()
            if isinstance(v, dict)
            for e in v.values()
            if isinstance(e, BaseException)
        ]
    text = str(error).strip().splitlines()
    return f"launcher=ray: {text[0] if text else type(error).__name__}"
