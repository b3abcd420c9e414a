"""Where a user's own code (`model._target_=my_models.TinyCNN`) is imported from.

The folder `dpt` (or `python train.py`) was started in is on the import path, after everything
else (a file there named like a standard module shadows nothing). Every process of the run sees
it: the launcher records it in `DPT_IMPORT_PATH`, and each rank adds it at start, whichever
launcher started the rank (local workers, torchrun, SLURM tasks, which inherit the submitting
shell's environment). `PYTHONPATH` works as usual on top of that.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from dpt.errors import ConfigError

IMPORT_PATH_ENV = "DPT_IMPORT_PATH"
HINT = (
    "dpt imports your code from the folder it was started in and from PYTHONPATH "
    "(docs/guides/own-model-and-data.md)"
)


def add_start_folder() -> None:
    """In the launching process: the start folder on the import path, for it and its ranks
    (first; folders an enclosing dpt process recorded follow it)."""
    inherited = os.environ.get(IMPORT_PATH_ENV, "").split(os.pathsep)
    folders = dict.fromkeys([os.getcwd(), *filter(None, inherited)])  # ordered, no repeats
    os.environ[IMPORT_PATH_ENV] = os.pathsep.join(folders)
    add_recorded_folders()


def add_recorded_folders() -> None:
    """In a rank: the folders the launcher recorded, at the end of the import path."""
    for folder in filter(None, os.environ.get(IMPORT_PATH_ENV, "").split(os.pathsep)):
        if folder not in sys.path:
            sys.path.append(folder)


# dpt's own modules that `_target_`s name, before they moved into the package's parts (dpt/launch,
# dpt/loop, ...): old module -> new module.
MOVED_MODULES = {
    "dpt.strategy": "dpt.loop.strategy",
    "dpt.schedulers": "dpt.loop.schedulers",
    "dpt.launch": "dpt.launch.launchers",
    "dpt.hydra_callbacks": "dpt.launch.hydra_callbacks",
    "dpt.sweep": "dpt.launch.sweep",
}


def moved_to(target: str) -> str | None:
    """Where a `_target_` of dpt's earlier flat layout lives now; None for any other path."""
    module, _, name = target.rpartition(".")
    new = MOVED_MODULES.get(module)
    return f"{new}.{name}" if new else None


def current_target(target: str) -> str:
    """`target` as this layout names it (checkpoints written before the move compare equal)."""
    return moved_to(target) or target


def check_moved(target: str, key: str) -> None:
    new = moved_to(target)
    if new is not None:
        raise ConfigError(
            f"{key}={target}: that path is {new} now (dpt's modules moved into parts); "
            f"write {key}={new}"
        )


def check_importable(target: str, key: str) -> None:
    """The module of a `_target_` can be found (without running it: a config error must answer
    fast, and user code may import torch). Its attribute is looked up when it is built."""
    check_moved(target, key)
    module = target.rpartition(".")[0]
    if not module:
        raise ConfigError(f"{key}={target}: not a dotted path (module.name), e.g. my_models.Net")
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or fails to import
        found = False
    if not found:
        raise ConfigError(f"{key}={target}: cannot import {module}; {HINT}")


def locate(target: str, key: str) -> Any:
    """The object a `_target_` names, or a one-line ConfigError saying why it cannot be had."""
    check_importable(target, key)
    module_name, _, name = target.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # the user's module itself failed while importing
        raise ConfigError(
            f"{key}={target}: importing {module_name} failed: {type(error).__name__}: {error}"
        ) from error
    try:
        return getattr(module, name)
    except AttributeError:
        raise ConfigError(f"{key}={target}: {module_name} has no {name}") from None
