"""A torchrun job is one run, however often torchrun restarts its workers.

torchrun (`--max-restarts`, `--nnodes=MIN:MAX`) restarts every worker of the job when one fails
or a node comes or goes, with the same command line. Its rank 0 would compose Hydra anew and make
a new run folder (`${now:...}`), and nothing would resume. Instead the first rank 0 of the job
records its run folder in the store torchrun's agent keeps for the whole job (the same rendezvous
id), and each later rank 0 runs in that folder (`hydra.run.dir`): it takes the folder's lock once
the previous attempt's processes are gone, and `checkpoint.resume=auto` continues from the newest
committed checkpoint, at whatever world size the rendezvous formed.

The agent's store lives on the node that hosts it; where that node is lost, the next rank 0 finds
no record and its folder is the one its command names: give multi-node jobs a `hydra.run.dir`.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

RUN_DIR_KEY = "dpt/run_dir"
STORE_TIMEOUT = timedelta(seconds=30)
# Set by `dpt-torchrun` (dpt.launch.torchrun_agent): a file where its ranks write their run
# folder, for the line that names a failed rank's log.
RUN_DIR_NOTE = "DPT_RUN_DIR_NOTE"


def in_torchrun_job() -> bool:
    """Started by torchrun's agent, with its store shared with the workers (the default)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def restart() -> int:
    """How many times the agent has restarted its workers (0 on its first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def recorded_run_dir() -> str | None:
    """The job's run folder, if an earlier attempt of this torchrun job recorded one."""
    if not in_torchrun_job():
        return None
    from dpt.rendezvous import agent_store  # torch: only under torchrun, which trains anyway

    store = agent_store(STORE_TIMEOUT)
    return store.get(RUN_DIR_KEY).decode() if store.check([RUN_DIR_KEY]) else None


def continued(argv: list[str]) -> list[str]:
    """`argv` of a restarted rank 0, running in the folder the job's first attempt made."""
    folder = recorded_run_dir()
    if folder is None:
        return argv
    kept = [arg for arg in argv if not arg.startswith(("hydra.run.dir=", "+hydra.run.dir="))]
    return [*kept, f"hydra.run.dir={folder}"]


def record(folder: Path) -> None:
    """Rank 0, once its folder is taken: where the job's later attempts run."""
    if not in_torchrun_job():
        return
    from dpt.rendezvous import agent_store

    agent_store(STORE_TIMEOUT).set(RUN_DIR_KEY, str(folder.resolve()))


def is_restart() -> bool:
    """An attempt after the first (after a failure; a change of members keeps the count)."""
    return in_torchrun_job() and restart() > 0


def attempt() -> str:
    """`torchrun restart 1 of 2: ` on an attempt after the first, else nothing."""
    if not is_restart():
        return ""
    return f"torchrun restart {restart()} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}: "


def note_run_dir(folder: Path) -> None:
    """Every rank, once it knows its run folder: tell `dpt-torchrun` (its agent) where it is."""
    note = os.environ.get(RUN_DIR_NOTE)
    if note is None:
        return
    tmp = Path(f"{note}.{os.getpid()}")
    try:
        tmp.write_text(str(folder))
        tmp.replace(note)  # whole, whichever rank writes last (they all write the same)
    except OSError:
        pass  # only the failure line's log path is lost
