"""Where Hydra put a job, said for its ranks: the TensorBoard place of the run (a run's own
`tb/`, or the sweep's `tb/<job> <swept values>/`) and its config groups' options.

Made in the process where Hydra runs the job, from Hydra's own config there; the ranks get it
resolved (dpt.launch.worker). A rank must not read the job's saved `.hydra/hydra.yaml`: a
sweep's folder there is `multirun/${now:...}`, and `now` is Hydra's resolver, registered (with
the time it gave) only where Hydra runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dpt.observe.dashboard import TB_FOLDER, TbPlace, job_label, one_run
from dpt.state.sweep_folder import swept_keys


def place(run_dir: Path) -> TbPlace:
    """The TbPlace of the Hydra job whose folder is `run_dir`; a run of its own where Hydra
    runs no such job in this process (a test, a script calling the worker)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return one_run(run_dir)
    hydra_cfg = HydraConfig.get()
    if Path(hydra_cfg.runtime.output_dir).resolve() != run_dir.resolve():
        return one_run(run_dir)
    groups = group_choices(hydra_cfg)
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return TbPlace(run_dir / TB_FOLDER, writes_experiment=True, groups=groups)
    sweep_dir = Path(hydra_cfg.sweep.dir).absolute()
    label = job_label(int(hydra_cfg.job.num), list(hydra_cfg.overrides.task), swept_keys(sweep_dir))
    return TbPlace(sweep_dir / TB_FOLDER / label, writes_experiment=False, groups=groups,
                   sweep_dir=sweep_dir)  # fmt: skip


def group_choices(hydra_cfg: Any) -> dict[str, str]:
    """The option of each config group (`strategy: ddp`), Hydra's own groups left out: a sweep
    over a group (`strategy=single,ddp`) varies these, not only the keys they set."""
    choices = OmegaConf.to_container(hydra_cfg.runtime.choices)
    assert isinstance(choices, dict)
    return {str(group): str(option) for group, option in choices.items()
            if option is not None and not str(group).startswith("hydra")}  # fmt: skip
