"""The `dpt` command (and `train.py`): Hydra main, torchrun followers, and one-line errors.

Nothing here imports torch at module level: `--help`, `--cfg job` and a config error answer in
well under a second. The launcher (and with it torch) is imported by the task, once the config
is known to be good.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from dpt import user_code
from dpt.config import experiments
from dpt.config.build import build
from dpt.config.store import register_configs
from dpt.errors import Abort, DptError, could_not_write, is_disk_full, one_line
from dpt.launch import parent_death, run_lock, torchrun_job
from dpt.launch.hydra_run import (
    CONFIG_NAME,
    CONFIG_PATH,
    checked_args,
    hydra_app,
    hydra_args,
    run_hydra_main,
)
from dpt.launch.process_exit import exit_code, leave_after_exit_handlers, leave_at_once
from dpt.launch.validate import validate
from dpt.observe.logs import setup_logging

if TYPE_CHECKING:
    from hydra._internal.hydra import Hydra

register_configs()


def task(cfg: DictConfig) -> float:
    """One Hydra job: check it, hand it to the configured launcher; returns the run's objective
    (sweep.objective; NaN where the run has none), what a search's sweeper optimizes. The run's
    other results are in its metrics.json."""
    hydra_cfg = HydraConfig.get()
    try:
        validate(cfg)  # in a multirun, this job's own overrides are first seen here
        # Lines from this process, not from a rank (those every rank says, a rank says)
        setup_logging(launcher_prefix(hydra_cfg), speaks_once=False)
        launcher = build(cfg.launcher)  # imports dpt.launch.launchers, and with it torch
        run_dir = Path(hydra_cfg.runtime.output_dir)
        with _run_folder_held(run_dir):
            summary = launcher.run(cfg, run_dir)
        value = (summary.get("objective") or {}).get("value")
        return float("nan") if value is None else float(value)
    except DptError as error:
        if hydra_cfg.mode == RunMode.RUN:
            raise Abort(error) from error  # one line, without Hydra's "Error executing job"
        raise  # a sweep records the failed job and goes on


def _run_folder_held(run_dir: Path) -> contextlib.AbstractContextManager[None]:
    """A multirun job's folder, locked here; a single run's was locked before Hydra wrote into
    it (dpt.launch.hydra_callbacks), and stays so."""
    if not run_lock.holds_lock_here():
        return contextlib.nullcontext()
    return run_lock.holding(run_dir)


def launcher_prefix(hydra_cfg: DictConfig) -> str:
    """`launcher`, or `launcher job 3` in a multirun: concurrent jobs (joblib) share a console."""
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return f"launcher job {hydra_cfg.job.num}"
    return "launcher"


@hydra.main(config_path=CONFIG_PATH, config_name=CONFIG_NAME, version_base="1.3")
def _hydra_main(cfg: DictConfig) -> Any:
    return task(cfg)


def main() -> None:
    """`dpt [overrides]` and `python train.py [overrides]`: the same command. Returns, or raises
    SystemExit (exit 1 after a one-line error), so it can also be called in a process that goes
    on; `entry` is the command's own process."""
    run(_hydra_main)


def entry() -> NoReturn:
    """The `dpt` command's process (and train.py's): `main`, then leave without the interpreter's
    finalization, which with torch imported costs about half a second after the run is done."""
    _end_with_starter()
    try:
        main()
        code = 0
    except SystemExit as stop:
        code = exit_code(stop)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        leave_at_once(code)
    leave_after_exit_handlers(code)


