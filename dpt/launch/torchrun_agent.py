"""`dpt-torchrun`: torchrun, ending in one line.

It takes torchrun's arguments and runs torchrun's own engine (`torch.distributed.run.run`): the
same rendezvous, restarts (`--max-restarts`) and elastic worlds (`--nnodes=MIN:MAX`). What
differs is the end of a job that fails for good, its restarts used up: torchrun ends with its
report (a traceback and a table of every failure); dpt-torchrun with the line dpt's own launcher
prints, the rank that failed, why, and its log (`Error: rank 1 failed: killed by SIGKILL (log:
<run>/logs/rank1.log)`), exit 1. The agent's own log lines (each failure, each shutdown step)
are left out: the ranks say what happened, a restart too (`torchrun restart 1 of 2: ...`).
Started by SkyPilot or dstack, it takes the world from their variables (dpt/launch/cluster_env.py).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

from dpt.launch.cluster_env import torchrun_variables
from dpt.launch.torchrun_job import RUN_DIR_NOTE


def main() -> NoReturn:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from dpt.launch.local_world import describe_failure, describe_stop, quiet_elastic_logs

    os.environ.update(torchrun_variables(os.environ))  # SkyPilot's or dstack's world
    args = parse_args(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="dpt-torchrun-") as notes:
        note = Path(notes) / "run_dir"
        os.environ[RUN_DIR_NOTE] = str(note)  # where this node's ranks say their run folder
        try:
            with quiet_elastic_logs():
                run(args)
        except ChildFailedError as failed:
            _fail(describe_failure(failed, _run_dir(note)))
        except SignalException as stopped:  # SIGTERM/SIGINT: passed on, the ranks checkpointed
            _fail(describe_stop(stopped, _run_dir(note)))
    sys.exit(0)


def _run_dir(note: Path) -> Path | None:
    try:
        return Path(note.read_text())
    except OSError:  # no rank got as far as its run folder
        return None


def _fail(line: str) -> NoReturn:
    print(f"Error: {line}", file=sys.stderr)
    sys.exit(1)
