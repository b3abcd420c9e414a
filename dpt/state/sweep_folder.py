"""What a sweep folder holds (`multirun/<date>/<time>/`, Hydra's `-m`): the names, and how a
command that wants one run tells a sweep folder apart and points into it.

Hydra writes the sweep's config; dpt's sweep callback (dpt.launch.sweep) writes each job's
status, the summary and the `best` link; each job's run folder is `<n>/`.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

SWEEP_CONFIG = "multirun.yaml"  # the sweep's config, as Hydra's basic sweeper writes it
STATUS_FILE = "job_status.json"  # in each job's folder: how it ended
BEST_LINK = "best"  # the best job's run folder, by the objective
SUMMARY_CSV = "summary.csv"
SUMMARY_PNG = "summary.png"


def is_sweep(folder: Path) -> bool:
    """A sweep's folder (not one of its jobs'): its config or its summary is there."""
    return (folder / SWEEP_CONFIG).is_file() or (folder / SUMMARY_CSV).is_file()


def job_folders(sweep_dir: Path) -> list[Path]:
    """The jobs' run folders, by job number."""
    found = [p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    return sorted(found, key=lambda p: int(p.name))


def not_a_run(sweep_dir: Path) -> str:
    """What to say where a sweep folder is given and one run is wanted: its `best` link and
    its jobs' folders."""
    jobs = job_folders(sweep_dir)
    listed = ", ".join(str(p) for p in jobs[:4]) + (", ..." if len(jobs) > 4 else "")
    best = sweep_dir / BEST_LINK
    runs = [f"{best} (the best job)"] if best.is_dir() else []
    runs += [f"a job's folder ({listed})"] if jobs else []
    return (f"{sweep_dir} is a sweep folder, not a run folder: give one of its runs: "
            f"{' or '.join(runs) if runs else 'none has started yet'}")  # fmt: skip


def swept_keys(sweep_dir: Path) -> set[str]:
    """The keys the sweep varies: its command line's sweep overrides (`a=1,2`, `range(...)`,
    a search's `interval(...)`) and `hydra.sweeper.params`, as saved in `multirun.yaml`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    saved = sweep_dir / SWEEP_CONFIG
    if not saved.is_file():
        return set()
    hydra_cfg = OmegaConf.load(saved).hydra
    parsed = OverridesParser.create().parse_overrides(list(hydra_cfg.overrides.task))
    keys = {o.get_key_element() for o in parsed if o.is_sweep_override()}
    return keys | set(OmegaConf.select(hydra_cfg, "sweeper.params") or {})