def _end_with_starter() -> None:
    """A torchrun rank ends with its agent (SIGTERM: it checkpoints and leaves, as when the agent
    passes a signal on); what this process forks (loader workers) ends with it."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        parent_death.end_with_parent(signal.SIGTERM)
    parent_death.children_end_with_this_process(signal.SIGKILL)


def run(hydra_main: Callable[[], Any]) -> None:
    """Run Hydra's main, printing bad input as one line on stderr (exit 1), not a traceback.

    HYDRA_FULL_ERROR=1 keeps Hydra's full traceback for those who want it.
    """
    argv = sys.argv[1:]
    user_code.add_start_folder()  # a user's `_target_` imports from here, in every rank too
    setup_logging("launcher", speaks_once=False)  # the checks before the run (preflight) say
    if is_torchrun_follower():
        return _report(lambda: follow_torchrun(argv))
    if asks_for_help(argv):
        return _report(lambda: show_help(argv))
    if "TORCHELASTIC_RUN_ID" in os.environ:  # rank 0 of a restarted torchrun job: its folder
        argv = torchrun_job.continued(argv)
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        run_hydra_main(hydra_main, hydra_args(argv))
        return None
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises; we print the short form ourselves
    try:
        _report(lambda: run_hydra_main(hydra_main, checked_args(argv)))
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)
    return None


# --- --help ---------------------------------------------------------------------------------------


def asks_for_help(argv: list[str]) -> bool:
    return "--help" in argv or "-h" in argv


def show_help(argv: list[str]) -> None:
    """Hydra's `--help` with dpt's template (dpt/conf/hydra/help/dpt.yaml), listing only the
    user's config groups, in a fraction of the time (see `_AppGroupsHydra`)."""
    from hydra._internal.utils import get_args_parser

    args = hydra_args(argv)
    app = hydra_app(args, cls=_app_groups_hydra())
    app.app_help(config_name=args.config_name or CONFIG_NAME, args_parser=get_args_parser(),
                 args=args)  # fmt: skip


def _app_groups_hydra() -> type[Hydra]:
    from hydra._internal.hydra import Hydra

    class _AppGroupsHydra(Hydra):
        """`$APP_CONFIG_GROUPS` without the internal `schema/*` groups. Hydra's own listing
        walks every group, Hydra's included, copying the whole config store for each (about two
        seconds): here only the top-level groups of the app are listed."""

        def format_config_groups(
            self, predicate: Callable[[str], bool], compact: bool = True
        ) -> str:
            hidden = ("hydra", "schema")
            groups = [g for g in self.config_loader.list_groups("") if g not in hidden]
            return "".join(
                f"{group}: {', '.join(sorted(self.config_loader.get_group_options(group)))}\n"
                for group in sorted(groups)
                if predicate(group)
            )

    return _AppGroupsHydra


# --- torchrun ranks >= 1 --------------------------------------------------------------------------


def is_torchrun_follower() -> bool:
    """A non-zero rank under torchrun: it must not run Hydra's run machinery (no second folder)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("RANK", "0") != "0"


def follow_torchrun(argv: list[str]) -> None:
    """Compose the config from the same command line as rank 0, then join its world and folder."""
    cfg = compose_from_argv(argv)
    if cfg is None:
        return  # --help, --cfg, ...: rank 0 prints it; there is no world to join
    from dpt.launch.launchers import follow_torchrun_world  # torch: only now that a rank must train

    follow_torchrun_world(cfg)


# Hydra flags that print something and exit instead of running the job.
_PRINT_ONLY_FLAGS = ("help", "hydra_help", "cfg", "info", "shell_completion")


def compose_from_argv(argv: list[str]) -> DictConfig | None:
    """What `_hydra_main` would compose from `argv`, without making a run folder; None for flags
    that only print (rank 0 prints them)."""
    args = hydra_args(argv)
    if any(getattr(args, flag) for flag in _PRINT_ONLY_FLAGS):
        return None
    if args.multirun:
        raise DptError("under torchrun, run one job (no -m): torchrun starts one world")
    app = hydra_app(args)
    cfg = app.compose_config(
        args.config_name or CONFIG_NAME,
        args.overrides,
        run_mode=RunMode.RUN,
        with_log_configuration=False,
    )
    return app.get_sanitized_cfg(cfg, "job")  # the job's config, as the task gets it (no hydra)


# --- errors ---------------------------------------------------------------------------------------


def _report(func: Callable[[], Any]) -> None:
    try:
        func()
    except Abort as rejected:
        _fail(rejected.error)
    except HydraException as error:  # an experiment's key the chosen option lacks: dpt's words
        _fail(experiments.explain(error, sys.argv[1:]) or error)
    except (DptError, OmegaConfBaseException) as error:
        _fail(error)
    except OSError as error:  # e.g. Hydra writing `.hydra/config.yaml` onto a full disk
        if not is_disk_full(error):
            raise
        _fail(DptError(could_not_write(_output_dir(), error)))


def _output_dir() -> str:
    """The run folder Hydra was writing into (this process locked it first), for an error that
    names no file."""
    folders = run_lock.held()
    return str(folders[-1]) if folders else "the run folder"


def _fail(error: BaseException) -> None:
    print(f"Error: {one_line(error)}", file=sys.stderr)
    sys.exit(1)
