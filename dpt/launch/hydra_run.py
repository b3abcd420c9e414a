"""`hydra.main`'s run path without its mode probe, where the probe cannot change the answer.

Before a plain run, Hydra's `_run_hydra` composes the whole config once only to read
`hydra.mode` (`Hydra.get_mode`), then composes it again to run: about 0.1 s of every start. The
first compose can only matter when some config sets `hydra.mode` (a file that turns a plain
command into a sweep). dpt's own configs never do (tests/test_hydra_run.py composes every
option of every group to hold that), so when nothing but dpt's configs can be in play and the
command line leaves `hydra.mode` alone, the answer is known: None, a plain run. Then this
module goes straight to Hydra's `_run_app`, exactly as `_run_hydra` does with that answer (the
same `hydra.mode=RUN` override, callbacks, run folder and `.hydra/` files). Any other command
goes through `hydra.main` unchanged.
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hydra.core.global_hydra import GlobalHydra

from dpt.errors import DptError

if TYPE_CHECKING:
    from hydra._internal.hydra import Hydra

# The config groups ship inside the package (dpt/conf): the same path from a clone, an editable
# install or a wheel, whatever the current folder.
CONFIG_PATH = "pkg://dpt.conf"
CONFIG_NAME = "config"
MAIN_MODULE = "dpt.launch.cli"  # where `@hydra.main` decorates the task

# Search path providers when only dpt's configs are found: Hydra's own, dpt's package and the
# structured schemas. A search-path plugin, `--config-dir` or `--config-path` adds or changes one.
DPT_ONLY_SOURCES = (("hydra", "hydra.conf"), ("main", "dpt.conf"), ("schema", ""))

# `hydra.*` overrides that cannot make a config set `hydra.mode` (they select no config and no
# search path). Anything else under `hydra` goes through `hydra.main`'s probe.
HARMLESS_HYDRA_KEYS = ("hydra.run.", "hydra.job.", "hydra.verbose", "hydra.output_subdir")

# Flags that do something other than run one job: `hydra.main` handles them itself.
OTHER_COMMANDS = (
    "help", "hydra_help", "cfg", "resolve", "info", "shell_completion", "multirun",
    "experimental_rerun", "config_path", "config_name", "config_dir",
)  # fmt: skip


def run_hydra_main(hydra_main: Callable[[], Any], args: argparse.Namespace) -> None:
    """Run the job of `hydra_main` (a function under `@hydra.main`) as Hydra would, skipping the
    mode probe where `plain_run` says it is known."""
    if not plain_run(args):
        hydra_main()
        return
    from hydra._internal.utils import _run_app

    task_function = hydra_main.__wrapped__  # type: ignore[attr-defined]  # functools.wraps
    app = hydra_app(args, task_name=task_name(task_function))
    if not only_dpt_configs(app):
        GlobalHydra.instance().clear()
        hydra_main()
        return
    try:
        # mode=None is what `Hydra.get_mode` answers here: a run, with `hydra.mode=RUN` added
        _run_app(run=True, multirun=False, mode=None, hydra=app, config_name=CONFIG_NAME,
                 task_function=task_function, overrides=args.overrides)  # fmt: skip
    finally:
        GlobalHydra.instance().clear()  # as `_run_hydra` leaves it


def plain_run(args: argparse.Namespace) -> bool:
    """One job from dpt's config, with no override that could set `hydra.mode`."""
    if any(getattr(args, flag) for flag in OTHER_COMMANDS):
        return False
    return not any(touches_hydra_mode(override) for override in args.overrides)


def touches_hydra_mode(override: str) -> bool:
    """`hydra.mode=...`, a `hydra/...` group, `hydra.searchpath`: anything under `hydra` that is
    not one of the harmless keys (run folder, job settings, verbosity)."""
    key = override.split("=", 1)[0].lstrip("~+").split("@", 1)[0]
    if key != "hydra" and not key.startswith(("hydra.", "hydra/")):
        return False
    return not key.startswith(HARMLESS_HYDRA_KEYS)


def only_dpt_configs(app: Any) -> bool:
    """Whether Hydra's config search path holds dpt's configs and Hydra's, and nothing else."""
    sources = app.config_loader.get_sources()
    return tuple((source.provider, source.path) for source in sources) == DPT_ONLY_SOURCES


def task_name(task_function: Callable[..., Any]) -> str:
    """The task name `_run_hydra` derives from the task function (the job's `hydra.job.name`
    default; dpt's config sets it to `dpt`)."""
    from hydra._internal.utils import (
        detect_calling_file_or_module_from_task_function,
        detect_task_name,
    )

    calling_file, calling_module = detect_calling_file_or_module_from_task_function(task_function)
    return detect_task_name(calling_file, calling_module)


# --- Hydra's command line, outside `hydra.main` ------------------------------------------------


def hydra_args(argv: list[str]) -> argparse.Namespace:
    """`argv` as `hydra.main` parses it: flags (--config-dir, --cfg, -m, ...) and overrides."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_args(argv)


# What Hydra does with a command: one of these at a time (its attribute in `hydra_args`).
_MODES = {"run": "--run", "multirun": "--multirun", "cfg": "--cfg", "info": "--info",
          "shell_completion": "--shell-completion"}  # fmt: skip


def checked_args(argv: list[str]) -> argparse.Namespace:
    """`hydra_args`, refusing in one line what Hydra would answer with a traceback (two modes at
    once) or with a message that misses the point (a value split by the shell at a space)."""
    args = hydra_args(argv)
    given = [flag for name, flag in _MODES.items() if getattr(args, name) not in (None, False)]
    if len(given) > 1:
        raise DptError(
            f"{' and '.join(given)}: a command does one of {', '.join(_MODES.values())}; "
            "give only one"
        )
    _check_split_values(args.overrides)
    return args


def _check_split_values(overrides: list[str]) -> None:
    """`hydra.run.dir=my runs/a` unquoted reaches Hydra as `hydra.run.dir=my` and `runs/a`."""
    for i, word in enumerate(overrides[1:], start=1):
        before = overrides[i - 1]
        if "=" in word or word.startswith("~") or "=" not in before:
            continue
        rest = itertools.takewhile(lambda w: "=" not in w, overrides[i:])
        whole = " ".join([before, *rest])
        raise DptError(
            f"{word}: not an override (key=value); if it belongs to the value of "
            f"{before.split('=', 1)[0].lstrip('+~')}, the shell split that value at a space: "
            f"quote the whole override, '{whole}'"
        )


def hydra_app(
    args: argparse.Namespace, cls: type[Hydra] | None = None, task_name: str = "dpt"
) -> Hydra:
    """Hydra as `hydra.main` sets it up for `_hydra_main`: the same search path, so that
    `--config-dir`, `--config-path` and the config groups mean the same here."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery

    # A relative --config-path resolves against the module of `_hydra_main`, as Hydra does.
    search_path = create_automatic_config_search_path(
        None, MAIN_MODULE, args.config_path or CONFIG_PATH
    )
    if args.config_dir is not None:
        search_path.prepend(
            provider="command-line",
            path=f"file://{os.path.abspath(args.config_dir)}",
            anchor=SearchPathQuery(provider="schema"),
        )
    return (cls or Hydra).create_main_hydra2(task_name=task_name, config_search_path=search_path)
