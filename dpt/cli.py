"""The `train.py` entry point: Hydra main, torchrun followers, and one-line errors."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from dpt.config import build, register_configs, validate
from dpt.errors import Abort, DptError, one_line
from dpt.launch import follow_torchrun, is_torchrun_follower
from dpt.logs import setup_logging

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

register_configs()


def task(cfg: DictConfig) -> dict[str, Any]:
    """One Hydra job: check it, then hand it to the configured launcher."""
    hydra_cfg = HydraConfig.get()
    try:
        validate(cfg)  # in a multirun, this job's own overrides are first seen here
        setup_logging("launcher")  # lines from this process, as opposed to a rank's
        launcher = build(cfg.launcher)
        return launcher.run(cfg, Path(hydra_cfg.runtime.output_dir))
    except DptError as error:
        if hydra_cfg.mode == RunMode.RUN:
            raise Abort(error) from error  # one line, without Hydra's "Error executing job"
        raise  # a sweep records the failed job and goes on


def run(hydra_main: Callable[[], Any]) -> None:
    """Run Hydra's main, printing bad input as one line on stderr (exit 1), not a traceback.

    HYDRA_FULL_ERROR=1 keeps Hydra's full traceback for those who want it.
    """
    if is_torchrun_follower():
        return _report(lambda: follow_torchrun(CONF_DIR, sys.argv[1:]))
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        hydra_main()
        return None
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises; we print the short form ourselves
    try:
        _report(hydra_main)
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)
    return None


def _report(func: Callable[[], Any]) -> None:
    try:
        func()
    except Abort as rejected:
        _fail(rejected.error)
    except (DptError, HydraException, OmegaConfBaseException) as error:
        _fail(error)


def _fail(error: BaseException) -> None:
    print(f"Error: {one_line(error)}", file=sys.stderr)
    sys.exit(1)
