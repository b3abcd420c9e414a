"""hydra-submitit-launcher's SLURM launcher, with one task per rank done right.

The stock launcher runs the whole Hydra job in every task of a SLURM job. With one task per rank
that means every task writing the same `.hydra/` files and running the job callbacks in one job
folder; and one job that ends without a result (time limit, node failure, scancel) makes `launch`
raise, which ends the sweep without a summary. This subclass changes only that:

- tasks with SLURM_PROCID > 0 run the same job without Hydra's bookkeeping (no `.hydra/`, no
  Hydra job log, no job callbacks): task 0 does it, once per job;
- a job that comes back without a result is reported to the callbacks as FAILED (so the sweep
  summary lists it) and the other jobs are still awaited; with
  `hydra.callbacks.summary.stop_on_failure=true` the first failure cancels the unfinished jobs;
- a task that stopped on a signal (preemption: the trainer checkpoints, then raises
  `Interrupted`) leaves no result, so submitit keeps waiting for the requeued job, which runs in
  the same job folder (same job number) and resumes from its newest checkpoint.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra._internal.callbacks import Callbacks
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.types import HydraContext
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from dpt.errors import Abort, DptError
from dpt.launch.sweep import describe_error
from dpt.loop.interrupt import Interrupted

log = logging.getLogger(__name__)


class DptSlurmLauncher(SlurmLauncher):
    def __call__(
        self,
        sweep_overrides: list[str],
        job_dir_key: str,
        job_num: int,
        job_id: str,
        singleton_state: dict[type, Singleton],
    ) -> JobReturn:
        """Runs in each task of the job."""
        if os.environ.get("SLURM_PROCID", "0") != "0":
            self._leave_bookkeeping_to_task_0()
        ret = super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)
        # SIGTERM/SIGINT arrived and a checkpoint was written (the summary may say COMPLETED)
        if isinstance(ret._return_value, Interrupted):
            raise SystemExit(f"stopped by a signal: {ret._return_value}")  # no result pickle
        return ret

    def _leave_bookkeeping_to_task_0(self) -> None:
        assert self.config is not None and self.hydra_context is not None
        # Each job's config is composed again from these overrides (`load_sweep_config`).
        with read_write(self.config), open_dict(self.config):
            self.config.hydra.overrides.hydra.extend(
                ["hydra.output_subdir=null", "hydra/job_logging=none"]
            )
        self.hydra_context = HydraContext(
            config_loader=self.hydra_context.config_loader, callbacks=Callbacks()
        )

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        """Runs in the process that started the sweep: submit one array, await every job."""
        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        log.info(f"Submitit 'slurm' sweep output dir : {sweep_dir}")
        nums = range(initial_job_idx, initial_job_idx + len(job_overrides))
        args = []
        for num, overrides in zip(nums, job_overrides, strict=True):
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
            state = Singleton.get_state()
            args.append((list(overrides), "hydra.sweep.dir", num, f"job_id_for_{num}", state))
        jobs = self._executor().map_array(self, *zip(*args, strict=True))
        return self._collect(jobs, list(nums), job_overrides)

    def _executor(self) -> Any:
        """The stock launcher's mapping of its keys onto submitit's SLURM executor."""
        import submitit

        params = dict(self.params)
        executor = submitit.AutoExecutor(
            cluster=self._EXECUTOR,
            folder=params.pop("submitit_folder"),
            slurm_max_num_timeout=params.pop("max_num_timeout"),
        )
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{k if k in shared else f"slurm_{k}": v for k, v in params.items()}
        )
        return executor

    def _collect(
        self, jobs: list[Any], nums: list[int], job_overrides: Sequence[Sequence[str]]
    ) -> list[JobReturn]:
        returns = []
        try:
            for job, num, overrides in zip(jobs, nums, job_overrides, strict=True):
                ret = self._result(job, num, list(overrides))
                if ret.status == JobStatus.FAILED and self._stop_on_failure():
                    raise Abort(
                        DptError(
                            f"job {num} failed ({describe_error(ret._return_value)}); sweep "
                            "stopped (hydra.callbacks.summary.stop_on_failure=true)"
                        )
                    )
                returns.append(ret)
        except Abort:
            for job in jobs:
                if not job.done():
                    job.cancel(check=False)
            raise
        return returns

    def _result(self, job: Any, num: int, overrides: list[str]) -> JobReturn:
        from submitit.core.utils import UncompletedJobError

        task = job.task(0)  # rank 0's: it ran Hydra's bookkeeping and the callbacks
        try:
            task.wait()  # until SLURM says the job ended, or its result is there
            if job.state.startswith("CANCELLED") and not task.paths.result_pickle.exists():
                # No result comes from a cancelled job: not submitit's 15 s wait for a slow
                # shared file system to show one.
                raise UncompletedJobError(job.state)
            return task.result()
        except UncompletedJobError:  # killed, timed out, cancelled, or crashed
            lost = DptError(
                f"SLURM job {job.job_id} ended without a result ({job.state}); "
                f"log: {job.task(0).paths.stderr}"
            )
            return self._report_lost(num, overrides, lost)

    def _report_lost(self, num: int, overrides: list[str], error: DptError) -> JobReturn:
        """Tell the callbacks (the sweep summary) about a job whose own on_job_end never ran."""
        assert self.config is not None and self.hydra_context is not None
        config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(config):
            config.hydra.job.num = num
        ret = JobReturn(overrides=overrides, status=JobStatus.FAILED)
        ret.return_value = error
        previous = HydraConfig.instance().cfg
        HydraConfig.instance().set_config(config)  # `${hydra:...}` in the job's folder name
        try:
            with read_write(config.hydra.runtime), open_dict(config.hydra.runtime):
                config.hydra.runtime.output_dir = _job_dir(config)
            self.hydra_context.callbacks.on_job_end(config=config, job_return=ret)
        finally:
            HydraConfig.instance().cfg = previous  # type: ignore[assignment]
        return ret

    def _stop_on_failure(self) -> bool:
        path = "hydra.callbacks.summary.stop_on_failure"
        return bool(OmegaConf.select(self.config, path, default=False))


def _job_dir(config: DictConfig) -> str:
    return os.path.abspath(os.path.join(config.hydra.sweep.dir, str(config.hydra.sweep.subdir)))
